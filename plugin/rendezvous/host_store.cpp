#include "plugin/rendezvous/host_store.h"

#include <algorithm>
#include <cstring>

#include "plugin/core/deadline.h"  // deadlineAfter: clamped, saturating
#include "plugin/core/error.h"
#include "plugin/core/log.h"

namespace sfsync {

namespace {

// The largest value sfsync accepts from a host store (rendezvous values are
// a few hundred bytes per rank).
constexpr uint64_t kMaxValueBytes = uint64_t(1) << 30;
// Size of the first buffer a get offers; larger values take a second call.
constexpr uint64_t kFirstCapacity = 1024;
constexpr uint64_t kUnset = ~uint64_t(0);

using Clock = HostStore::Clock;

int64_t msLeft(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max<int64_t>(0, left.count());
}

}  // namespace

HostStore::HostStore(const sf_store& store, const std::string& prefix,
                     std::chrono::milliseconds timeout)
    : store_(store),
      prefix_(prefix.empty() ? "sfsync/" : prefix + "/sfsync/"),
      timeout_(timeout) {}

std::string HostStore::fullKey(const std::string& key) const { return prefix_ + key; }

void HostStore::failStatus(const char* op, const std::string& key, int32_t status,
                           int64_t timeoutMs) const {
  if (status == SF_STORE_TIMEOUT) {
    fail(SF_ERR_TIMEOUT, std::string("host store: key '") + key + "' did not appear within " +
                             std::to_string(timeoutMs) + " ms (" + op + ")");
  }
  if (status == SF_STORE_ERROR) {
    fail(SF_ERR_BACKEND, std::string("host store: ") + op + " of key '" + key +
                             "' failed (the host's callback returned SF_STORE_ERROR)");
  }
  fail(SF_ERR_BACKEND, std::string("host store: ") + op + " of key '" + key +
                           "': the host's callback returned " + std::to_string(status) +
                           ", which is not SF_STORE_OK, SF_STORE_TIMEOUT or SF_STORE_ERROR");
}

void HostStore::set(const std::string& key, const std::vector<char>& data) {
  const std::string k = fullKey(key);
  SF_LOG(kTrace, "store", "host store set '" << k << "' (" << data.size() << " bytes)");
  int32_t status = SF_STORE_ERROR;
  try {
    status = store_.set(store_.user, k.c_str(), data.data(), uint64_t(data.size()));
  } catch (...) {  // a C++ host's callback must not take sfsync down with it
    fail(SF_ERR_BACKEND, "host store: set of key '" + k + "': the host's callback threw");
  }
  if (status != SF_STORE_OK) failStatus("set", k, status, 0);
}

std::vector<char> HostStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return getUntil(key, deadlineAfter(timeout), timeout.count());
}

std::vector<char> HostStore::getUntil(const std::string& key, Clock::time_point deadline,
                                      int64_t timeoutMs) {
  const std::string k = fullKey(key);
  std::vector<char> buffer(kFirstCapacity);
  // A value that grew between two calls takes another round; a store that
  // keeps reporting larger sizes is broken, not slow.
  for (int attempt = 0; attempt < 8; ++attempt) {
    const int64_t left = msLeft(deadline);
    uint64_t bytes = kUnset;
    int32_t status = SF_STORE_ERROR;
    try {
      status = store_.get(store_.user, k.c_str(), left, buffer.data(), uint64_t(buffer.size()),
                          &bytes);
    } catch (...) {
      fail(SF_ERR_BACKEND, "host store: get of key '" + k + "': the host's callback threw");
    }
    if (status != SF_STORE_OK) failStatus("get", k, status, timeoutMs);
    if (bytes == kUnset) {
      fail(SF_ERR_BACKEND, "host store: get of key '" + k +
                               "' returned SF_STORE_OK without setting *bytes");
    }
    if (bytes > kMaxValueBytes) {
      fail(SF_ERR_BACKEND, "host store: key '" + k + "' holds " + std::to_string(bytes) +
                               " bytes, more than the " + std::to_string(kMaxValueBytes) +
                               " sfsync accepts");
    }
    if (bytes <= buffer.size()) {
      buffer.resize(size_t(bytes));
      SF_LOG(kTrace, "store", "host store got '" << k << "' (" << bytes << " bytes)");
      return buffer;
    }
    buffer.assign(size_t(bytes), 0);  // too small: ask again with the reported size
  }
  fail(SF_ERR_BACKEND, "host store: get of key '" + k +
                           "' reported a larger size on each of 8 calls");
}

std::vector<char> HostStore::get(const std::string& key) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = fetched_.find(key);
    if (it != fetched_.end()) {
      std::vector<char> v = std::move(it->second);
      fetched_.erase(it);
      return v;
    }
  }
  return get(key, timeout_);
}

void HostStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void HostStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  // The callbacks have no wait of their own: a get within what is left of
  // one deadline, keeping the value for the get() that follows.
  const Clock::time_point deadline = deadlineAfter(timeout);
  for (const auto& key : keys) {
    std::vector<char> v = getUntil(key, deadline, timeout.count());
    std::lock_guard<std::mutex> lock(mutex_);
    fetched_[key] = std::move(v);
  }
}

}  // namespace sfsync
