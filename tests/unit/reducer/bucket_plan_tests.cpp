#include <boost/test/unit_test.hpp>

#include "plugin/reducer/bucket_plan.h"

using namespace sfsync;

namespace {
std::vector<int64_t> ids(const PlannedBucket& b) { return b.grads; }
GradSpec f32(int64_t n) { return {n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST}; }
}  // namespace

BOOST_AUTO_TEST_SUITE(bucket_plan_tests)

BOOST_AUTO_TEST_CASE(reverse_order_one_bucket_when_everything_fits) {
  auto plan = planBuckets({f32(10), f32(20), f32(30)}, 1 << 20, 1 << 20);
  BOOST_REQUIRE_EQUAL(plan.size(), 1u);
  BOOST_TEST(ids(plan[0]) == (std::vector<int64_t>{2, 1, 0}), boost::test_tools::per_element());
  BOOST_TEST(plan[0].bytes == 240);
}

BOOST_AUTO_TEST_CASE(first_bucket_closes_once_it_reaches_the_first_cap) {
  // 6 gradients of 512 bytes and a last one of 192: first cap 512, cap 1024.
  // The first bucket takes gradients until it holds 512 bytes (DDP's rule:
  // it starts during the backward with real bytes in it), later ones are
  // strictly capped at 1024.
  std::vector<GradSpec> g(6, f32(128));
  g.push_back(f32(48));
  auto plan = planBuckets(g, 1024, 512);
  BOOST_REQUIRE_EQUAL(plan.size(), 4u);
  BOOST_TEST(ids(plan[0]) == (std::vector<int64_t>{6, 5}), boost::test_tools::per_element());
  BOOST_TEST(ids(plan[1]) == (std::vector<int64_t>{4, 3}), boost::test_tools::per_element());
  BOOST_TEST(ids(plan[2]) == (std::vector<int64_t>{2, 1}), boost::test_tools::per_element());
  BOOST_TEST(ids(plan[3]) == (std::vector<int64_t>{0}), boost::test_tools::per_element());
  BOOST_TEST(plan[0].bytes == 704);
  BOOST_TEST(plan[1].bytes == 1024);
}

BOOST_AUTO_TEST_CASE(an_mlp_gets_ddps_buckets) {
  // bench_ddp's MLP 256-1024x1024x1024-10 (weight, bias per layer) at DDP's
  // defaults (cap 25 MiB, first 1 MiB): DDP's plan, [out.b out.w L3.b L3.w]
  // (4.24 MB, complete once L3's weight gradient is: early in the backward)
  // and the rest. The strict first cap made [out.b out.w L3.b] (45 KB) and
  // left 99.5 % of the bytes for the end of the backward.
  std::vector<GradSpec> g = {f32(256 * 1024), f32(1024), f32(1024 * 1024), f32(1024),
                             f32(1024 * 1024), f32(1024), f32(10 * 1024), f32(10)};
  auto plan = planBuckets(g, 25 << 20, 1 << 20);
  BOOST_REQUIRE_EQUAL(plan.size(), 2u);
  BOOST_TEST(ids(plan[0]) == (std::vector<int64_t>{7, 6, 5, 4}), boost::test_tools::per_element());
  BOOST_TEST(ids(plan[1]) == (std::vector<int64_t>{3, 2, 1, 0}), boost::test_tools::per_element());
  BOOST_TEST(plan[0].bytes == 4 * (10 + 10240 + 1024 + 1048576));
  BOOST_TEST(plan[1].bytes == 4 * (1024 + 1048576 + 1024 + 262144));
}

BOOST_AUTO_TEST_CASE(the_first_bucket_never_grows_past_the_bucket_cap) {
  // First cap 100, cap 1000: [40 B] cannot take the 2000 B gradient (it
  // would pass the bucket cap), which gets a bucket of its own.
  auto plan = planBuckets({f32(500), f32(10)}, 1000, 100);
  BOOST_REQUIRE_EQUAL(plan.size(), 2u);
  BOOST_TEST(ids(plan[0]) == (std::vector<int64_t>{1}), boost::test_tools::per_element());
  BOOST_TEST(ids(plan[1]) == (std::vector<int64_t>{0}), boost::test_tools::per_element());
  // A first cap above the bucket cap: the first bucket fills to the larger.
  plan = planBuckets({f32(100), f32(100), f32(100)}, 500, 1000);
  BOOST_REQUIRE_EQUAL(plan.size(), 2u);
  BOOST_TEST(plan[0].bytes == 800);
  BOOST_TEST(plan[1].bytes == 400);
}

