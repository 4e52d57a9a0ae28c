#pragma once
// Admission of the ranks that meet in a store: every rank agrees on
// world_size and each rank number is claimed by one process. Responsible for
// the protocol over the store (claims, rank 0's roster) and its messages; not
// for the transport or for who may reach the store (the store's own
// authentication is the env:// server's business).
//
// Protocol (keys under the store's prefix):
//   join/<r>  each rank r publishes its claim "world_size=W nonce=N host=H pid=P";
//   roster    rank 0 waits (one deadline, timeout_ms) for join/1..W-1, checks
//             that every claim says world_size W, and publishes "ok" with the
//             W claims, or "error <status>" with the message, so that every
//             rank fails with rank 0's reason instead of timing out;
//   every rank r != 0 waits for the roster and checks that it lists its own
//   claim: otherwise another process claimed rank r (SF_ERR_MISMATCH), and
//   this one writes its claim again so that the other sees it in recheck().
// Under a launcher that restarts jobs the store is the attempt's (scoped by
// Rendezvous) and an AttemptGuard is given: rank 0 marks the earlier
// attempts superseded, and a process of a superseded attempt is refused
// (SF_ERR_MISMATCH) at join, while it waits there, and at recheck().

#include <chrono>
#include <cstdint>
#include <string>

#include "plugin/rendezvous/launch_attempt.h"
#include "sfsync.h"

namespace gloo {
namespace rendezvous {
class Store;
}
}  // namespace gloo

namespace sfsync {

class Membership {
 public:
  // `guard` (may be null: no launcher attempt) must outlive this object.
  Membership(const sf_options& opts, std::string where, AttemptGuard* guard = nullptr);

  // Before the transport connects. Throws SF_ERR_MISMATCH (world sizes
  // differ, rank claimed twice, this process's attempt superseded), SF_ERR_TIMEOUT (ranks or the roster missing
  // after timeout_ms, naming them), SF_ERR_BACKEND (store failed).
  void join(gloo::rendezvous::Store& store);

  // After the transport connected (a point every rank of the job reached
  // after reading the roster): "" if this rank's claim (and, on rank 0, the
  // roster) still hold, else a message naming the second claimant.
  std::string recheck(gloo::rendezvous::Store& store) const;

  const std::string& claim() const { return claim_; }

 private:
  void joinAsRoot(gloo::rendezvous::Store& store);
  void joinAsPeer(gloo::rendezvous::Store& store);
  // Throws SF_ERR_MISMATCH when a later attempt has started.
  void refuseIfSuperseded();
  // waitGet within `timeout`, asking the guard every kGuardPoll whether a
  // later attempt started (then refused).
  std::string waitGetGuarded(gloo::rendezvous::Store& store, const std::string& key,
                             std::chrono::milliseconds timeout, const std::string& what);

  const sf_options opts_;
  const std::string where_;  // for messages: which store
  AttemptGuard* const guard_;
  bool refused_ = false;  // the error in flight is refuseIfSuperseded's
  std::string claim_;
  std::string roster_;  // as published or read
};

}  // namespace sfsync
