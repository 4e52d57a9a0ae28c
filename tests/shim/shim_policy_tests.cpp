#include "shim/policy/shim_policy.h"

#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "plugin/api/sfsync_internal.h"
#include "sfsync.h"

using sfshim::ShimConfig;
using sfshim::ShimPolicy;

namespace {

const void* kBuf1 = reinterpret_cast<const void*>(0xb000);
const void* kBuf2 = reinterpret_cast<const void*>(0xc000);
const void* kComm = reinterpret_cast<const void*>(0x1000);

sf_shim_call call(sf_dtype dtype, sf_shim_op op, int64_t bytes, const void* buffer = kBuf1,
                  int32_t worldSize = 4) {
  sf_shim_call c{};
  c.api = SF_SHIM_API_GLOO;
  c.dtype = dtype;
  c.op = op;
  c.world_size = worldSize;
  c.rank = 1;
  c.comm = kComm;
  c.buffer = buffer;
  c.bytes = bytes;
  return c;
}

sf_shim_call grad(int64_t bytes, const void* buffer = kBuf1) {
  return call(SF_DTYPE_FLOAT32, SF_SHIM_OP_SUM, bytes, buffer);
}

// A policy over a real (world size 1) context of libsfsync.so, whose window
// state it reads as the shim does (sf_window_state_v1), with its
// messages captured.
struct Harness {
  explicit Harness(ShimConfig config = {}, bool withContext = true) {
    BOOST_REQUIRE(sf_create(nullptr, &ctx) == SF_OK);
    ShimPolicy::WindowSource source;
    if (withContext) {
      source = [this](sf_window_state_v1* s) {
        return sf_internal_window_state_v1(ctx, SF_INTERNAL_FOLLOW, s) == SF_OK;
      };
    }
    policy = std::make_unique<ShimPolicy>(
        std::move(config), source, [this](int level, const std::string& l) {
          (level == SF_LOG_INFO ? info : lines).push_back(l);
        });
  }
  ~Harness() {
    policy.reset();
    sf_destroy(ctx);
  }
  void begin() { BOOST_REQUIRE(sf_begin_accumulation(ctx) == SF_OK); }
  void end() { BOOST_REQUIRE(sf_end_accumulation(ctx) == SF_OK); }
  sf_shim_action act(const sf_shim_call& c) { return policy->decide(c).action; }
  size_t said(const std::string& part) const {
    size_t n = 0;
    for (const auto& l : lines) n += l.find(part) != std::string::npos;
    return n;
  }
  sf_context* ctx = nullptr;
  std::unique_ptr<ShimPolicy> policy;
  std::vector<std::string> lines;  // WARN
  std::vector<std::string> info;   // INFO
};

ShimConfig config(int64_t minBytes, int64_t steps = 0) {
  ShimConfig c;
  c.minBytes = minBytes;
  c.accumulationSteps = steps;
  return c;
}

// The bytes of a factor encoded as NCCL wants its pre-multiplication scalar.
std::vector<unsigned char> scalarBytes(sf_dtype dtype, double factor) {
  std::vector<unsigned char> b(8, 0);
  if (dtype == SF_DTYPE_FLOAT32) {
    const float f = float(factor);
    std::memcpy(b.data(), &f, 4);
  } else if (dtype == SF_DTYPE_FLOAT64) {
    std::memcpy(b.data(), &factor, 8);
  } else {  // 1 and 4 in float16 and bfloat16
    const uint16_t h = dtype == SF_DTYPE_FLOAT16 ? (factor == 4 ? 0x4400 : 0x3c00)
                                                 : (factor == 4 ? 0x4080 : 0x3f80);
    std::memcpy(b.data(), &h, 2);
  }
  return b;
}

// DDP's shape for automatic mode: one bucket in pass 1, two after.
void ddpPass(Harness& h, int pass, std::vector<sf_shim_action>* actions) {
  if (pass == 1) {
    actions->push_back(h.act(grad(3000, reinterpret_cast<const void*>(0xa000))));
  } else {
    actions->push_back(h.act(grad(2000, kBuf1)));
    actions->push_back(h.act(grad(1000, kBuf2)));
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(shim_policy_tests)

BOOST_AUTO_TEST_CASE(every_dtype_op_and_size_inside_and_outside_a_window) {
  const sf_dtype dtypes[] = {SF_DTYPE_FLOAT32, SF_DTYPE_FLOAT64, SF_DTYPE_FLOAT16,
                             SF_DTYPE_BFLOAT16, SF_SHIM_DTYPE_OTHER, 17};
  const sf_shim_op ops[] = {SF_SHIM_OP_SUM, SF_SHIM_OP_AVERAGE, SF_SHIM_OP_OTHER, 9};
  const int64_t sizes[] = {0, 1023, 1024, 1 << 20};
  Harness h(config(1024));
  int64_t deferred = 0, total = 0;
  for (const bool inside : {false, true}) {
    if (inside) h.begin();
    for (const sf_dtype d : dtypes) {
      for (const sf_shim_op op : ops) {
        for (const int64_t bytes : sizes) {
          const sf_shim_decision r = h.policy->decide(call(d, op, bytes));
          ++total;
          const bool gradient = (d >= 0 && d <= 3) && (op == SF_SHIM_OP_SUM || op == SF_SHIM_OP_AVERAGE) &&
                                bytes >= 1024;
          BOOST_TEST_CONTEXT("inside " << inside << " dtype " << d << " op " << op << " bytes " << bytes) {
            BOOST_TEST(r.action == (inside && gradient ? SF_SHIM_DEFER : SF_SHIM_PASS));
            if (r.action == SF_SHIM_DEFER) {
              ++deferred;
              const double factor = op == SF_SHIM_OP_SUM ? 4.0 : 1.0;  // world size 4
              BOOST_TEST(r.factor == factor);
              BOOST_TEST(std::vector<unsigned char>(r.factor_scalar, r.factor_scalar + 8) ==
                         scalarBytes(d, factor));
              BOOST_TEST(r.window == 1);
            }
          }
        }
      }
    }
  }
  BOOST_TEST(deferred == 4 * 2 * 2);  // float types x (sum, average) x (1024, 1 MiB)
  const auto k = h.policy->counters();
  BOOST_TEST(k.calls == total);
  BOOST_TEST(k.deferred == deferred);
  BOOST_TEST(k.passed == total - deferred);
  BOOST_TEST(k.bytesDeferred == 4 * 2 * (1024 + (1 << 20)));
}

BOOST_AUTO_TEST_CASE(a_call_without_a_world_size_is_never_deferred) {
  Harness h(config(0));
  h.begin();
  BOOST_TEST(h.act(call(SF_DTYPE_FLOAT32, SF_SHIM_OP_SUM, 4096, kBuf1, 0)) == SF_SHIM_PASS);
  BOOST_TEST(h.act(call(SF_DTYPE_FLOAT32, SF_SHIM_OP_SUM, 4096, kBuf1, 1)) == SF_SHIM_DEFER);
}

BOOST_AUTO_TEST_CASE(counts_bytes_and_windows_of_three_explicit_windows) {
  Harness h(config(100));
  h.act(grad(500));  // before any window: a plain synchronization
  for (int w = 1; w <= 3; ++w) {
    h.begin();
    for (int micro = 0; micro < 2; ++micro) {
      BOOST_TEST(h.act(grad(300, kBuf1)) == SF_SHIM_DEFER);
      BOOST_TEST(h.act(grad(200, kBuf2)) == SF_SHIM_DEFER);
      BOOST_TEST(h.act(call(SF_DTYPE_FLOAT32, SF_SHIM_OP_SUM, 4)) == SF_SHIM_PASS);  // a loss
      BOOST_TEST(h.act(call(SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_SUM, 800)) == SF_SHIM_PASS);
    }
    h.end();
    BOOST_TEST(h.act(grad(300, kBuf1)) == SF_SHIM_PASS);
    BOOST_TEST(h.act(grad(200, kBuf2)) == SF_SHIM_PASS);
  }
  const auto k = h.policy->counters();
  BOOST_TEST(k.calls == 1 + 3 * (8 + 2));
  BOOST_TEST(k.deferred == 3 * 4);
  BOOST_TEST(k.bytesDeferred == 3 * 1000);
  BOOST_TEST(k.gradientCallsSent == 1 + 3 * 2);
  BOOST_TEST(k.gradientBytesSent == 500 + 3 * 500);
  BOOST_TEST(k.bytesSent == 500 + 3 * (500 + 2 * 804));
  BOOST_TEST(k.windows == 3);
  BOOST_TEST(k.unsynchronizedWindows.empty());
  const auto r = h.policy->windowRecords();
  BOOST_REQUIRE(r.size() == 3u);
  for (const auto& w : r) {
    BOOST_TEST(w.deferredCalls == 4);
    BOOST_TEST(w.bytesDeferred == 1000);
    BOOST_TEST(w.gradientBytesSent == 500);
  }
  BOOST_TEST(h.policy->finish());
  BOOST_TEST(h.lines.empty());
}

BOOST_AUTO_TEST_CASE(a_window_never_synchronized_is_said_at_exit_naming_it) {
  Harness h(config(100));
  h.begin();
  h.act(grad(300));
  h.act(grad(200, kBuf2));
  h.end();  // ... and the optimizer steps: no synchronization
  h.begin();
  BOOST_TEST(h.act(grad(300)) == SF_SHIM_DEFER);  // no pass between: the same window
  h.end();
  BOOST_TEST(h.lines.empty());  // no window synchronized yet: nothing to compare with
  BOOST_TEST(h.policy->finish());  // not strict
  BOOST_TEST(h.said("windows 1-2 (consecutive, no pass between: one) ended with 3 deferred "
                    "gradient all-reduces (800 bytes) and no real synchronization before exit") ==
             1u);
  BOOST_TEST(h.policy->counters().unsynchronizedWindows == std::vector<int64_t>({1}));
  BOOST_TEST(h.policy->finish());  // idempotent: nothing said twice
  BOOST_TEST(h.lines.size() == 1u);
}

BOOST_AUTO_TEST_CASE(synchronization_between_windows_clears_the_guard) {
  Harness h(config(100));
  for (int w = 0; w < 3; ++w) {
    h.begin();
    h.act(grad(300));
    h.end();
    h.act(grad(300));  // the last micro-batch: synchronized
  }
  BOOST_TEST(h.policy->finish());
  BOOST_TEST(h.lines.empty());
}

// Issue 9: begin/end around each non-final micro-batch, the last one
// synchronized, is legal: consecutive windows with no pass between them are
// one window. (Said "window K ended ... the optimizer stepped on local
// gradients" for windows 1, 2, 4, 5, ... before.)
BOOST_AUTO_TEST_CASE(consecutive_windows_without_a_pass_between_are_one_window) {
  Harness h(config(100));
  for (int step = 0; step < 4; ++step) {
    for (int micro = 0; micro < 3; ++micro) {
      h.begin();
      BOOST_TEST(h.act(grad(300, kBuf1)) == SF_SHIM_DEFER);
      BOOST_TEST(h.act(grad(200, kBuf2)) == SF_SHIM_DEFER);
      h.end();
    }
    BOOST_TEST(h.act(grad(300, kBuf1)) == SF_SHIM_PASS);
    BOOST_TEST(h.act(grad(200, kBuf2)) == SF_SHIM_PASS);
  }
  BOOST_TEST(h.lines.empty());
  BOOST_TEST(h.policy->finish());
  BOOST_TEST(h.lines.empty());
  const auto k = h.policy->counters();
  BOOST_TEST(k.unsynchronizedWindows.empty());
  BOOST_TEST(k.windows == 12);
  BOOST_TEST(k.bytesDeferred == 4 * 3 * 500);
  BOOST_TEST(k.gradientBytesSent == 4 * 500);
}

// One window of 3 deferred passes that synchronized, then one whose last
// micro-batch stays inside (the host ends it too late): said at the call
// that takes it past 3 passes, not later, once.
BOOST_AUTO_TEST_CASE(a_window_growing_past_the_longest_synchronized_is_said_at_that_call) {
  Harness h(config(100));
  auto pass = [&](std::vector<sf_shim_action>* a) {
    a->push_back(h.act(grad(300, kBuf1)));
    a->push_back(h.act(grad(200, kBuf2)));
  };
  std::vector<sf_shim_action> a;
  h.begin();
  for (int p = 0; p < 3; ++p) pass(&a);
  h.end();
  pass(&a);  // synchronized: 1500 bytes deferred before it
  h.begin();
  for (int p = 0; p < 3; ++p) pass(&a);
  BOOST_TEST(h.lines.empty());  // as long as the synchronized one: fine
  BOOST_TEST(h.act(grad(300, kBuf1)) == SF_SHIM_DEFER);  // 1800 > 1500
  BOOST_REQUIRE(h.lines.size() == 1u);
  BOOST_TEST(h.said("window 2 has deferred 7 gradient all-reduces (1800 bytes) without a "
                    "synchronization, more than the longest window that did synchronize (1500 "
                    "bytes)") == 1u);
  BOOST_TEST(h.act(grad(200, kBuf2)) == SF_SHIM_DEFER);
  h.end();
  h.begin();  // no pass between: still the same window, not said again
  pass(&a);
  h.end();
  BOOST_TEST(h.lines.size() == 1u);
  pass(&a);  // synchronized at last: the longest is now 2500 bytes
  h.begin();
  for (int p = 0; p < 5; ++p) pass(&a);
  h.end();
  pass(&a);
  BOOST_TEST(h.lines.size() == 1u);
  BOOST_TEST(h.policy->counters().unsynchronizedWindows == std::vector<int64_t>({2}));
  BOOST_TEST(h.policy->finish());  // not strict
}

BOOST_AUTO_TEST_CASE(strict_fails_the_call_where_a_window_grew_too_long_and_the_exit) {
  ShimConfig c = config(100);
  c.strict = true;
  Harness h(c);
  h.begin();
  h.act(grad(300));
  h.end();
  h.act(grad(300));  // synchronized: 300 bytes deferred before it
  h.begin();
  BOOST_TEST(h.act(grad(300)) == SF_SHIM_DEFER);
  const sf_shim_decision d = h.policy->decide(grad(300));
  BOOST_TEST(d.action == SF_SHIM_FAIL);
  BOOST_TEST(d.window == 2);
  BOOST_TEST(h.policy->failure().find("window 2 has deferred 2 gradient all-reduces (600 bytes)") !=
             std::string::npos);
  BOOST_TEST(h.said("(SF_STRICT=1: this all-reduce fails)") == 1u);
  BOOST_TEST(!h.policy->finish());
}

BOOST_AUTO_TEST_CASE(a_window_past_accumulation_steps_is_said_when_the_host_takes_over) {
  // SF_ACCUMULATION_STEPS=3 but the host opens windows itself: 2 deferred
  // passes of the synchronization's 500 bytes allowed, even when an earlier
  // window was longer.
  Harness h(config(100, 3));
  auto pass = [&] {
    h.act(grad(300, kBuf1));
    h.act(grad(200, kBuf2));
  };
  h.begin();
  for (int p = 0; p < 4; ++p) pass();
  h.end();
  pass();  // synchronized: 2000 bytes deferred before, 500 carried
  BOOST_TEST(h.said("following the host's windows") == 1u);
  BOOST_TEST(h.lines.size() == 1u);
  h.begin();
  pass();
  pass();
  BOOST_TEST(h.lines.size() == 1u);
  pass();  // 1300 > 2 x 500 at its first call
  BOOST_TEST(h.said("window 2 has deferred 5 gradient all-reduces (1300 bytes) without a "
                    "synchronization, more than the 2 passes of 500 bytes that "
                    "SF_ACCUMULATION_STEPS=3 allows") == 1u);
}

// A forgotten sf_end_accumulation: libsfsync refuses the next begin and says
// so at that call; the shim counts the refusal and, with SF_STRICT=1, fails
// the next gradient all-reduce (both ranks alike: the host is the same).
BOOST_AUTO_TEST_CASE(a_refused_begin_fails_the_next_gradient_call_when_strict) {
  for (const bool strict : {false, true}) {
    ShimConfig c = config(100);
    c.strict = strict;
    Harness h(c);
    h.begin();
    BOOST_TEST(h.act(grad(300)) == SF_SHIM_DEFER);
    BOOST_TEST(sf_begin_accumulation(h.ctx) == SF_ERR_INVALID_STATE);  // ignored by the host
    BOOST_TEST(h.act(call(SF_DTYPE_FLOAT32, SF_SHIM_OP_SUM, 4)) == SF_SHIM_PASS);  // a loss
    const sf_shim_decision d = h.policy->decide(grad(300));
    BOOST_TEST(d.action == (strict ? SF_SHIM_FAIL : SF_SHIM_DEFER), "strict " << strict);
    if (strict) {
      BOOST_TEST(h.policy->failure().find(
                     "sf_begin_accumulation was refused inside window 1 (a forgotten "
                     "sf_end_accumulation") != std::string::npos);
    }
    BOOST_TEST(h.act(grad(300)) == SF_SHIM_DEFER);  // acted on once
    BOOST_TEST(h.policy->counters().refusedBegins == 1);
    h.end();
    BOOST_TEST(h.policy->finish() == !strict);
  }
}

BOOST_AUTO_TEST_CASE(automatic_mode_says_at_info_that_it_cannot_see_weights) {
  Harness h(config(100, 4));
  BOOST_TEST(h.lines.empty());
  BOOST_REQUIRE(h.info.size() == 1u);
  for (const char* part : {"SF_ACCUMULATION_STEPS=4: automatic windows of 4 backward passes",
                           "not the optimizer step nor the weights", "verify_every=K",
                           "sf_check_replicas"}) {
    BOOST_TEST(h.info[0].find(part) != std::string::npos, part);
  }
  Harness e(config(100));  // explicit mode: no such line
  BOOST_TEST(e.info.empty());
}

BOOST_AUTO_TEST_CASE(automatic_mode_defers_every_pass_but_the_last_of_each_window) {
  Harness h(config(100, 3));
  std::vector<std::vector<sf_shim_action>> passes;
  for (int p = 1; p <= 15; ++p) {
    std::vector<sf_shim_action> a;
    ddpPass(h, p, &a);
    passes.push_back(a);
  }
  for (int p = 1; p <= 15; ++p) {
    const bool deferred = p > 5 && p % 3 != 0;  // learned at the end of pass 5
    for (const auto a : passes[size_t(p) - 1]) {
      BOOST_TEST_CONTEXT("pass " << p) {
        BOOST_TEST(a == (deferred ? SF_SHIM_DEFER : SF_SHIM_PASS));
      }
    }
  }
  // Windows of 3 passes of 3000 bytes: passes 1-6 sent, then 1 of 3.
  const auto r = h.policy->windowRecords();
  BOOST_REQUIRE(r.size() == 5u);
  const int64_t sent[] = {9000, 9000, 3000, 3000, 3000};
  const int64_t deferred[] = {0, 0, 6000, 6000, 6000};
  for (size_t w = 0; w < 5; ++w) {
    BOOST_TEST(r[w].gradientBytesSent == sent[w]);
    BOOST_TEST(r[w].bytesDeferred == deferred[w]);
  }
  BOOST_TEST(h.policy->counters().windows == 5);
  BOOST_TEST(h.policy->finish());
  BOOST_TEST(h.lines.empty());
}

BOOST_AUTO_TEST_CASE(automatic_mode_never_defers_the_last_pass_of_a_window) {
  for (const int64_t n : {1, 2, 3, 4, 7}) {
    Harness h(config(100, n));
    int64_t deferredPasses = 0;
    for (int p = 1; p <= 42; ++p) {
      std::vector<sf_shim_action> a;
      ddpPass(h, p, &a);
      const bool d = a[0] == SF_SHIM_DEFER;
      for (const auto x : a) BOOST_TEST(x == a[0]);  // a pass is one decision
      if (p % n == 0) BOOST_TEST(!d, "N = " << n << ", pass " << p);
      deferredPasses += d;
    }
    int64_t expected = 0;
    for (int p = 6; p <= 42; ++p) expected += p % n != 0;
    BOOST_TEST(deferredPasses == expected, "N = " << n);
    BOOST_TEST(h.policy->finish());
  }
}

BOOST_AUTO_TEST_CASE(two_threads_calling_one_pass_get_one_decision) {
  // ProcessGroupGloo runs a pass's bucket all-reduces on two worker threads.
  Harness h(config(100, 4));
  for (int p = 1; p <= 40; ++p) {
    sf_shim_action a1 = -1, a2 = -1;
    if (p == 1) {
      a1 = a2 = h.act(grad(3000, reinterpret_cast<const void*>(0xa000)));
    } else {
      std::thread t1([&] { a1 = h.act(grad(2000, kBuf1)); });
      std::thread t2([&] { a2 = h.act(grad(1000, kBuf2)); });
      t1.join();
      t2.join();
    }
    const bool deferred = p > 5 && p % 4 != 0;
    BOOST_TEST(a1 == (deferred ? SF_SHIM_DEFER : SF_SHIM_PASS), "pass " << p);
    BOOST_TEST(a2 == a1, "pass " << p);
  }
  const auto k = h.policy->counters();
  BOOST_TEST(k.calls == 1 + 39 * 2);
  BOOST_TEST(k.deferred == 2 * 26);  // passes 6..40 not divisible by 4
  BOOST_TEST(h.policy->finish());
  BOOST_TEST(h.lines.empty(), (h.lines.empty() ? "" : h.lines[0]));
}

BOOST_AUTO_TEST_CASE(automatic_mode_reports_a_window_unfinished_at_exit) {
  Harness h(config(100, 4));
  std::vector<sf_shim_action> a;
  for (int p = 1; p <= 10; ++p) ddpPass(h, p, &a);  // window 3 = passes 9-12: 9, 10 deferred
  BOOST_TEST(h.policy->finish());
  BOOST_TEST(h.said("window 3 ended with 4 deferred gradient all-reduces (6000 bytes)") == 1u);
}

BOOST_AUTO_TEST_CASE(automatic_mode_says_at_exit_when_it_never_learned) {
  Harness h(config(100, 2));
  std::vector<sf_shim_action> a;
  for (int p = 1; p <= 4; ++p) ddpPass(h, p, &a);
  for (const auto x : a) BOOST_TEST(x == SF_SHIM_PASS);
  BOOST_TEST(h.lines.empty());
  BOOST_TEST(h.policy->finish());
  BOOST_TEST(h.said("SF_ACCUMULATION_STEPS=2: 7 gradient all-reduces, but no per-pass pattern "
                    "learned (it takes 5 backward passes)") == 1u);
}

BOOST_AUTO_TEST_CASE(automatic_mode_gives_up_once_and_then_passes_everything) {
  Harness h(config(100, 2));
  std::vector<sf_shim_action> a;
  for (int p = 1; p <= 7; ++p) ddpPass(h, p, &a);  // pass 7 deferred
  BOOST_TEST(a.back() == SF_SHIM_DEFER);
  BOOST_TEST(h.act(grad(40000, reinterpret_cast<const void*>(0xf000))) == SF_SHIM_PASS);
  BOOST_TEST(h.act(grad(40000, reinterpret_cast<const void*>(0xf000))) == SF_SHIM_PASS);
  a.clear();
  for (int p = 8; p <= 12; ++p) ddpPass(h, p, &a);
  for (const auto x : a) BOOST_TEST(x == SF_SHIM_PASS);
  BOOST_TEST(h.said("cannot tell where backward passes start") == 1u);
  BOOST_TEST(h.lines.size() == 1u);
  BOOST_TEST(h.policy->finish());  // what pass 7 deferred was carried by later passes
  BOOST_TEST(h.lines.size() == 1u);
}

// A host that already synchronizes once per optimizer step (DDP with a
// correct no_sync()) run with SF_ACCUMULATION_STEPS=4: each "pass" the shim
// counts is a real window synchronization, and deferring one means the ranks
// stepped on local gradients. When the track is lost while passes of the
// current window are deferred (here: a new DDP model's first bucket), it is
// said at once, naming the window, and under SF_STRICT=1 that call fails.
BOOST_AUTO_TEST_CASE(losing_the_track_with_deferred_passes_says_the_window_at_once) {
  for (const bool strict : {false, true}) {
    BOOST_TEST_CONTEXT("strict " << strict) {
      ShimConfig c = config(100, 4);
      c.strict = strict;
      Harness h(c);
      std::vector<sf_shim_action> a;
      for (int p = 1; p <= 6; ++p) ddpPass(h, p, &a);  // pass 6: window 2, deferred
      BOOST_TEST(a.back() == SF_SHIM_DEFER);
      BOOST_TEST(h.lines.empty());
      const sf_shim_decision d = h.policy->decide(grad(3000, reinterpret_cast<const void*>(0xd000)));
      BOOST_TEST(d.action == (strict ? SF_SHIM_FAIL : SF_SHIM_PASS));
      BOOST_REQUIRE(h.lines.size() == 1u);
      const std::string& l = h.lines[0];
      for (const char* part : {"cannot tell where backward passes start",
                               "window 2 (backward passes 5-8 as the shim counts them)",
                               "2 gradient all-reduces (3000 bytes) deferred",
                               "were not averaged across the ranks", "no_sync()",
                               "verify_every", "sf_check_replicas"}) {
        BOOST_TEST(l.find(part) != std::string::npos, part << " in " << l);
      }
      BOOST_TEST(l.find("(correct, not faster)") == std::string::npos);
      if (strict) BOOST_TEST(h.policy->failure() == l);
      const auto k = h.policy->counters();
      BOOST_REQUIRE(k.unsynchronizedWindows.size() == 1u);
      BOOST_TEST(k.unsynchronizedWindows[0] == 2);
      // Everything passes afterwards; nothing more is said, not at exit either.
      for (int p = 0; p < 3; ++p) BOOST_TEST(h.act(grad(3000, kBuf2)) == SF_SHIM_PASS);
      BOOST_TEST(h.policy->finish() == !strict);
      BOOST_TEST(h.lines.size() == 1u);
    }
  }
}

// Lost between windows (nothing deferred since the last synchronization):
// passing everything is exact whatever the host does, and said so.
BOOST_AUTO_TEST_CASE(losing_the_track_between_windows_is_correct_and_said_so) {
  ShimConfig c = config(100, 4);
  c.strict = true;
  Harness h(c);
  std::vector<sf_shim_action> a;
  for (int p = 1; p <= 8; ++p) ddpPass(h, p, &a);  // pass 8 ends window 2
  BOOST_TEST(a.back() == SF_SHIM_PASS);
  BOOST_TEST(h.act(grad(3000, reinterpret_cast<const void*>(0xd000))) == SF_SHIM_PASS);
  BOOST_REQUIRE(h.lines.size() == 1u);
  BOOST_TEST(h.said("(correct, not faster)") == 1u);
  BOOST_TEST(h.policy->finish());
}

// Finding F2 (tests/fuzz/README.md): byte counts near 2^63 (an NCCL count x
// element size) or negative ones must not overflow the int64 counters (UB).
BOOST_AUTO_TEST_CASE(byte_counters_saturate_instead_of_overflowing) {
  Harness h(config(100, 0));
  const int64_t big = INT64_MAX - 5;
  BOOST_TEST(h.act(call(SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_SUM, big)) == SF_SHIM_PASS);
  BOOST_TEST(h.act(call(SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_SUM, big)) == SF_SHIM_PASS);
  BOOST_TEST(h.act(call(SF_SHIM_DTYPE_OTHER, SF_SHIM_OP_SUM, -7)) == SF_SHIM_PASS);
  BOOST_TEST(h.act(grad(big)) == SF_SHIM_PASS);
  BOOST_TEST(h.act(grad(big)) == SF_SHIM_PASS);
  h.begin();
  BOOST_TEST(h.act(grad(big)) == SF_SHIM_DEFER);
  BOOST_TEST(h.act(grad(big, kBuf2)) == SF_SHIM_DEFER);
  h.end();
  BOOST_TEST(h.act(grad(big)) == SF_SHIM_PASS);
  const auto k = h.policy->counters();
  BOOST_TEST(k.bytesSent == INT64_MAX);
  BOOST_TEST(k.gradientBytesSent == INT64_MAX);
  BOOST_TEST(k.bytesDeferred == INT64_MAX);
  for (const auto& r : h.policy->windowRecords()) {
    BOOST_TEST(r.bytesDeferred >= 0);
    BOOST_TEST(r.gradientBytesSent >= 0);
  }
  BOOST_TEST(h.policy->finish());
  // Automatic mode: the tracker's running count and (N - 1) x pass bytes.
  Harness a(config(100, int64_t(INT32_MAX)));
  for (int i = 0; i < 12; ++i) {
    BOOST_TEST(a.act(grad(big, i % 2 ? kBuf1 : kBuf2)) == SF_SHIM_PASS);
  }
  BOOST_TEST(a.policy->counters().gradientBytesSent == INT64_MAX);
  BOOST_TEST(a.policy->finish());
}

BOOST_AUTO_TEST_CASE(host_windows_take_over_from_automatic_mode) {
  Harness h(config(100, 3));
  h.begin();
  BOOST_TEST(h.act(grad(300)) == SF_SHIM_DEFER);
  BOOST_TEST(int(h.policy->mode()) == int(ShimPolicy::Mode::kExplicit));
  BOOST_TEST(h.said("following the host's windows") == 1u);
  h.end();
  BOOST_TEST(h.act(grad(300)) == SF_SHIM_PASS);
}

BOOST_AUTO_TEST_CASE(invalid_steps_pass_everything) {
  ShimConfig c = config(100);
  c.stepsInvalid = true;
  c.problems.push_back("SF_ACCUMULATION_STEPS=x is not a positive integer");
  Harness h(c);
  BOOST_TEST(h.said("SF_ACCUMULATION_STEPS=x") == 1u);
  h.begin();
  BOOST_TEST(h.act(grad(300)) == SF_SHIM_PASS);
  BOOST_TEST(int(h.policy->mode()) == int(ShimPolicy::Mode::kOff));
}

BOOST_AUTO_TEST_CASE(without_window_state_every_call_passes) {
  Harness h(config(100), false);
  h.begin();
  BOOST_TEST(h.act(grad(300)) == SF_SHIM_PASS);
  BOOST_TEST(h.act(grad(300)) == SF_SHIM_PASS);
  BOOST_TEST(h.said("no window state from libsfsync.so") == 1u);
}

BOOST_AUTO_TEST_CASE(a_default_context_not_made_has_no_windows) {
  // What the shim sees before the host makes the default context (that
  // reading it never makes it is checked in a fresh process:
  // tests/shim/window_warnings.py).
  ShimPolicy p(config(100), [](sf_window_state_v1* s) {
    s->context_made = 0;
    return true;
  }, [](int, const std::string&) {});
  BOOST_TEST(p.decide(grad(300)).action == SF_SHIM_PASS);
  sf_window_state_v1 s{};
  s.struct_size = 8;
  BOOST_TEST(sf_internal_window_state_v1(nullptr, 0, &s) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("struct_size = 8") != std::string::npos);
  BOOST_TEST(sf_internal_window_state_v1(nullptr, 0, nullptr) == SF_ERR_INVALID_ARGUMENT);
}

BOOST_AUTO_TEST_CASE(configuration_from_the_environment) {
  setenv("SF_SHIM_MIN_BYTES", "12x", 1);
  setenv("SF_ACCUMULATION_STEPS", "0", 1);
  setenv("SF_STRICT", "1", 1);
  setenv("SF_SHIM_REPORT", "/tmp/r-%r.json", 1);
  ShimConfig c = sfshim::shimConfigFromEnvironment();
  BOOST_TEST(c.minBytes == sfshim::kDefaultShimMinBytes);
  BOOST_TEST(c.stepsInvalid);
  BOOST_TEST(!c.strict);  // libsfsync reads SF_STRICT, and publishes it
  BOOST_TEST(c.reportPath == "/tmp/r-%r.json");
  BOOST_TEST(c.problems.size() == 2u);
  setenv("SF_SHIM_MIN_BYTES", "4096", 1);
  setenv("SF_ACCUMULATION_STEPS", "8", 1);
  setenv("SF_STRICT", "0", 1);
  c = sfshim::shimConfigFromEnvironment();
  BOOST_TEST(c.minBytes == 4096);
  BOOST_TEST(c.accumulationSteps == 8);
  BOOST_TEST(!c.stepsInvalid);
  BOOST_TEST(c.problems.empty());
  for (const char* v : {"SF_SHIM_MIN_BYTES", "SF_ACCUMULATION_STEPS", "SF_STRICT", "SF_SHIM_REPORT"}) {
    unsetenv(v);
  }
  c = sfshim::shimConfigFromEnvironment();
  BOOST_TEST(c.accumulationSteps == 0);
  BOOST_TEST(c.reportPath.empty());
}

BOOST_AUTO_TEST_CASE(report_file_names_the_rank_and_holds_the_counts) {
  const std::string dir = "/tmp/sfsync-shim-policy-" + std::to_string(getpid());
  BOOST_REQUIRE(std::system(("mkdir -p " + dir).c_str()) == 0);
  ShimConfig c = config(100);
  c.reportPath = dir + "/report-%r-%p.json";
  Harness h(c);
  h.begin();
  h.act(grad(300));
  h.end();
  h.act(grad(300));
  BOOST_TEST(h.policy->finish());
  const std::string path = dir + "/report-1-" + std::to_string(getpid()) + ".json";
  std::ifstream f(path);
  BOOST_REQUIRE(f.good());
  std::stringstream s;
  s << f.rdbuf();
  const std::string json = s.str();
  for (const char* part :
       {"\"rank\": 1", "\"world_size\": 4", "\"mode\": \"explicit\"", "\"calls\": 2",
        "\"deferred\": 1", "\"passed\": 1", "\"bytes_deferred\": 300", "\"bytes_sent\": 300",
        "\"windows\": 1", "\"unsynchronized_windows\": []",
        "{\"window\": 1, \"deferred_calls\": 1, \"bytes_deferred\": 300, "
        "\"gradient_calls_sent\": 1, \"gradient_bytes_sent\": 300}"}) {
    BOOST_TEST(json.find(part) != std::string::npos, part << " in " << json);
  }
  std::remove(path.c_str());
  rmdir(dir.c_str());
}

BOOST_AUTO_TEST_SUITE_END()
