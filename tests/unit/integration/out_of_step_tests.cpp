// Ranks out of step: when one rank skipped or added an sf_synchronize, the
// next synchronization fails with SF_ERR_MISMATCH on every rank, naming both
// window numbers, without an extra collective per window (the numbers ride
// in one bucket's collective). Windows of different lengths on different
// ranks stay legal. Ranks are threads over Gloo (memory:// store).

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "plugin/core/dtype.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

// What a rank does in window w: its micro-batches, and whether it skips the
// synchronization or adds a second one.
struct Plan {
  std::vector<std::vector<int>> micro;  // [rank][window]
  int skipRank = -1, skipWindow = -1;   // this rank does not synchronize window skipWindow
  int extraRank = -1, extraWindow = -1; // this rank synchronizes window extraWindow twice
  bool gradReady = true;
  bool bracketEach = false;  // begin/end around each non-final micro-batch (DDP's no_sync idiom)
  bool flat = true;
  sf_dtype dtype = SF_DTYPE_FLOAT32;
  sf_reduce_op op = SF_REDUCE_AVERAGE;
  double prescale = 1.0;
  sf_dtype wire = SF_DTYPE_FLOAT32;  // SF_WIRE_DTYPE: float32 buckets may travel as 16 bits
  std::vector<sf_dtype> dtypes;  // per gradient (mixed layouts); empty: every gradient is `dtype`
  int laterSyncs = 0;  // after a failed synchronize, this many more windows and synchronizes
};

struct Outcome {
  sf_status status = SF_OK;
  std::string error;
  int failedAtSync = -1;  // index of the sf_synchronize call that failed
  std::vector<sf_status> later;  // statuses of the synchronizes after the failure
  std::vector<std::string> laterErrors;
  int64_t laterCollectives = 0;  // collectives the later synchronizes issued (none: the context is failed)
  std::vector<int64_t> collectivesPerSync;
  int64_t buckets = 0;
  double worst = 0;  // |gradient - expected| over all elements after each good sync
  int checked = 0;   // good synchronizes whose values were compared with the expected ones
};

constexpr int kGrads = 6;

