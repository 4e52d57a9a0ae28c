// The C boundary at its limits: layouts whose sizes would wrap, "forever"
// timeouts, struct sizes of other ABI versions, and sf_destroy's side effects.

#include <boost/test/unit_test.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "plugin/core/deadline.h"
#include "plugin/core/options.h"
#include "plugin/core/error.h"
#include "plugin/reducer/bucket_plan.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

void expectError(sf_status got, sf_status want, std::initializer_list<std::string> fragments) {
  BOOST_TEST(got == want);
  const std::string m = sf_last_error();
  for (const auto& f : fragments) BOOST_TEST(m.find(f) != std::string::npos, "'" << f << "' in: " << m);
}

// Runs `body` in a forked child (a process where nothing was created yet
// by this test) and returns its exit status; -1 if it crashed.
int inChild(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -2;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

struct EnvVar {
  std::string name;
  EnvVar(const char* n, const char* value) : name(n) { setenv(n, value, 1); }
  ~EnvVar() { unsetenv(name.c_str()); }
};

}  // namespace

BOOST_AUTO_TEST_SUITE(limits_tests)

// ---- Huge layouts --------------------------------------------------------

BOOST_AUTO_TEST_CASE(gradients_past_2_62_bytes_in_total_are_refused_by_name) {
  // 64 gradients of 2^58 bytes would total 2^64 (0 after a wrap): before 0.2
  // they built "successfully" and sf_zero_gradients then wrote far outside
  // the flat buffer.
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  const int64_t numel = int64_t(1) << 56;  // x 4 bytes = 2^58
  int added = 0;
  sf_status st = SF_OK;
  for (int i = 0; i < 64; ++i) {
    int64_t id = -1;
    const std::string name = "huge" + std::to_string(i);
    st = sf_add_gradient(h.ctx, numel, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, name.c_str(), &id);
    if (st != SF_OK) break;
    ++added;
  }
  BOOST_TEST(added == 16);  // 16 x 2^58 = 2^62, the limit
  expectError(st, SF_ERR_INVALID_ARGUMENT, {"gradient 16", "'huge16'", "2^62"});
  BOOST_TEST(statsOf(h.ctx).gradient_count == 16);
  BOOST_TEST(statsOf(h.ctx).gradient_bytes == int64_t(1) << 62);
}

BOOST_AUTO_TEST_CASE(a_layout_that_cannot_be_allocated_fails_cleanly) {
  // 2^62 bytes of plugin-owned gradients: the flat buffer cannot be
  // allocated; every building call says so, nothing crashes, nothing leaks.
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  for (int i = 0; i < 16; ++i) {
    int64_t id;
    BOOST_REQUIRE(sf_add_gradient(h.ctx, int64_t(1) << 56, SF_DTYPE_FLOAT32, SF_DEVICE_HOST,
                                  nullptr, &id) == SF_OK);
  }
  expectError(sf_zero_gradients(h.ctx), SF_ERR_OUT_OF_MEMORY, {"sf_zero_gradients", "flat buffer"});
  void* p = nullptr;
  expectError(sf_gradient_data(h.ctx, 3, &p), SF_ERR_OUT_OF_MEMORY, {"sf_gradient_data"});
  BOOST_TEST(p == nullptr);
  expectError(sf_synchronize(h.ctx), SF_ERR_OUT_OF_MEMORY, {"sf_synchronize"});
  BOOST_TEST(statsOf(h.ctx).bucket_count == 0);
}

BOOST_AUTO_TEST_CASE(one_gradient_too_large_is_named) {
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int64_t id;
  expectError(sf_add_gradient(h.ctx, INT64_MAX, SF_DTYPE_FLOAT64, SF_DEVICE_HOST, "w", &id),
              SF_ERR_INVALID_ARGUMENT, {"numel = 9223372036854775807", "too large"});
  expectError(sf_add_gradient(h.ctx, (int64_t(1) << 58) / 2 + 1, SF_DTYPE_FLOAT16, SF_DEVICE_HOST,
                              "w", &id),
              SF_ERR_INVALID_ARGUMENT, {"too large"});
  BOOST_TEST(statsOf(h.ctx).gradient_count == 0);
}

