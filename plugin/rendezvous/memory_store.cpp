#include "plugin/rendezvous/memory_store.h"

#include "plugin/core/error.h"
#include "plugin/rendezvous/deadline.h"

namespace sfsync {

std::shared_ptr<MemoryStore> MemoryStore::named(const std::string& name) {
  static std::mutex registryMutex;
  static std::map<std::string, std::weak_ptr<MemoryStore>> registry;
  std::lock_guard<std::mutex> lock(registryMutex);
  std::shared_ptr<MemoryStore> store = registry[name].lock();
  if (!store) {
    store = std::make_shared<MemoryStore>();
    store->name_ = name;
    registry[name] = store;
  }
  return store;
}

void MemoryStore::claim(int rank, const std::string& url) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (poison_.empty() && claims_[rank]++ == 0) return;
    if (poison_.empty()) {
      poison_ = "rendezvous " + url + ": rank " + std::to_string(rank) +
                " was claimed by two contexts while the store was alive (a second job reusing the "
                "name while the first one lives? use a name per job)";
    }
  }
  cv_.notify_all();
  fail(SF_ERR_MISMATCH, poison_);
}

void MemoryStore::checkHealth() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!poison_.empty()) fail(SF_ERR_MISMATCH, poison_);
}

void MemoryStore::set(const std::string& key, const std::vector<char>& data) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!poison_.empty()) fail(SF_ERR_MISMATCH, poison_);
    auto it = data_.find(key);
    if (it != data_.end() && it->second != data) {
      fail(SF_ERR_MISMATCH, "rendezvous memory://" + name_ + ": key '" + key +
                                "' is already set and keys are written once (two contexts with the "
                                "same rank and name?)");
    }
    data_[key] = data;
  }
  cv_.notify_all();
}

std::vector<char> MemoryStore::get(const std::string& key) {
  wait({key});
  std::lock_guard<std::mutex> lock(mutex_);
  return data_.at(key);
}

void MemoryStore::wait(const std::vector<std::string>& keys) { wait(keys, kDefaultTimeout); }

void MemoryStore::wait(const std::vector<std::string>& keys,
                       const std::chrono::milliseconds& timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto allThere = [&] {
    if (!poison_.empty()) return true;
    for (const auto& k : keys) {
      if (!data_.count(k)) return false;
    }
    return true;
  };
  const bool done = cv_.wait_until(lock, deadlineAfter(timeout), allThere);
  if (!poison_.empty()) fail(SF_ERR_MISMATCH, poison_);
  if (!done) {
    fail(SF_ERR_TIMEOUT, "rendezvous memory://" + name_ + ": timed out after " +
                             std::to_string(timeout.count()) + " ms waiting for key '" + keys.front() +
                             "' (a rank did not arrive?)");
  }
}

}  // namespace sfsync
