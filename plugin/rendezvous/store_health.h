#pragma once
// A store that can say, without waiting, whether the job it serves is still
// sound: the env:// and memory:// stores report a second claimant for a rank
// (SF_ERR_MISMATCH) or a lost server (SF_ERR_BACKEND). The Gloo connect
// polls it while it waits for peers, so that a job that failed in the store
// fails on every rank, also on those already past the store.

namespace sfsync {

class StoreHealth {
 public:
  virtual ~StoreHealth() = default;
  // Throws sfsync::Error if the job cannot go on; returns at once otherwise.
  virtual void checkHealth() = 0;
};

}  // namespace sfsync