BOOST_AUTO_TEST_CASE(bucket_plan_sums_never_wrap) {
  using sfsync::GradSpec;
  // Two gradients of 2^62 bytes: their sum would wrap int64; each gets a bucket.
  const int64_t n = int64_t(1) << 60;
  auto plan = sfsync::planBuckets({{n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST}, {n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST}},
                                  INT64_MAX, INT64_MAX);
  BOOST_TEST(plan.size() == 2u);
  for (const auto& b : plan) BOOST_TEST(b.bytes == int64_t(1) << 62);
  // One gradient whose byte size does not fit in int64.
  bool threw = false;
  try {
    sfsync::planBuckets({{int64_t(1) << 62, SF_DTYPE_FLOAT64, SF_DEVICE_HOST}}, 1 << 20, 1 << 20);
  } catch (const sfsync::Error& e) {
    threw = e.status() == SF_ERR_INVALID_ARGUMENT &&
            std::string(e.what()).find("gradient 0") != std::string::npos;
  }
  BOOST_TEST(threw);
}

// ---- Timeouts ------------------------------------------------------------

BOOST_AUTO_TEST_CASE(deadline_arithmetic_saturates) {
  using sfsync::Deadline;
  using sfsync::kMaxTimeoutMs;
  BOOST_TEST(kMaxTimeoutMs == int64_t(1) << 40);
  BOOST_TEST(sfsync::clampTimeoutMs(INT64_MAX) == kMaxTimeoutMs);
  BOOST_TEST(sfsync::clampTimeoutMs(10000000000000) == kMaxTimeoutMs);
  BOOST_TEST(sfsync::clampTimeoutMs(1234) == 1234);
  BOOST_TEST(sfsync::timeoutDuration(INT64_MAX).count() == kMaxTimeoutMs);
  BOOST_TEST(sfsync::timeoutDuration(-5).count() == 0);
  const Deadline forever(INT64_MAX);
  BOOST_TEST(!forever.expired());
  BOOST_TEST(forever.remaining().count() > kMaxTimeoutMs - 1000);
  BOOST_TEST(forever.pollMs() == INT_MAX);
  BOOST_TEST((forever.at() > Deadline::Clock::now() + std::chrono::hours(24 * 365)));
  const Deadline now(0);
  BOOST_TEST(now.expired());
  BOOST_TEST(now.remaining().count() == 0);
  BOOST_TEST(now.pollMs() == 0);
  const Deadline soon(200);
  BOOST_TEST(soon.remaining().count() <= 200);
  BOOST_TEST(soon.remaining().count() > 0);
  BOOST_TEST(forever.earlier(100).remaining().count() <= 100);
  const auto far = Deadline::saturatingAdd(Deadline::Clock::now(), std::chrono::milliseconds::max());
  BOOST_TEST((far == Deadline::Clock::time_point::max()));
}

