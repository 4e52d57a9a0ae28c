#pragma once
// WindowCheck: that every rank synchronizes the same window, checked inside
// one bucket's own collective (no extra collective while the ranks agree).
// Responsible for choosing the bucket that carries the check (the carrier)
// and its modulus, encoding the window number into the reserved tail of each
// of the carrier's segments before its collective starts, and verifying the
// sums afterwards (on a difference: the exact numbers, by one small control
// collective, and SF_ERR_MISMATCH). Not responsible for the window number
// (the Context's WindowClock), where the tails are (BucketMemory and the
// shard layout, which reserve kElems per segment for it), or when the
// carrier's collective runs (the reducer).
//
// The encoding: each rank sends x = w mod p and x^2 in the two elements;
// both sums are exact in the carried dtype (p is chosen so), and a rank's
// sums are world * x and world * x^2 iff every rank sent the same x (zero
// variance): either every rank sees a difference or none does.

#include <cstdint>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/reducer/bucket_memory.h"
#include "plugin/reducer/bucket_plan.h"
#include "sfsync.h"

namespace sfsync {

// The out-of-step error's message (SF_ERR_MISMATCH): this rank's window
// number and the range of the ranks' numbers. The window check's, and the
// layout check's exact comparison of the first window (layout_check.h).
std::string outOfStepMessage(int64_t window, int64_t lo, int64_t hi);

class WindowCheck {
 public:
  // Elements the carrier reserves at the end of every segment.
  static constexpr int64_t kElems = 2;

  // Chooses the carrier of `plan` for `world` ranks (none at world size 1,
  // or when no bucket's dtype holds a modulus of at least 2): a bucket of
  // the most exact dtype; among equals a host bucket; in the flat sharded
  // layout the smaller; else the later. Device buckets only unsharded.
  void choose(const std::vector<PlannedBucket>& plan, int64_t world, sf_shard_layout shard,
              sf_dtype wireDtype);
  // The carrier's index, -1 when the check is off.
  int64_t carrier() const { return carrier_; }
  bool carries(size_t bucket) const { return carrier_ == int64_t(bucket); }
  int64_t modulus() const { return modulus_; }
  // Elements bucket i reserves per segment (kElems for the carrier, else 0).
  std::vector<int64_t> reserve(size_t buckets) const;

  // Before the carrier's collective: window `window` into every segment's
  // reserved tail of `b` (through `memory`, ordered before the collective).
  // Throws what the memory's writeSmall throws.
  void encode(const BucketBuffers& b, MemoryOps& memory, int64_t window);
  // After every bucket of the pass completed: reads this rank's own segment's
  // tail and compares. On a difference learns the ranks' exact numbers
  // through `backend` and throws SF_ERR_MISMATCH; rethrows a failed read or
  // collective (the latter's message saying the ranks were out of step).
  void verify(const BucketBuffers& b, int64_t ownSegment, MemoryOps& memory, Backend& backend,
              int64_t world) const;

 private:
  int64_t carrier_ = -1;
  int64_t modulus_ = 0;
  int64_t carried_ = 0;  // the window number the carrier's last collective carried
};

}  // namespace sfsync
