#include "plugin/core/dtype.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace sfsync {

bool dtypeValid(sf_dtype dtype) { return dtypeSize(dtype) != 0; }

size_t dtypeSize(sf_dtype dtype) {
  switch (dtype) {
    case SF_DTYPE_FLOAT32: return 4;
    case SF_DTYPE_FLOAT64: return 8;
    case SF_DTYPE_FLOAT16: return 2;
    case SF_DTYPE_BFLOAT16: return 2;
    default: return 0;
  }
}

const char* dtypeName(sf_dtype dtype) {
  switch (dtype) {
    case SF_DTYPE_FLOAT32: return "float32";
    case SF_DTYPE_FLOAT64: return "float64";
    case SF_DTYPE_FLOAT16: return "float16";
    case SF_DTYPE_BFLOAT16: return "bfloat16";
    default: return "unknown dtype";
  }
}

const char* deviceName(sf_device device) {
  switch (device) {
    case SF_DEVICE_HOST: return "host";
    case SF_DEVICE_CUDA: return "cuda";
    default: return "unknown device";
  }
}

#define SF_ALWAYS_INLINE static inline __attribute__((always_inline))

SF_ALWAYS_INLINE uint32_t floatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

SF_ALWAYS_INLINE float bitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The conversions without branches, so that the loops below vectorize (the
// method of Maratyszcza's FP16 library, which torch uses too): float
// arithmetic in round-to-nearest-even does the rounding, subnormals
// included. Checked against the plain definitions for every float32 and
// every half (tests/unit/core/dtype_tests.cpp); NaN: the quiet 0x7e00 with
// the sign, and a half NaN widens with its payload.
SF_ALWAYS_INLINE uint16_t halfBits(float f) {
  const uint32_t w = floatBits(f), shl1 = w + w, sign = w & 0x80000000u;
  // |f| * 2^112 * 2^-110: past half's range becomes inf; in it, unchanged x4
  float base = (bitsFloat(w & 0x7fffffffu) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t bias = std::max(shl1 & 0xff000000u, 0x71000000u);
  // adding 2^(e+13) rounds away the bits half has no room for
  base = bitsFloat((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = floatBits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
  return uint16_t((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : nonsign));
}

SF_ALWAYS_INLINE float halfValue(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16, sign = w & 0x80000000u, two = w + w;
  const uint32_t normal = floatBits(bitsFloat((two >> 4) + (0xe0u << 23)) * 0x1.0p-112f);
  const uint32_t subnormal = floatBits(bitsFloat((two >> 17) | (126u << 23)) - 0.5f);
  const uint32_t special = sign | 0x7f800000u | ((two >> 4) & 0x007fe000u);  // inf, NaN
  const uint32_t finite = sign | (two < (1u << 27) ? subnormal : normal);
  return bitsFloat(two >= 0xf8000000u ? special : finite);
}

SF_ALWAYS_INLINE float bf16Value(uint16_t b) { return bitsFloat(uint32_t(b) << 16); }

SF_ALWAYS_INLINE uint16_t bf16Bits(float f) {
  const uint32_t u = floatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return uint16_t((u + rounding) >> 16);
}

float halfToFloat(uint16_t h) { return halfValue(h); }
uint16_t floatToHalf(float f) { return halfBits(f); }
float bf16ToFloat(uint16_t b) { return bf16Value(b); }
uint16_t floatToBf16(float f) { return bf16Bits(f); }

// The element loops every reduction runs. Their bodies are always inlined
// into two sets of entry points: one compiled for the build's baseline
// (x86-64: SSE2), one for AVX2, picked once at run time by cpuid. The same
// operations element by element (no contraction, no reassociation), so
// either gives the same bits; tests/unit/core/dtype_tests.cpp compares them.

template <typename T>
SF_ALWAYS_INLINE void scaleLoop(T* dst, const T* src, int64_t n, double factor) {
  const T k = T(factor);
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * k;
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
SF_ALWAYS_INLINE void scale16Loop(uint16_t* dst, const uint16_t* src, int64_t n, double factor) {
  const float k = float(factor);
  for (int64_t i = 0; i < n; ++i) dst[i] = FromF(ToF(src[i]) * k);
}

template <uint16_t (*FromF)(float)>
SF_ALWAYS_INLINE void narrowLoop(uint16_t* dst, const float* src, int64_t n, float k) {
  if (k == 1.0f) {
    for (int64_t i = 0; i < n; ++i) dst[i] = FromF(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = FromF(src[i] * k);
  }
}

template <float (*ToF)(uint16_t)>
SF_ALWAYS_INLINE void widenLoop(float* dst, const uint16_t* src, int64_t n, float k) {
  if (k == 1.0f) {
    for (int64_t i = 0; i < n; ++i) dst[i] = ToF(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = ToF(src[i]) * k;
  }
}

template <typename T>
SF_ALWAYS_INLINE void addLoop(T* out, const T* a, const T* b, size_t n) {
  // In place (the rings' case) on its own: Clang's runtime overlap check
  // would send out == a to its scalar loop.
  if (out == a) {
    for (size_t i = 0; i < n; ++i) out[i] += b[i];
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
  }
}

// io[i] = round16(own[i] * k + widen(io[i])): a 16-bit ring's step, the
// rank's own float32 value added unrounded to the partial sum received.
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
SF_ALWAYS_INLINE void addOwnLoop(uint16_t* io, const float* own, int64_t n, float k) {
  if (k == 1.0f) {
    for (int64_t i = 0; i < n; ++i) io[i] = FromF(own[i] + ToF(io[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) io[i] = FromF(own[i] * k + ToF(io[i]));
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
SF_ALWAYS_INLINE void add16Loop(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n) {
  if (out == a) {
    for (size_t i = 0; i < n; ++i) out[i] = FromF(ToF(out[i]) + ToF(b[i]));
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = FromF(ToF(a[i]) + ToF(b[i]));
  }
}

namespace {

struct Loops {
  void (*scaleF32)(float*, const float*, int64_t, double);
  void (*scaleF64)(double*, const double*, int64_t, double);
  void (*scaleHalf)(uint16_t*, const uint16_t*, int64_t, double);
  void (*scaleBf16)(uint16_t*, const uint16_t*, int64_t, double);
  void (*narrowHalf)(uint16_t*, const float*, int64_t, float);
  void (*narrowBf16)(uint16_t*, const float*, int64_t, float);
  void (*widenHalf)(float*, const uint16_t*, int64_t, float);
  void (*widenBf16)(float*, const uint16_t*, int64_t, float);
  void (*addF32)(float*, const float*, const float*, size_t);
  void (*addF64)(double*, const double*, const double*, size_t);
  void (*addHalf)(uint16_t*, const uint16_t*, const uint16_t*, size_t);
  void (*addBf16)(uint16_t*, const uint16_t*, const uint16_t*, size_t);
  void (*addOwnHalf)(uint16_t*, const float*, int64_t, float);
  void (*addOwnBf16)(uint16_t*, const float*, int64_t, float);
};

// One set of entry points, every function compiled with `target`.
#define SF_DEFINE_LOOPS(ns, target)                                                           \
  namespace ns {                                                                              \
  target void scaleF32(float* d, const float* s, int64_t n, double k) { scaleLoop(d, s, n, k); } \
  target void scaleF64(double* d, const double* s, int64_t n, double k) {                    \
    scaleLoop(d, s, n, k);                                                                    \
  }                                                                                           \
  target void scaleHalf(uint16_t* d, const uint16_t* s, int64_t n, double k) {               \
    scale16Loop<halfValue, halfBits>(d, s, n, k);                                             \
  }                                                                                           \
  target void scaleBf16(uint16_t* d, const uint16_t* s, int64_t n, double k) {               \
    scale16Loop<bf16Value, bf16Bits>(d, s, n, k);                                             \
  }                                                                                           \
  target void narrowHalf(uint16_t* d, const float* s, int64_t n, float k) {                  \
    narrowLoop<halfBits>(d, s, n, k);                                                         \
  }                                                                                           \
  target void narrowBf16(uint16_t* d, const float* s, int64_t n, float k) {                  \
    narrowLoop<bf16Bits>(d, s, n, k);                                                         \
  }                                                                                           \
  target void widenHalf(float* d, const uint16_t* s, int64_t n, float k) {                   \
    widenLoop<halfValue>(d, s, n, k);                                                         \
  }                                                                                           \
  target void widenBf16(float* d, const uint16_t* s, int64_t n, float k) {                   \
    widenLoop<bf16Value>(d, s, n, k);                                                         \
  }                                                                                           \
  target void addF32(float* o, const float* a, const float* b, size_t n) { addLoop(o, a, b, n); } \
  target void addF64(double* o, const double* a, const double* b, size_t n) {                \
    addLoop(o, a, b, n);                                                                      \
  }                                                                                           \
  target void addHalf(uint16_t* o, const uint16_t* a, const uint16_t* b, size_t n) {         \
    add16Loop<halfValue, halfBits>(o, a, b, n);                                               \
  }                                                                                           \
  target void addBf16(uint16_t* o, const uint16_t* a, const uint16_t* b, size_t n) {         \
    add16Loop<bf16Value, bf16Bits>(o, a, b, n);                                               \
  }                                                                                           \
  target void addOwnHalf(uint16_t* io, const float* own, int64_t n, float k) {               \
    addOwnLoop<halfValue, halfBits>(io, own, n, k);                                           \
  }                                                                                           \
  target void addOwnBf16(uint16_t* io, const float* own, int64_t n, float k) {               \
    addOwnLoop<bf16Value, bf16Bits>(io, own, n, k);                                           \
  }                                                                                           \
  constexpr Loops kLoops = {scaleF32,   scaleF64,   scaleHalf, scaleBf16, narrowHalf, narrowBf16, \
                            widenHalf,  widenBf16,  addF32,    addF64,    addHalf,    addBf16,    \
                            addOwnHalf, addOwnBf16};                                              \
  }

SF_DEFINE_LOOPS(baseline, )
#if defined(__x86_64__)
SF_DEFINE_LOOPS(avx2, __attribute__((target("avx2"))))

bool cpuHasAvx2() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u;
  if (!osxsave || !avx) return false;
  unsigned lo = 0, hi = 0;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 0x6u) != 0x6u) return false;  // the OS saves the YMM registers
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (b >> 5) & 1u;
}
#else
bool cpuHasAvx2() { return false; }
#endif

bool wideAvailable() {
  static const bool has = cpuHasAvx2();
  return has;
}

std::atomic<const Loops*> active{nullptr};

const Loops& loops() {
  const Loops* l = active.load(std::memory_order_acquire);
  if (l) return *l;
#if defined(__x86_64__)
  l = wideAvailable() ? &avx2::kLoops : &baseline::kLoops;
#else
  l = &baseline::kLoops;
#endif
  active.store(l, std::memory_order_release);
  return *l;
}

}  // namespace

bool useWideLoops(bool wide) {
  const bool can = wideAvailable();
#if defined(__x86_64__)
  active.store(wide && can ? &avx2::kLoops : &baseline::kLoops, std::memory_order_release);
#else
  active.store(&baseline::kLoops, std::memory_order_release);
#endif
  return can;
}

void copyScaled(void* dst, const void* src, int64_t numel, sf_dtype dtype, double factor) {
  if (factor == 1.0) {
    if (dst != src) std::memcpy(dst, src, size_t(numel) * dtypeSize(dtype));
    return;
  }
  const Loops& l = loops();
  switch (dtype) {
    case SF_DTYPE_FLOAT32:
      l.scaleF32(static_cast<float*>(dst), static_cast<const float*>(src), numel, factor);
      break;
    case SF_DTYPE_FLOAT64:
      l.scaleF64(static_cast<double*>(dst), static_cast<const double*>(src), numel, factor);
      break;
    case SF_DTYPE_FLOAT16:
      l.scaleHalf(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), numel, factor);
      break;
    case SF_DTYPE_BFLOAT16:
      l.scaleBf16(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), numel, factor);
      break;
    default:
      break;
  }
}

void scaleInPlace(void* data, int64_t numel, sf_dtype dtype, double factor) {
  copyScaled(data, data, numel, dtype, factor);
}

void narrowTo16(uint16_t* dst, const float* src, int64_t numel, sf_dtype wire, float factor) {
  const Loops& l = loops();
  (wire == SF_DTYPE_FLOAT16 ? l.narrowHalf : l.narrowBf16)(dst, src, numel, factor);
}

void widenFrom16(float* dst, const uint16_t* src, int64_t numel, sf_dtype wire, float factor) {
  const Loops& l = loops();
  (wire == SF_DTYPE_FLOAT16 ? l.widenHalf : l.widenBf16)(dst, src, numel, factor);
}

void addOwnTo16(uint16_t* io, const float* own, int64_t numel, sf_dtype wire, float factor) {
  const Loops& l = loops();
  (wire == SF_DTYPE_FLOAT16 ? l.addOwnHalf : l.addOwnBf16)(io, own, numel, factor);
}

void addInto(void* out, const void* a, const void* b, size_t n, sf_dtype dtype) {
  const Loops& l = loops();
  switch (dtype) {
    case SF_DTYPE_FLOAT32:
      l.addF32(static_cast<float*>(out), static_cast<const float*>(a),
               static_cast<const float*>(b), n);
      break;
    case SF_DTYPE_FLOAT64:
      l.addF64(static_cast<double*>(out), static_cast<const double*>(a),
               static_cast<const double*>(b), n);
      break;
    case SF_DTYPE_FLOAT16:
      l.addHalf(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(a),
                static_cast<const uint16_t*>(b), n);
      break;
    case SF_DTYPE_BFLOAT16:
      l.addBf16(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(a),
                static_cast<const uint16_t*>(b), n);
      break;
    default:
      break;
  }
}

int exactIntegerBits(sf_dtype dtype) {
  switch (dtype) {
    case SF_DTYPE_FLOAT64: return 53;
    case SF_DTYPE_FLOAT32: return 24;
    case SF_DTYPE_FLOAT16: return 11;
    default: return 8;  // bfloat16
  }
}

void storeAsDtype(char* p, sf_dtype dtype, double v) {
  switch (dtype) {
    case SF_DTYPE_FLOAT64: std::memcpy(p, &v, sizeof v); break;
    case SF_DTYPE_FLOAT32: { const float f = float(v); std::memcpy(p, &f, sizeof f); break; }
    case SF_DTYPE_FLOAT16: { const uint16_t h = floatToHalf(float(v)); std::memcpy(p, &h, 2); break; }
    default: { const uint16_t h = floatToBf16(float(v)); std::memcpy(p, &h, 2); break; }
  }
}

double loadFromDtype(const char* p, sf_dtype dtype) {
  switch (dtype) {
    case SF_DTYPE_FLOAT64: { double v; std::memcpy(&v, p, sizeof v); return v; }
    case SF_DTYPE_FLOAT32: { float f; std::memcpy(&f, p, sizeof f); return f; }
    case SF_DTYPE_FLOAT16: { uint16_t h; std::memcpy(&h, p, 2); return halfToFloat(h); }
    default: { uint16_t h; std::memcpy(&h, p, 2); return bf16ToFloat(h); }
  }
}

}  // namespace sfsync
