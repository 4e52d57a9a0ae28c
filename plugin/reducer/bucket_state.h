#pragma once
// BucketCycle: where one bucket is in its window's cycle, and the one
// collective of it in flight. Responsible for the bucket's state, its count
// of gradients not yet reported, the Work handle of its reduction or
// parameter gather, and for checking every change of state against one
// table (an illegal one is SF_ERR_INTERNAL naming the bucket and both
// states: a bug in the reducer, never undefined behaviour). Every Work of a
// bucket (its reduction, its parameter gather, its gradient gather) is held
// here and nowhere else. Not responsible
// for starting or waiting collectives, the memory they work on, or the
// host-facing checks (the reducer refuses a misuse with SF_ERR_INVALID_STATE
// before it asks for a transition).
//
// The cycle: the transitions kBucketTransitions allows, and no other:
//   idle      -> filling    the first of its gradients reported ready
//   idle      -> reducing   started with none reported (sf_synchronize[_start])
//   filling   -> reducing   started (complete, or by a synchronization)
//   reducing  -> reduced    waited for: the results in place
//   reducing  -> idle       abandoned: drained after a failure or at teardown
//   reduced   -> gathering  its parameter gather started (sharded)
//   reduced   -> idle       the next window began
//   gathering -> reducing   the next window's reduction started (after the gather)
//   reduced   -> gathering_gradients  sf_gather_gradients started its all-gather
//   gathering_gradients -> reduced    waited for: the reduced gradients whole
//   gathering_gradients -> idle       abandoned: drained after a failure
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
//    whether a gathering bucket's reduction is the current pass's;
//  - gathering_gradients: sf_gather_gradients' all-gather of the reduced
//    segments in flight (sharded; the call waits for it before it returns,
//    so only a failure leaves a bucket here). The reduction stays the
//    current pass's.
// Passes (pass_ref.h): the cycle records the pass it is in (enterPass), the
// pass whose reduction is in place (reducedIn) and the pass whose gradients
// sf_gather_gradients made whole; the reducer keeps no pass of its own.
// Reports (gradientReported) move only idle to filling; in any other state
// they are counted and change nothing (a report after sf_synchronize_start
// started the bucket, or while the previous window's gather runs).

#include <cstdint>
#include <memory>

#include "plugin/backend/backend.h"

namespace sfsync {

enum class BucketState : uint8_t {
  kIdle, kFilling, kReducing, kReduced, kGathering, kGatheringGradients
};
constexpr int kBucketStates = 6;

// kBucketTransitions[from][to]: the whole cycle above, and nothing else.
inline constexpr bool kBucketTransitions[kBucketStates][kBucketStates] = {
    //                       idle   filling reducing reduced gathering gathering_gradients
    /* idle */               {false, true,   true,    false,  false,    false},
    /* filling */            {false, false,  true,    false,  false,    false},
    /* reducing */           {true,  false,  false,   true,   false,    false},
    /* reduced */            {true,  false,  false,   false,  true,     true},
    /* gathering */          {false, false,  true,    false,  false,    false},
    /* gathering_gradients */{true,  false,  false,   true,   false,    false},
};

const char* bucketStateName(BucketState state);
// The table, for any two values (false for one that is no state).
inline bool bucketTransitionAllowed(BucketState from, BucketState to) {
  const int f = int(from), t = int(to);
  return f < kBucketStates && t < kBucketStates && kBucketTransitions[f][t];
}

// Inline: every grad-ready and every bucket of every window passes here.
class BucketCycle {
 public:
  BucketCycle(int64_t bucket, int64_t gradients)
      : bucket_(bucket), gradients_(gradients), pending_(gradients) {}

  BucketState state() const { return state_; }
  // Gradients of the bucket not reported since the last synchronization.
  int64_t pending() const { return pending_; }
  bool complete() const { return pending_ == 0; }
  // Whether the bucket's reduction of pass `pass` is in place (reduced, or
  // gathering since then).
  bool reducedIn(int64_t pass) const {
    return (state_ == BucketState::kReduced || state_ == BucketState::kGathering ||
            state_ == BucketState::kGatheringGradients) &&
           reducedPass_ == pass;
  }
  bool gathering() const { return state_ == BucketState::kGathering; }
  // The pass the bucket's state belongs to (enterPass; 0 before the first).
  int64_t pass() const { return pass_; }
  // Whether sf_gather_gradients made the bucket's reduced gradients of pass
  // `pass` whole on this rank (its reduction of `pass` still in place).
  bool gradientsWholeIn(int64_t pass) const { return reducedIn(pass) && wholePass_ == pass; }

