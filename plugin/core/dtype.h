#pragma once
// Element types of gradients: sizes, names, 16-bit float conversions and the
// scaling used for averaging and pre-scaling. Knows nothing of backends.

#include <cstddef>
#include <cstdint>
#include <string>

#include "sfsync.h"

namespace sfsync {

bool dtypeValid(sf_dtype dtype);
size_t dtypeSize(sf_dtype dtype);  // bytes per element; 0 for an unknown dtype
const char* dtypeName(sf_dtype dtype);
const char* deviceName(sf_device device);

float halfToFloat(uint16_t h);
uint16_t floatToHalf(float f);  // round to nearest even
float bf16ToFloat(uint16_t b);
uint16_t floatToBf16(float f);  // round to nearest even

// data[i] *= factor for `numel` elements of `dtype` in host memory.
void scaleInPlace(void* data, int64_t numel, sf_dtype dtype, double factor);
// dst[i] = src[i] * factor (factor 1 is a plain copy).
void copyScaled(void* dst, const void* src, int64_t numel, sf_dtype dtype, double factor);
// Bulk float32 <-> 16-bit (`wire` = SF_DTYPE_FLOAT16 or SF_DTYPE_BFLOAT16,
// round to nearest even): dst[i] = round16(src[i] * factor) and
// dst[i] = widen(src[i]) * factor. For carrying float32 buckets on a 16-bit wire.
void narrowTo16(uint16_t* dst, const float* src, int64_t numel, sf_dtype wire, float factor);
void widenFrom16(float* dst, const uint16_t* src, int64_t numel, sf_dtype wire, float factor);
// io[i] = round16(own[i] * factor + widen(io[i])), the sum in float32: a
// 16-bit ring's partial sum received in io, plus this rank's own value,
// which is never rounded to 16 bits on its own.
void addOwnTo16(uint16_t* io, const float* own, int64_t numel, sf_dtype wire, float factor);
// out[i] = a[i] + b[i]: the reduction that the host backends apply.
void addInto(void* out, const void* a, const void* b, size_t numel, sf_dtype dtype);

// The element loops above run compiled for AVX2 where the CPU has it, for
// the baseline otherwise (the same bits either way). For tests: false picks
// the baseline, true AVX2 where available; returns whether it is.
bool useWideLoops(bool wide);

// Bits of an integer a dtype holds exactly (2^m and every integer below):
// 53, 24, 11, 8. What the reserved tails (window check, window weight) use
// to keep their sums exact whatever the order of the additions.
int exactIntegerBits(sf_dtype dtype);
// One value of `dtype` at `p` (host memory, unaligned), from or to a double.
void storeAsDtype(char* p, sf_dtype dtype, double v);
double loadFromDtype(const char* p, sf_dtype dtype);

}  // namespace sfsync