Outcome runRank(const Plan& plan, int world, int rank, const std::string& rdv) {
  Outcome out;
  ContextHandle h;
  sf_options o = rankOptions(rank, world, rdv, 20000);
  o.bucket_cap_mb = 64.0 / 1048576.0;  // several buckets
  o.first_bucket_cap_mb = 32.0 / 1048576.0;
  o.reduce_op = plan.op;
  o.prescale = plan.prescale;
  o.wire_dtype = plan.wire;
  if (sf_create(&o, &h.ctx) != SF_OK) {
    out.status = SF_ERR_INTERNAL;
    out.error = sf_last_error();
    return out;
  }
  auto dtypeOf = [&](int g) { return plan.dtypes.empty() ? plan.dtype : plan.dtypes[size_t(g)]; };
  std::vector<std::vector<char>> own(static_cast<size_t>(kGrads));
  std::vector<char*> data(static_cast<size_t>(kGrads));
  for (int g = 0; g < kGrads; ++g) {
    const int64_t numel = 8 + g;
    int64_t id = -1;
    if (plan.flat) {
      sf_add_gradient(h.ctx, numel, dtypeOf(g), SF_DEVICE_HOST, nullptr, &id);
    } else {
      own[size_t(g)].assign(size_t(numel) * sfsync::dtypeSize(dtypeOf(g)), 0);
      sf_register_gradient(h.ctx, own[size_t(g)].data(), numel, dtypeOf(g), SF_DEVICE_HOST,
                           nullptr, &id);
    }
    if (id != g) {
      out.status = SF_ERR_INTERNAL;
      out.error = std::string("setup: ") + sf_last_error();
      return out;
    }
  }
  for (int g = 0; g < kGrads; ++g) {
    void* p = nullptr;
    if (sf_gradient_data(h.ctx, g, &p) != SF_OK) {
      out.status = SF_ERR_INTERNAL;
      out.error = std::string("setup: ") + sf_last_error();
      return out;
    }
    data[size_t(g)] = static_cast<char*>(p);
  }
  // Each micro-batch adds 1 to every element, on every rank.
  auto microBatch = [&](bool outside) {
    for (int g = kGrads - 1; g >= 0; --g) {
      for (int64_t i = 0; i < 8 + g; ++i) {
        char* e = data[size_t(g)] + size_t(i) * sfsync::dtypeSize(dtypeOf(g));
        switch (dtypeOf(g)) {
          case SF_DTYPE_FLOAT32: *reinterpret_cast<float*>(e) += 1.0f; break;
          case SF_DTYPE_FLOAT64: *reinterpret_cast<double*>(e) += 1.0; break;
          case SF_DTYPE_FLOAT16: {
            uint16_t* x = reinterpret_cast<uint16_t*>(e);
            *x = sfsync::floatToHalf(sfsync::halfToFloat(*x) + 1.0f);
            break;
          }
          default: {
            uint16_t* x = reinterpret_cast<uint16_t*>(e);
            *x = sfsync::floatToBf16(sfsync::bf16ToFloat(*x) + 1.0f);
            break;
          }
        }
      }
      if (plan.gradReady && sf_grad_ready(h.ctx, g) != SF_OK && out.status == SF_OK) {
        out.status = SF_ERR_INTERNAL;
        out.error = std::string("grad_ready: ") + sf_last_error();
      }
    }
    (void)outside;
  };
  auto value = [&](int g, int64_t i) {
    const char* e = data[size_t(g)] + size_t(i) * sfsync::dtypeSize(dtypeOf(g));
    switch (dtypeOf(g)) {
      case SF_DTYPE_FLOAT32: return double(*reinterpret_cast<const float*>(e));
      case SF_DTYPE_FLOAT64: return *reinterpret_cast<const double*>(e);
      case SF_DTYPE_FLOAT16: return double(sfsync::halfToFloat(*reinterpret_cast<const uint16_t*>(e)));
      default: return double(sfsync::bf16ToFloat(*reinterpret_cast<const uint16_t*>(e)));
    }
  };
  int syncs = 0;
  int64_t before = 0;  // collectives when the window began (hooks may start buckets early)
  auto synchronize = [&](double expected) {
    const sf_status st = sf_synchronize(h.ctx);
    if (st != SF_OK) {
      if (out.status == SF_OK) {
        out.status = st;
        out.error = sf_last_error();
        out.failedAtSync = syncs;
      }
      ++syncs;
      return false;
    }
    const int64_t now = statsOf(h.ctx).collectives_issued;
    out.collectivesPerSync.push_back(now - before);
    before = now;
    if (expected >= 0) ++out.checked;
    for (int g = 0; g < kGrads && expected >= 0; ++g) {
      for (int64_t i = 0; i < 8 + g; ++i) out.worst = std::fmax(out.worst, std::fabs(value(g, i) - expected));
    }
    ++syncs;
    return true;
  };
  const auto& micro = plan.micro[size_t(rank)];
  for (size_t w = 0; w < micro.size(); ++w) {
    const int n = micro[w];
    sf_zero_gradients(h.ctx);
    if (plan.bracketEach) {
      for (int k = 0; k < n - 1; ++k) {
        sf_begin_accumulation(h.ctx);
        microBatch(false);
        sf_end_accumulation(h.ctx);
      }
    } else {
      if (n > 1 && sf_begin_accumulation(h.ctx) != SF_OK) break;
      for (int k = 0; k < n - 1; ++k) microBatch(false);
      if (n > 1) sf_end_accumulation(h.ctx);
    }
    microBatch(true);
    if (rank == plan.skipRank && int(w) == plan.skipWindow) continue;
    // Every element holds micro[r][w] on rank r: after the reduction, the sum
    // over the ranks (divided by the world size for an average). Checked in
    // every window that all ranks synchronize in step (before a skip or an
    // extra synchronization).
    double expected = -1;
    double total = 0;
    bool all = true;
    for (const auto& m : plan.micro) {
      all = all && m.size() > w;
      if (m.size() > w) total += m[w];
    }
    const bool inStep = (plan.skipRank < 0 || int(w) < plan.skipWindow) &&
                        (plan.extraRank < 0 || int(w) <= plan.extraWindow);
    if (all && inStep) {
      if (plan.op == SF_REDUCE_AVERAGE) expected = total / world;
      if (plan.op == SF_REDUCE_SUM) expected = total;
      if (plan.op == SF_REDUCE_PRESCALED_SUM) expected = total * plan.prescale;
    }
    if (!synchronize(expected)) break;
    if (rank == plan.extraRank && int(w) == plan.extraWindow && !synchronize(-1)) break;
  }
  // A failed context stays failed: later windows and synchronizes (each
  // one must fail, with the first failure's status).
  const int64_t failedAt = statsOf(h.ctx).collectives_issued;
  for (int k = 0; k < plan.laterSyncs && out.status != SF_OK; ++k) {
    sf_zero_gradients(h.ctx);
    microBatch(true);
    out.later.push_back(sf_synchronize(h.ctx));
    out.laterErrors.push_back(sf_last_error());
  }
  out.laterCollectives = statsOf(h.ctx).collectives_issued - failedAt;
  out.buckets = statsOf(h.ctx).bucket_count;
  return out;
}

