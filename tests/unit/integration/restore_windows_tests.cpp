// sf_restore_windows through the ABI (plugin/orchestrator/context.cpp,
// window_clock.h): a resumed run continues the saved run's window count in
// sf_stats.windows_completed and in the out-of-step check's numbers; bad
// counts and late calls are refused with a message; ranks that restore
// different counts fail their first synchronization on every rank with the
// out-of-step error, within the timeout. Ranks are threads over Gloo
// (memory:// store), or one rank alone.

#include <boost/test/unit_test.hpp>

#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

constexpr int64_t kNumel[] = {8, 5};  // two float32 gradients

// What one rank saw: the restore's status and message, each
// synchronization's status and message (a failed one ends the run), the
// values and stats at the end, and how long the run took.
struct RankRun {
  sf_status restore = SF_OK;
  std::string restoreError;
  std::vector<sf_status> syncs;
  std::string syncError;  // the first failed synchronization's message
  // The first failed sf_grad_ready's status and message: the last
  // micro-batch's hook starts the first bucket, and with it the first
  // synchronization's checks (the layout, the window numbers).
  sf_status readyStatus = SF_OK;
  std::string readyError;
  std::vector<float> values;  // every element of both gradients after the last good window
  sf_stats stats{};
  double seconds = 0;
  std::string setupError;
};

// Rank `rank` of `world` on `rdv`: restore `restore` (none when negative)
// right after sf_create, then `windows` windows of 2 micro-batches (rank r
// adds 1, then r + 1 to every element; grad-ready for each gradient in the
// last one), each synchronized; the rank `extraRank` synchronizes window
// `extraWindow` twice (out of step from then on).
RankRun runRank(int rank, int world, const std::string& rdv, int64_t restore, int windows,
                int extraRank = -1, int extraWindow = -1) {
  RankRun out;
  const auto t0 = std::chrono::steady_clock::now();
  ContextHandle h;
  sf_options o = rankOptions(rank, world, rdv, 10000);
  float* data[2] = {nullptr, nullptr};
  bool ok = sf_create(&o, &h.ctx) == SF_OK;
  for (int g = 0; ok && g < 2; ++g) {
    int64_t id = -1;
    ok = sf_add_gradient(h.ctx, kNumel[g], SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id) == SF_OK;
  }
  for (int g = 0; ok && g < 2; ++g) {
    void* p = nullptr;
    ok = sf_gradient_data(h.ctx, g, &p) == SF_OK;
    data[g] = static_cast<float*>(p);
  }
  if (!ok) {
    out.setupError = sf_last_error();
    return out;
  }
  if (restore >= 0) {
    out.restore = sf_restore_windows(h.ctx, restore);
    if (out.restore != SF_OK) out.restoreError = sf_last_error();
  }
  auto addAll = [&](float v) {
    for (int g = 0; g < 2; ++g) {
      for (int64_t i = 0; i < kNumel[g]; ++i) data[g][i] += v;
    }
  };
  auto synchronize = [&] {
    const sf_status st = sf_synchronize(h.ctx);
    out.syncs.push_back(st);
    if (st != SF_OK && out.syncError.empty()) out.syncError = sf_last_error();
    return st == SF_OK;
  };
  for (int w = 0; w < windows; ++w) {
    sf_zero_gradients(h.ctx);
    sf_begin_accumulation(h.ctx);
    addAll(1.0f);
    sf_end_accumulation(h.ctx);
    addAll(float(rank + 1));
    for (int g = 1; g >= 0; --g) {
      const sf_status st = sf_grad_ready(h.ctx, g);
      if (st != SF_OK && out.readyStatus == SF_OK) {
        out.readyStatus = st;
        out.readyError = sf_last_error();
      }
    }
    if (!synchronize()) break;
    out.values.assign(data[0], data[0] + kNumel[0]);
    out.values.insert(out.values.end(), data[1], data[1] + kNumel[1]);
    if (rank == extraRank && w == extraWindow && !synchronize()) break;
  }
  out.stats = statsOf(h.ctx);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

std::vector<RankRun> runRanks(const std::vector<int64_t>& restores, int windows,
                              int extraRank = -1, int extraWindow = -1) {
  const std::string rdv = "memory://" + uniqueName("restore");
  const int world = int(restores.size());
  return runThreadRanks<RankRun>(world, [&](int r) {
    return runRank(r, world, rdv, restores[size_t(r)], windows, extraRank, extraWindow);
  });
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A context of one rank with one gradient.
struct Alone {
  ContextHandle h;
  Alone() {
    sf_options o = rankOptions(0, 1, "");
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK, sf_last_error());
    int64_t id = -1;
    BOOST_TEST_REQUIRE(sf_add_gradient(h.ctx, 4, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "w", &id) == SF_OK);
  }
};

}  // namespace

