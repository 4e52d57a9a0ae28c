#include "plugin/shim_policy/reduce_probe.h"

#include <array>
#include <cstdint>
#include <cstring>

#include "plugin/core/dtype.h"

namespace sfsync {

namespace {

// Exact in float16 and bfloat16 as well as in float32/64, and so are their
// sums; a product, max, min or an integer sum of these bit patterns differs
// in at least one element.
constexpr std::array<double, 4> kA = {1.5, -2.25, 3.0, 0.5};
constexpr std::array<double, 4> kB = {2.25, 1.0, -0.75, 8.0};

template <typename T, typename Encode>
bool sumsAs(const ReduceFunction& fn, Encode encode) {
  std::array<T, 4> a, b, expected, out;
  for (size_t i = 0; i < 4; ++i) {
    a[i] = encode(kA[i]);
    b[i] = encode(kB[i]);
    expected[i] = encode(kA[i] + kB[i]);
    std::memset(&out[i], 0x5a, sizeof(T));
  }
  try {
    fn(out.data(), a.data(), b.data(), 4);
  } catch (...) {
    return false;
  }
  return std::memcmp(out.data(), expected.data(), sizeof out) == 0;
}

}  // namespace

ReduceClass probeReduce(size_t elementSize, const ReduceFunction& fn) {
  ReduceClass r;
  if (!fn) return r;
  bool sum = false;
  switch (elementSize) {
    case 4:
      sum = sumsAs<float>(fn, [](double x) { return float(x); });
      r.dtype = SF_DTYPE_FLOAT32;
      break;
    case 8:
      sum = sumsAs<double>(fn, [](double x) { return x; });
      r.dtype = SF_DTYPE_FLOAT64;
      break;
    case 2:
      if (sumsAs<uint16_t>(fn, [](double x) { return floatToHalf(float(x)); })) {
        sum = true;
        r.dtype = SF_DTYPE_FLOAT16;
      } else {
        sum = sumsAs<uint16_t>(fn, [](double x) { return floatToBf16(float(x)); });
        r.dtype = SF_DTYPE_BFLOAT16;
      }
      break;
    default:
      break;
  }
  if (!sum) return ReduceClass{};
  r.op = SF_SHIM_OP_SUM;
  return r;
}

ReduceClass ReduceClassifier::classify(const void* identity, size_t elementSize,
                                       const ReduceFunction& fn) {
  if (identity) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = cache_.find({identity, elementSize});
    if (it != cache_.end()) return it->second;
  }
  const ReduceClass r = probeReduce(elementSize, fn);
  std::lock_guard<std::mutex> lock(mutex_);
  ++probes_;
  if (identity) cache_[{identity, elementSize}] = r;
  return r;
}

size_t ReduceClassifier::probes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return probes_;
}

}  // namespace sfsync
