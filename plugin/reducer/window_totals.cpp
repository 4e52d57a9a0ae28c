// WindowTotals (window_totals.h): which bucket carries what, the limbs in
// and out of the tails.

#include "plugin/reducer/window_totals.h"

#include <cmath>
#include <string>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"

namespace sfsync {

void WindowTotals::plan(const std::vector<PlannedBucket>& plan, int64_t world,
                        sf_dtype wireDtype, bool weighted, const std::vector<int64_t>& after) {
  weighted_ = weighted;
  codecs_.clear();
  at_ = after;
  if (!weighted || world <= 1) return;
  for (size_t i = 0; i < plan.size(); ++i) {
    // A float32 bucket on a 16-bit wire carries its limbs as that type.
    sf_dtype carried = plan[i].dtype;
    if (carried == SF_DTYPE_FLOAT32 &&
        (wireDtype == SF_DTYPE_BFLOAT16 || wireDtype == SF_DTYPE_FLOAT16)) {
      carried = wireDtype;
    }
    const LimbCodec c = LimbCodec::forWire(carried, world);
    if (!c.usable()) {
      fail(SF_ERR_UNSUPPORTED,
           "reduce_op = SF_REDUCE_WEIGHTED: bucket " + std::to_string(i) + " travels as " +
               dtypeName(carried) + ", which cannot sum the window weight exactly over " +
               std::to_string(world) + " ranks (at most 128 ranks for bfloat16, 1024 for float16)");
    }
    codecs_.push_back(c);
    // A device bucket's limbs reach it in one small write (at most 256 bytes).
    const int64_t bytes = int64_t(c.limbs) * (i == 0 ? 1 + kSums : 1) * int64_t(dtypeSize(plan[i].dtype));
    if (plan[i].device != SF_DEVICE_HOST && bytes > kMaxDeviceWrite) {
      fail(SF_ERR_UNSUPPORTED,
           "reduce_op = SF_REDUCE_WEIGHTED: bucket " + std::to_string(i) + " (" +
               deviceName(plan[i].device) + ", " + dtypeName(carried) + ") would need " +
               std::to_string(bytes) + " bytes of weight limbs for " + std::to_string(world) +
               " ranks, more than one small device write holds (" +
               std::to_string(kMaxDeviceWrite) + "); float32 buckets hold them up to 4096 ranks");
    }
  }
}

int64_t WindowTotals::limbElems(size_t i) const {
  if (codecs_.empty()) return 0;
  return int64_t(codecs_[i].limbs) * (i == 0 ? 1 + kSums : 1);
}

std::vector<int64_t> WindowTotals::reserve(size_t buckets) const {
  std::vector<int64_t> r(buckets, 0);
  for (size_t i = 0; i < buckets && i < codecs_.size(); ++i) r[i] = limbElems(i);
  return r;
}

void WindowTotals::addSums(const double* values, int count) {
  for (int k = 0; k < count; ++k) local_.sums[size_t(k)] += values[k];
}

void WindowTotals::describe(size_t i, ReduceSpec& spec) const {
  if (!weighted_) return;
  spec.prescale = 1.0;
  if (codecs_.empty()) {
    // World size 1: the local weight divides (0: nothing, reported after).
    spec.postscale = local_.weight != 0.0 ? 1.0 / local_.weight : 1.0;
    return;
  }
  spec.postscale = 1.0;
  spec.weightAt = at_[i];
  spec.weightElems = limbElems(i);
}

std::vector<double> WindowTotals::readLimbs(size_t i, const BucketBuffers& b, int64_t segment,
                                            int64_t n, MemoryOps& memory) const {
  const sf_dtype dtype = b.plan->dtype;  // a 16-bit wire's sums, widened exactly
  const size_t esize = dtypeSize(dtype);
  std::vector<char> bytes(static_cast<size_t>(n) * esize);
  memory.readSmall(bytes.data(), b.reservedTail(segment) + size_t(at_[i]) * esize, bytes.size());
  std::vector<double> sums(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) sums[size_t(j)] = loadFromDtype(bytes.data() + size_t(j) * esize, dtype);
  return sums;
}

double WindowTotals::scaleOf(size_t i, const BucketBuffers& b, int64_t ownSegment,
                             MemoryOps& memory) const {
  if (codecs_.empty()) return 1.0;  // world size 1: describe()'s postscale divided
  const LimbCodec& c = codecs_[i];
  const double weight = c.decode(readLimbs(i, b, ownSegment, c.limbs, memory).data());
  if (weight == 0.0 || !std::isfinite(weight)) return 1.0;
  return 1.0 / weight;
}

void WindowTotals::encode(size_t i, const BucketBuffers& b, MemoryOps& memory) const {
  if (codecs_.empty()) return;
  const LimbCodec& c = codecs_[i];
  const sf_dtype dtype = b.plan->dtype;  // the tail's elements (the wire's values fit them)
  const size_t esize = dtypeSize(dtype);
  const int64_t n = limbElems(i);
  std::vector<double> limbs(static_cast<size_t>(n));
  c.encode(local_.weight, limbs.data());
  if (i == 0) {
    for (int k = 0; k < kSums; ++k) {
      c.encode(local_.sums[size_t(k)], limbs.data() + c.limbs * (1 + k));
    }
  }
  std::vector<char> bytes(static_cast<size_t>(n) * esize);
  for (int64_t j = 0; j < n; ++j) storeAsDtype(bytes.data() + size_t(j) * esize, dtype, limbs[size_t(j)]);
  for (int64_t k = 0; k < b.layout.world; ++k) {
    memory.writeSmall(b.reservedTail(k) + size_t(at_[i]) * esize, bytes.data(), bytes.size());
  }
}

const WindowTotals::Totals& WindowTotals::collect(const BucketBuffers& first, int64_t ownSegment,
                                                  MemoryOps& memory) {
  if (codecs_.empty()) {
    totals_ = local_;
  } else {
    const LimbCodec& c = codecs_[0];
    const std::vector<double> sums = readLimbs(0, first, ownSegment, limbElems(0), memory);
    totals_.weight = c.decode(sums.data());
    for (int k = 0; k < kSums; ++k) totals_.sums[size_t(k)] = c.decode(sums.data() + c.limbs * (1 + k));
  }
  collected_ = true;
  local_ = Totals{};
  return totals_;
}

}  // namespace sfsync
