// LimbCodec (plugin/core/limb_codec.h): values summed as limbs over W ranks,
// with each partial sum rounded to the wire dtype in an arbitrary order,
// decode to the exact fixed-point sum; the bounds of forWire.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "plugin/core/dtype.h"
#include "plugin/core/limb_codec.h"

using sfsync::LimbCodec;

namespace {

// x rounded to `dtype` (as a wire's addition rounds each partial sum).
double roundTo(double x, sf_dtype dtype) {
  char p[8];
  sfsync::storeAsDtype(p, dtype, x);
  return sfsync::loadFromDtype(p, dtype);
}

// Sums the ranks' limbs in `dtype`, rank order reversed on odd limbs.
double sumOver(const LimbCodec& c, const std::vector<double>& values, sf_dtype dtype) {
  std::vector<std::vector<double>> limbs(values.size(), std::vector<double>(size_t(c.limbs)));
  for (size_t r = 0; r < values.size(); ++r) c.encode(values[r], limbs[r].data());
  std::vector<double> sums(size_t(c.limbs), 0.0);
  for (int j = 0; j < c.limbs; ++j) {
    for (size_t k = 0; k < values.size(); ++k) {
      const size_t r = j % 2 ? values.size() - 1 - k : k;
      BOOST_TEST_REQUIRE(roundTo(limbs[r][size_t(j)], dtype) == limbs[r][size_t(j)]);
      sums[size_t(j)] = roundTo(sums[size_t(j)] + limbs[r][size_t(j)], dtype);
    }
  }
  return c.decode(sums.data());
}

double onGrid(double v) { return std::ldexp(std::nearbyint(std::ldexp(v, 32)), -32); }

}  // namespace

BOOST_AUTO_TEST_SUITE(limb_codec_tests)

BOOST_AUTO_TEST_CASE(sums_are_exact_in_every_wire_for_1_to_128_ranks) {
  std::mt19937_64 rng(12345);  // fixed: the same values every run
  std::uniform_real_distribution<double> mag(-30, 51);
  for (sf_dtype dtype : {SF_DTYPE_FLOAT64, SF_DTYPE_FLOAT32, SF_DTYPE_FLOAT16, SF_DTYPE_BFLOAT16}) {
    for (int world : {1, 2, 3, 7, 64, 128}) {
      const LimbCodec c = LimbCodec::forWire(dtype, world);
      BOOST_TEST_REQUIRE(c.usable(), sfsync::dtypeName(dtype) << " " << world);
      for (int trial = 0; trial < 20; ++trial) {
        std::vector<double> values;
        long double exact = 0;
        for (int r = 0; r < world; ++r) {
          double v = std::ldexp(1.0, int(mag(rng))) * (double(rng() % 1000000) / 1e6);
          if (rng() % 3 == 0) v = -v;
          if (trial == 0) v = double(rng() % 5000);  // token counts
          values.push_back(v);
          exact += (long double)onGrid(v);
        }
        const double got = sumOver(c, values, dtype);
        BOOST_TEST(got == double(exact), sfsync::dtypeName(dtype) << " world " << world << " trial "
                                                                << trial);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(integers_and_binary_fractions_are_exact_and_others_within_2_to_the_minus_33) {
  const LimbCodec c = LimbCodec::forWire(SF_DTYPE_FLOAT32, 2);
  BOOST_TEST(sumOver(c, {4096.0, 123456789.0}, SF_DTYPE_FLOAT32) == 123460885.0);
  BOOST_TEST(sumOver(c, {0.5, -0.25}, SF_DTYPE_FLOAT32) == 0.25);
  BOOST_TEST(sumOver(c, {4503599627370495.0, 4503599627370495.0}, SF_DTYPE_FLOAT32) ==
             9007199254740990.0);
  BOOST_TEST(sumOver(c, {-4503599627370495.0, -1.0}, SF_DTYPE_FLOAT32) == -4503599627370496.0);
  BOOST_TEST(std::fabs(sumOver(c, {0.1, 0.2}, SF_DTYPE_FLOAT32) - 0.3) <= std::ldexp(1.0, -32));
  BOOST_TEST(sumOver(c, {0.0, 0.0}, SF_DTYPE_FLOAT32) == 0.0);
}

BOOST_AUTO_TEST_CASE(for_wire_bounds_limb_bits_by_the_spread_of_the_ranks) {
  BOOST_TEST(LimbCodec::forWire(SF_DTYPE_FLOAT32, 2).bits == 23);
  BOOST_TEST(LimbCodec::forWire(SF_DTYPE_FLOAT32, 3).bits == 22);
  BOOST_TEST(LimbCodec::forWire(SF_DTYPE_BFLOAT16, 128).bits == 1);
  BOOST_TEST(!LimbCodec::forWire(SF_DTYPE_BFLOAT16, 129).usable());
  BOOST_TEST(LimbCodec::forWire(SF_DTYPE_FLOAT16, 1024).usable());
  BOOST_TEST(!LimbCodec::forWire(SF_DTYPE_FLOAT16, 1025).usable());
  // Every limb sum stays within the wire's exact integers: world * (2^bits - 1) <= 2^m.
  for (sf_dtype dtype : {SF_DTYPE_FLOAT64, SF_DTYPE_FLOAT32, SF_DTYPE_FLOAT16, SF_DTYPE_BFLOAT16}) {
    for (int world : {1, 2, 5, 100, 200}) {
      const LimbCodec c = LimbCodec::forWire(dtype, world);
      BOOST_TEST(std::ldexp(double(world), c.bits) - world <=
                 std::ldexp(1.0, sfsync::exactIntegerBits(dtype)));
      BOOST_TEST(c.limbs * c.bits >= c.totalBits);
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