BOOST_AUTO_TEST_SUITE(restore_windows_tests)

// The count goes on from the restored one: 3 windows after restoring 41 are
// windows_completed 44; windows_begun counts this context's begins only.
BOOST_AUTO_TEST_CASE(one_rank_windows_completed_continues_from_the_restored_count) {
  const auto runs = runRanks({41}, 3);
  const RankRun& r = runs[0];
  BOOST_TEST_REQUIRE(r.setupError == "");
  BOOST_TEST(r.restore == SF_OK, r.restoreError);
  BOOST_TEST(r.syncs == (std::vector<sf_status>{SF_OK, SF_OK, SF_OK}), r.syncError);
  BOOST_TEST(r.stats.windows_completed == 44);
  BOOST_TEST(r.stats.windows_begun == 3);
}

BOOST_AUTO_TEST_CASE(restore_is_read_back_by_sf_get_stats_at_once) {
  Alone a;
  BOOST_TEST(statsOf(a.h.ctx).windows_completed == 0);
  BOOST_TEST(sf_restore_windows(a.h.ctx, 12345678901LL) == SF_OK, sf_last_error());
  BOOST_TEST(statsOf(a.h.ctx).windows_completed == 12345678901LL);
  // A second call before the first window replaces the first.
  BOOST_TEST(sf_restore_windows(a.h.ctx, 9) == SF_OK, sf_last_error());
  BOOST_TEST(statsOf(a.h.ctx).windows_completed == 9);
  BOOST_TEST(sf_restore_windows(a.h.ctx, 0) == SF_OK, sf_last_error());
  BOOST_TEST(statsOf(a.h.ctx).windows_completed == 0);
  // Building the buckets is set-up, not a window: still allowed.
  BOOST_TEST(sf_build_buckets(a.h.ctx) == SF_OK, sf_last_error());
  BOOST_TEST(sf_restore_windows(a.h.ctx, 3) == SF_OK, sf_last_error());
  BOOST_TEST(sf_synchronize(a.h.ctx) == SF_OK, sf_last_error());
  BOOST_TEST(statsOf(a.h.ctx).windows_completed == 4);
}

