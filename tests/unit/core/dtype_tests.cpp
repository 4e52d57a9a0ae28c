#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstdint>
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

BOOST_AUTO_TEST_SUITE_END()
