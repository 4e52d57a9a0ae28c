#pragma once
// WindowTotals: a weighted window's weight and window sums (SF_REDUCE_WEIGHTED,
// "Weighted windows" in include/sfsync.h), carried inside the buckets' own
// collectives. Responsible for this rank's weight and sums of the window in
// progress, the codec of each bucket (core/limb_codec.h, for the dtype its
// limbs travel in), how many tail elements each bucket reserves and where
// its limbs start, writing the limbs before a bucket's collective, and,
// once a bucket's plain sum is done, decoding the global weight from its own
// segment's tail into the factor its data is scaled by (the one place the
// weight is decoded; the backends only sum and scale), and reading the
// global totals once the window's buckets are reduced. Not responsible for
// when buckets start (the reducer, which also refuses a late weight, and
// asks its backend for the scaling step), or for the window check's
// elements before its own in the same tail.
//
// The weight rides in every bucket (each divides by it), the window sums in
// the first bucket only (the first to start, and the one that freezes the
// window's values).

#include <array>
#include <cstdint>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/core/limb_codec.h"
#include "plugin/reducer/bucket_memory.h"
#include "plugin/reducer/bucket_plan.h"
#include "sfsync.h"

namespace sfsync {

class WindowTotals {
 public:
  static constexpr int kSums = SF_WINDOW_SUMS;
  static constexpr int64_t kMaxDeviceWrite = 256;  // MemoryOps::writeSmall on a device
  struct Totals {
    double weight = 0;
    std::array<double, kSums> sums{};
  };

  // At the build, for `plan` on `world` ranks; `after[i]`: the elements of
  // bucket i's tail before this one's (the window check's). Off (no limbs)
  // unless `weighted`; none at world size 1. SF_ERR_UNSUPPORTED for a
  // dtype whose wire cannot sum one bit per limb exactly for
  // this many ranks, or a device bucket whose limbs pass one small write
  // (naming the bucket, its dtype and the world size).
  void plan(const std::vector<PlannedBucket>& plan, int64_t world, sf_dtype wireDtype,
            bool weighted, const std::vector<int64_t>& after);
  bool weighted() const { return weighted_; }
  // Tail elements bucket i reserves for the limbs.
  std::vector<int64_t> reserve(size_t buckets) const;

  // This rank's values for the window in progress (the caller checks the
  // arguments and the timing).
  void addWeight(double w) { local_.weight += w; }
  void addSums(const double* values, int count);
  double localWeight() const { return local_.weight; }

  // Bucket i's ReduceSpec: at world size 1 the local weight's division as
  // its postscale; else a plain sum (the limbs' place, for the wire counts).
  void describe(size_t i, ReduceSpec& spec) const;
  // Once bucket i's plain sum is done (world size > 1): 1 / the global
  // weight decoded from the limbs in segment `ownSegment`'s tail, as the
  // wire summed them; 1 when that weight is 0 or not finite (the sums stay
  // as they are; the reducer reports the window) and at world size 1.
  double scaleOf(size_t i, const BucketBuffers& b, int64_t ownSegment, MemoryOps& memory) const;
  // Before bucket i's collective: this rank's limbs into every segment's tail.
  void encode(size_t i, const BucketBuffers& b, MemoryOps& memory) const;
  // Once every bucket of the window is reduced: the global totals from the
  // first bucket's own segment (world size 1: this rank's), then this
  // rank's values start again at 0. Returns the totals.
  const Totals& collect(const BucketBuffers& first, int64_t ownSegment, MemoryOps& memory);
  // The last collected totals; false before the first collect.
  bool hasTotals() const { return collected_; }
  const Totals& totals() const { return totals_; }

 private:
  int64_t limbElems(size_t i) const;  // limbs of bucket i (weight, and sums in bucket 0)
  // The first `n` limbs of bucket i's segment `segment`, summed, as doubles.
  std::vector<double> readLimbs(size_t i, const BucketBuffers& b, int64_t segment, int64_t n,
                                MemoryOps& memory) const;

  bool weighted_ = false;
  std::vector<LimbCodec> codecs_;  // per bucket; empty at world size 1
  std::vector<int64_t> at_;        // where the limbs start in bucket i's tail
  Totals local_;
  Totals totals_;
  bool collected_ = false;
};

}  // namespace sfsync
