// BucketCycle (bucket_state.h): the names and the failure path of an
// illegal transition; the table and the transitions are inline there.

#include "plugin/reducer/bucket_state.h"

#include <string>

#include "plugin/core/error.h"

namespace sfsync {

const char* bucketStateName(BucketState state) {
  switch (state) {
    case BucketState::kIdle: return "idle";
    case BucketState::kFilling: return "filling";
    case BucketState::kReducing: return "reducing";
    case BucketState::kReduced: return "reduced";
    case BucketState::kGathering: return "gathering";
    case BucketState::kGatheringGradients: return "gathering_gradients";
  }
  return "not a bucket state";
}

void BucketCycle::internal(const char* what) const {
  fail(SF_ERR_INTERNAL, "bucket " + std::to_string(bucket_) + " (" + bucketStateName(state_) +
                            "): " + what + " (a bug in sfsync: please report it)");
}

void BucketCycle::illegal(BucketState to) const {
  internal((std::string("illegal transition to ") + bucketStateName(to)).c_str());
}

}  // namespace sfsync