  // ---- Transitions (each checked by moveTo) ---------------------------------
  // pending - 1; idle -> filling.
  void gradientReported() {
    if (pending_ <= 0) internal("a gradient reported with none pending");
    --pending_;
    if (state_ == BucketState::kIdle) moveTo(BucketState::kFilling);
  }
  // A synchronization completed: all pending again.
  void reportsCleared() { pending_ = gradients_; }
  // reduced -> idle; idle and gathering stay.
  void newWindow() {
    if (state_ == BucketState::kReduced) {
      moveTo(BucketState::kIdle);
    } else if (state_ != BucketState::kIdle && state_ != BucketState::kGathering) {
      internal("a new window began while the bucket was in this state");
    }
  }
  // Pass `pass` opened: newWindow(), and the cycle is in it.
  void enterPass(int64_t pass) {
    newWindow();
    pass_ = pass;
  }
  // The reduction of `pass` is whole on this rank (gathered, or nothing to
  // gather); the caller checked reducedIn(pass).
  void gradientsMadeWhole(int64_t pass) { wholePass_ = pass; }
  // idle|filling|gathering (its gather waited) -> reducing.
  void startReduction(std::unique_ptr<Work> work) {
    if (!work) internal("a reduction started without a collective");
    if (work_) internal("a reduction started while a collective of the bucket is in flight");
    moveTo(BucketState::kReducing);
    work_ = std::move(work);
  }
  // reducing -> reduced; the handle released. (Only from reducing: the
  // table's other way into reduced is a gradient gather's end.)
  void reductionDone(int64_t pass) {
    if (state_ != BucketState::kReducing) illegal(BucketState::kReduced);
    moveTo(BucketState::kReduced);
    work_.reset();
    reducedPass_ = pass;
  }
  // reduced -> gathering.
  void startGather(std::unique_ptr<Work> work) {
    if (!work) internal("a gather started without a collective");
    moveTo(BucketState::kGathering);
    work_ = std::move(work);
  }
  // gathering: the (waited) handle released.
  void gatherDone() {
    if (state_ != BucketState::kGathering) internal("a gather finished that was never started");
    work_.reset();
  }
  // reduced -> gathering_gradients (sf_gather_gradients).
  void startGradientGather(std::unique_ptr<Work> work) {
    if (!work) internal("a gradient gather started without a collective");
    moveTo(BucketState::kGatheringGradients);
    work_ = std::move(work);
  }
  // The gradient gather in flight; SF_ERR_INTERNAL when there is none.
  Work& gradientGather() const {
    if (state_ != BucketState::kGatheringGradients || !work_) {
      internal("waiting for a gradient gather that is not in flight");
    }
    return *work_;
  }
  // gathering_gradients -> reduced (waited); the handle released.
  void gradientGatherDone() {
    if (state_ != BucketState::kGatheringGradients) {
      internal("a gradient gather finished that was never started");
    }
    moveTo(BucketState::kReduced);
    work_.reset();
  }
  // Drained (after a failure, at teardown): the handle released; a
  // reduction or a gradient gather is abandoned (-> idle), a parameter
  // gather is over.
  void abandon() {
    work_.reset();
    if (state_ == BucketState::kReducing || state_ == BucketState::kGatheringGradients) {
      moveTo(BucketState::kIdle);
    }
  }

  // The collective in flight: the reduction (reducing), the parameter
  // gather (gathering, not waited yet) or the gradient gather
  // (gathering_gradients); nullptr when none.
  Work* inFlight() const { return work_.get(); }
  // The reduction in flight; SF_ERR_INTERNAL when the bucket is not reducing.
  Work& reduction() const {
    if (state_ != BucketState::kReducing || !work_) {
      internal("waiting for a reduction that is not in flight");
    }
    return *work_;
  }

 private:
  // The one place a state changes.
  void moveTo(BucketState to) {
    if (!kBucketTransitions[int(state_)][int(to)]) illegal(to);
    state_ = to;
  }
  [[noreturn]] void illegal(BucketState to) const;
  [[noreturn]] void internal(const char* what) const;

  int64_t bucket_;
  int64_t gradients_;
  int64_t pending_;
  BucketState state_ = BucketState::kIdle;
  int64_t pass_ = 0;         // the pass entered last
  int64_t reducedPass_ = 0;  // the pass whose reduction is in place (reduced, gathering)
  int64_t wholePass_ = 0;    // the pass whose gradients were made whole
  std::unique_ptr<Work> work_;
};

}  // namespace sfsync
