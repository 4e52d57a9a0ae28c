#pragma once
// An in-process key-value store for ranks that are threads of one process
// ("memory://name"). Stores are shared by name while any context holds them.

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

namespace sfsync {

class MemoryStore : public gloo::rendezvous::Store {
 public:
  // The store registered under `name`, created if no context holds it now.
  static std::shared_ptr<MemoryStore> named(const std::string& name);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<char>> data_;
};

}  // namespace sfsync
