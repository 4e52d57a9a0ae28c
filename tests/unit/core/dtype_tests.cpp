#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "plugin/core/dtype.h"

using namespace sfsync;

BOOST_AUTO_TEST_SUITE(dtype_tests)

BOOST_AUTO_TEST_CASE(sizes_and_names) {
  BOOST_TEST(dtypeSize(SF_DTYPE_FLOAT32) == 4u);
  BOOST_TEST(dtypeSize(SF_DTYPE_FLOAT64) == 8u);
  BOOST_TEST(dtypeSize(SF_DTYPE_FLOAT16) == 2u);
  BOOST_TEST(dtypeSize(SF_DTYPE_BFLOAT16) == 2u);
  BOOST_TEST(dtypeSize(7) == 0u);
  BOOST_TEST(!dtypeValid(-1));
  BOOST_TEST(std::string(dtypeName(SF_DTYPE_BFLOAT16)) == "bfloat16");
}

BOOST_AUTO_TEST_CASE(half_round_trips_exact_values) {
  for (float v : {0.0f, 1.0f, -2.5f, 1.5f, 65504.0f, 0.000061035156f, 5.9604645e-08f}) {
    BOOST_TEST(halfToFloat(floatToHalf(v)) == v);
  }
  BOOST_TEST(floatToHalf(1.0f) == 0x3c00);
  BOOST_TEST(floatToHalf(-2.0f) == 0xc000);
  BOOST_TEST(floatToHalf(1e6f) == 0x7c00);  // overflow to inf
  BOOST_TEST(std::isnan(halfToFloat(floatToHalf(NAN))));
  // 1 + 2^-11 is halfway between 1 and the next half: rounds to even (1).
  BOOST_TEST(floatToHalf(1.0f + 1.0f / 2048) == 0x3c00);
  BOOST_TEST(floatToHalf(1.0f + 3.0f / 2048) == 0x3c02);
}

BOOST_AUTO_TEST_CASE(bfloat16_rounds_to_nearest_even) {
  BOOST_TEST(floatToBf16(1.0f) == 0x3f80);
  BOOST_TEST(bf16ToFloat(0x3f80) == 1.0f);
  BOOST_TEST(bf16ToFloat(floatToBf16(3.0f)) == 3.0f);
  BOOST_TEST(floatToBf16(1.0f + 1.0f / 256) == 0x3f80);       // halfway, even stays
  BOOST_TEST(floatToBf16(1.0f + 3.0f / 256) == 0x3f82);       // halfway, odd rounds up
  BOOST_TEST(std::isnan(bf16ToFloat(floatToBf16(NAN))));
}

BOOST_AUTO_TEST_CASE(scale_and_add_every_dtype) {
  std::vector<float> f = {1, 2, 3};
  scaleInPlace(f.data(), 3, SF_DTYPE_FLOAT32, 0.5);
  BOOST_TEST(f[2] == 1.5f);
  std::vector<double> d = {4, 8}, d2 = {1, 1};
  addInto(d.data(), d.data(), d2.data(), 2, SF_DTYPE_FLOAT64);
  BOOST_TEST(d[1] == 9.0);
  std::vector<uint16_t> h = {floatToHalf(1.5f), floatToHalf(-3.0f)};
  scaleInPlace(h.data(), 2, SF_DTYPE_FLOAT16, 2.0);
  BOOST_TEST(halfToFloat(h[0]) == 3.0f);
  BOOST_TEST(halfToFloat(h[1]) == -6.0f);
  std::vector<uint16_t> b = {floatToBf16(2.0f)}, b2 = {floatToBf16(0.5f)};
  addInto(b.data(), b.data(), b2.data(), 1, SF_DTYPE_BFLOAT16);
  BOOST_TEST(bf16ToFloat(b[0]) == 2.5f);
  std::vector<float> src = {2, 4}, dst(2);
  copyScaled(dst.data(), src.data(), 2, SF_DTYPE_FLOAT32, 0.25);
  BOOST_TEST(dst[1] == 1.0f);
}

