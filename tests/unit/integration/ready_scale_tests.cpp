// The average scaled at grad-ready (Reducer::readyScaleOf, since 0.5): at a
// power-of-two world size each host gradient is multiplied by 1 / W as it is
// reported ready and its bucket sums, which must give the bits of "sum, then
// divide" in every way a window can go: every gradient reported, none
// (sf_synchronize starts them), some, window after window, and a window begun
// after reports that no synchronization followed. Ranks as threads over
// Gloo (memory://).

#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

constexpr int kGrads = 6;
constexpr int64_t kNumel = 1000;  // 4000 bytes (float32): cap 0.005 MB, about one per bucket

// Rank r's value of element i of gradient g in window w. Two ranks: a full
// float32 mantissa (the sum rounds; x / 2 does not). More ranks: multiples of
// 2^-12 below 2^8, so that every order of the ring's additions is exact.
double value(int world, int rank, int window, int g, int64_t i) {
  uint64_t x = 0x9e3779b97f4a7c15ULL * uint64_t(1 + rank + 7 * window + 131 * g) + uint64_t(i);
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 29;
  const double unit = double(x >> 11) / double(uint64_t(1) << 53) - 0.5;  // [-0.5, 0.5)
  if (world == 2) return double(float(unit * 3.0));
  return double(int64_t(unit * (1 << 20))) / double(1 << 12);
}

enum class Report { kAll, kNone, kEven };

struct RankResult {
  sf_status status = SF_OK;
  std::string error;
  std::vector<std::vector<float>> grads;  // [window * kGrads + g]: after sf_synchronize
  std::vector<std::vector<double>> grads64;
};

// Three windows of one micro-batch each; `restart`: window 1 first reports
// every even gradient ready, then begins a window (no synchronization
// between), adds a second micro-batch into every gradient, ends it and
// synchronizes.
RankResult runRank(int rank, int world, const std::string& rdv, Report report, bool restart) {
  RankResult out;
  sf_options o = rankOptions(rank, world, rdv);
  ContextHandle h;
  sf_status st = sf_create(&o, &h.ctx);
  if (st == SF_OK) st = sf_set_bucket_cap_mb(h.ctx, 0.005);
  std::vector<int64_t> ids(kGrads);
  for (int g = 0; g < kGrads && st == SF_OK; ++g) {
    const sf_dtype dt = g % 3 == 2 ? SF_DTYPE_FLOAT64 : SF_DTYPE_FLOAT32;
    st = sf_add_gradient(h.ctx, kNumel, dt, SF_DEVICE_HOST, nullptr, &ids[size_t(g)]);
  }
  if (st == SF_OK) st = sf_build_buckets(h.ctx);
  std::vector<void*> data(kGrads);
  for (int g = 0; g < kGrads && st == SF_OK; ++g) st = sf_gradient_data(h.ctx, ids[size_t(g)], &data[size_t(g)]);
  auto fill = [&](int w, bool add) {
    for (int g = 0; g < kGrads; ++g) {
      for (int64_t i = 0; i < kNumel; ++i) {
        const double v = value(world, rank, w + (add ? 100 : 0), g, i);
        if (g % 3 == 2) {
          double* p = static_cast<double*>(data[size_t(g)]);
          p[i] = add ? p[i] + v : v;
        } else {
          float* p = static_cast<float*>(data[size_t(g)]);
          p[i] = add ? float(p[i] + float(v)) : float(v);
        }
      }
    }
  };
  for (int w = 0; w < 3 && st == SF_OK; ++w) {
    fill(w, false);
    if (restart && w == 1) {
      for (int g = 0; g < kGrads && st == SF_OK; g += 2) st = sf_grad_ready(h.ctx, ids[size_t(g)]);
      if (st == SF_OK) st = sf_begin_accumulation(h.ctx);
      fill(w, true);
      if (st == SF_OK) st = sf_end_accumulation(h.ctx);
    } else {
      // Bucket order is the reverse of registration: report in that order.
      for (int g = kGrads - 1; g >= 0 && st == SF_OK; --g) {
        if (report == Report::kAll || (report == Report::kEven && g % 2 == 0)) {
          st = sf_grad_ready(h.ctx, ids[size_t(g)]);
        }
      }
    }
    if (st == SF_OK) st = sf_synchronize(h.ctx);
    for (int g = 0; g < kGrads && st == SF_OK; ++g) {
      if (g % 3 == 2) {
        const double* p = static_cast<const double*>(data[size_t(g)]);
        out.grads64.emplace_back(p, p + kNumel);
        out.grads.emplace_back();
      } else {
        const float* p = static_cast<const float*>(data[size_t(g)]);
        out.grads.emplace_back(p, p + kNumel);
        out.grads64.emplace_back();
      }
    }
  }
  out.status = st;
  if (st != SF_OK) out.error = sf_last_error();
  return out;
}

