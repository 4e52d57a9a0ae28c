#pragma once
// LimbCodec: a float64 value as a few small integers ("limbs") that a
// collective of any floating-point wire dtype sums exactly across ranks,
// whatever the order of the additions. What a weighted window's weight and
// window sums travel as in the reserved tail of a bucket (see "Weighted
// windows" in include/sfsync.h). Responsible for the encoding, its exactness
// bounds and the decoding; not for where the limbs sit (the reducer's
// WindowTotals) or when they travel.
//
// The encoding: a value v becomes the integer N = round(v * 2^32) (v within
// 2^-33 of a multiple of 2^-32; integers are exact), taken modulo 2^T in two's
// complement, T = 85 + ceil(log2 world) bits (|v| < 2^52 per rank, so the
// sum over the ranks fits with its sign). N is cut into `limbs` unsigned
// digits of `bits` bits each, bits = m - ceil(log2 world) for a wire that
// holds every integer up to 2^m exactly (float64 53, float32 24, float16 11,
// bfloat16 8): the sum of `world` digits stays at most 2^m, exact. Decoding
// adds the digit sums back at their weights modulo 2^T and sign-extends.

#include <cstdint>

#include "sfsync.h"

namespace sfsync {

struct LimbCodec {
  // Values per rank must satisfy |v| < kMaxMagnitude (2^52).
  static constexpr double kMaxMagnitude = 4503599627370496.0;
  static constexpr int kFractionBits = 32;

  int bits = 0;       // per limb; 0: no encoding (unset, or no room: see forWire)
  int limbs = 0;      // per value
  int totalBits = 0;  // T

  // The codec for `world` ranks on a wire of `wire` dtype. bits == 0 when
  // the wire cannot hold one bit per limb for that many ranks (bfloat16
  // above 128 ranks, float16 above 1024).
  static LimbCodec forWire(sf_dtype wire, int64_t world);
  bool usable() const { return bits > 0; }

  // `limbs` small non-negative integers (as doubles) for v: |v| must be below
  // kMaxMagnitude and finite (the caller checks).
  void encode(double v, double* out) const;
  // The value whose limbs summed (elementwise, over the ranks) to `sums`.
  double decode(const double* sums) const;
};

}  // namespace sfsync
