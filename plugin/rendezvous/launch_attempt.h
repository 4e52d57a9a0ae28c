#pragma once
// Which attempt of an elastically restarted job this process belongs to (the
// launcher's restart count and run id), and the keys that keep one attempt's
// rendezvous apart from another's in a store that outlives attempts (a
// launcher's own store, Redis, a directory): every key of the attempt goes
// under its scope, and each new attempt marks the earlier ones superseded so
// that a process left over from one of them is refused with a clear error
// instead of waiting for peers that will never come. Not responsible for
// the admission itself (Membership) or for rank discovery.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace gloo {
namespace rendezvous {
class Store;
}
}  // namespace gloo

namespace sfsync {

class LaunchAttempt {
 public:
  // From the environment: torchrun (TORCHELASTIC_RESTART_COUNT, with
  // TORCHELASTIC_RUN_ID), else Slurm (SLURM_RESTART_COUNT, with
  // SLURM_JOB_ID), else none (an unscoped job). Throws
  // SF_ERR_INVALID_ARGUMENT naming the variable when a count is not an
  // integer >= 0.
  static LaunchAttempt fromEnvironment();

  LaunchAttempt() = default;
  LaunchAttempt(std::string launcher, std::string runId, int64_t count, std::string variable);

  bool scoped() const { return !launcher_.empty(); }
  int64_t count() const { return count_; }
  // "<launcher>/<run id>": the run's keys, shared by its attempts.
  std::string runScope() const;
  // "<launcher>/<run id>/attempt/<count>": this attempt's keys.
  std::string attemptScope() const;
  // "attempt 1 of torchrun run 'x' (TORCHELASTIC_RESTART_COUNT=1)".
  std::string describe() const;

 private:
  std::string launcher_;  // "torchrun", "slurm", or "" (none)
  std::string runId_;
  int64_t count_ = 0;
  std::string variable_;  // the environment variable the count came from
};

// The superseded markers of one run, in the run's (unscoped) store.
class AttemptGuard {
 public:
  AttemptGuard(LaunchAttempt attempt, std::shared_ptr<gloo::rendezvous::Store> runStore);

  const LaunchAttempt& attempt() const { return attempt_; }

  // Rank 0 of a new attempt: marks every earlier attempt (the last 64)
  // superseded. A marker already there (another rank 0, or a write-once
  // store) is left as it is.
  void supersedeEarlier();

  // "" while no later attempt has started, else the message refusing this
  // process (it belongs to an earlier attempt than the one now running).
  // Asks the store once, without waiting.
  std::string supersededBy();

 private:
  const LaunchAttempt attempt_;
  std::shared_ptr<gloo::rendezvous::Store> store_;
};

}  // namespace sfsync
