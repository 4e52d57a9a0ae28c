#pragma once
// An in-process key-value store for ranks that are threads of one process
// ("memory://name"). Stores are shared by name while any context holds them.
// Like the env:// store, keys are written once and each rank is claimed
// once: a second claimant (a second job reusing the name while the first is
// alive) fails every rank still waiting in this store with SF_ERR_MISMATCH.

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "plugin/rendezvous/store_health.h"

namespace sfsync {

class MemoryStore : public gloo::rendezvous::Store, public StoreHealth {
 public:
  // The store registered under `name`, created if no context holds it now.
  static std::shared_ptr<MemoryStore> named(const std::string& name);

  // Records that a context of `rank` uses this store; a second claim of the
  // same rank poisons the store and throws SF_ERR_MISMATCH naming it.
  void claim(int rank, const std::string& url);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  void checkHealth() override;  // SF_ERR_MISMATCH once a rank was claimed twice

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<char>> data_;
  std::map<int, int> claims_;  // rank -> claims
  std::string poison_;
  std::string name_;
};

}  // namespace sfsync
