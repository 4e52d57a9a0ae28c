#include "shim/policy/reduce_probe.h"

#include <array>
#include <cstdint>
#include <cstring>

#include "plugin/core/dtype.h"

namespace sfshim {

using sfsync::floatToBf16;
using sfsync::floatToHalf;

namespace {

// Exact in float16 and bfloat16 as well as in float32/64, and so are their
// sums; a product, max, min or an integer sum of these bit patterns differs
// in at least one element. All magnitudes are below 2 and no pair holds two
// negatives, so the bit patterns, read as signed integers of the same width,
// add without overflow: probing a host's integer sum is well defined. (An
// integer product of them may overflow: there, as on every machine these
// libraries run on, it wraps.)
constexpr std::array<double, 4> kA = {1.5, -0.75, 1.25, 0.5};
constexpr std::array<double, 4> kB = {0.25, 1.0, -0.5, 1.75};

// Room for 4 elements of up to 8 bytes: a function whose element is wider
// than the size the host declared (a host bug) still stays in bounds.
struct alignas(16) ProbeBuffer {
  unsigned char bytes[4 * 8];
};

template <typename T, typename Encode>
bool sumsAs(const ReduceFunction& fn, Encode encode) {
  ProbeBuffer a{}, b{}, out;
  std::array<T, 4> expected;
  std::memset(out.bytes, 0x5a, sizeof out.bytes);
  for (size_t i = 0; i < 4; ++i) {
    const T x = encode(kA[i]), y = encode(kB[i]);
    std::memcpy(a.bytes + i * sizeof(T), &x, sizeof(T));
    std::memcpy(b.bytes + i * sizeof(T), &y, sizeof(T));
    expected[i] = encode(kA[i] + kB[i]);
  }
  try {
    fn(out.bytes, a.bytes, b.bytes, 4);
  } catch (...) {
    return false;
  }
  return std::memcmp(out.bytes, expected.data(), sizeof expected) == 0;
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

}  // namespace sfshim
