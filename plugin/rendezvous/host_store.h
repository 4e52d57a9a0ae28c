#pragma once
// The host's own key-value store (sf_set_store) as a Gloo store: every key
// gets the context's prefix, every wait is bounded by timeout_ms, and the
// callbacks' statuses become sfsync::Error (SF_ERR_TIMEOUT / SF_ERR_BACKEND
// naming the key). Not responsible for the store itself: the host owns it
// and its thread safety.

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "sfsync.h"

namespace sfsync {

class HostStore : public gloo::rendezvous::Store {
 public:
  using Clock = std::chrono::steady_clock;

  // `store` is copied (struct_size already checked); keys become
  // "<prefix>/sfsync/<key>", or "sfsync/<key>" for an empty prefix.
  HostStore(const sf_store& store, const std::string& prefix, std::chrono::milliseconds timeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  // Waits up to the context's timeout for the key.
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  // Fetches every key within one deadline; the values are kept for get().
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // One get within `timeout` (>= 0 ms).
  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout);

  const std::string& prefix() const { return prefix_; }

 private:
  std::string fullKey(const std::string& key) const;
  // One get that ends by `deadline`; messages say `timeoutMs`.
  std::vector<char> getUntil(const std::string& key, Clock::time_point deadline, int64_t timeoutMs);
  [[noreturn]] void failStatus(const char* op, const std::string& key, int32_t status,
                               int64_t timeoutMs) const;

  sf_store store_;
  std::string prefix_;  // "<prefix>/sfsync/"
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::map<std::string, std::vector<char>> fetched_;  // by wait(), taken by get()
};

}  // namespace sfsync
