// sf_bucket_state and sf_window_state (Since 0.5): the states a host reads
// instead of keeping its own record, across whole windows at world size 1
// (the local backend: every collective of the sharded mode, nothing on a
// wire), and bad input named with its value, out-parameters untouched.

#include <boost/test/unit_test.hpp>

#include <atomic>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

// Two gradients of two dtypes, so two buckets: bucket 0 = "b" (float64,
// registered last: the first synchronized), bucket 1 = "w" (float32).
// Sharded (flat) with plugin-owned parameters, or not.
struct TwoBuckets {
  ContextHandle h;
  int64_t w = -1, b = -1;
  explicit TwoBuckets(bool sharded) {
    sf_options o = rankOptions(0, 1, "");
    BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    BOOST_REQUIRE(sf_add_gradient(h.ctx, 10, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "w", &w) == SF_OK);
    BOOST_REQUIRE(sf_add_gradient(h.ctx, 5, SF_DTYPE_FLOAT64, SF_DEVICE_HOST, "b", &b) == SF_OK);
    if (sharded) {
      BOOST_REQUIRE(sf_set_shard_layout(h.ctx, SF_SHARD_FLAT) == SF_OK);
      BOOST_REQUIRE(sf_register_parameter(h.ctx, w, nullptr, 10, SF_DTYPE_FLOAT32,
                                          SF_DEVICE_HOST) == SF_OK);
      BOOST_REQUIRE(sf_register_parameter(h.ctx, b, nullptr, 5, SF_DTYPE_FLOAT64,
                                          SF_DEVICE_HOST) == SF_OK);
    }
  }
  // Every bucket's state, in bucket order.
  std::vector<int32_t> states() const {
    std::vector<int32_t> out;
    for (int64_t i = 0; i < 2; ++i) {
      int32_t s = -1;
      BOOST_REQUIRE(sf_bucket_state(h.ctx, i, &s) == SF_OK);
      out.push_back(s);
    }
    return out;
  }
  int32_t window() const {
    int32_t f = -1;
    BOOST_REQUIRE(sf_window_state(h.ctx, &f) == SF_OK);
    return f;
  }
};

using States = std::vector<int32_t>;

void expectError(sf_status got, sf_status want, std::initializer_list<const char*> fragments) {
  BOOST_TEST(got == want);
  const std::string m = sf_last_error();
  for (const char* f : fragments) BOOST_TEST(m.find(f) != std::string::npos, "'" << f << "' in: " << m);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(bucket_state_api_tests)

BOOST_AUTO_TEST_CASE(a_sharded_window_filling_reducing_reduced_whole_gathering_gathered) {
  TwoBuckets t(true);
  BOOST_TEST(t.window() == 0);  // not built: nothing reduced
  BOOST_REQUIRE(sf_build_buckets(t.h.ctx) == SF_OK);
  int64_t bucket = -1;
  BOOST_REQUIRE(sf_gradient_bucket(t.h.ctx, t.w, &bucket) == SF_OK);
  BOOST_REQUIRE(bucket == 1);
  BOOST_TEST((t.states() == States{SF_BUCKET_IDLE, SF_BUCKET_IDLE}));

  // Bucket 1 is complete but waits for bucket 0 (buckets start in order).
  BOOST_REQUIRE(sf_grad_ready(t.h.ctx, t.w) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_IDLE, SF_BUCKET_FILLING}));
  BOOST_TEST(t.window() == 0);

  BOOST_REQUIRE(sf_synchronize_start(t.h.ctx) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_REDUCING, SF_BUCKET_REDUCING}));
  BOOST_TEST(t.window() == SF_WINDOW_SYNCHRONIZING);

  BOOST_REQUIRE(sf_wait_bucket(t.h.ctx, 0) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_REDUCED, SF_BUCKET_REDUCING}));
  BOOST_REQUIRE(sf_wait_bucket(t.h.ctx, 1) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_REDUCED, SF_BUCKET_REDUCED}));
  // Every bucket waited, the window not synchronized yet: still under way.
  BOOST_TEST(t.window() == SF_WINDOW_SYNCHRONIZING);

  BOOST_REQUIRE(sf_synchronize(t.h.ctx) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_REDUCED, SF_BUCKET_REDUCED}));
  BOOST_TEST(t.window() == 0);  // sharded: this rank's ranges only

  BOOST_REQUIRE(sf_gather_gradients(t.h.ctx) == SF_OK);
  BOOST_TEST(t.window() == SF_WINDOW_GRADIENTS_WHOLE);

  BOOST_REQUIRE(sf_start_gather(t.h.ctx, 1) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_REDUCED, SF_BUCKET_GATHERING}));
  BOOST_TEST(t.window() == SF_WINDOW_GRADIENTS_WHOLE);  // the reduction still in place
  BOOST_REQUIRE(sf_wait_gather(t.h.ctx, 1) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_REDUCED, SF_BUCKET_GATHERED}));
  BOOST_REQUIRE(sf_start_gather(t.h.ctx, 0) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_GATHERING, SF_BUCKET_GATHERED}));

  // The next window: a gather outlives its window until the bucket's next
  // reduction starts (which waits for it); the last window is not whole.
  BOOST_REQUIRE(sf_grad_ready(t.h.ctx, t.w) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_GATHERING, SF_BUCKET_GATHERED}));
  BOOST_TEST(t.window() == 0);
  BOOST_REQUIRE(sf_grad_ready(t.h.ctx, t.b) == SF_OK);  // completes both: they start
  BOOST_TEST((t.states() == States{SF_BUCKET_REDUCING, SF_BUCKET_REDUCING}));
  BOOST_TEST(t.window() == SF_WINDOW_SYNCHRONIZING);
  BOOST_REQUIRE(sf_synchronize(t.h.ctx) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_REDUCED, SF_BUCKET_REDUCED}));
  BOOST_TEST(t.window() == 0);
}