BOOST_AUTO_TEST_CASE(a_negative_count_is_an_invalid_argument_naming_it) {
  for (int64_t bad : {int64_t(-1), int64_t(-42), std::numeric_limits<int64_t>::min()}) {
    BOOST_TEST_CONTEXT("windows_completed = " << bad) {
      Alone a;
      BOOST_TEST(sf_restore_windows(a.h.ctx, bad) == SF_ERR_INVALID_ARGUMENT);
      const std::string e = sf_last_error();
      BOOST_TEST(contains(e, "sf_restore_windows: "), e);
      BOOST_TEST(contains(e, "windows_completed = " + std::to_string(bad) + " is negative"), e);
      // Nothing changed: the first window is still window 1 / completed 1.
      BOOST_TEST(statsOf(a.h.ctx).windows_completed == 0);
      BOOST_TEST(sf_synchronize(a.h.ctx) == SF_OK, sf_last_error());
      BOOST_TEST(statsOf(a.h.ctx).windows_completed == 1);
    }
  }
  BOOST_TEST(sf_restore_windows(nullptr, 3) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(contains(sf_last_error(), "sf_restore_windows: ctx is NULL"), sf_last_error());
}

// After the first window call, synchronization (also a failed one) the
// count cannot change: SF_ERR_INVALID_STATE saying when to call it, and
// the stats as they were.
BOOST_AUTO_TEST_CASE(a_call_after_the_first_window_or_synchronization_is_too_late) {
  const char* cases[] = {"begin", "grad_ready", "synchronize", "failed synchronize"};
  for (const char* what : cases) {
    BOOST_TEST_CONTEXT(what) {
      const std::string w = what;
      ContextHandle h;
      sf_options o = rankOptions(0, 1, "");
      BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
      if (w == "failed synchronize") {
        // No gradient registered: the synchronization fails, but it ran.
        BOOST_TEST(sf_synchronize(h.ctx) == SF_ERR_INVALID_STATE);
      } else {
        int64_t id = -1;
        BOOST_TEST_REQUIRE(sf_add_gradient(h.ctx, 4, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "w", &id) == SF_OK);
        if (w == "begin") BOOST_TEST(sf_begin_accumulation(h.ctx) == SF_OK);
        if (w == "grad_ready") BOOST_TEST(sf_grad_ready(h.ctx, id) == SF_OK);
        if (w == "synchronize") BOOST_TEST(sf_synchronize(h.ctx) == SF_OK);
      }
      const sf_stats before = statsOf(h.ctx);
      BOOST_TEST(sf_restore_windows(h.ctx, 10) == SF_ERR_INVALID_STATE);
      const std::string e = sf_last_error();
      BOOST_TEST(contains(e, "sf_restore_windows: too late to restore windows_completed = 10"), e);
      BOOST_TEST(contains(e, "right after sf_create, before training resumes"), e);
      BOOST_TEST(statsOf(h.ctx).windows_completed == before.windows_completed);
    }
  }
}

// Both ranks restore 100: the windows are in step, reduce as usual, and the
// out-of-step check numbers them 101, 102, ...: rank 1 adds a
// synchronization in the second window (102 again) while rank 0 goes on to
// 103, and both fail naming those numbers. Broken restore of the number
// (the count only): the range would read "from 2 to 3".
BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_same_restore_continue_in_step_from_it) {
  const auto runs = runRanks({100, 100}, 3, /*extraRank=*/1, /*extraWindow=*/1);
  for (size_t r = 0; r < runs.size(); ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST_REQUIRE(runs[r].setupError == "");
      BOOST_TEST(runs[r].restore == SF_OK, runs[r].restoreError);
      BOOST_TEST_REQUIRE(runs[r].syncs.size() == 3u);
      BOOST_TEST(runs[r].syncs[0] == SF_OK);
      BOOST_TEST(runs[r].syncs[1] == SF_OK);
      BOOST_TEST(runs[r].syncs[2] == SF_ERR_MISMATCH, runs[r].syncError);
      BOOST_TEST(contains(runs[r].syncError, "out of step"), runs[r].syncError);
      BOOST_TEST(contains(runs[r].syncError, "range from 102 to 103"), runs[r].syncError);
      BOOST_TEST(runs[r].stats.windows_completed == 102);
      // Windows 101 and 102 averaged: (1 + 1) + (1 + 2) over 2 ranks.
      BOOST_TEST_REQUIRE(runs[r].values.size() == 13u);
      for (float v : runs[r].values) BOOST_TEST(v == 2.5f);
    }
  }
  BOOST_TEST(contains(runs[0].syncError, "synchronizing window 103"), runs[0].syncError);
  BOOST_TEST(contains(runs[1].syncError, "synchronizing window 102"), runs[1].syncError);
}

// Rank 0 restores 5, rank 1 restores 7: the first synchronization fails on
// both with the out-of-step error naming 6 and 8, well within the timeout
// (10 s), before any bucket collective. Here the hook of the last
// micro-batch starts the first bucket, so sf_grad_ready reports it first and
// sf_synchronize then returns the same error (the context failed). Also for
// counts p = 2897 apart (float32 on 2 ranks), which the modulo-p window
// check alone would pass: the first synchronization compares the numbers
// exactly.
BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_different_restores_fail_the_first_synchronization) {
  struct Case {
    int64_t r0, r1;
  };
  for (const Case c : {Case{5, 7}, Case{5, 5 + 2897}, Case{0, 1}}) {
    BOOST_TEST_CONTEXT("restored " << c.r0 << " and " << c.r1) {
      const auto runs = runRanks({c.r0, c.r1}, 2);
      const std::string range =
          "range from " + std::to_string(c.r0 + 1) + " to " + std::to_string(c.r1 + 1);
      for (size_t r = 0; r < runs.size(); ++r) {
        BOOST_TEST_CONTEXT("rank " << r) {
          BOOST_TEST_REQUIRE(runs[r].setupError == "");
          BOOST_TEST(runs[r].restore == SF_OK, runs[r].restoreError);
          BOOST_TEST_REQUIRE(runs[r].syncs.size() == 1u);  // the first one failed
          BOOST_TEST(runs[r].readyStatus == SF_ERR_MISMATCH, runs[r].readyError);
          BOOST_TEST(contains(runs[r].readyError, "sf_grad_ready: ranks are out of step"),
                     runs[r].readyError);
          BOOST_TEST(contains(runs[r].readyError, range), runs[r].readyError);
          BOOST_TEST(contains(runs[r].readyError, "sf_restore_windows"), runs[r].readyError);
          BOOST_TEST(runs[r].syncs[0] == SF_ERR_MISMATCH, runs[r].syncError);
          BOOST_TEST(contains(runs[r].syncError, "sf_synchronize: "), runs[r].syncError);
          BOOST_TEST(contains(runs[r].syncError, "ranks are out of step"), runs[r].syncError);
          BOOST_TEST(contains(runs[r].syncError, range), runs[r].syncError);
          BOOST_TEST(runs[r].stats.windows_completed == (r == 0 ? c.r0 : c.r1));
          BOOST_TEST(runs[r].stats.collectives_issued == 0);  // caught before any bucket
          BOOST_TEST(runs[r].seconds < 8.0);
        }
      }
      BOOST_TEST(contains(runs[0].syncError, "synchronizing window " + std::to_string(c.r0 + 1)));
      BOOST_TEST(contains(runs[1].syncError, "synchronizing window " + std::to_string(c.r1 + 1)));
    }
  }
}

