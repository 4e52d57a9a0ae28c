// LimbCodec (limb_codec.h): the bounds, the digits and their sum.

#include "plugin/core/limb_codec.h"

#include <cmath>

#include "plugin/core/dtype.h"

namespace sfsync {

namespace {

using U128 = unsigned __int128;
using I128 = __int128;

int ceilLog2(int64_t x) {
  int k = 0;
  while ((int64_t(1) << k) < x) ++k;
  return k;
}

U128 maskOf(int bits) { return bits >= 128 ? ~U128(0) : (U128(1) << bits) - 1; }

}  // namespace

LimbCodec LimbCodec::forWire(sf_dtype wire, int64_t world) {
  LimbCodec c;
  const int spread = ceilLog2(world < 1 ? 1 : world);
  const int bits = exactIntegerBits(wire) - spread;
  if (bits < 1) return c;
  c.bits = bits > 48 ? 48 : bits;
  // 52 magnitude bits + 32 fraction bits + the ranks' spread + a sign bit.
  c.totalBits = 52 + kFractionBits + spread + 1;
  c.limbs = (c.totalBits + c.bits - 1) / c.bits;
  return c;
}

void LimbCodec::encode(double v, double* out) const {
  // Exact: scaling by a power of two, then rounding to an integer below 2^85.
  const double scaled = std::nearbyint(std::ldexp(v, kFractionBits));
  const U128 n = U128(I128(scaled)) & maskOf(totalBits);
  const U128 digit = maskOf(bits);
  for (int j = 0; j < limbs; ++j) out[j] = double(uint64_t((n >> (bits * j)) & digit));
}

double LimbCodec::decode(const double* sums) const {
  U128 n = 0;
  for (int j = 0; j < limbs; ++j) {
    // Each sum is a non-negative integer below 2^53 (exact in the wire);
    // anything else (a corrupted tail) counts as 0 rather than being UB.
    const double s = sums[j] >= 0 && sums[j] < 9007199254740992.0 ? sums[j] : 0.0;
    n += U128(uint64_t(s)) << (bits * j);
  }
  n &= maskOf(totalBits);
  // Sign-extend from bit T-1.
  I128 signedN = I128(n);
  if ((n >> (totalBits - 1)) & 1) signedN -= I128(U128(1) << totalBits);
  return std::ldexp(double(signedN), -kFractionBits);
}

}  // namespace sfsync
