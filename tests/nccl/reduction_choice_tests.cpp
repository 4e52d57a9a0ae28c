// plugin/backend/nccl/reduction_choice.h: which NCCL reduction each
// sf_reduce_op becomes.

#include "plugin/backend/nccl/reduction_choice.h"

#include <boost/test/unit_test.hpp>

using sfsync::nccl::chooseReduction;
using sfsync::nccl::Reduction;

BOOST_AUTO_TEST_SUITE(reduction_choice_tests)

BOOST_AUTO_TEST_CASE(average_uses_nccl_avg) {
  for (int world : {2, 3, 4, 7, 8}) {
    const auto c = chooseReduction(1.0, 1.0 / world, world);
    BOOST_TEST(int(c.kind) == int(Reduction::kAverage), "world " << world);
  }
}

BOOST_AUTO_TEST_CASE(plain_sum_and_world_one_average_are_sums) {
  BOOST_TEST(int(chooseReduction(1.0, 1.0, 4).kind) == int(Reduction::kSum));
  BOOST_TEST(int(chooseReduction(1.0, 1.0 / 1, 1).kind) == int(Reduction::kSum));
}

BOOST_AUTO_TEST_CASE(prescale_folds_with_postscale_into_one_premulsum) {
  auto c = chooseReduction(0.25, 1.0, 2);
  BOOST_TEST(int(c.kind) == int(Reduction::kPreMulSum));
  BOOST_TEST(c.factor == 0.25);
  c = chooseReduction(0.5, 1.0 / 4, 4);
  BOOST_TEST(int(c.kind) == int(Reduction::kPreMulSum));
  BOOST_TEST(c.factor == 0.125);
}

BOOST_AUTO_TEST_CASE(a_postscale_that_is_not_an_average_is_premulsum) {
  const auto c = chooseReduction(1.0, 0.5, 4);
  BOOST_TEST(int(c.kind) == int(Reduction::kPreMulSum));
  BOOST_TEST(c.factor == 0.5);
}

BOOST_AUTO_TEST_SUITE_END()