namespace {

uint32_t bitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float floatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The half conversions as the plugin wrote them up to 0.4, with branches:
// what its branch-free ones are checked against, value by value.
float halfToFloatPlain(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return floatOf(sign);
    // Subnormal half: value = man * 2^-24.
    float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return floatOf(sign | 0x7f800000u | (man << 13));
  return floatOf(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t floatToHalfPlain(float f) {
  uint32_t u = bitsOf(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  }
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or 0
    // Scale into the subnormal range with float arithmetic, which rounds to
    // nearest even for us.
    float v = floatOf(abs) * 16777216.0f;  // value in units of 2^-24
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

// Values the loops must treat alike: signed zeros, subnormals of both
// widths, ties at half's and bfloat16's rounding bits, the edges of their
// ranges, inf, NaN, and ordinary gradients.
std::vector<float> awkwardValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v;
  const uint32_t fixed[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x33800000u,
                            0x33000000u, 0x387fe000u, 0x38800000u, 0x3f801000u, 0x3f803000u,
                            0x3f808000u, 0x3f818000u, 0x477fefffu, 0x477ff000u, 0x7f7fffffu,
                            0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u};
  for (uint32_t u : fixed) v.push_back(floatOf(u));
  while (v.size() < n) {
    const float g = normal(rng);
    switch (rng() % 4) {
      case 0: v.push_back(g); break;
      case 1: v.push_back(g * 1e-3f); break;
      case 2: v.push_back(g * 3e-6f); break;  // half subnormals
      default: v.push_back(floatOf(rng())); break;  // any bits
    }
  }
  return v;
}

// Equal bits, or both NaN: which NaN a NaN + NaN gives is the compiler's
// choice of operand order (IEEE 754 leaves it open).
bool sameFloat(float a, float b) { return bitsOf(a) == bitsOf(b) || (a != a && b != b); }

bool sameWire(uint16_t a, uint16_t b, sf_dtype w) {
  return a == b || (w == SF_DTYPE_FLOAT16 ? sameFloat(halfToFloat(a), halfToFloat(b))
                                          : sameFloat(bf16ToFloat(a), bf16ToFloat(b)));
}

}  // namespace

BOOST_AUTO_TEST_CASE(half_conversions_equal_their_plain_definitions) {
  // Counted, not asserted one by one (millions of values); the first
  // mismatch is named.
  uint64_t checked = 0, wrong = 0;
  uint32_t first = 0;
  auto check = [&](bool same, uint32_t what) {
    ++checked;
    if (!same && wrong++ == 0) first = what;
  };
  // every half, both ways
  for (uint32_t h = 0; h < 65536; ++h) {
    check(bitsOf(halfToFloat(uint16_t(h))) == bitsOf(halfToFloatPlain(uint16_t(h))), h);
  }
  BOOST_TEST(wrong == 0u, wrong << " halves widen differently, the first 0x" << std::hex << first);
  // every sign, exponent and leading 10 mantissa bits, with the 13 bits
  // half rounds away at their ties and next to them; and a stride through
  // every float (subnormal halves round further up)
  for (uint32_t top = 0; top < (1u << 19); ++top) {
    for (uint32_t low : {0x0u, 0x1u, 0xfffu, 0x1000u, 0x1001u, 0x1fffu}) {
      const uint32_t u = (top << 13) | low;
      check(floatToHalf(floatOf(u)) == floatToHalfPlain(floatOf(u)), u);
    }
  }
  for (uint64_t u = 0; u < (uint64_t(1) << 32); u += 1021) {
    check(floatToHalf(floatOf(uint32_t(u))) == floatToHalfPlain(floatOf(uint32_t(u))), uint32_t(u));
  }
  BOOST_TEST(wrong == 0u, wrong << " values differ, the first 0x" << std::hex << first);
  BOOST_TEST(checked > 7000000u);
}

BOOST_AUTO_TEST_CASE(wide_and_baseline_loops_give_the_same_bits) {
  // Both sets of loops (AVX2 and the baseline: the same where the CPU has
  // no AVX2) against each other and against the element conversions, at
  // lengths that leave every vector tail and at unaligned starts.
  const bool wide = useWideLoops(true);
  BOOST_TEST_MESSAGE("AVX2 loops: " << (wide ? "yes" : "no (baseline twice)"));
  const std::vector<float> f = awkwardValues(4096 + 67, 7), g = awkwardValues(4096 + 67, 8);
  size_t compared = 0;
  for (sf_dtype w : {SF_DTYPE_FLOAT16, SF_DTYPE_BFLOAT16}) {
    auto narrow1 = [w](float x) { return w == SF_DTYPE_FLOAT16 ? floatToHalf(x) : floatToBf16(x); };
    auto widen1 = [w](uint16_t x) { return w == SF_DTYPE_FLOAT16 ? halfToFloat(x) : bf16ToFloat(x); };
    for (float k : {1.0f, 0.5f, 3.0f}) {
      for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(31), size_t(67), size_t(4096)}) {
        for (size_t at : {size_t(0), size_t(1), size_t(3)}) {
          std::vector<uint16_t> nw[2], sum[2], inplace[2], scaled[2], own[2];
          std::vector<float> wd[2], sc[2];
          for (int pass = 0; pass < 2; ++pass) {
            useWideLoops(pass == 1);
            nw[pass].assign(n, 0);
            narrowTo16(nw[pass].data(), f.data() + at, int64_t(n), w, k);
            std::vector<uint16_t> other(n);
            narrowTo16(other.data(), g.data() + at, int64_t(n), w, 1.0f);
            wd[pass].assign(n, 0);
            widenFrom16(wd[pass].data(), nw[pass].data(), int64_t(n), w, k);
            sum[pass].assign(n, 0);
            addInto(sum[pass].data(), nw[pass].data(), other.data(), n, w);
            inplace[pass] = nw[pass];
            addInto(inplace[pass].data(), inplace[pass].data(), other.data(), n, w);
            scaled[pass] = other;
            scaleInPlace(scaled[pass].data(), int64_t(n), w, double(k));
            own[pass] = other;
            addOwnTo16(own[pass].data(), f.data() + at, int64_t(n), w, k);
            sc[pass].assign(f.begin() + long(at), f.begin() + long(at + n));
            addInto(sc[pass].data(), sc[pass].data(), g.data() + at, n, SF_DTYPE_FLOAT32);
            scaleInPlace(sc[pass].data(), int64_t(n), SF_DTYPE_FLOAT32, double(k));
            for (size_t i = 0; i < n; ++i) {
              // each element as its scalar definition gives it
              const uint16_t o = narrow1(g[at + i]);
              BOOST_TEST_REQUIRE(nw[pass][i] == narrow1(k == 1.0f ? f[at + i] : f[at + i] * k));
              BOOST_TEST_REQUIRE(sameFloat(wd[pass][i], k == 1.0f ? widen1(nw[pass][i])
                                                                  : widen1(nw[pass][i]) * k));
              BOOST_TEST_REQUIRE(sameWire(sum[pass][i], narrow1(widen1(nw[pass][i]) + widen1(o)), w));
              BOOST_TEST_REQUIRE(sameWire(inplace[pass][i], sum[pass][i], w));
              BOOST_TEST_REQUIRE(sameWire(scaled[pass][i], narrow1(widen1(o) * k), w));
              BOOST_TEST_REQUIRE(sameWire(
                  own[pass][i], narrow1((k == 1.0f ? f[at + i] : f[at + i] * k) + widen1(o)), w));
              BOOST_TEST_REQUIRE(sameFloat(sc[pass][i], (f[at + i] + g[at + i]) * k));
            }
          }
          for (size_t i = 0; i < n; ++i) {
            BOOST_TEST_REQUIRE(nw[0][i] == nw[1][i], "narrow " << i << " of " << n);
            BOOST_TEST_REQUIRE(bitsOf(wd[0][i]) == bitsOf(wd[1][i]), "widen " << i << " of " << n);
            BOOST_TEST_REQUIRE(sameWire(sum[0][i], sum[1][i], w), "add " << i << " of " << n);
            BOOST_TEST_REQUIRE(sameWire(own[0][i], own[1][i], w), "add own " << i << " of " << n);
            BOOST_TEST_REQUIRE(sameFloat(sc[0][i], sc[1][i]), "float32 " << i << " of " << n);
            ++compared;
          }
        }
      }
    }
  }
  useWideLoops(true);
  BOOST_TEST(compared == 2u * 3u * 3u * (1u + 7u + 31u + 67u + 4096u));
}

BOOST_AUTO_TEST_SUITE_END()
