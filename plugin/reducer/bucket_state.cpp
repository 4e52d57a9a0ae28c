// BucketCycle (bucket_state.h): the transition table and the checks each
// transition makes; no collective is started or waited for here.

#include "plugin/reducer/bucket_state.h"

#include <string>

#include "plugin/core/error.h"

namespace sfsync {

namespace {
constexpr int kStates = 5;
using S = BucketState;
// kAllowed[from][to]: the whole cycle of bucket_state.h, and nothing else.
constexpr bool kAllowed[kStates][kStates] = {
    //            idle   filling reducing reduced gathering
    /* idle */    {false, true,   true,    false,  false},
    /* filling */ {false, false,  true,    false,  false},
    /* reducing */{true,  false,  false,   true,   false},
    /* reduced */ {true,  false,  false,   false,  true},
    /* gathering*/{false, false,  true,    false,  false},
};
}  // namespace

const char* bucketStateName(BucketState state) {
  switch (state) {
    case S::kIdle: return "idle";
    case S::kFilling: return "filling";
    case S::kReducing: return "reducing";
    case S::kReduced: return "reduced";
    case S::kGathering: return "gathering";
  }
  return "not a bucket state";
}

bool bucketTransitionAllowed(BucketState from, BucketState to) {
  const int f = int(from), t = int(to);
  return f >= 0 && f < kStates && t >= 0 && t < kStates && kAllowed[f][t];
}

BucketCycle::BucketCycle(int64_t bucket, int64_t gradients)
    : bucket_(bucket), gradients_(gradients), pending_(gradients) {}

void BucketCycle::internal(const char* what) const {
  fail(SF_ERR_INTERNAL, "bucket " + std::to_string(bucket_) + " (" + bucketStateName(state_) +
                            "): " + what + " (a bug in sfsync: please report it)");
}

void BucketCycle::moveTo(BucketState to) {
  if (!bucketTransitionAllowed(state_, to)) {
    internal((std::string("illegal transition to ") + bucketStateName(to)).c_str());
  }
  state_ = to;
}

bool BucketCycle::reducedIn(int64_t pass) const {
  return (state_ == S::kReduced || state_ == S::kGathering) && reducedPass_ == pass;
}

void BucketCycle::gradientReported() {
  if (pending_ <= 0) internal("a gradient reported with none pending");
  --pending_;
  if (state_ == S::kIdle) moveTo(S::kFilling);
}

void BucketCycle::reportsCleared() { pending_ = gradients_; }

void BucketCycle::newWindow() {
  if (state_ == S::kReduced) {
    moveTo(S::kIdle);
  } else if (state_ != S::kIdle && state_ != S::kGathering) {
    internal("a new window began while the bucket was in this state");
  }
}

void BucketCycle::startReduction(std::unique_ptr<Work> work) {
  if (!work) internal("a reduction started without a collective");
  if (work_) internal("a reduction started while a collective of the bucket is in flight");
  moveTo(S::kReducing);
  work_ = std::move(work);
}

Work& BucketCycle::reduction() const {
  if (state_ != S::kReducing || !work_) internal("waiting for a reduction that is not in flight");
  return *work_;
}

void BucketCycle::reductionDone(int64_t pass) {
  moveTo(S::kReduced);
  work_.reset();
  reducedPass_ = pass;
}

void BucketCycle::startGather(std::unique_ptr<Work> work) {
  if (!work) internal("a gather started without a collective");
  moveTo(S::kGathering);
  work_ = std::move(work);
}

void BucketCycle::gatherDone() {
  if (state_ != S::kGathering) internal("a gather finished that was never started");
  work_.reset();
}

void BucketCycle::abandon() {
  work_.reset();
  if (state_ == S::kReducing) moveTo(S::kIdle);
}

}  // namespace sfsync
