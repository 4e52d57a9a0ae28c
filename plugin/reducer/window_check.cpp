// WindowCheck (window_check.h): the carrier rule, the modulus, the encoding
// and the verification; it owns no memory and starts no bucket collective.

#include "plugin/reducer/window_check.h"

#include <cmath>
#include <cstring>
#include <sstream>
#include <string>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/reducer/agreement.h"

namespace sfsync {

namespace {

// The modulus p for `world` ranks: the largest p (at most 2^20) with
// world * (p - 1)^2 <= 2^m, so that both sums, of x = w mod p and of x^2,
// are exact integers in the dtype whatever the order of the additions.
// p < 2 means no check (bfloat16 with more than 256 ranks).
int64_t modulusFor(sf_dtype dtype, int64_t world) {
  using U = unsigned __int128;
  const U limit = U(1) << exactIntegerBits(dtype);
  auto fits = [&](int64_t q) { return U(world) * U(q) * U(q) <= limit; };  // q = p - 1
  int64_t q = int64_t(std::sqrt(std::ldexp(1.0, exactIntegerBits(dtype)) / double(world)));
  while (q > 0 && !fits(q)) --q;
  while (fits(q + 1)) ++q;
  const int64_t kMaxModulus = int64_t(1) << 20;
  return q + 1 > kMaxModulus ? kMaxModulus : q + 1;
}

// Whether bucket i carries the check better than bucket c (see choose()):
// the more exact dtype (a 16-bit host bucket must not shrink a float32
// device layout's modulus); among equals a host bucket; in the flat sharded
// layout, which stages its carrier (the reserved tails cut gradients), the
// smaller; else the later (every rank plans the same buckets from the same
// layout, which the layout check confirms before the first collective).
bool betterCarrier(const PlannedBucket& i, const PlannedBucket& c, sf_shard_layout shard) {
  const int ei = exactIntegerBits(i.dtype), ec = exactIntegerBits(c.dtype);
  if (ei != ec) return ei > ec;
  const bool hi = i.device == SF_DEVICE_HOST, hc = c.device == SF_DEVICE_HOST;
  if (hi != hc) return hi;
  if (shard == SF_SHARD_FLAT && i.bytes != c.bytes) return i.bytes < c.bytes;
  return true;
}

}  // namespace

void WindowCheck::choose(const std::vector<PlannedBucket>& plan, int64_t world,
                         sf_shard_layout shard, sf_dtype wireDtype) {
  carrier_ = -1;
  modulus_ = 0;
  if (world <= 1) return;
  // Device buckets only unsharded (NCCL's reduce-scatter scales every
  // element it receives); a device carrier's two values go through a small
  // pinned copy.
  for (size_t i = 0; i < plan.size(); ++i) {
    if (plan[i].device != SF_DEVICE_HOST && shard != SF_SHARD_NONE) continue;
    if (carrier_ < 0 || betterCarrier(plan[i], plan[size_t(carrier_)], shard)) {
      carrier_ = int64_t(i);
    }
  }
  if (carrier_ < 0) return;
  // A float32 bucket on a 16-bit wire carries its values as that type.
  sf_dtype carried = plan[size_t(carrier_)].dtype;
  if (carried == SF_DTYPE_FLOAT32 &&
      (wireDtype == SF_DTYPE_BFLOAT16 || wireDtype == SF_DTYPE_FLOAT16)) {
    carried = wireDtype;
  }
  modulus_ = modulusFor(carried, world);
  if (modulus_ < 2) carrier_ = -1;
}

std::vector<int64_t> WindowCheck::reserve(size_t buckets) const {
  std::vector<int64_t> r(buckets, 0);
  if (carrier_ >= 0) r[size_t(carrier_)] = kElems;
  return r;
}

void WindowCheck::encode(const BucketBuffers& b, MemoryOps& memory, int64_t window) {
  // The reserved elements must be summed exactly: the backend scales only
  // the gradients (up to the layout's data end), and the modulus fits the
  // dtype they travel in (a 16-bit wire included). Sharded: after every
  // rank's segment, so that each rank checks its own.
  const sf_dtype dtype = b.plan->dtype;
  const size_t esize = dtypeSize(dtype);
  const int64_t x = window % modulus_;
  char values[16];
  storeAsDtype(values, dtype, double(x));
  storeAsDtype(values + esize, dtype, double(x * x));
  for (int64_t k = 0; k < b.layout.world; ++k) {
    memory.writeSmall(b.reservedTail(k), values, 2 * esize);
  }
  carried_ = window;
}

void WindowCheck::verify(const BucketBuffers& b, int64_t ownSegment, MemoryOps& memory,
                         Backend& backend, int64_t world) const {
  const sf_dtype dtype = b.plan->dtype;
  const size_t esize = dtypeSize(dtype);
  // This rank's own segment's tail (the only one a reduce-scatter sums here).
  char values[16];
  memory.readSmall(values, b.reservedTail(ownSegment), 2 * esize);
  const double sum = loadFromDtype(values, dtype);
  const double sumSquares = loadFromDtype(values + esize, dtype);
  const int64_t w = carried_, x = w % modulus_;
  // world * x^2 <= 2^53: exact in int64 and double.
  if (sum == double(world * x) && sumSquares == double(world * x * x)) return;
  // Failure path only: one small collective for the exact numbers.
  RankRange range;
  try {
    range = agreeAcrossRanks(backend, {w})[0];
  } catch (const Error& e) {
    throw Error(e.status(), std::string("ranks are out of step (their window numbers differ) and "
                                        "gathering the numbers failed: ") + e.what());
  }
  throw Error(SF_ERR_MISMATCH, outOfStepMessage(w, range.lo, range.hi));
}

std::string outOfStepMessage(int64_t window, int64_t lo, int64_t hi) {
  std::ostringstream m;
  m << "ranks are out of step: this rank is synchronizing window " << window
    << ", the ranks' window numbers range from " << lo << " to " << hi
    << " (a rank skipped or added an sf_synchronize, began more windows than the others, or "
       "restored another count with sf_restore_windows)";
  return m.str();
}

}  // namespace sfsync