// What "sum over ranks, then divide by W" gives, in each gradient's dtype.
void checkAgainstSumThenDivide(int world, const std::vector<RankResult>& runs, bool restart) {
  for (int r = 0; r < world; ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      const RankResult& run = runs[size_t(r)];
      BOOST_TEST_REQUIRE(run.status == SF_OK, run.error);
      int64_t wrong = 0;
      std::string first;
      for (int w = 0; w < 3; ++w) {
        for (int g = 0; g < kGrads; ++g) {
          for (int64_t i = 0; i < kNumel; ++i) {
            double sum64 = 0;
            float sum32 = 0;
            for (int q = 0; q < world; ++q) {
              double v = value(world, q, w, g, i);
              if (restart && w == 1) {
                v = g % 3 == 2 ? v + value(world, q, w + 100, g, i)
                               : double(float(float(v) + float(value(world, q, w + 100, g, i))));
              }
              sum64 += v;
              sum32 = float(sum32 + float(v));
            }
            const size_t k = size_t(w * kGrads + g);
            bool same;
            double got, want;
            if (g % 3 == 2) {
              got = run.grads64[k][size_t(i)];
              want = sum64 / world;
              same = std::memcmp(&got, &want, sizeof got) == 0;
            } else {
              const float g32 = run.grads[k][size_t(i)], w32 = float(sum32 / float(world));
              same = std::memcmp(&g32, &w32, sizeof g32) == 0;
              got = g32, want = w32;
            }
            if (!same && wrong++ == 0) {
              first = "window " + std::to_string(w) + ", gradient " + std::to_string(g) +
                      ", element " + std::to_string(i) + ": " + std::to_string(got) +
                      " where the sum over ranks / " + std::to_string(world) + " is " +
                      std::to_string(want);
            }
          }
        }
      }
      BOOST_TEST(wrong == 0, wrong << " elements differ; the first: " << first);
    }
  }
}

void runAndCheck(int world, Report report, bool restart, const std::string& tag) {
  const std::string rdv = "memory://" + uniqueName(tag);
  auto runs = runThreadRanks<RankResult>(
      world, [&](int r) { return runRank(r, world, rdv, report, restart); });
  checkAgainstSumThenDivide(world, runs, restart);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(ready_scale_tests)

BOOST_AUTO_TEST_CASE(average_at_2_and_4_ranks_is_the_sum_over_w_bit_for_bit_however_reported) {
  for (int world : {2, 4}) {
    BOOST_TEST_CONTEXT("world " << world << ", every gradient reported") {
      runAndCheck(world, Report::kAll, false, "scale-all");
    }
    BOOST_TEST_CONTEXT("world " << world << ", none reported (sf_synchronize starts them)") {
      runAndCheck(world, Report::kNone, false, "scale-none");
    }
    BOOST_TEST_CONTEXT("world " << world << ", every other one reported") {
      runAndCheck(world, Report::kEven, false, "scale-even");
    }
  }
}

BOOST_AUTO_TEST_CASE(a_window_begun_after_unsynchronized_reports_sums_what_it_accumulated) {
  for (int world : {2, 4}) {
    BOOST_TEST_CONTEXT("world " << world) { runAndCheck(world, Report::kAll, true, "scale-restart"); }
  }
}

BOOST_AUTO_TEST_SUITE_END()