// The same without hooks (no sf_grad_ready): sf_synchronize itself starts
// the buckets, and fails with the out-of-step error on both ranks.
BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_different_restores_fail_in_sf_synchronize_without_hooks) {
  const std::string rdv = "memory://" + uniqueName("restore-nohooks");
  const auto runs = runThreadRanks<RankRun>(2, [&](int r) {
    RankRun out;
    ContextHandle h;
    sf_options o = rankOptions(r, 2, rdv, 10000);
    int64_t id = -1;
    if (sf_create(&o, &h.ctx) != SF_OK ||
        sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT64, SF_DEVICE_HOST, "w", &id) != SF_OK) {
      out.setupError = sf_last_error();
      return out;
    }
    out.restore = sf_restore_windows(h.ctx, r == 0 ? 1000 : 999);
    sf_begin_accumulation(h.ctx);
    sf_end_accumulation(h.ctx);
    out.syncs.push_back(sf_synchronize(h.ctx));
    out.syncError = sf_last_error();
    out.stats = statsOf(h.ctx);
    return out;
  });
  for (size_t r = 0; r < runs.size(); ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST_REQUIRE(runs[r].setupError == "");
      BOOST_TEST(runs[r].restore == SF_OK);
      BOOST_TEST(runs[r].syncs[0] == SF_ERR_MISMATCH, runs[r].syncError);
      BOOST_TEST(contains(runs[r].syncError, "sf_synchronize: ranks are out of step: this rank is "
                                             "synchronizing window " +
                                                 std::to_string(r == 0 ? 1001 : 1000) +
                                                 ", the ranks' window numbers range from 1000 to "
                                                 "1001"),
                 runs[r].syncError);
      BOOST_TEST(runs[r].stats.windows_completed == (r == 0 ? 1000 : 999));
    }
  }
}

// sf_count_window (Since 0.5): a host that reduces its windows itself (DDP's
// comm hook under sfsync.torch's attach) has them counted where every
// window count lives. Each call is one window completed, after a restored
// count too; inside a window, on a context with registered gradients, or on
// NULL: refused, naming why, and nothing counted.
BOOST_AUTO_TEST_CASE(count_window_counts_a_window_the_host_reduced) {
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK, sf_last_error());
  BOOST_TEST(sf_restore_windows(h.ctx, 7) == SF_OK, sf_last_error());
  for (int64_t w = 8; w <= 10; ++w) {
    BOOST_TEST(sf_begin_accumulation(h.ctx) == SF_OK);  // the window's local passes
    BOOST_TEST(sf_count_window(h.ctx) == SF_ERR_INVALID_STATE);
    const std::string e = sf_last_error();
    BOOST_TEST(contains(e, "sf_count_window: sf_count_window inside an accumulation window"), e);
    BOOST_TEST(sf_end_accumulation(h.ctx) == SF_OK);
    BOOST_TEST(statsOf(h.ctx).windows_completed == w - 1);
    BOOST_TEST(sf_count_window(h.ctx) == SF_OK, sf_last_error());  // its last pass went to the host
    BOOST_TEST(statsOf(h.ctx).windows_completed == w);
  }
  // Too late to restore now: the clock has run.
  BOOST_TEST(sf_restore_windows(h.ctx, 3) == SF_ERR_INVALID_STATE);
  BOOST_TEST(sf_count_window(nullptr) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(contains(sf_last_error(), "sf_count_window: ctx is NULL"), sf_last_error());

  // A context that reduces gradients counts its windows at sf_synchronize.
  Alone a;
  BOOST_TEST(sf_count_window(a.h.ctx) == SF_ERR_INVALID_STATE);
  const std::string e = sf_last_error();
  BOOST_TEST(contains(e, "with 1 registered gradients: sf_synchronize reduces and counts"), e);
  BOOST_TEST(statsOf(a.h.ctx).windows_completed == 0);
  BOOST_TEST(sf_synchronize(a.h.ctx) == SF_OK, sf_last_error());
  BOOST_TEST(statsOf(a.h.ctx).windows_completed == 1);
}

BOOST_AUTO_TEST_SUITE_END()
