// The C boundary: bad input gets a status and a message naming the argument
// and the value; window misuse is SF_ERR_INVALID_STATE; nothing crashes.

#include <boost/test/unit_test.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "tests/support/bounded.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

// A world-size-1 context with two plugin-owned gradients.
struct Local {
  ContextHandle h;
  Local() {
    sf_options o = rankOptions(0, 1, "");
    BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    int64_t id;
    BOOST_REQUIRE(sf_add_gradient(h.ctx, 10, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "w", &id) == SF_OK);
    BOOST_REQUIRE(sf_add_gradient(h.ctx, 5, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "b", &id) == SF_OK);
  }
};

// The status, and the last error must mention every fragment.
void expectError(sf_status got, sf_status want, std::initializer_list<const char*> fragments) {
  BOOST_TEST(got == want);
  const std::string m = sf_last_error();
  for (const char* f : fragments) BOOST_TEST(m.find(f) != std::string::npos, "'" << f << "' in: " << m);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(api_tests)

BOOST_AUTO_TEST_CASE(versions) {
  BOOST_TEST(sf_abi_version() == SF_ABI_VERSION);
  BOOST_TEST(sf_version_number() == SF_VERSION_NUMBER);
  BOOST_TEST(std::string(sf_version_string()) == "0.4.0");
}

BOOST_AUTO_TEST_CASE(status_strings_cover_every_code) {
  for (sf_status s = SF_OK; s <= SF_ERR_INTERNAL; ++s) {
    BOOST_TEST(std::string(sf_status_string(s)) != "unknown status");
  }
  BOOST_TEST(std::string(sf_status_string(99)) == "unknown status");
  BOOST_TEST(std::string(sf_status_string(SF_ERR_TIMEOUT)).find("SF_TIMEOUT_MS") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(null_handles_and_pointers) {
  int64_t id;
  void* p;
  sf_stats st{};
  st.struct_size = sizeof st;
  expectError(sf_synchronize(nullptr), SF_ERR_INVALID_ARGUMENT, {"sf_synchronize", "ctx is NULL"});
  expectError(sf_begin_accumulation(nullptr), SF_ERR_INVALID_ARGUMENT, {"sf_begin_accumulation", "ctx"});
  expectError(sf_end_accumulation(nullptr), SF_ERR_INVALID_ARGUMENT, {"ctx is NULL"});
  expectError(sf_grad_ready(nullptr, 0), SF_ERR_INVALID_ARGUMENT, {"sf_grad_ready", "ctx"});
  expectError(sf_get_stats(nullptr, &st), SF_ERR_INVALID_ARGUMENT, {"ctx"});
  expectError(sf_set_bucket_cap_mb(nullptr, 1), SF_ERR_INVALID_ARGUMENT, {"ctx"});
  expectError(sf_add_gradient(nullptr, 1, 0, 0, nullptr, &id), SF_ERR_INVALID_ARGUMENT, {"ctx"});
  expectError(sf_gradient_data(nullptr, 0, &p), SF_ERR_INVALID_ARGUMENT, {"ctx"});
  expectError(sf_create(nullptr, nullptr), SF_ERR_INVALID_ARGUMENT, {"sf_create", "out is NULL"});
  expectError(sf_options_init(nullptr, sizeof(sf_options)), SF_ERR_INVALID_ARGUMENT, {"opts is NULL"});
  expectError(sf_default_context(nullptr), SF_ERR_INVALID_ARGUMENT, {"out is NULL"});
  BOOST_TEST(sf_in_accumulation(nullptr) == -1);
  sf_destroy(nullptr);  // accepted
  Local l;
  expectError(sf_register_gradient(l.h.ctx, nullptr, 4, 0, 0, "x", &id), SF_ERR_INVALID_ARGUMENT, {"data is NULL"});
  expectError(sf_add_gradient(l.h.ctx, 4, 0, 0, "x", nullptr), SF_ERR_INVALID_ARGUMENT, {"out_id is NULL"});
  expectError(sf_gradient_data(l.h.ctx, 0, nullptr), SF_ERR_INVALID_ARGUMENT, {"out is NULL"});
  expectError(sf_get_stats(l.h.ctx, nullptr), SF_ERR_INVALID_ARGUMENT, {"out is NULL"});
  // A call that fails changes nothing: no gradient added, no buckets built.
  const sf_stats s = statsOf(l.h.ctx);
  BOOST_TEST(s.gradient_count == 2);
  BOOST_TEST(s.bucket_count == 0);
  float buf[4];
  expectError(sf_register_gradient(l.h.ctx, buf, 4, 0, 0, "x", nullptr), SF_ERR_INVALID_ARGUMENT, {"out_id is NULL"});
  BOOST_TEST(statsOf(l.h.ctx).gradient_count == 2);
}

BOOST_AUTO_TEST_CASE(bad_caps_are_named_with_their_value) {
  Local l;
  expectError(sf_set_bucket_cap_mb(l.h.ctx, 0), SF_ERR_INVALID_ARGUMENT, {"bucket_cap_mb = 0"});
  expectError(sf_set_bucket_cap_mb(l.h.ctx, -2), SF_ERR_INVALID_ARGUMENT, {"bucket_cap_mb = -2"});
  expectError(sf_set_bucket_cap_mb(l.h.ctx, NAN), SF_ERR_INVALID_ARGUMENT, {"bucket_cap_mb = nan"});
  expectError(sf_set_first_bucket_cap_mb(l.h.ctx, INFINITY), SF_ERR_INVALID_ARGUMENT, {"first_bucket_cap_mb = inf"});
  expectError(sf_set_first_bucket_cap_mb(l.h.ctx, -INFINITY), SF_ERR_INVALID_ARGUMENT, {"first_bucket_cap_mb = -inf"});
  BOOST_TEST(sf_set_bucket_cap_mb(l.h.ctx, 0.5) == SF_OK);
  sf_options o;
  o.struct_size = sizeof o;
  BOOST_TEST(sf_get_options(l.h.ctx, &o) == SF_OK);
  BOOST_TEST(o.bucket_cap_mb == 0.5);  // the failed calls changed nothing

  sf_options bad = rankOptions(0, 1, "");
  bad.bucket_cap_mb = NAN;
  sf_context* c = nullptr;
  expectError(sf_create(&bad, &c), SF_ERR_INVALID_ARGUMENT, {"sf_create", "bucket_cap_mb = nan"});
  BOOST_TEST(c == nullptr);
}

BOOST_AUTO_TEST_CASE(bad_gradients) {
  Local l;
  int64_t id = -7;
  float buf[4];
  expectError(sf_register_gradient(l.h.ctx, buf, 4, 7, SF_DEVICE_HOST, "x", &id), SF_ERR_INVALID_ARGUMENT, {"dtype = 7"});
  expectError(sf_register_gradient(l.h.ctx, buf, 4, -1, SF_DEVICE_HOST, "x", &id), SF_ERR_INVALID_ARGUMENT, {"dtype = -1"});
  expectError(sf_add_gradient(l.h.ctx, 4, SF_DTYPE_FLOAT32, 5, "x", &id), SF_ERR_INVALID_ARGUMENT, {"device = 5"});
  expectError(sf_add_gradient(l.h.ctx, 0, SF_DTYPE_FLOAT32, 0, "x", &id), SF_ERR_INVALID_ARGUMENT, {"numel = 0"});
  expectError(sf_add_gradient(l.h.ctx, -3, SF_DTYPE_FLOAT32, 0, "x", &id), SF_ERR_INVALID_ARGUMENT, {"numel = -3"});
  BOOST_TEST(id == -7);  // untouched on failure
  expectError(sf_grad_ready(l.h.ctx, 2), SF_ERR_INVALID_ARGUMENT, {"id = 2"});
  expectError(sf_grad_ready(l.h.ctx, -1), SF_ERR_INVALID_ARGUMENT, {"id = -1"});
  expectError(sf_bucket_info(l.h.ctx, 0, nullptr, nullptr, nullptr), SF_ERR_INVALID_STATE, {"not built"});
}

BOOST_AUTO_TEST_CASE(struct_size_too_small) {
  sf_options o;
  expectError(sf_options_init(&o, 8), SF_ERR_INVALID_ARGUMENT, {"struct_size = 8"});
  BOOST_REQUIRE(sf_options_init(&o, sizeof o) == SF_OK);
  o.struct_size = 12;
  sf_context* c = nullptr;
  expectError(sf_create(&o, &c), SF_ERR_INVALID_ARGUMENT, {"struct_size = 12"});
  Local l;
  sf_stats s{};
  s.struct_size = 16;
  expectError(sf_get_stats(l.h.ctx, &s), SF_ERR_INVALID_ARGUMENT, {"struct_size = 16"});
}

BOOST_AUTO_TEST_CASE(larger_caller_structs_keep_their_tail) {
  // A caller built against a later version passes a larger struct.
  struct Bigger {
    sf_options o;
    int64_t future;
  } big;
  big.future = 77;
  BOOST_REQUIRE(sf_options_init(&big.o, sizeof big) == SF_OK);
  BOOST_TEST(big.o.struct_size == sizeof big);
  BOOST_TEST(big.future == 77);
  BOOST_TEST(big.o.bucket_cap_mb > 0);
}

BOOST_AUTO_TEST_CASE(window_misuse_is_invalid_state) {
  Local l;
  sf_context* c = l.h.ctx;
  expectError(sf_end_accumulation(c), SF_ERR_INVALID_STATE, {"sf_end_accumulation", "without"});
  BOOST_TEST(sf_begin_accumulation(c) == SF_OK);
  BOOST_TEST(sf_in_accumulation(c) == 1);
  expectError(sf_begin_accumulation(c), SF_ERR_INVALID_STATE, {"already inside"});
  expectError(sf_synchronize(c), SF_ERR_INVALID_STATE, {"sf_synchronize", "inside an accumulation window"});
  BOOST_TEST(sf_in_accumulation(c) == 1);  // the failed calls left the window open
  BOOST_TEST(sf_grad_ready(c, 0) == SF_OK);
  BOOST_TEST(sf_end_accumulation(c) == SF_OK);
  BOOST_TEST(sf_in_accumulation(c) == 0);
  expectError(sf_end_accumulation(c), SF_ERR_INVALID_STATE, {"not inside"});
  BOOST_TEST(sf_synchronize(c) == SF_OK);
  const sf_stats s = statsOf(c);
  BOOST_TEST(s.windows_begun == 1);
  BOOST_TEST(s.windows_completed == 1);
  BOOST_TEST(s.collectives_issued == 1);
  BOOST_TEST(s.deferred_ready_calls == 1);
}

BOOST_AUTO_TEST_CASE(grad_ready_twice_and_begin_while_in_flight) {
  Local l;
  sf_context* c = l.h.ctx;
  BOOST_TEST(sf_grad_ready(c, 1) == SF_OK);  // bucket [b, w] not complete yet
  expectError(sf_grad_ready(c, 1), SF_ERR_INVALID_STATE, {"already reported ready"});
  BOOST_TEST(sf_grad_ready(c, 0) == SF_OK);  // completes the bucket: it starts
  expectError(sf_begin_accumulation(c), SF_ERR_INVALID_STATE, {"in flight", "sf_synchronize"});
  BOOST_TEST(sf_synchronize(c) == SF_OK);
  BOOST_TEST(statsOf(c).early_launches == 1);
  BOOST_TEST(sf_begin_accumulation(c) == SF_OK);
}

BOOST_AUTO_TEST_CASE(registration_and_caps_close_when_buckets_are_built) {
  Local l;
  BOOST_TEST(sf_build_buckets(l.h.ctx) == SF_OK);
  BOOST_TEST(sf_build_buckets(l.h.ctx) == SF_OK);  // idempotent
  int64_t id;
  float buf[2];
  expectError(sf_add_gradient(l.h.ctx, 2, 0, 0, "late", &id), SF_ERR_INVALID_STATE, {"already built"});
  expectError(sf_register_gradient(l.h.ctx, buf, 2, 0, 0, "late", &id), SF_ERR_INVALID_STATE, {"already built"});
  expectError(sf_set_bucket_cap_mb(l.h.ctx, 4), SF_ERR_INVALID_STATE, {"already built"});
  expectError(sf_set_first_bucket_cap_mb(l.h.ctx, 4), SF_ERR_INVALID_STATE, {"already built"});
  int64_t bytes = 0, grads = 0;
  sf_dtype dt = -1;
  BOOST_TEST(sf_bucket_info(l.h.ctx, 0, &bytes, &grads, &dt) == SF_OK);
  BOOST_TEST(bytes == 60);
  BOOST_TEST(grads == 2);
  BOOST_TEST(dt == SF_DTYPE_FLOAT32);
  expectError(sf_bucket_info(l.h.ctx, 1, &bytes, nullptr, nullptr), SF_ERR_INVALID_ARGUMENT, {"index = 1"});
}

BOOST_AUTO_TEST_CASE(no_gradients_is_invalid_state) {
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  expectError(sf_synchronize(h.ctx), SF_ERR_INVALID_STATE, {"no gradient"});
}

BOOST_AUTO_TEST_CASE(flat_buffer_views_are_stable_and_zeroed) {
  Local l;
  float* w = nullptr;
  float* b = nullptr;
  BOOST_REQUIRE(sf_gradient_data(l.h.ctx, 0, reinterpret_cast<void**>(&w)) == SF_OK);
  BOOST_REQUIRE(sf_gradient_data(l.h.ctx, 1, reinterpret_cast<void**>(&b)) == SF_OK);
  for (int i = 0; i < 10; ++i) BOOST_TEST(w[i] == 0.0f);
  // Bucket order is reverse registration: b packs first, w right after it.
  BOOST_TEST(b + 5 == w);
  for (int i = 0; i < 10; ++i) w[i] = float(i);
  BOOST_TEST(sf_synchronize(l.h.ctx) == SF_OK);  // world 1, average: unchanged
  BOOST_TEST(w[9] == 9.0f);
  BOOST_TEST(sf_zero_gradients(l.h.ctx) == SF_OK);
  BOOST_TEST(w[9] == 0.0f);
  void* again = nullptr;
  BOOST_REQUIRE(sf_gradient_data(l.h.ctx, 0, &again) == SF_OK);
  BOOST_TEST(again == static_cast<void*>(w));
}

BOOST_AUTO_TEST_CASE(default_context_without_rank_variables) {
  for (const char* k : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "SF_RENDEZVOUS"}) ::unsetenv(k);
  sf_context* a = nullptr;
  sf_context* b = nullptr;
  BOOST_REQUIRE(sf_default_context(&a) == SF_OK);
  BOOST_REQUIRE(sf_default_context(&b) == SF_OK);
  BOOST_TEST(a == b);
  sf_options o;
  o.struct_size = sizeof o;
  BOOST_REQUIRE(sf_get_options(a, &o) == SF_OK);
  BOOST_TEST(o.world_size == 1);
  sf_destroy(a);  // ignored for the default context
  BOOST_TEST(sf_begin_accumulation(a) == SF_OK);
  BOOST_TEST(sf_end_accumulation(a) == SF_OK);
}

BOOST_AUTO_TEST_CASE(bad_environment_is_reported_by_options_init) {
  ::setenv("SF_FIRST_BUCKET_CAP_MB", "-4", 1);
  sf_options o;
  expectError(sf_options_init(&o, sizeof o), SF_ERR_INVALID_ARGUMENT, {"SF_FIRST_BUCKET_CAP_MB='-4'"});
  ::unsetenv("SF_FIRST_BUCKET_CAP_MB");
  BOOST_TEST(o.first_bucket_cap_mb == 1.0);  // the default stayed
  BOOST_TEST(o.struct_size == sizeof o);
}

BOOST_AUTO_TEST_CASE(last_error_is_per_thread) {
  sf_synchronize(nullptr);
  const std::string mine = sf_last_error();
  std::string other = "unset";
  std::thread t([&] { other = sf_last_error(); });
  t.join();
  BOOST_TEST(mine.find("sf_synchronize") != std::string::npos);
  BOOST_TEST(other.empty());
}

BOOST_AUTO_TEST_CASE(a_missing_peer_is_a_timeout_not_a_hang) {
  ContextHandle h;
  sf_options o = rankOptions(0, 2, "memory://" + uniqueName("alone"), 500);
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int64_t id;
  BOOST_REQUIRE(sf_add_gradient(h.ctx, 8, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "w", &id) == SF_OK);
  const Bounded first = boundedCall([&] { return sf_synchronize(h.ctx); }, 30);
  expectBounded(first, 0.5, {SF_ERR_TIMEOUT});
  BOOST_TEST(first.message.find("sf_synchronize") != std::string::npos, first.message);
  // The context stays failed: the same error again, at once.
  expectError(sf_synchronize(h.ctx), SF_ERR_TIMEOUT, {"failed earlier"});
}

BOOST_AUTO_TEST_SUITE_END()
