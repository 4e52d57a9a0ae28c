#pragma once
// A host key-value store for sf_set_store tests: C callbacks over an
// in-process map, as a host's own store would be (waits honour timeout_ms).
// Counts calls, records keys, and can be told to fail in the ways the ABI
// names (SF_STORE_ERROR, SF_STORE_TIMEOUT, a status outside the enum, *bytes
// left unset).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "sfsync.h"

namespace sftest {

struct MapStore {
  std::mutex mutex;
  std::condition_variable cv;
  std::map<std::string, std::string> data;
  std::set<std::string> keysSet;  // every key ever set
  std::atomic<int> sets{0}, gets{0};
  std::atomic<int64_t> largestTimeoutMs{-1};
  // Failure injection (read by the callbacks).
  std::atomic<int32_t> setResult{SF_STORE_OK};
  std::atomic<int32_t> getResult{SF_STORE_OK};  // returned instead of looking the key up
  std::atomic<bool> leaveBytesUnset{false};

  sf_store handle() {
    sf_store s;
    sf_store_init(&s, sizeof s);
    s.user = this;
    s.set = &MapStore::setCallback;
    s.get = &MapStore::getCallback;
    return s;
  }

  void put(const std::string& key, const std::string& value) {
    std::lock_guard<std::mutex> lock(mutex);
    data[key] = value;
    keysSet.insert(key);
    cv.notify_all();
  }

  static int32_t setCallback(void* user, const char* key, const void* value, uint64_t bytes) {
    auto* self = static_cast<MapStore*>(user);
    ++self->sets;
    const int32_t r = self->setResult.load();
    if (r != SF_STORE_OK) return r;
    self->put(key, std::string(static_cast<const char*>(value), size_t(bytes)));
    return SF_STORE_OK;
  }

  static int32_t getCallback(void* user, const char* key, int64_t timeoutMs, void* buffer,
                             uint64_t capacity, uint64_t* bytes) {
    auto* self = static_cast<MapStore*>(user);
    ++self->gets;
    int64_t seen = self->largestTimeoutMs.load();
    while (timeoutMs > seen && !self->largestTimeoutMs.compare_exchange_weak(seen, timeoutMs)) {
    }
    const int32_t r = self->getResult.load();
    if (r != SF_STORE_OK) return r;
    std::unique_lock<std::mutex> lock(self->mutex);
    const bool found = self->cv.wait_for(lock, std::chrono::milliseconds(timeoutMs), [&] {
      return self->data.count(key) > 0;
    });
    if (!found) return SF_STORE_TIMEOUT;
    const std::string& v = self->data[key];
    if (self->leaveBytesUnset) return SF_STORE_OK;
    *bytes = v.size();
    if (v.size() <= capacity) std::memcpy(buffer, v.data(), v.size());
    return SF_STORE_OK;
  }
};

}  // namespace sftest
