#pragma once
// BucketCycle: where one bucket is in its window's cycle, and the one
// collective of it in flight. Responsible for the bucket's state, its count
// of gradients not yet reported, the Work handle of its reduction or
// parameter gather, and for checking every change of state against one
// table (an illegal one is SF_ERR_INTERNAL naming the bucket and both
// states: a bug in the reducer, never undefined behaviour). Not responsible
// for starting or waiting collectives, the memory they work on, or the
// host-facing checks (the reducer refuses a misuse with SF_ERR_INVALID_STATE
// before it asks for a transition).
//
// The cycle: the transitions bucketTransitionAllowed allows, and no other:
//   idle      -> filling    the first of its gradients reported ready
//   idle      -> reducing   started with none reported (sf_synchronize[_start])
//   filling   -> reducing   started (complete, or by a synchronization)
//   reducing  -> reduced    waited for: the results in place
//   reducing  -> idle       abandoned: drained after a failure or at teardown
//   reduced   -> gathering  its parameter gather started (sharded)
//   reduced   -> idle       the next window began
//   gathering -> reducing   the next window's reduction started (after the gather)
//
//  - idle: nothing of the current window in the bucket, nothing in flight;
//  - filling: some of its gradients reported ready, not started (complete()
//    once all are: it starts when every bucket before it has started);
//  - reducing: its reduction in flight (the handle);
//  - reduced: the current window's reduction waited for and in place;
//  - gathering: the parameter gather of its last reduced window started (in
//    flight until waited). It outlives that window: the gather overlaps the
//    next window's forward, until the host waits for it or the bucket's next
//    reduction starts (which waits for it first). So reducedIn(pass) tells
//    whether a gathering bucket's reduction is the current pass's.
// Reports (gradientReported) move only idle to filling; in any other state
// they are counted and change nothing (a report after sf_synchronize_start
// started the bucket, or while the previous window's gather runs).

#include <cstdint>
#include <memory>

#include "plugin/backend/backend.h"

namespace sfsync {

enum class BucketState : uint8_t { kIdle, kFilling, kReducing, kReduced, kGathering };

const char* bucketStateName(BucketState state);
bool bucketTransitionAllowed(BucketState from, BucketState to);

class BucketCycle {
 public:
  BucketCycle(int64_t bucket, int64_t gradients);

  BucketState state() const { return state_; }
  // Gradients of the bucket not reported since the last synchronization.
  int64_t pending() const { return pending_; }
  bool complete() const { return pending_ == 0; }
  // Whether the bucket's reduction of pass `pass` is in place (reduced, or
  // gathering since then).
  bool reducedIn(int64_t pass) const;
  bool gathering() const { return state_ == BucketState::kGathering; }

  // ---- Transitions (each checked by moveTo) ---------------------------------
  void gradientReported();            // pending - 1; idle -> filling
  void reportsCleared();              // a synchronization completed: all pending again
  void newWindow();                   // reduced -> idle; idle and gathering stay
  void startReduction(std::unique_ptr<Work> work);  // idle|filling|gathering -> reducing
  void reductionDone(int64_t pass);   // reducing -> reduced; the handle released
  void startGather(std::unique_ptr<Work> work);     // reduced -> gathering
  void gatherDone();                  // gathering: the (waited) handle released
  // Drained (after a failure, at teardown): the handle released; a
  // reduction is abandoned (reducing -> idle), a gather is over.
  void abandon();

  // The collective in flight: the reduction (reducing) or the parameter
  // gather (gathering, not waited yet); nullptr when none.
  Work* inFlight() const { return work_.get(); }
  // The reduction in flight; SF_ERR_INTERNAL when the bucket is not reducing.
  Work& reduction() const;

 private:
  void moveTo(BucketState to);  // the one place a state changes
  [[noreturn]] void internal(const char* what) const;

  int64_t bucket_;
  int64_t gradients_;
  int64_t pending_;
  BucketState state_ = BucketState::kIdle;
  int64_t reducedPass_ = 0;  // the pass whose reduction is in place (reduced, gathering)
  std::unique_ptr<Work> work_;
};

}  // namespace sfsync
