#include "plugin/core/dtype.h"

#include <cstring>

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

static uint32_t floatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static float bitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float halfToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return bitsFloat(sign);
    // Subnormal half: value = man * 2^-24.
    float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return bitsFloat(sign | 0x7f800000u | (man << 13));
  return bitsFloat(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t floatToHalf(float f) {
  uint32_t u = floatBits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  }
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or 0
    // Scale into the subnormal range with float arithmetic, which rounds to
    // nearest even for us.
    float v = bitsFloat(abs) * 16777216.0f;  // value in units of 2^-24
    uint32_t m = uint32_t(v);
    float rem = v - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  uint32_t exp = ((abs >> 23) - 112) << 10;
  uint32_t man = (abs >> 13) & 0x3ffu;
  uint32_t half = exp | man;
  uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return uint16_t(sign | half);
}

float bf16ToFloat(uint16_t b) { return bitsFloat(uint32_t(b) << 16); }

uint16_t floatToBf16(float f) {
  uint32_t u = floatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return uint16_t((u + rounding) >> 16);
}

template <typename T>
static void scaleTyped(T* dst, const T* src, int64_t n, double factor) {
  const T k = T(factor);
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * k;
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
static void scale16(uint16_t* dst, const uint16_t* src, int64_t n, double factor) {
  const float k = float(factor);
  for (int64_t i = 0; i < n; ++i) dst[i] = FromF(ToF(src[i]) * k);
}

void copyScaled(void* dst, const void* src, int64_t numel, sf_dtype dtype, double factor) {
  if (factor == 1.0) {
    if (dst != src) std::memcpy(dst, src, size_t(numel) * dtypeSize(dtype));
    return;
  }
  switch (dtype) {
    case SF_DTYPE_FLOAT32:
      scaleTyped(static_cast<float*>(dst), static_cast<const float*>(src), numel, factor);
      break;
    case SF_DTYPE_FLOAT64:
      scaleTyped(static_cast<double*>(dst), static_cast<const double*>(src), numel, factor);
      break;
    case SF_DTYPE_FLOAT16:
      scale16<halfToFloat, floatToHalf>(static_cast<uint16_t*>(dst),
                                        static_cast<const uint16_t*>(src), numel, factor);
      break;
    case SF_DTYPE_BFLOAT16:
      scale16<bf16ToFloat, floatToBf16>(static_cast<uint16_t*>(dst),
                                        static_cast<const uint16_t*>(src), numel, factor);
      break;
    default:
      break;
  }
}

void scaleInPlace(void* data, int64_t numel, sf_dtype dtype, double factor) {
  copyScaled(data, data, numel, dtype, factor);
}

template <uint16_t (*FromF)(float)>
static void narrowTyped(uint16_t* dst, const float* src, int64_t n, float k) {
  if (k == 1.0f) {
    for (int64_t i = 0; i < n; ++i) dst[i] = FromF(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = FromF(src[i] * k);
  }
}

template <float (*ToF)(uint16_t)>
static void widenTyped(float* dst, const uint16_t* src, int64_t n, float k) {
  if (k == 1.0f) {
    for (int64_t i = 0; i < n; ++i) dst[i] = ToF(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = ToF(src[i]) * k;
  }
}

void narrowTo16(uint16_t* dst, const float* src, int64_t numel, sf_dtype wire, float factor) {
  if (wire == SF_DTYPE_FLOAT16) {
    narrowTyped<floatToHalf>(dst, src, numel, factor);
  } else {
    narrowTyped<floatToBf16>(dst, src, numel, factor);
  }
}

void widenFrom16(float* dst, const uint16_t* src, int64_t numel, sf_dtype wire, float factor) {
  if (wire == SF_DTYPE_FLOAT16) {
    widenTyped<halfToFloat>(dst, src, numel, factor);
  } else {
    widenTyped<bf16ToFloat>(dst, src, numel, factor);
  }
}

template <typename T>
static void addTyped(T* out, const T* a, const T* b, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
static void add16(uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = FromF(ToF(a[i]) + ToF(b[i]));
}

void addInto(void* out, const void* a, const void* b, size_t n, sf_dtype dtype) {
  switch (dtype) {
    case SF_DTYPE_FLOAT32:
      addTyped(static_cast<float*>(out), static_cast<const float*>(a),
               static_cast<const float*>(b), n);
      break;
    case SF_DTYPE_FLOAT64:
      addTyped(static_cast<double*>(out), static_cast<const double*>(a),
               static_cast<const double*>(b), n);
      break;
    case SF_DTYPE_FLOAT16:
      add16<halfToFloat, floatToHalf>(static_cast<uint16_t*>(out),
                                      static_cast<const uint16_t*>(a),
                                      static_cast<const uint16_t*>(b), n);
      break;
    case SF_DTYPE_BFLOAT16:
      add16<bf16ToFloat, floatToBf16>(static_cast<uint16_t*>(out),
                                      static_cast<const uint16_t*>(a),
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