BOOST_AUTO_TEST_CASE(forever_timeouts_clamp_in_options) {
  sf_options o = rankOptions(0, 1, "");
  o.timeout_ms = INT64_MAX;
  ContextHandle h;
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  sf_options got;
  got.struct_size = sizeof got;
  BOOST_REQUIRE(sf_get_options(h.ctx, &got) == SF_OK);
  BOOST_TEST(got.timeout_ms == sfsync::kMaxTimeoutMs);

  for (const char* value : {"9223372036854775807", "10000000000000", "1e13",
                            "99999999999999999999999"}) {
    BOOST_TEST_CONTEXT("SF_TIMEOUT_MS=" << value) {
      EnvVar env("SF_TIMEOUT_MS", value);
      sf_options e;
      BOOST_TEST(sf_options_init(&e, sizeof e) == SF_OK, sf_last_error());
      BOOST_TEST(e.timeout_ms == sfsync::kMaxTimeoutMs);
    }
  }
  {
    EnvVar env("SF_TIMEOUT_MS", "2.5e3");
    sf_options e;
    BOOST_TEST(sf_options_init(&e, sizeof e) == SF_OK, sf_last_error());
    BOOST_TEST(e.timeout_ms == 2500);
  }
  for (const char* value : {"0", "-1", "abc", "nan", "0.5"}) {
    BOOST_TEST_CONTEXT("SF_TIMEOUT_MS=" << value) {
      EnvVar env("SF_TIMEOUT_MS", value);
      sf_options e;
      expectError(sf_options_init(&e, sizeof e), SF_ERR_INVALID_ARGUMENT,
                  {"SF_TIMEOUT_MS='" + std::string(value) + "'"});
    }
  }
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_synchronize_with_forever_timeouts) {
  // Before 0.2 a timeout of INT64_MAX or 1e13 ms failed at once: the ms -> ns
  // conversion overflowed into the past.
  for (int64_t timeout : {INT64_MAX, int64_t(10000000000000), sfsync::kMaxTimeoutMs}) {
    BOOST_TEST_CONTEXT("timeout_ms = " << timeout) {
      const std::string rdv = "memory://" + uniqueName("forever");
      struct R {
        sf_status status = SF_OK;
        std::string error;
        float value = 0;
      };
      auto out = runThreadRanks<R>(2, [&](int rank) {
        R r;
        ContextHandle h;
        sf_options o = rankOptions(rank, 2, rdv, timeout);
        int64_t id;
        float* p = nullptr;
        if ((r.status = sf_create(&o, &h.ctx)) != SF_OK ||
            (r.status = sf_add_gradient(h.ctx, 4, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "g", &id)) != SF_OK ||
            (r.status = sf_gradient_data(h.ctx, 0, reinterpret_cast<void**>(&p))) != SF_OK) {
          r.error = sf_last_error();
          return r;
        }
        for (int i = 0; i < 4; ++i) p[i] = float(rank + 1);
        r.status = sf_synchronize(h.ctx);
        r.error = sf_last_error();
        r.value = p[3];
        return r;
      });
      for (const auto& r : out) {
        BOOST_TEST(r.status == SF_OK, r.error);
        BOOST_TEST(r.value == 1.5f);
      }
    }
  }
}

// ---- Struct sizes of other ABI versions -----------------------------------

BOOST_AUTO_TEST_CASE(version_1_sizes_are_frozen) {
  BOOST_TEST(sfsync::kOptionsV1Size == 320u);
  BOOST_TEST(sfsync::kStatsV1Size == 112u);
  BOOST_TEST(sizeof(sf_options) >= sfsync::kOptionsV1Size);
  BOOST_TEST(sizeof(sf_stats) >= sfsync::kStatsV1Size);
}

