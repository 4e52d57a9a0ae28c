#include "shim/policy/reduce_probe.h"

#include <gloo/math.h>
#include <gloo/types.h>

#include <boost/test/unit_test.hpp>
#include <cstdint>
#include <stdexcept>

#include "plugin/core/dtype.h"

using sfshim::probeReduce;
using sfshim::ReduceClass;
using sfshim::ReduceClassifier;
using sfshim::ReduceFunction;

namespace {

using Plain = void (*)(void*, const void*, const void*, size_t);

void check(const ReduceClass& r, sf_dtype dtype, sf_shim_op op) {
  BOOST_TEST(r.dtype == dtype);
  BOOST_TEST(r.op == op);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(reduce_probe_tests)

BOOST_AUTO_TEST_CASE(gloo_float_sums_are_gradient_sums) {
  check(probeReduce(4, static_cast<Plain>(&gloo::sum<float>)), SF_DTYPE_FLOAT32, SF_SHIM_OP_SUM);
  check(probeReduce(8, static_cast<Plain>(&gloo::sum<double>)), SF_DTYPE_FLOAT64, SF_SHIM_OP_SUM);
  check(probeReduce(2, static_cast<Plain>(&gloo::sum<gloo::float16>)), SF_DTYPE_FLOAT16, SF_SHIM_OP_SUM);
}

BOOST_AUTO_TEST_CASE(bfloat16_sum_is_told_from_float16_sum) {
  const ReduceFunction bf16 = [](void* c, const void* a, const void* b, size_t n) {
    sfsync::addInto(c, a, b, n, SF_DTYPE_BFLOAT16);
  };
  check(probeReduce(2, bf16), SF_DTYPE_BFLOAT16, SF_SHIM_OP_SUM);
}

BOOST_AUTO_TEST_CASE(max_min_product_are_not_sums) {
  check(probeReduce(4, static_cast<Plain>(&gloo::max<float>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
  check(probeReduce(4, static_cast<Plain>(&gloo::min<float>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
  check(probeReduce(4, static_cast<Plain>(&gloo::product<float>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
  check(probeReduce(8, static_cast<Plain>(&gloo::max<double>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
  check(probeReduce(2, static_cast<Plain>(&gloo::max<gloo::float16>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
}

BOOST_AUTO_TEST_CASE(integer_sums_of_the_same_width_are_not_float_sums) {
  check(probeReduce(4, static_cast<Plain>(&gloo::sum<int32_t>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
  check(probeReduce(4, static_cast<Plain>(&gloo::sum<uint32_t>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
  check(probeReduce(8, static_cast<Plain>(&gloo::sum<int64_t>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
  check(probeReduce(2, static_cast<Plain>(&gloo::sum<int16_t>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
  check(probeReduce(1, static_cast<Plain>(&gloo::sum<int8_t>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
}

BOOST_AUTO_TEST_CASE(a_float_sum_of_another_width_is_not_trusted) {
  // A float sum handed 8-byte elements (a host bug) must not be deferred.
  check(probeReduce(8, static_cast<Plain>(&gloo::sum<float>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
  check(probeReduce(4, static_cast<Plain>(&gloo::sum<double>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
}

BOOST_AUTO_TEST_CASE(throwing_empty_and_odd_sized_functions_are_other) {
  const ReduceFunction throws = [](void*, const void*, const void*, size_t) {
    throw std::runtime_error("Cannot use ReduceOp.BAND with non-integral dtype");
  };
  check(probeReduce(4, throws), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
  check(probeReduce(4, ReduceFunction()), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
  check(probeReduce(3, static_cast<Plain>(&gloo::sum<float>)), SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_OTHER);
}

BOOST_AUTO_TEST_CASE(classifier_probes_a_plain_function_once) {
  ReduceClassifier c;
  const Plain sum = static_cast<Plain>(&gloo::sum<float>);
  const Plain max = static_cast<Plain>(&gloo::max<float>);
  for (int i = 0; i < 3; ++i) {
    check(c.classify(reinterpret_cast<const void*>(sum), 4, sum), SF_DTYPE_FLOAT32, SF_SHIM_OP_SUM);
    check(c.classify(reinterpret_cast<const void*>(max), 4, max), SF_SHIM_DTYPE_OTHER,
          SF_SHIM_OP_OTHER);
  }
  BOOST_TEST(c.probes() == 2u);
  // No identity (a lambda): probed every time.
  const ReduceFunction lambda = [](void* c, const void* a, const void* b, size_t n) {
    gloo::sum<float>(c, a, b, n);
  };
  check(c.classify(nullptr, 4, lambda), SF_DTYPE_FLOAT32, SF_SHIM_OP_SUM);
  check(c.classify(nullptr, 4, lambda), SF_DTYPE_FLOAT32, SF_SHIM_OP_SUM);
  BOOST_TEST(c.probes() == 4u);
}

BOOST_AUTO_TEST_SUITE_END()