std::vector<Outcome> runPlan(const Plan& plan, int world) {
  const std::string rdv = "memory://" + uniqueName("step");
  return runThreadRanks<Outcome>(world, [&](int r) { return runRank(plan, world, r, rdv); });
}

// Every rank failed with SF_ERR_MISMATCH naming both window numbers.
void expectOutOfStep(const std::vector<Outcome>& outcomes, int64_t lo, int64_t hi) {
  const std::string range = "from " + std::to_string(lo) + " to " + std::to_string(hi);
  for (size_t r = 0; r < outcomes.size(); ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST(outcomes[r].status == SF_ERR_MISMATCH, outcomes[r].error);
      BOOST_TEST(outcomes[r].error.find("out of step") != std::string::npos, outcomes[r].error);
      BOOST_TEST(outcomes[r].error.find(range) != std::string::npos, outcomes[r].error);
    }
  }
}

void expectClean(const std::vector<Outcome>& outcomes, size_t syncs) {
  for (size_t r = 0; r < outcomes.size(); ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST_REQUIRE(outcomes[r].status == SF_OK, outcomes[r].error);
      BOOST_TEST(outcomes[r].collectivesPerSync.size() == syncs);
      BOOST_TEST(outcomes[r].buckets > 1);
      // One collective per bucket per window: the check adds none.
      for (int64_t c : outcomes[r].collectivesPerSync) BOOST_TEST(c == outcomes[r].buckets);
      BOOST_TEST(outcomes[r].checked == int(syncs));  // every window's values were compared
      BOOST_TEST(outcomes[r].worst == 0.0);
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(out_of_step_tests)

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_in_step_runs_are_unaffected) {
  for (bool hooks : {true, false}) {
    for (bool flat : {true, false}) {
      BOOST_TEST_CONTEXT((hooks ? "hooks" : "no hooks") << ", " << (flat ? "flat" : "host buffers")) {
        Plan p;
        p.micro = {{3, 1, 2, 4}, {3, 1, 2, 4}};
        p.gradReady = hooks;
        p.flat = flat;
        expectClean(runPlan(p, 2), 4);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_every_dtype_and_reduce_op_in_step) {
  // The window-check elements are excluded from averaging and pre-scaling: every
  // gradient element, in the control bucket too, is exactly as expected.
  for (sf_dtype d : {SF_DTYPE_FLOAT32, SF_DTYPE_FLOAT64, SF_DTYPE_FLOAT16, SF_DTYPE_BFLOAT16}) {
    for (sf_reduce_op op : {SF_REDUCE_AVERAGE, SF_REDUCE_SUM, SF_REDUCE_PRESCALED_SUM}) {
      BOOST_TEST_CONTEXT("dtype " << d << ", op " << op) {
        Plan p;
        p.micro = {{2, 1, 3}, {2, 1, 3}};
        p.dtype = d;
        p.op = op;
        p.prescale = 0.25;
        expectClean(runPlan(p, 2), 3);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_uneven_window_lengths_stay_legal) {
  // Uneven data at an epoch's end: different lengths per rank, 1 included
  // (no sf_begin_accumulation at all), with and without grad-ready reports.
  for (bool hooks : {true, false}) {
    for (bool flat : {true, false}) {
      BOOST_TEST_CONTEXT((hooks ? "hooks" : "no hooks") << ", " << (flat ? "flat" : "host buffers")) {
        Plan p;
        p.micro = {{4, 1, 2, 1, 5}, {1, 3, 1, 2, 2}};
        p.gradReady = hooks;
        p.flat = flat;
        expectClean(runPlan(p, 2), 5);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_micro_batches_bracketed_one_by_one_stay_legal) {
  // A host with grad-ready hooks that brackets each non-final micro-batch on
  // its own (PyTorch's no_sync idiom): consecutive windows with no pass
  // between them are one window, also with uneven counts per rank.
  Plan p;
  p.micro = {{3, 1, 4, 2}, {2, 2, 1, 5}};
  p.bracketEach = true;
  expectClean(runPlan(p, 2), 4);
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_one_skips_a_synchronize) {
  for (bool flat : {true, false}) {
    BOOST_TEST_CONTEXT((flat ? "flat" : "host buffers")) {
      // Rank 1 skips window 1's synchronization (a host without grad-ready
      // reports: with them, its early launches would fail its next begin).
      Plan p;
      p.micro = {{2, 2, 2, 2}, {2, 2, 2, 2}};
      p.gradReady = false;
      p.flat = flat;
      p.skipRank = 1;
      p.skipWindow = 1;
      auto out = runPlan(p, 2);
      // Rank 0's second synchronization is window 2, rank 1's is window 3.
      expectOutOfStep(out, 2, 3);
      BOOST_TEST(out[0].failedAtSync == 1);
      BOOST_TEST(out[1].failedAtSync == 1);
      BOOST_TEST(out[1].error.find("synchronizing window 3") != std::string::npos, out[1].error);
      BOOST_TEST(out[0].error.find("synchronizing window 2") != std::string::npos, out[0].error);
    }
  }
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_16_bit_wire_detects_a_skipped_synchronize) {
  // On a bf16 or fp16 wire the check's elements travel as 16 bits too: the
  // modulus must fit that type, not float32.
  for (sf_dtype wire : {SF_DTYPE_BFLOAT16, SF_DTYPE_FLOAT16}) {
    BOOST_TEST_CONTEXT("wire " << wire) {
      Plan p;
      p.micro = {{2, 2, 2, 2}, {2, 2, 2, 2}};
      p.gradReady = false;
      p.wire = wire;
      p.skipRank = 1;
      p.skipWindow = 1;
      auto out = runPlan(p, 2);
      expectOutOfStep(out, 2, 3);
    }
  }
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_one_adds_a_synchronize) {
  for (bool flat : {true, false}) {
    BOOST_TEST_CONTEXT((flat ? "flat" : "host buffers")) {
      Plan p;
      p.micro = {{2, 1, 2, 2}, {2, 1, 2, 2}};
      p.flat = flat;
      p.extraRank = 0;
      p.extraWindow = 0;
      auto out = runPlan(p, 2);
      // Rank 0's extra synchronization claims window 1 again; rank 1 is at 2.
      expectOutOfStep(out, 1, 2);
      BOOST_TEST(out[0].failedAtSync == 1);
      BOOST_TEST(out[1].failedAtSync == 1);
    }
  }
}

BOOST_AUTO_TEST_CASE(four_ranks_gloo_threads_one_skips_and_one_adds) {
  {
    Plan p;
    p.micro = std::vector<std::vector<int>>(4, {3, 2, 2});
    p.gradReady = false;
    p.skipRank = 2;
    p.skipWindow = 0;
    expectOutOfStep(runPlan(p, 4), 1, 2);
  }
  {
    Plan p;
    p.micro = std::vector<std::vector<int>>(4, {3, 2, 2});
    p.flat = false;
    p.extraRank = 3;
    p.extraWindow = 1;
    expectOutOfStep(runPlan(p, 4), 2, 3);
  }
}

BOOST_AUTO_TEST_CASE(four_ranks_gloo_threads_16_bit_layouts_detect_too) {
  for (sf_dtype d : {SF_DTYPE_FLOAT16, SF_DTYPE_BFLOAT16}) {
    BOOST_TEST_CONTEXT("dtype " << d) {
      Plan p;
      p.micro = std::vector<std::vector<int>>(4, {2, 2, 2});
      p.dtype = d;
      p.extraRank = 1;
      p.extraWindow = 0;
      expectOutOfStep(runPlan(p, 4), 1, 2);
    }
  }
}

BOOST_AUTO_TEST_CASE(a_failed_check_fails_every_later_synchronize) {
  // Rank 1 adds a synchronization in window 1; both ranks then keep going:
  // three more windows each, every synchronize fails the same way, at once.
  Plan p;
  p.micro = {{2, 2, 2, 2}, {2, 2, 2, 2}};
  p.extraRank = 1;
  p.extraWindow = 1;
  p.laterSyncs = 3;
  const auto out = runPlan(p, 2);
  expectOutOfStep(out, 2, 3);
  for (size_t r = 0; r < out.size(); ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST_REQUIRE(out[r].later.size() == 3u);
      for (size_t k = 0; k < out[r].later.size(); ++k) {
        BOOST_TEST(out[r].later[k] == SF_ERR_MISMATCH, out[r].laterErrors[k]);
        // The first failure's error, said again at once ("failed earlier").
        BOOST_TEST(out[r].laterErrors[k].find("failed earlier") != std::string::npos, out[r].laterErrors[k]);
        BOOST_TEST(out[r].laterErrors[k].find("out of step") != std::string::npos, out[r].laterErrors[k]);
      }
      BOOST_TEST(out[r].laterCollectives == 0);
    }
  }
}

BOOST_AUTO_TEST_CASE(four_ranks_gloo_threads_bfloat16_more_windows_than_the_modulus) {
  // A bfloat16 layout on 4 ranks compares window numbers modulo p = 9: 14
  // windows of uneven lengths wrap the numbers (no false alarm, every value
  // checked), and a skip after the wrap is still found, naming the real
  // window numbers (not their residues).
  const std::vector<std::vector<int>> micro = {{1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2},
                                               {3, 1, 1, 2, 2, 1, 3, 1, 1, 2, 2, 1, 3, 1},
                                               {2, 2, 1, 1, 3, 2, 2, 2, 1, 1, 3, 2, 2, 2},
                                               {1, 1, 2, 3, 1, 1, 1, 1, 2, 3, 1, 1, 1, 1}};
  for (bool flat : {true, false}) {
    BOOST_TEST_CONTEXT((flat ? "flat" : "host buffers")) {
      Plan p;
      p.micro = micro;
      p.flat = flat;
      p.gradReady = false;
      p.dtype = SF_DTYPE_BFLOAT16;
      expectClean(runPlan(p, 4), 14);
      p.skipRank = 2;
      p.skipWindow = 11;
      auto out = runPlan(p, 4);
      expectOutOfStep(out, 12, 13);
      for (size_t r = 0; r < out.size(); ++r) BOOST_TEST(out[r].failedAtSync == 11);
    }
  }
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_mixed_dtypes) {
  // One layout of all four dtypes: the check rides in one host bucket, the
  // values of every dtype are as expected with uneven lengths, and a skip or
  // an extra synchronization is found.
  Plan p;
  p.micro = {{3, 1, 2, 4, 1}, {1, 2, 2, 1, 3}};
  p.dtypes = {SF_DTYPE_FLOAT32, SF_DTYPE_BFLOAT16, SF_DTYPE_FLOAT16,
              SF_DTYPE_FLOAT64, SF_DTYPE_BFLOAT16, SF_DTYPE_FLOAT32};
  for (sf_reduce_op op : {SF_REDUCE_AVERAGE, SF_REDUCE_SUM}) {
    BOOST_TEST_CONTEXT("op " << op) {
      p.op = op;
      expectClean(runPlan(p, 2), 5);
    }
  }
  Plan skip = p;
  skip.gradReady = false;
  skip.skipRank = 0;
  skip.skipWindow = 2;
  expectOutOfStep(runPlan(skip, 2), 3, 4);
  Plan extra = p;
  extra.extraRank = 1;
  extra.extraWindow = 3;
  expectOutOfStep(runPlan(extra, 2), 4, 5);
}

BOOST_AUTO_TEST_SUITE_END()