BOOST_AUTO_TEST_CASE(stats_and_options_take_the_v1_size_and_larger) {
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  o.bucket_cap_mb = 3;
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int64_t id;
  BOOST_REQUIRE(sf_add_gradient(h.ctx, 10, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "w", &id) == SF_OK);
  BOOST_REQUIRE(sf_synchronize(h.ctx) == SF_OK);

  // Exactly version 1, in a buffer with a sentinel right after it.
  struct {
    unsigned char bytes[112];
    unsigned char after[16];
  } v1s;
  std::memset(&v1s, 0xAB, sizeof v1s);
  uint64_t size = sfsync::kStatsV1Size;
  std::memcpy(v1s.bytes, &size, sizeof size);
  BOOST_TEST(sf_get_stats(h.ctx, reinterpret_cast<sf_stats*>(v1s.bytes)) == SF_OK, sf_last_error());
  sf_stats s1;
  std::memcpy(&s1, v1s.bytes, 112);
  BOOST_TEST(s1.struct_size == 112u);
  BOOST_TEST(s1.gradient_count == 1);
  BOOST_TEST(s1.windows_completed == 1);
  BOOST_TEST(s1.sync_ns_total > 0);  // the last v1 field
  for (unsigned char c : v1s.after) BOOST_TEST(c == 0xAB);

  // Larger than the library's: the tail is the caller's and stays as it was.
  struct {
    sf_stats s;
    int64_t future[4];
  } big;
  std::memset(&big, 0, sizeof big);
  big.s.struct_size = sizeof big;
  for (auto& f : big.future) f = 77;
  BOOST_TEST(sf_get_stats(h.ctx, &big.s) == SF_OK, sf_last_error());
  BOOST_TEST(big.s.struct_size == sizeof big);
  BOOST_TEST(big.s.gradient_count == 1);
  for (auto f : big.future) BOOST_TEST(f == 77);

  struct {
    unsigned char bytes[320];
    unsigned char after[16];
  } v1o;
  std::memset(&v1o, 0xCD, sizeof v1o);
  size = sfsync::kOptionsV1Size;
  std::memcpy(v1o.bytes, &size, sizeof size);
  BOOST_TEST(sf_get_options(h.ctx, reinterpret_cast<sf_options*>(v1o.bytes)) == SF_OK, sf_last_error());
  sf_options o1;
  std::memcpy(&o1, v1o.bytes, 320);
  BOOST_TEST(o1.bucket_cap_mb == 3.0);
  BOOST_TEST(o1.rendezvous[0] == 0);  // the last v1 field
  for (unsigned char c : v1o.after) BOOST_TEST(c == 0xCD);

  struct {
    sf_options o;
    int64_t future[4];
  } bigo;
  bigo.o.struct_size = sizeof bigo;
  for (auto& f : bigo.future) f = 66;
  BOOST_TEST(sf_get_options(h.ctx, &bigo.o) == SF_OK, sf_last_error());
  BOOST_TEST(bigo.o.bucket_cap_mb == 3.0);
  for (auto f : bigo.future) BOOST_TEST(f == 66);

  // One byte short of version 1 is refused, naming both sizes.
  sf_stats small{};
  small.struct_size = 111;
  expectError(sf_get_stats(h.ctx, &small), SF_ERR_INVALID_ARGUMENT, {"struct_size = 111", "112"});
  sf_options smallo{};
  smallo.struct_size = 319;
  expectError(sf_get_options(h.ctx, &smallo), SF_ERR_INVALID_ARGUMENT, {"struct_size = 319", "320"});
  // A v1-sized caller struct is accepted by sf_create and sf_options_init too.
  sf_options init;
  BOOST_TEST(sf_options_init(&init, sfsync::kOptionsV1Size) == SF_OK);
  BOOST_TEST(init.struct_size == sfsync::kOptionsV1Size);
  sf_context* c = nullptr;
  BOOST_TEST(sf_create(&init, &c) == SF_OK, sf_last_error());
  sf_destroy(c);
}

// ---- sf_destroy ----------------------------------------------------------

BOOST_AUTO_TEST_CASE(destroy_keeps_the_last_error) {
  ContextHandle keep;  // unused; the context below is destroyed by hand
  sf_options o = rankOptions(0, 1, "");
  sf_context* c = nullptr;
  BOOST_REQUIRE(sf_create(&o, &c) == SF_OK);
  BOOST_REQUIRE(sf_synchronize(nullptr) == SF_ERR_INVALID_ARGUMENT);
  const std::string before = sf_last_error();
  BOOST_REQUIRE(!before.empty());
  {
    // A default context made now would fail on this environment and
    // overwrite the message (sf_destroy used to make it).
    EnvVar bad("SF_REDUCE", "bogus");
    sf_destroy(c);
  }
  BOOST_TEST(std::string(sf_last_error()) == before);
}

BOOST_AUTO_TEST_CASE(destroy_does_not_create_the_default_context) {
  // In a fresh process: the default context takes its options from the
  // environment when it is made. Made by sf_destroy (as before 0.2), it
  // would have the first cap; made on first use, the second.
  const int rc = inChild([] {
    setenv("SF_BUCKET_CAP_MB", "3", 1);
    sf_options o;
    sf_options_init(&o, sizeof o);
    o.rank = 0;
    o.world_size = 1;
    o.rendezvous[0] = 0;
    sf_context* c = nullptr;
    if (sf_create(&o, &c) != SF_OK) return 10;
    sf_destroy(c);
    setenv("SF_BUCKET_CAP_MB", "7", 1);
    sf_context* d = nullptr;
    if (sf_default_context(&d) != SF_OK) return 11;
    sf_options got;
    got.struct_size = sizeof got;
    if (sf_get_options(d, &got) != SF_OK) return 12;
    if (got.bucket_cap_mb == 3.0) return 13;  // sf_destroy made it
    if (got.bucket_cap_mb != 7.0) return 14;
    sf_destroy(d);  // ignored: the default context is never destroyed
    if (sf_get_options(d, &got) != SF_OK) return 15;
    return 0;
  });
  BOOST_TEST(rc == 0);
}

BOOST_AUTO_TEST_SUITE_END()
