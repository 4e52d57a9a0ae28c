// Ranks that registered different layouts all fail with SF_ERR_MISMATCH
// naming the first differing gradient, and never hang.

#include <boost/test/unit_test.hpp>

#include <functional>

#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

struct Outcome {
  sf_status status = SF_OK;
  std::string error;
  sf_status second = SF_OK;
};

// Each rank registers what `layout(rank, ctx)` registers, then synchronizes twice.
std::vector<Outcome> run(int world, const std::function<void(int, sf_context*)>& layout,
                         const std::function<void(int, sf_options&)>& tweak = nullptr) {
  const std::string rdv = "memory://" + uniqueName("layout");
  return runThreadRanks<Outcome>(world, [&](int rank) {
    Outcome out;
    ContextHandle h;
    sf_options o = rankOptions(rank, world, rdv, 10000);
    if (tweak) tweak(rank, o);
    if (sf_create(&o, &h.ctx) != SF_OK) {
      out.status = SF_ERR_INTERNAL;
      out.error = sf_last_error();
      return out;
    }
    layout(rank, h.ctx);
    out.status = sf_synchronize(h.ctx);
    out.error = sf_last_error();
    out.second = sf_synchronize(h.ctx);
    return out;
  });
}

void add(sf_context* c, int64_t numel, sf_dtype dtype, const char* name) {
  int64_t id;
  sf_add_gradient(c, numel, dtype, SF_DEVICE_HOST, name, &id);
}

void expectMismatch(const std::vector<Outcome>& outs, std::initializer_list<const char*> fragments) {
  for (size_t r = 0; r < outs.size(); ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST(outs[r].status == SF_ERR_MISMATCH, outs[r].error);
      BOOST_TEST(outs[r].second == SF_ERR_MISMATCH);
      for (const char* f : fragments) {
        BOOST_TEST(outs[r].error.find(f) != std::string::npos, "'" << f << "' in: " << outs[r].error);
      }
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(layout_tests)

BOOST_AUTO_TEST_CASE(same_layout_synchronizes) {
  auto outs = run(2, [](int, sf_context* c) {
    add(c, 10, SF_DTYPE_FLOAT32, "a");
    add(c, 20, SF_DTYPE_FLOAT32, "b");
  });
  for (const auto& o : outs) BOOST_TEST(o.status == SF_OK, o.error);
}

BOOST_AUTO_TEST_CASE(different_size_names_the_gradient_on_every_rank_two_ranks) {
  auto outs = run(2, [](int rank, sf_context* c) {
    add(c, 10, SF_DTYPE_FLOAT32, "layer0.weight");
    add(c, 10, SF_DTYPE_FLOAT32, "layer0.bias");
    add(c, rank == 1 ? 30 : 20, SF_DTYPE_FLOAT32, "layer1.weight");
    add(c, 5, SF_DTYPE_FLOAT32, "layer1.bias");
  });
  expectMismatch(outs, {"gradient 2", "layer1.weight", "20 x float32", "30 x float32"});
}

BOOST_AUTO_TEST_CASE(different_dtype_four_ranks) {
  auto outs = run(4, [](int rank, sf_context* c) {
    add(c, 10, SF_DTYPE_FLOAT32, "a");
    add(c, 10, rank == 3 ? SF_DTYPE_FLOAT64 : SF_DTYPE_FLOAT32, "b");
  });
  expectMismatch(outs, {"gradient 1", "'b'", "float64"});
}

BOOST_AUTO_TEST_CASE(a_gradient_missing_on_one_rank) {
  auto outs = run(2, [](int rank, sf_context* c) {
    add(c, 10, SF_DTYPE_FLOAT32, "a");
    add(c, 10, SF_DTYPE_FLOAT32, "b");
    if (rank == 0) add(c, 10, SF_DTYPE_FLOAT32, "extra");
  });
  expectMismatch(outs, {"gradient counts differ", "gradient 2", "missing on some ranks"});
}

BOOST_AUTO_TEST_CASE(different_bucket_caps) {
  auto outs = run(
      2,
      [](int, sf_context* c) {
        for (int i = 0; i < 6; ++i) add(c, 1000, SF_DTYPE_FLOAT32, "g");
      },
      [](int rank, sf_options& o) { o.bucket_cap_mb = rank == 0 ? 25 : 0.004; });
  expectMismatch(outs, {"differ"});
}

BOOST_AUTO_TEST_SUITE_END()