BOOST_AUTO_TEST_CASE(unsharded_gradients_are_whole_once_reduced_until_the_next_window) {
  TwoBuckets t(false);
  BOOST_REQUIRE(sf_build_buckets(t.h.ctx) == SF_OK);
  BOOST_TEST(t.window() == 0);
  BOOST_REQUIRE(sf_synchronize(t.h.ctx) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_REDUCED, SF_BUCKET_REDUCED}));
  BOOST_TEST(t.window() == SF_WINDOW_GRADIENTS_WHOLE);
  BOOST_REQUIRE(sf_begin_accumulation(t.h.ctx) == SF_OK);
  BOOST_TEST((t.states() == States{SF_BUCKET_IDLE, SF_BUCKET_IDLE}));
  BOOST_TEST(t.window() == 0);
  BOOST_REQUIRE(sf_end_accumulation(t.h.ctx) == SF_OK);
}

BOOST_AUTO_TEST_CASE(bad_input_names_the_argument_and_leaves_the_output) {
  TwoBuckets t(false);
  int32_t s = -7;
  expectError(sf_bucket_state(t.h.ctx, 0, &s), SF_ERR_INVALID_STATE, {"sf_bucket_state", "not built"});
  BOOST_TEST(s == -7);
  expectError(sf_bucket_state(nullptr, 0, &s), SF_ERR_INVALID_ARGUMENT, {"sf_bucket_state", "ctx is NULL"});
  expectError(sf_bucket_state(t.h.ctx, 0, nullptr), SF_ERR_INVALID_ARGUMENT, {"state is NULL"});
  expectError(sf_window_state(nullptr, &s), SF_ERR_INVALID_ARGUMENT, {"sf_window_state", "ctx is NULL"});
  expectError(sf_window_state(t.h.ctx, nullptr), SF_ERR_INVALID_ARGUMENT, {"flags is NULL"});
  BOOST_TEST(s == -7);
  BOOST_REQUIRE(sf_build_buckets(t.h.ctx) == SF_OK);
  expectError(sf_bucket_state(t.h.ctx, 2, &s), SF_ERR_INVALID_ARGUMENT, {"index = 2", "(0..1)"});
  expectError(sf_bucket_state(t.h.ctx, -1, &s), SF_ERR_INVALID_ARGUMENT, {"index = -1"});
  BOOST_TEST(s == -7);
  BOOST_TEST(sf_bucket_state(t.h.ctx, 1, &s) == SF_OK);
  BOOST_TEST(s == SF_BUCKET_IDLE);
}

BOOST_AUTO_TEST_CASE(read_beside_the_window_calls_one_rank) {
  // A reader asks while the host reports gradients and synchronizes (as
  // sf_bucket_info may run beside any call): every answer is a state, every
  // status SF_OK, and the windows complete (under TSan: no race).
  TwoBuckets t(true);
  BOOST_REQUIRE(sf_build_buckets(t.h.ctx) == SF_OK);
  std::atomic<bool> done{false};
  std::atomic<int> bad{0};
  std::thread reader([&] {
    while (!done.load()) {
      int32_t s = -1, f = -1;
      for (int64_t i = 0; i < 2; ++i) {
        if (sf_bucket_state(t.h.ctx, i, &s) != SF_OK || s < SF_BUCKET_IDLE ||
            s > SF_BUCKET_GATHERED) {
          bad.fetch_add(1);
        }
      }
      if (sf_window_state(t.h.ctx, &f) != SF_OK || f < 0 ||
          f > (SF_WINDOW_SYNCHRONIZING | SF_WINDOW_GRADIENTS_WHOLE)) {
        bad.fetch_add(1);
      }
    }
  });
  for (int w = 0; w < 200; ++w) {
    if (sf_grad_ready(t.h.ctx, t.w) != SF_OK || sf_synchronize_start(t.h.ctx) != SF_OK ||
        sf_synchronize(t.h.ctx) != SF_OK || sf_gather_gradients(t.h.ctx) != SF_OK ||
        sf_start_gather(t.h.ctx, -1) != SF_OK) {
      bad.fetch_add(1000);
      break;
    }
  }
  done.store(true);
  reader.join();
  BOOST_TEST(bad.load() == 0, sf_last_error());
  sf_stats st{};
  st.struct_size = sizeof st;
  BOOST_REQUIRE(sf_get_stats(t.h.ctx, &st) == SF_OK);
  BOOST_TEST(st.windows_completed == 200);
}

BOOST_AUTO_TEST_SUITE_END()
