// Speed features, tested for what they must keep: several buckets in flight
// (max_inflight lanes) give the exact same sums, once per bucket, in every
// lane count, and a failure on one lane fails the whole synchronization
// within its timeout; the 16-bit wire (wire_dtype) stays within the bound the
// header documents and is off by default. Ranks are threads (memory:// store).

#include <boost/test/unit_test.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

// Sets an environment variable for the life of the object.
struct EnvVar {
  std::string name;
  EnvVar(const char* n, const char* value) : name(n) { ::setenv(n, value, 1); }
  ~EnvVar() { ::unsetenv(name.c_str()); }
};

sf_status initWith(const char* name, const char* value, sf_options& o) {
  EnvVar e(name, value);
  return sf_options_init(&o, sizeof o);
}

struct ExactRun {
  std::string error;
  int64_t collectives = 0, buckets = 0, bytes = 0, mismatches = 0;
  double firstBad = 0, firstWant = 0;
};

// Every rank adds `sizes` gradients; element i of gradient g in window w on
// rank r is (r + 1) * (w + 1) + (i + g) % 5: small integers, so every sum is
// exact in float32 whatever the order.
ExactRun exactWindows(int rank, int world, int lanes, const std::string& url,
                      const std::vector<int64_t>& sizes, double capMb, int windows) {
  ExactRun out;
  sf_options o = rankOptions(rank, world, url);
  o.reduce_op = SF_REDUCE_SUM;
  o.max_inflight = lanes;
  o.bucket_cap_mb = capMb;
  o.first_bucket_cap_mb = 0.25;
  ContextHandle h;
  if (sf_create(&o, &h.ctx) != SF_OK) return {sf_last_error()};
  std::vector<float*> data;
  for (size_t g = 0; g < sizes.size(); ++g) {
    int64_t id;
    sf_add_gradient(h.ctx, sizes[g], SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
  }
  for (size_t g = 0; g < sizes.size(); ++g) {
    void* p = nullptr;
    sf_gradient_data(h.ctx, int64_t(g), &p);
    data.push_back(static_cast<float*>(p));
  }
  for (int w = 0; w < windows; ++w) {
    for (size_t g = 0; g < sizes.size(); ++g) {
      for (int64_t i = 0; i < sizes[g]; ++i) {
        data[g][i] = float((rank + 1) * (w + 1) + (i + int64_t(g)) % 5);
      }
    }
    // Odd windows start buckets early through grad-ready (reverse order).
    if (w % 2 == 1) {
      for (int64_t g = int64_t(sizes.size()) - 1; g >= 0; --g) {
        if (sf_grad_ready(h.ctx, g) != SF_OK) return {sf_last_error()};
      }
    }
    if (sf_synchronize(h.ctx) != SF_OK) return {sf_last_error()};
    const int64_t rankSum = int64_t(world) * (world + 1) / 2;
    for (size_t g = 0; g < sizes.size(); ++g) {
      for (int64_t i = 0; i < sizes[g]; ++i) {
        const float want = float(rankSum * (w + 1) + world * ((i + int64_t(g)) % 5));
        if (data[g][i] != want) {
          if (out.mismatches++ == 0) {
            out.firstBad = data[g][i];
            out.firstWant = want;
          }
        }
      }
    }
  }
  const sf_stats s = statsOf(h.ctx);
  out.collectives = s.collectives_issued;
  out.buckets = s.bucket_count;
  out.bytes = s.bytes_reduced;
  return out;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(inflight_tests)

BOOST_AUTO_TEST_CASE(option_default_environment_and_validation) {
  sf_options o;
  BOOST_REQUIRE(sf_options_init(&o, sizeof o) == SF_OK);
  BOOST_TEST(o.max_inflight == 4);
  BOOST_TEST(o.wire_dtype == SF_DTYPE_FLOAT32);
  BOOST_TEST(initWith("SF_MAX_INFLIGHT", "3", o) == SF_OK);
  BOOST_TEST(o.max_inflight == 3);
  for (const char* bad : {"0", "17", "two", "-1"}) {
    BOOST_TEST_CONTEXT("SF_MAX_INFLIGHT=" << bad) {
      BOOST_TEST(initWith("SF_MAX_INFLIGHT", bad, o) == SF_ERR_INVALID_ARGUMENT);
      BOOST_TEST(std::string(sf_last_error()).find("SF_MAX_INFLIGHT") != std::string::npos);
      BOOST_TEST(o.max_inflight == 4);  // the default stays
    }
  }
  sf_options_init(&o, sizeof o);
  for (int bad : {0, -3, 17}) {
    o.max_inflight = bad;
    sf_context* ctx = nullptr;
    BOOST_TEST(sf_create(&o, &ctx) == SF_ERR_INVALID_ARGUMENT);
    BOOST_TEST(ctx == nullptr);
    BOOST_TEST(std::string(sf_last_error()).find("max_inflight = " + std::to_string(bad)) !=
               std::string::npos);
  }
}

BOOST_AUTO_TEST_CASE(older_callers_get_the_defaults) {
  // A 0.1 caller's struct ends at rendezvous: whatever follows is not its.
  sf_options o;
  sf_options_init(&o, sizeof o);
  o.struct_size = offsetof(sf_options, rendezvous) + SF_RENDEZVOUS_MAX;
  o.max_inflight = -7;  // garbage beyond the caller's struct
  o.wire_dtype = 99;
  sf_context* ctx = nullptr;
  BOOST_REQUIRE(sf_create(&o, &ctx) == SF_OK);
  sf_options got;
  got.struct_size = sizeof got;
  BOOST_REQUIRE(sf_get_options(ctx, &got) == SF_OK);
  BOOST_TEST(got.max_inflight == 4);
  BOOST_TEST(got.wire_dtype == SF_DTYPE_FLOAT32);
  sf_destroy(ctx);
}

BOOST_AUTO_TEST_CASE(exact_sums_once_per_bucket_for_every_lane_count) {
  // An 8.2 MiB gradient is split into pieces across lanes; the small ones make
  // several buckets of a 0.5 MiB cap.
  const std::vector<int64_t> sizes = {1000, 70000, 2100 * 1024, 3, 200000, 65536, 7};
  int64_t total = 0;
  for (int64_t n : sizes) total += n * 4;
  for (int lanes : {1, 2, 5}) {
    for (int world : {2, 3}) {
      BOOST_TEST_CONTEXT("lanes " << lanes << ", world " << world) {
        const std::string url = "memory://" + uniqueName("lanes");
        auto runs = runThreadRanks<ExactRun>(world, [&](int r) {
          return exactWindows(r, world, lanes, url, sizes, 0.5, 2);
        });
        for (const auto& run : runs) {
          BOOST_REQUIRE_MESSAGE(run.error.empty(), run.error);
          BOOST_TEST(run.mismatches == 0, "first wrong value " << run.firstBad << ", expected "
                                                               << run.firstWant);
          // The first bucket closes once it holds 1 MiB (first_bucket_cap_mb).
          BOOST_TEST(run.buckets == 5);  // [7 65536] [200000] [3] [8.2 MiB] [70000 1000]
          BOOST_TEST(run.collectives == 2 * run.buckets);  // once per bucket per window
          BOOST_TEST(run.bytes == 2 * total);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(a_silent_peer_fails_the_whole_sync_within_its_timeout) {
  // 32 buckets on 4 lanes: were the queued ones each to wait for their own
  // timeout, rank 0 would wait 8 x 1 s; a failed lane fails the rest at once.
  const int64_t timeoutMs = 1000;
  const std::string url = "memory://" + uniqueName("silent");
  std::atomic<bool> rank0Done{false};
  struct Result {
    std::string error;
    sf_status first = SF_OK, second = SF_OK;
    double firstSeconds = 0, secondSeconds = 0;
    std::string message;
  };
  auto runs = runThreadRanks<Result>(2, [&](int r) {
    Result out;
    sf_options o = rankOptions(r, 2, url, timeoutMs);
    o.max_inflight = 4;
    o.bucket_cap_mb = 0.25;
    o.first_bucket_cap_mb = 0.25;
    ContextHandle h;
    if (sf_create(&o, &h.ctx) != SF_OK) { out.error = sf_last_error(); return out; }
    for (int g = 0; g < 32; ++g) {
      int64_t id;
      sf_add_gradient(h.ctx, 65536, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
    }
    if (sf_synchronize(h.ctx) != SF_OK) { out.error = sf_last_error(); return out; }  // connected
    if (r == 1) {  // silent from now on, until rank 0 has seen the failure
      while (!rank0Done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return out;
    }
    auto t0 = std::chrono::steady_clock::now();
    out.first = sf_synchronize(h.ctx);
    out.message = sf_last_error();
    out.firstSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    t0 = std::chrono::steady_clock::now();
    out.second = sf_synchronize(h.ctx);
    out.secondSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rank0Done.store(true);
    return out;
  });
  BOOST_REQUIRE_MESSAGE(runs[0].error.empty(), runs[0].error);
  BOOST_REQUIRE_MESSAGE(runs[1].error.empty(), runs[1].error);
  BOOST_TEST_MESSAGE("silent peer: first error after " << runs[0].firstSeconds << " s: "
                                                      << runs[0].message);
  BOOST_TEST(runs[0].first == SF_ERR_TIMEOUT);
  BOOST_TEST(runs[0].firstSeconds >= 0.9);
  BOOST_TEST(runs[0].firstSeconds < 1.0 + 3.0);  // one timeout + slack for a loaded machine
  BOOST_TEST(runs[0].second != SF_OK);           // the context stays failed
  BOOST_TEST(runs[0].secondSeconds < 0.5);
}

BOOST_AUTO_TEST_SUITE_END()

namespace {

struct WireRun {
  std::string error;
  double worstRatio = 0;   // max over elements of |err| / bound
  double worstRel = 0;     // max |err| / sum|x|
  int64_t inexact = 0;     // elements not equal to the float32 reference
};

// Rank r's element i: deterministic pseudo-random, regenerable by every rank.
uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

float wireValue(int rank, int64_t i, bool mixedSigns, int scaleBits) {
  const uint64_t h = splitmix(uint64_t(rank) << 40 ^ uint64_t(i));
  const double mant = 0.5 + 1.5 * double(h >> 11) * 0x1p-53;  // [0.5, 2)
  const int e = int((h >> 1) % uint64_t(2 * scaleBits + 1)) - scaleBits;
  double v = std::ldexp(mant, e);
  if (mixedSigns && (h & 1)) v = -v;
  return float(v);
}

// The window's gradients: three tensors; the 8.2 MiB one is split into pieces
// and carries the window check (its last piece holds the two unscaled
// window-check elements).
const std::vector<int64_t> kWireSizes = {2100 * 1024, 4099, 100000};

// Every element's sum over the ranks: exact (double), of magnitudes, and the
// float32 sum in rank order; one table for all of a window's ranks.
struct WireExpected {
  std::vector<double> exact, absSum;
  std::vector<float> ref;
};

WireExpected wireExpected(int world, bool mixedSigns, int scaleBits) {
  int64_t total = 0;
  for (int64_t n : kWireSizes) total += n;
  WireExpected e{std::vector<double>(size_t(total)), std::vector<double>(size_t(total)),
                 std::vector<float>(size_t(total))};
  for (int64_t i = 0; i < total; ++i) {
    double exact = 0, absSum = 0;
    float ref = 0;  // float32, ranks in order (exact for 2 ranks)
    for (int r = 0; r < world; ++r) {
      const float x = wireValue(r, i, mixedSigns, scaleBits);
      exact += x;
      absSum += std::fabs(x);
      ref += x;
    }
    e.exact[size_t(i)] = exact;
    e.absSum[size_t(i)] = absSum;
    e.ref[size_t(i)] = ref;
  }
  return e;
}

WireRun wireWindow(int rank, int world, sf_dtype wire, const std::string& url, bool mixedSigns,
                   int scaleBits, sf_reduce_op op, bool setWire, const WireExpected& expected) {
  WireRun out;
  sf_options o = rankOptions(rank, world, url);
  o.reduce_op = op;
  if (setWire) o.wire_dtype = wire;
  o.bucket_cap_mb = 2;
  ContextHandle h;
  if (sf_create(&o, &h.ctx) != SF_OK) return {sf_last_error()};
  const std::vector<int64_t>& sizes = kWireSizes;
  for (int64_t n : sizes) {
    int64_t id;
    sf_add_gradient(h.ctx, n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
  }
  std::vector<float*> data;
  int64_t base = 0;
  std::vector<int64_t> bases;
  for (size_t g = 0; g < sizes.size(); ++g) {
    void* p = nullptr;
    sf_gradient_data(h.ctx, int64_t(g), &p);
    data.push_back(static_cast<float*>(p));
    bases.push_back(base);
    for (int64_t i = 0; i < sizes[g]; ++i) data[g][i] = wireValue(rank, base + i, mixedSigns, scaleBits);
    base += sizes[g];
  }
  if (sf_synchronize(h.ctx) != SF_OK) return {sf_last_error()};
  const double u = wire == SF_DTYPE_BFLOAT16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double absTerm = wire == SF_DTYPE_FLOAT16 ? world * std::ldexp(1.0, -24) : 0.0;
  const double div = op == SF_REDUCE_AVERAGE ? world : 1.0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    for (int64_t i = 0; i < sizes[g]; ++i) {
      const size_t k = size_t(bases[g] + i);
      const double exact = expected.exact[k], absSum = expected.absSum[k];
      const float ref = expected.ref[k];
      const double err = std::fabs(double(data[g][i]) * div - exact);
      // The documented bound, plus float32 rounding of the average.
      const double bound = (world + 1) * u * absSum + absTerm + std::ldexp(absSum, -23) * (div > 1);
      out.worstRatio = std::max(out.worstRatio, err / bound);
      out.worstRel = std::max(out.worstRel, err / absSum);
      if (data[g][i] * float(div) != ref) ++out.inexact;
    }
  }
  return out;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(wire_dtype_tests)

BOOST_AUTO_TEST_CASE(environment_and_validation) {
  sf_options o;
  BOOST_TEST(initWith("SF_WIRE_DTYPE", "bf16", o) == SF_OK);
  BOOST_TEST(o.wire_dtype == SF_DTYPE_BFLOAT16);
  BOOST_TEST(initWith("SF_WIRE_DTYPE", "fp16", o) == SF_OK);
  BOOST_TEST(o.wire_dtype == SF_DTYPE_FLOAT16);
  BOOST_TEST(initWith("SF_WIRE_DTYPE", "native", o) == SF_OK);
  BOOST_TEST(o.wire_dtype == SF_DTYPE_FLOAT32);
  BOOST_TEST(initWith("SF_WIRE_DTYPE", "int8", o) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("SF_WIRE_DTYPE='int8'") != std::string::npos);
  sf_options_init(&o, sizeof o);
  for (int bad : {SF_DTYPE_FLOAT64, 4, -1}) {
    o.wire_dtype = bad;
    sf_context* ctx = nullptr;
    BOOST_TEST(sf_create(&o, &ctx) == SF_ERR_INVALID_ARGUMENT);
    BOOST_TEST(std::string(sf_last_error()).find("wire_dtype = " + std::to_string(bad)) !=
               std::string::npos);
  }
}

BOOST_AUTO_TEST_CASE(error_bound_holds_for_2_and_4_ranks) {
  struct Case {
    sf_dtype wire;
    bool mixed;
    int scaleBits;
    sf_reduce_op op;
  };
  // fp16: magnitudes 2^-6..2^7 (no overflow); bf16: 2^-40..2^41.
  const std::vector<Case> cases = {{SF_DTYPE_BFLOAT16, false, 40, SF_REDUCE_SUM},
                                   {SF_DTYPE_BFLOAT16, true, 40, SF_REDUCE_AVERAGE},
                                   {SF_DTYPE_FLOAT16, false, 6, SF_REDUCE_SUM},
                                   {SF_DTYPE_FLOAT16, true, 6, SF_REDUCE_AVERAGE}};
  for (int world : {2, 4}) {
    for (const auto& c : cases) {
      BOOST_TEST_CONTEXT("world " << world << ", wire " << c.wire << ", mixed signs " << c.mixed
                                  << ", op " << c.op) {
        const std::string url = "memory://" + uniqueName("wire");
        const WireExpected expected = wireExpected(world, c.mixed, c.scaleBits);
        auto runs = runThreadRanks<WireRun>(world, [&](int r) {
          return wireWindow(r, world, c.wire, url, c.mixed, c.scaleBits, c.op, true, expected);
        });
        for (const auto& run : runs) {
          BOOST_REQUIRE_MESSAGE(run.error.empty(), run.error);
          BOOST_TEST(run.worstRatio <= 1.0);
          // It really went 16-bit: errors far above float32's.
          BOOST_TEST(run.inexact > 1000);
          BOOST_TEST(run.worstRel > std::ldexp(1.0, c.wire == SF_DTYPE_BFLOAT16 ? -10 : -13));
        }
        BOOST_TEST_MESSAGE("worst |err|/sum|x| = " << runs[0].worstRel << " (bound "
                           << (world + 1) * std::ldexp(1.0, c.wire == SF_DTYPE_BFLOAT16 ? -8 : -11)
                           << "), worst err/bound = " << runs[0].worstRatio);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(off_by_default_exact) {
  // Two ranks: the float32 sum of two values is one rounding, the same
  // whichever rank adds: the result must equal it bit for bit.
  const std::string url = "memory://" + uniqueName("wireoff");
  const WireExpected expected = wireExpected(2, true, 40);
  auto runs = runThreadRanks<WireRun>(2, [&](int r) {
    return wireWindow(r, 2, SF_DTYPE_BFLOAT16, url, true, 40, SF_REDUCE_SUM, false, expected);
  });
  for (const auto& run : runs) {
    BOOST_REQUIRE_MESSAGE(run.error.empty(), run.error);
    BOOST_TEST(run.inexact == 0);
  }
}

BOOST_AUTO_TEST_SUITE_END()

// ---- The 16-bit wire at its edges: rounding, subnormals, overflow, prescale ----
// The oracle is computed here, in double, from IEEE 754's definition (round
// to nearest, ties to even, on the format's grid), not with the plugin's
// own conversions.

namespace {

// x rounded to binary16 (fp16: 10 fraction bits, smallest normal 2^-14,
// largest 65504) or bfloat16 (7 fraction bits, float32's range); inf past
// the largest finite value's rounding boundary.
double roundTo16(double x, sf_dtype wire) {
  if (x == 0 || !std::isfinite(x)) return x;
  const bool half = wire == SF_DTYPE_FLOAT16;
  const int fraction = half ? 10 : 7, minExp = half ? -14 : -126;
  int e = 0;
  std::frexp(std::fabs(x), &e);  // |x| in [2^(e-1), 2^e)
  const int ulpExp = std::max(e - 1, minExp) - fraction;
  const double r = std::ldexp(std::nearbyint(std::ldexp(x, -ulpExp)), ulpExp);
  const double largest = half ? 65504.0 : std::ldexp(255.0 / 128.0, 127);
  return std::fabs(r) > largest ? std::copysign(INFINITY, x) : r;
}

struct Reduced {
  std::string error;
  std::vector<float> out;
};

// One window of one float32 gradient of n elements; rank r's element i is
// value(r, i). Returns the synchronized gradient.
Reduced reduceOnce(int rank, int world, const std::string& url, sf_dtype wire, sf_reduce_op op,
                   double prescale, int64_t n, const std::function<float(int, int64_t)>& value) {
  sf_options o = rankOptions(rank, world, url);
  o.reduce_op = op;
  o.prescale = prescale;
  o.wire_dtype = wire;
  ContextHandle h;
  int64_t id = -1;
  void* p = nullptr;
  if (sf_create(&o, &h.ctx) != SF_OK ||
      sf_add_gradient(h.ctx, n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id) != SF_OK ||
      sf_gradient_data(h.ctx, id, &p) != SF_OK) {
    return {sf_last_error(), {}};
  }
  float* g = static_cast<float*>(p);
  for (int64_t i = 0; i < n; ++i) g[i] = value(rank, i);
  if (sf_synchronize(h.ctx) != SF_OK) return {sf_last_error(), {}};
  return {"", std::vector<float>(g, g + n)};
}

std::vector<Reduced> reduceOnRanks(int world, sf_dtype wire, sf_reduce_op op, double prescale,
                                   int64_t n, const std::function<float(int, int64_t)>& value) {
  const std::string url = "memory://" + uniqueName("wire-edge");
  auto runs = runThreadRanks<Reduced>(
      world, [&](int r) { return reduceOnce(r, world, url, wire, op, prescale, n, value); });
  for (const auto& run : runs) BOOST_REQUIRE_MESSAGE(run.error.empty(), run.error);
  return runs;
}

// Values at which rounding to `wire` is hardest: exact ties (each way of
// "to even"), a float32 ulp either side of a tie, the subnormal range and
// its ties (fp16), the largest finite value and the overflow boundary, both
// signs; then pseudo-random values over the whole range.
std::vector<float> roundingCases(sf_dtype wire) {
  const bool half = wire == SF_DTYPE_FLOAT16;
  const int fraction = half ? 10 : 7;
  std::vector<double> v;
  for (int e : {0, -3, 7, half ? -14 : -126, half ? 15 : 100}) {
    const double ulp = std::ldexp(1.0, e - fraction);
    for (double m : {0.0, 1.0, 2.0, 3.0, 100.0}) {  // even and odd last bits
      const double tie = std::ldexp(1.0, e) + (m + 0.5) * ulp;
      v.push_back(tie);
      v.push_back(std::nextafter(float(tie), 0.0f));
      v.push_back(std::nextafter(float(tie), INFINITY));
    }
  }
  if (half) {
    for (double k : {0.5, 1.0, 1.5, 2.5, 3.0, 1023.5, 1000.25, 0.49, 0.51}) {
      v.push_back(std::ldexp(k, -24));  // subnormal fp16: multiples of 2^-24, ties included
    }
    v.push_back(std::ldexp(1.0, -30));       // rounds to 0
    for (double x : {65504.0, 65519.0, 65519.99, 65520.0, 65536.0, 1e6}) v.push_back(x);
  } else {
    v.push_back(std::ldexp(255.0 / 128.0, 127));  // the largest bfloat16
    v.push_back(3.4e38);                          // rounds past it: inf
  }
  std::vector<float> out;
  for (double x : v) {
    out.push_back(float(x));
    out.push_back(-float(x));
  }
  for (int64_t i = 0; i < 4000; ++i) out.push_back(wireValue(0, i, true, half ? 20 : 60));
  return out;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(wire_dtype_tests)

BOOST_AUTO_TEST_CASE(one_rank_of_zeros_gives_each_value_rounded_to_nearest_even_2_ranks) {
  // Rank 1 holds zeros: every partial sum is x + 0, so the result is x
  // rounded once to the wire type, which the oracle knows exactly.
  for (sf_dtype wire : {SF_DTYPE_FLOAT16, SF_DTYPE_BFLOAT16}) {
    BOOST_TEST_CONTEXT("wire " << wire) {
      const std::vector<float> x = roundingCases(wire);
      auto runs = reduceOnRanks(2, wire, SF_REDUCE_SUM, 1.0, int64_t(x.size()),
                                [&](int r, int64_t i) { return r == 0 ? x[size_t(i)] : 0.0f; });
      int64_t wrong = 0, infinities = 0, subnormals = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        const double want = roundTo16(x[i], wire);
        for (const auto& run : runs) {
          const bool same = run.out[i] == float(want);
          if (!same && wrong++ < 5) {
            BOOST_TEST_MESSAGE("x = " << std::hexfloat << x[i] << ": got " << run.out[i] << ", want "
                                      << want << std::defaultfloat);
          }
        }
        infinities += std::isinf(want);
        subnormals += wire == SF_DTYPE_FLOAT16 && want != 0 && std::fabs(want) < std::ldexp(1.0, -14);
      }
      BOOST_TEST(wrong == 0);
      BOOST_TEST(infinities >= 2);
      if (wire == SF_DTYPE_FLOAT16) BOOST_TEST(subnormals >= 10);
    }
  }
}

BOOST_AUTO_TEST_CASE(fp16_overflow_is_inf_without_a_prescale_and_finite_with_one_2_ranks) {
  // 40000 is an fp16 value; the sum of two (80000) is not: documented inf.
  // Averaging divides after widening, so it overflows too; a prescale of
  // 1/4 applied before rounding keeps every partial sum in range. 98304
  // alone is out of fp16's range before any sum.
  const std::vector<float> x0 = {40000.0f, 65504.0f, 98304.0f, -40000.0f, 1.0f};
  const std::vector<float> x1 = {40000.0f, 65504.0f, 0.0f, -40000.0f, 1.0f};
  auto value = [&](int r, int64_t i) { return (r == 0 ? x0 : x1)[size_t(i)]; };
  const int64_t n = int64_t(x0.size());
  for (sf_reduce_op op : {SF_REDUCE_SUM, SF_REDUCE_AVERAGE}) {
    for (const auto& run : reduceOnRanks(2, SF_DTYPE_FLOAT16, op, 1.0, n, value)) {
      BOOST_TEST_CONTEXT("op " << op) {
        for (int i : {0, 1, 2}) BOOST_TEST((std::isinf(run.out[size_t(i)]) && run.out[size_t(i)] > 0));
        BOOST_TEST((std::isinf(run.out[3]) && run.out[3] < 0));
        BOOST_TEST(run.out[4] == (op == SF_REDUCE_SUM ? 2.0f : 1.0f));
      }
    }
  }
  for (const auto& run : reduceOnRanks(2, SF_DTYPE_FLOAT16, SF_REDUCE_PRESCALED_SUM, 0.25, n, value)) {
    for (int64_t i = 0; i < n; ++i) {
      const double want = 0.25 * (double(x0[size_t(i)]) + x1[size_t(i)]);
      BOOST_TEST(std::isfinite(run.out[size_t(i)]));
      // Every value here is exact in fp16 after the prescale: no rounding at all.
      BOOST_TEST(run.out[size_t(i)] == float(want), "element " << i);
    }
  }
}

BOOST_AUTO_TEST_CASE(each_owner_adds_its_own_float32_value_2_ranks) {
  // Since 0.5 a rank never rounds its own contribution before it adds it:
  // at two ranks an element's result is round(x_own + round(x_other)) (the
  // sum in float32), for whichever rank owns it, the same bits on both
  // ranks; never round(round(x0) + round(x1)), which rounds twice before
  // the sum. Nearly cancelling pairs make the two differ: there the
  // rounding of each input is most of the error.
  const int64_t n = 8192;
  for (sf_dtype wire : {SF_DTYPE_FLOAT16, SF_DTYPE_BFLOAT16}) {
    const bool half = wire == SF_DTYPE_FLOAT16;
    auto value = [&](int r, int64_t i) {
      const uint64_t h = splitmix(uint64_t(i) + 77);
      // x0: 24 significant bits, exponents -4..5 (fp16-safe); x1 = -x0 (1 + d), |d| < 2^-5.
      const float x0 = float(std::ldexp(double((h & 0xffffff) | 0x800000), int((h >> 24) % 10) - 28));
      const float s = (h >> 40) & 1 ? -1.0f : 1.0f;
      const double d = std::ldexp(double(int64_t((h >> 41) % 2048) - 1024), -15);
      return r == 0 ? s * x0 : float(-double(s * x0) * (1.0 + d));
    };
    auto r16 = [&](float x) { return float(roundTo16(x, wire)); };
    for (sf_reduce_op op : {SF_REDUCE_SUM, SF_REDUCE_AVERAGE}) {
      BOOST_TEST_CONTEXT("wire " << wire << ", op " << op) {
        const float div = op == SF_REDUCE_AVERAGE ? 2.0f : 1.0f;
        auto runs = reduceOnRanks(2, wire, op, 1.0, n, value);
        int64_t wrong = 0, apart = 0, discriminating = 0;
        for (int64_t i = 0; i < n; ++i) {
          const float x0 = value(0, i), x1 = value(1, i);
          const float own0 = r16(x0 + r16(x1)) / div, own1 = r16(x1 + r16(x0)) / div;
          const float twice = r16(r16(x0) + r16(x1)) / div;
          const float got = runs[0].out[size_t(i)];
          apart += std::memcmp(&got, &runs[1].out[size_t(i)], sizeof got) != 0;
          const bool ok = got == own0 || got == own1;
          discriminating += twice != own0 && twice != own1;
          if (!ok && wrong++ < 5) {
            BOOST_TEST_MESSAGE("element " << i << std::hexfloat << ": x0 " << x0 << ", x1 " << x1
                                          << ": got " << got << ", want " << own0 << " or " << own1
                                          << " (rounded twice: " << twice << ")"
                                          << std::defaultfloat);
          }
        }
        BOOST_TEST(apart == 0);
        BOOST_TEST(wrong == 0);
        // The values do tell the two arithmetics apart.
        BOOST_TEST(discriminating > n / (half ? 8 : 4));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(uneven_and_empty_segments_3_ranks) {
  // The ring cuts a piece into world_size segments: 3 ranks and sizes that
  // leave segments short or empty (1 and 2 elements) or uneven. Every rank
  // must end with the same bits, within the documented bound.
  for (int64_t n : {int64_t(1), int64_t(2), int64_t(5), int64_t(7919)}) {
    BOOST_TEST_CONTEXT("n " << n) {
      auto value = [](int r, int64_t i) { return wireValue(r, i, true, 20); };
      auto runs = reduceOnRanks(3, SF_DTYPE_BFLOAT16, SF_REDUCE_SUM, 1.0, n, value);
      const double u = std::ldexp(1.0, -8);
      int64_t apart = 0, over = 0, inexact = 0;
      for (int64_t i = 0; i < n; ++i) {
        double exact = 0, absSum = 0;
        for (int r = 0; r < 3; ++r) {
          exact += value(r, i);
          absSum += std::fabs(value(r, i));
        }
        const float got = runs[0].out[size_t(i)];
        for (const auto& run : runs) apart += std::memcmp(&got, &run.out[size_t(i)], sizeof got) != 0;
        over += std::fabs(double(got) - exact) > 4 * u * absSum;
        inexact += double(got) != exact;
      }
      BOOST_TEST(apart == 0);
      BOOST_TEST(over == 0);
      if (n > 1000) BOOST_TEST(inexact > n / 2);  // it went 16-bit
    }
  }
}

BOOST_AUTO_TEST_CASE(documented_bound_on_adversarial_values_2_and_4_ranks) {
  // Each input a float32 ulp below a tie of the wire's grid (every rounding
  // close to its worst), same signs (errors cannot cancel), magnitudes over
  // fp16's normal and subnormal range; sums, prescaled sums (1/3: not a power
  // of two) and averages. Bound (include/sfsync.h), against the exact S:
  //   |result - k S| <= (N + 1) u sum_i |k x_i|  (+ N 2^-24 for fp16)
  // plus float32's rounding of k x_i and of the average.
  const int64_t n = 6000;
  for (sf_dtype wire : {SF_DTYPE_FLOAT16, SF_DTYPE_BFLOAT16}) {
    const bool half = wire == SF_DTYPE_FLOAT16;
    const int fraction = half ? 10 : 7;
    auto value = [&](int r, int64_t i) {
      const uint64_t h = splitmix(uint64_t(r + 1) << 32 ^ uint64_t(i));
      // fp16: exponents -24..12 (subnormals below -14; sums of 4 stay below 65504).
      const int e = half ? int(h % 37) - 24 : int(h % 80) - 40;
      const double ulp = std::ldexp(1.0, std::max(e, half ? -14 : -126) - fraction);
      const double m = double((h >> 8) % uint64_t(1 << fraction));
      const double base = e < -14 && half ? 0.0 : std::ldexp(1.0, e);
      const double tie = base + (m + 0.5) * ulp;
      return std::nextafter(float(tie), 0.0f);
    };
    for (int world : {2, 4}) {
      for (auto [op, k] : {std::pair<sf_reduce_op, double>{SF_REDUCE_SUM, 1.0},
                           {SF_REDUCE_PRESCALED_SUM, 1.0 / 3.0}, {SF_REDUCE_AVERAGE, 1.0}}) {
        BOOST_TEST_CONTEXT("wire " << wire << ", world " << world << ", op " << op) {
          auto runs = reduceOnRanks(world, wire, op, k, n, value);
          const double u = std::ldexp(1.0, -(fraction + 1));
          const double div = op == SF_REDUCE_AVERAGE ? world : 1.0;
          const double kf = double(float(k));  // the factor as the wire applies it
          double worst = 0;
          int64_t over = 0;
          for (int64_t i = 0; i < n; ++i) {
            double exact = 0, absSum = 0;
            for (int r = 0; r < world; ++r) {
              exact += kf * value(r, i);
              absSum += std::fabs(kf * value(r, i));
            }
            exact /= div;
            absSum /= div;
            const double absTerm = half ? world * std::ldexp(1.0, -24) / div : 0.0;
            const double bound = (world + 1) * u * absSum + absTerm + std::ldexp(absSum, -22);
            for (const auto& run : runs) {
              const double err = std::fabs(double(run.out[size_t(i)]) - exact);
              worst = std::max(worst, err / bound);
              over += err > bound;
            }
          }
          BOOST_TEST(over == 0);
          // Adversarial indeed: some element uses a good part of the bound.
          BOOST_TEST(worst > 0.25);
          BOOST_TEST_MESSAGE("worst err/bound = " << worst);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()

// ---- SF_TRACE ---------------------------------------------------------------

#include <boost/property_tree/json_parser.hpp>
#include "plugin/core/tracer.h"
#include <boost/property_tree/ptree.hpp>

#include <fstream>
#include <map>

namespace {

struct TraceEvent {
  std::string ph, name;
  int pid = -1, tid = -1;
  double ts = 0, dur = 0;
  boost::property_tree::ptree args;
};

std::vector<TraceEvent> loadTrace(const std::string& path) {
  boost::property_tree::ptree root;
  boost::property_tree::read_json(path, root);
  std::vector<TraceEvent> out;
  for (const auto& kv : root.get_child("traceEvents")) {
    const auto& e = kv.second;
    TraceEvent t;
    t.ph = e.get<std::string>("ph");
    t.name = e.get<std::string>("name");
    t.pid = e.get<int>("pid");
    t.tid = e.get<int>("tid");
    t.ts = e.get<double>("ts", 0);
    t.dur = e.get<double>("dur", 0);
    if (auto a = e.get_child_optional("args")) t.args = *a;
    out.push_back(t);
  }
  return out;
}

struct TraceRun {
  std::string error;
  int64_t buckets = 0, bytes = 0;
};

// Two windows of three micro-batches; every micro-batch reports every
// gradient ready (the last one outside the window, starting buckets early).
TraceRun tracedWindows(int rank, const std::string& url, int lanes, sf_dtype wire) {
  sf_options o = rankOptions(rank, 2, url);
  o.max_inflight = lanes;
  o.wire_dtype = wire;
  o.bucket_cap_mb = 1;
  o.first_bucket_cap_mb = 1;
  ContextHandle h;
  if (sf_create(&o, &h.ctx) != SF_OK) return {sf_last_error()};
  const int grads = 6;
  for (int g = 0; g < grads; ++g) {
    int64_t id;
    sf_add_gradient(h.ctx, 256 * 1024, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
  }
  for (int w = 0; w < 2; ++w) {
    sf_begin_accumulation(h.ctx);
    for (int m = 0; m < 3; ++m) {
      if (m == 2) sf_end_accumulation(h.ctx);
      for (int g = grads - 1; g >= 0; --g) {
        if (sf_grad_ready(h.ctx, g) != SF_OK) return {sf_last_error()};
      }
    }
    if (sf_synchronize(h.ctx) != SF_OK) return {sf_last_error()};
  }
  const sf_stats s = statsOf(h.ctx);
  return {"", s.bucket_count, s.bytes_reduced};
}

}  // namespace

BOOST_AUTO_TEST_SUITE(trace_tests)

BOOST_AUTO_TEST_CASE(path_per_rank) {
  BOOST_TEST(sfsync::Tracer::pathFor("t.json", 0, 1) == "t.json");
  BOOST_TEST(sfsync::Tracer::pathFor("/a/t.json", 1, 2) == "/a/t.rank1.json");
  BOOST_TEST(sfsync::Tracer::pathFor("/a.b/t", 3, 4) == "/a.b/t.rank3");
  BOOST_TEST(sfsync::Tracer::pathFor("/x/r%r.json", 2, 4) == "/x/r2.json");
}

BOOST_AUTO_TEST_CASE(windows_passes_launches_wire_and_finishes) {
  for (sf_dtype wire : {SF_DTYPE_FLOAT32, SF_DTYPE_BFLOAT16}) {
    BOOST_TEST_CONTEXT("wire dtype " << wire) {
      const std::string dir = "/tmp/" + uniqueName("sftrace");
      BOOST_REQUIRE(::system(("mkdir -p " + dir).c_str()) == 0);
      const std::string pattern = dir + "/trace.json";
      std::vector<TraceRun> runs;
      {
        EnvVar e("SF_TRACE", pattern.c_str());
        const std::string url = "memory://" + uniqueName("trace");
        runs = runThreadRanks<TraceRun>(2, [&](int r) { return tracedWindows(r, url, 3, wire); });
      }
      for (int rank = 0; rank < 2; ++rank) {
        BOOST_TEST_CONTEXT("rank " << rank) {
          BOOST_REQUIRE_MESSAGE(runs[size_t(rank)].error.empty(), runs[size_t(rank)].error);
          const int64_t buckets = runs[size_t(rank)].buckets;
          BOOST_TEST(buckets == 6);
          const auto events = loadTrace(dir + "/trace.rank" + std::to_string(rank) + ".json");
          std::map<std::string, int> count;
          int passesInWindow = 0, lanesUsed = 0;
          int64_t wireBytes = 0;
          std::map<int, bool> lanes;
          std::map<int64_t, double> launchAt, finishAt;
          std::vector<TraceEvent> wires, windows, syncs;
          for (const auto& e : events) {
            BOOST_TEST(e.pid == rank);
            if (e.ph == "M") continue;
            ++count[e.name];
            if (e.name == "pass" && e.args.get<bool>("in_window")) ++passesInWindow;
            if (e.name == "launch") launchAt[e.args.get<int64_t>("bucket")] = e.ts;  // last window's
            if (e.name == "finish") finishAt[e.args.get<int64_t>("bucket")] = e.ts;
            if (e.name == "wire") {
              BOOST_TEST(e.tid >= 1);
              BOOST_TEST(e.tid <= 3);
              lanes[e.tid] = true;
              wireBytes += e.args.get<int64_t>("wire_bytes");
              wires.push_back(e);
            }
            if (e.name == "window") windows.push_back(e);
            if (e.name == "synchronize") syncs.push_back(e);
          }
          lanesUsed = int(lanes.size());
          BOOST_TEST(count["window"] == 2);
          BOOST_TEST(count["synchronize"] == 2);
          BOOST_TEST(count["pass"] == 6);
          BOOST_TEST(passesInWindow == 4);
          BOOST_TEST(count["launch"] == 2 * buckets);
          BOOST_TEST(count["finish"] == 2 * buckets);
          BOOST_TEST(count["wire"] == 2 * buckets);  // 1 MiB buckets: one piece each
          BOOST_TEST(lanesUsed == 3);
          // Every byte reduced went through a wire span, halved on a 16-bit
          // wire, plus the out-of-step check's two elements per window in
          // one bucket (float32 gradients: 4 bytes each, 2 on a 16-bit wire).
          const int64_t bytes = runs[size_t(rank)].bytes;
          const int64_t control = 2 * 2 * (wire == SF_DTYPE_FLOAT32 ? 4 : 2);
          BOOST_TEST(wireBytes == (wire == SF_DTYPE_FLOAT32 ? bytes : bytes / 2) + control);
          // Each synchronize lies in its window; the last window's wire spans
          // lie between their bucket's launch and finish.
          for (size_t w = 0; w < windows.size() && w < syncs.size(); ++w) {
            BOOST_TEST(syncs[w].ts >= windows[w].ts);
            BOOST_TEST(syncs[w].ts + syncs[w].dur <= windows[w].ts + windows[w].dur + 1);
          }
          for (const auto& e : wires) {
            if (e.ts < windows.back().ts) continue;
            const int64_t b = e.args.get<int64_t>("bucket");
            BOOST_TEST(e.ts >= launchAt[b] - 1);
            BOOST_TEST(e.ts + e.dur <= finishAt[b] + 1);
          }
          // Buckets in flight together: two lanes' spans overlap in time.
          bool overlap = false;
          for (const auto& a : wires) {
            for (const auto& b : wires) {
              if (a.tid != b.tid && a.ts < b.ts + b.dur && b.ts < a.ts + a.dur) overlap = true;
            }
          }
          BOOST_TEST(overlap);
        }
      }
      BOOST_REQUIRE(::system(("rm -rf " + dir).c_str()) == 0);
    }
  }
}

BOOST_AUTO_TEST_CASE(unwritable_path_is_a_warning_not_a_failure) {
  EnvVar e("SF_TRACE", "/nonexistent-dir/x/trace.json");
  sf_options o = rankOptions(0, 1, "");
  sf_context* ctx = nullptr;
  BOOST_REQUIRE(sf_create(&o, &ctx) == SF_OK);
  int64_t id;
  sf_add_gradient(ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
  BOOST_TEST(sf_synchronize(ctx) == SF_OK);
  sf_destroy(ctx);
}

BOOST_AUTO_TEST_SUITE_END()
