#pragma once
// A context's one meeting point with its peers. Owns the rendezvous store
// (opened on first use from opts.rendezvous, or the host's store from
// sf_set_store) and hands it to every backend of the context (Gloo's pairs,
// NCCL's unique id) and to the membership check. Under a launcher that
// restarts jobs (LaunchAttempt) every key goes under the attempt's scope, so
// that a restarted job meets afresh in a store that outlived the attempt
// before (torchrun's agent store, Redis, a directory), and the earlier
// attempts' processes are refused. Not responsible for what the backends
// exchange through it.

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "plugin/rendezvous/launch_attempt.h"
#include "plugin/rendezvous/membership.h"
#include "sfsync.h"

namespace gloo {
namespace rendezvous {
class Store;
}
}  // namespace gloo

namespace sfsync {

class Rendezvous {
 public:
  // kSkip: the store alone, without Membership's admission (tools and tests
  // that drive one transport's connect against hand-made peers).
  enum class Admission { kCheck, kSkip };
  explicit Rendezvous(const sf_options& opts, Admission admission = Admission::kCheck);
  ~Rendezvous();

  // Use the host's store (already validated) from now on. SF_ERR_INVALID_STATE
  // once the store was handed out.
  void setHostStore(const sf_store& store, const std::string& prefix);

  // The store (the attempt's scope of it), opened on the first call, after this rank was admitted
  // (Membership::join: world sizes agree, one process per rank) when
  // world_size > 1. Blocks up to timeout_ms. Throws as openStore and
  // Membership::join do; a failed admission is repeated to every later caller.
  std::shared_ptr<gloo::rendezvous::Store> store();

  // After the transport connected: "" when this rank's claim still holds
  // (Membership::recheck), also when the store was never opened.
  std::string recheck();

 private:
  const sf_options opts_;
  const Admission admission_;
  mutable std::mutex mutex_;
  std::shared_ptr<gloo::rendezvous::Store> store_;  // what the backends get
  std::shared_ptr<gloo::rendezvous::Store> base_;   // the store as opened or given
  bool opened_ = false;
  bool admitted_ = false;
  sf_status joinStatus_ = SF_OK;  // a failed admission, repeated
  std::string joinError_;
  std::unique_ptr<AttemptGuard> guard_;  // under a restarting launcher
  std::unique_ptr<Membership> membership_;
};

}  // namespace sfsync
