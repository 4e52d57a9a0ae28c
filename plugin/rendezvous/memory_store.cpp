#include "plugin/rendezvous/memory_store.h"

#include "plugin/core/error.h"

namespace sfsync {

std::shared_ptr<MemoryStore> MemoryStore::named(const std::string& name) {
  static std::mutex registryMutex;
  static std::map<std::string, std::weak_ptr<MemoryStore>> registry;
  std::lock_guard<std::mutex> lock(registryMutex);
  std::shared_ptr<MemoryStore> store = registry[name].lock();
  if (!store) {
    store = std::make_shared<MemoryStore>();
    registry[name] = store;
  }
  return store;
}

void MemoryStore::set(const std::string& key, const std::vector<char>& data) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
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
    for (const auto& k : keys) {
      if (!data_.count(k)) return false;
    }
    return true;
  };
  if (!cv_.wait_for(lock, timeout, allThere)) {
    fail(SF_ERR_TIMEOUT, "rendezvous: timed out after " + std::to_string(timeout.count()) +
                             " ms waiting for key '" + keys.front() + "' in the memory store");
  }
}

}  // namespace sfsync