BOOST_AUTO_TEST_CASE(cap_is_never_exceeded_by_a_gradient_that_could_wait) {
  auto plan = planBuckets({f32(100), f32(100), f32(100)}, 700, 700);  // 400 B each
  BOOST_REQUIRE_EQUAL(plan.size(), 3u);
  for (const auto& b : plan) BOOST_TEST(b.bytes <= 700);
}

BOOST_AUTO_TEST_CASE(a_gradient_larger_than_the_cap_is_never_split) {
  auto plan = planBuckets({f32(10), f32(1000), f32(10)}, 100, 100);
  BOOST_REQUIRE_EQUAL(plan.size(), 3u);
  BOOST_TEST(ids(plan[1]) == (std::vector<int64_t>{1}), boost::test_tools::per_element());
  BOOST_TEST(plan[1].bytes == 4000);
}

BOOST_AUTO_TEST_CASE(one_dtype_and_device_per_bucket) {
  std::vector<GradSpec> g = {{10, SF_DTYPE_FLOAT32, SF_DEVICE_HOST},
                             {10, SF_DTYPE_FLOAT64, SF_DEVICE_HOST},
                             {10, SF_DTYPE_FLOAT32, SF_DEVICE_HOST},
                             {10, SF_DTYPE_FLOAT16, SF_DEVICE_HOST},
                             {10, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA}};
  auto plan = planBuckets(g, 1 << 20, 1 << 20);
  BOOST_REQUIRE_EQUAL(plan.size(), 4u);
  int64_t total = 0;
  for (const auto& b : plan) {
    for (int64_t id : b.grads) {
      BOOST_TEST(g[size_t(id)].dtype == b.dtype);
      BOOST_TEST(g[size_t(id)].device == b.device);
    }
    total += int64_t(b.grads.size());
  }
  BOOST_TEST(total == 5);
  // The float32 host bucket holds 2 then 0, in reverse order.
  bool found = false;
  for (const auto& b : plan) {
    if (b.dtype == SF_DTYPE_FLOAT32 && b.device == SF_DEVICE_HOST) {
      BOOST_TEST(ids(b) == (std::vector<int64_t>{2, 0}), boost::test_tools::per_element());
      found = true;
    }
  }
  BOOST_TEST(found);
}

BOOST_AUTO_TEST_CASE(every_gradient_in_exactly_one_bucket) {
  std::vector<GradSpec> g;
  for (int i = 0; i < 50; ++i) g.push_back(f32(1 + (i * 37) % 300));
  auto plan = planBuckets(g, 2000, 300);
  std::vector<int> seen(g.size(), 0);
  for (const auto& b : plan) {
    int64_t bytes = 0;
    for (int64_t id : b.grads) {
      ++seen[size_t(id)];
      bytes += g[size_t(id)].numel * 4;
    }
    BOOST_TEST(bytes == b.bytes);
    BOOST_TEST((b.bytes <= 2000 || b.grads.size() == 1));
  }
  for (int s : seen) BOOST_TEST(s == 1);
  // The first bucket closed at the gradient that brought it to 300 bytes.
  const PlannedBucket& first = plan.front();
  BOOST_TEST(first.bytes - g[size_t(first.grads.back())].numel * 4 < 300);
}

BOOST_AUTO_TEST_CASE(mixed_dtypes_are_ordered_by_when_a_backward_completes_them) {
  // Registration: w1, b1 (float32), w2, b2 (float64). Backward readiness:
  // b2, w2, b1, w1. The float64 bucket [b2 w2] completes first and must not
  // wait behind the float32 first bucket [b1].
  // The float32 first bucket [b1] closes (at w1, which would carry it past
  // the 1000-byte cap) after [b2 w2] is complete.
  std::vector<GradSpec> g = {{384, SF_DTYPE_FLOAT32, SF_DEVICE_HOST},
                             {24, SF_DTYPE_FLOAT32, SF_DEVICE_HOST},
                             {10, SF_DTYPE_FLOAT64, SF_DEVICE_HOST},
                             {4, SF_DTYPE_FLOAT64, SF_DEVICE_HOST}};
  auto plan = planBuckets(g, 1000, 200);
  BOOST_REQUIRE_EQUAL(plan.size(), 3u);
  BOOST_TEST(ids(plan[0]) == (std::vector<int64_t>{3, 2}), boost::test_tools::per_element());
  BOOST_TEST(ids(plan[1]) == (std::vector<int64_t>{1}), boost::test_tools::per_element());
  BOOST_TEST(ids(plan[2]) == (std::vector<int64_t>{0}), boost::test_tools::per_element());
}

BOOST_AUTO_TEST_SUITE_END()
