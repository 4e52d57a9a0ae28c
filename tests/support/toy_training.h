#pragma once
// One rank of the toy trainer (samples/c/toy_model.h) on an sfsync context,
// recording per-window collective counts, plus the single-process reference.
// Used by the multi-rank suites with ranks as threads.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "sfsync.h"
#include "tests/support/thread_ranks.h"
#include "toy_model.h"

namespace sftest {

struct Scenario {
  int world = 2;
  std::vector<int> micro = {4, 4, 4};  // micro-batches per window
  toy_model model{16, 8, 6, 4};        // 6 blocks of 512 B + a 192 B bias = 3264 B
  double capMb = 25, firstCapMb = 1;
  bool flat = true;       // plugin-owned flat buffer, else host buffers
  bool gradReady = true;  // report grad-ready in every micro-batch
};

// 4 buckets for the default model: [bias] [W5 W4] [W3 W2] [W1 W0].
constexpr double kSmallCapMb = 1024.0 / 1048576.0;
constexpr double kSmallFirstCapMb = 512.0 / 1048576.0;

struct RankRun {
  sf_status status = SF_OK;
  std::string error;
  std::vector<std::vector<float>> params;
  std::vector<int64_t> inside, atSync, bytes, early;  // per window
  sf_stats stats{};
};

inline RankRun trainRank(const Scenario& sc, int rank, const std::string& rendezvous) {
  RankRun run;
  auto check = [&](sf_status st) {
    if (st != SF_OK && run.status == SF_OK) {
      run.status = st;
      run.error = sf_last_error();
    }
    return st == SF_OK;
  };
  const toy_model* m = &sc.model;
  const int np = toy_param_count(m);
  sf_options o = rankOptions(rank, sc.world, rendezvous);
  o.bucket_cap_mb = sc.capMb;
  o.first_bucket_cap_mb = sc.firstCapMb;
  ContextHandle h;
  if (!check(sf_create(&o, &h.ctx))) return run;
  run.params.resize(size_t(np));
  std::vector<std::vector<float>> own(static_cast<size_t>(np));
  std::vector<float*> params(static_cast<size_t>(np)), grads(static_cast<size_t>(np));
  for (int p = 0; p < np; ++p) {
    run.params[size_t(p)].resize(size_t(toy_param_numel(m, p)));
    params[size_t(p)] = run.params[size_t(p)].data();
    int64_t id = -1;
    if (sc.flat) {
      check(sf_add_gradient(h.ctx, toy_param_numel(m, p), SF_DTYPE_FLOAT32, SF_DEVICE_HOST,
                            nullptr, &id));
    } else {
      own[size_t(p)].assign(size_t(toy_param_numel(m, p)), 0.0f);
      check(sf_register_gradient(h.ctx, own[size_t(p)].data(), toy_param_numel(m, p),
                                 SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id));
    }
    if (id != p) return run;
  }
  for (int p = 0; p < np; ++p) {
    if (!check(sf_gradient_data(h.ctx, p, reinterpret_cast<void**>(&grads[size_t(p)])))) return run;
  }
  toy_init_params(m, params.data());
  auto reportReady = [&] {
    for (int p = np - 1; p >= 0 && sc.gradReady; --p) check(sf_grad_ready(h.ctx, p));
  };
  for (size_t w = 0; w < sc.micro.size(); ++w) {
    const int n = sc.micro[w];
    check(sf_zero_gradients(h.ctx));
    const sf_stats before = statsOf(h.ctx);
    if (n > 1) check(sf_begin_accumulation(h.ctx));
    for (int k = 0; k < n - 1; ++k) {
      toy_accumulate_grads(m, params.data(), toy_seed(int(w), k, rank), grads.data());
      reportReady();
    }
    if (n > 1) check(sf_end_accumulation(h.ctx));
    const sf_stats mid = statsOf(h.ctx);
    toy_accumulate_grads(m, params.data(), toy_seed(int(w), n - 1, rank), grads.data());
    reportReady();
    if (!check(sf_synchronize(h.ctx))) return run;
    const sf_stats after = statsOf(h.ctx);
    run.inside.push_back(mid.collectives_issued - before.collectives_issued);
    run.atSync.push_back(after.collectives_issued - mid.collectives_issued);
    run.bytes.push_back(after.bytes_reduced - before.bytes_reduced);
    run.early.push_back(after.early_launches - before.early_launches);
    toy_sgd_step(m, params.data(), grads.data(), 0.05f);
  }
  run.stats = statsOf(h.ctx);
  return run;
}

inline std::vector<std::vector<float>> reference(const Scenario& sc) {
  const toy_model* m = &sc.model;
  std::vector<std::vector<float>> ref(static_cast<size_t>(toy_param_count(m)));
  std::vector<float*> ptrs;
  for (int p = 0; p < toy_param_count(m); ++p) {
    ref[size_t(p)].resize(size_t(toy_param_numel(m, p)));
    ptrs.push_back(ref[size_t(p)].data());
  }
  toy_reference(m, sc.world, int(sc.micro.size()), sc.micro.data(), 0.05f, ptrs.data());
  return ref;
}

inline double maxAbsDiff(const std::vector<std::vector<float>>& a,
                         const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t p = 0; p < a.size(); ++p) {
    if (a[p].size() != b[p].size()) return INFINITY;
    for (size_t i = 0; i < a[p].size(); ++i) {
      const double d = std::fabs(double(a[p][i]) - double(b[p][i]));
      if (!(d <= worst)) worst = std::isnan(d) ? INFINITY : d;
    }
  }
  return worst;
}

inline std::vector<RankRun> trainThreads(const Scenario& sc, const std::string& rendezvous) {
  return runThreadRanks<RankRun>(sc.world, [&](int r) { return trainRank(sc, r, rendezvous); });
}

constexpr double kTolerance = 1e-5;

// Boost assertions on every rank's run: counts per window, bytes, parity
// with the reference, identical weights on every rank. Call from the test thread.
inline void checkRuns(const Scenario& sc, const std::vector<RankRun>& runs, int64_t buckets) {
  const auto ref = reference(sc);
  const int64_t gradBytes = 3264;  // the default toy model
  for (size_t r = 0; r < runs.size(); ++r) {
    const RankRun& run = runs[r];
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST_REQUIRE(run.status == SF_OK, run.error);
      BOOST_TEST(run.stats.bucket_count == buckets);
      BOOST_TEST(run.stats.windows_completed == int64_t(sc.micro.size()));
      BOOST_TEST(run.stats.collectives_issued == buckets * int64_t(sc.micro.size()));
      for (size_t w = 0; w < sc.micro.size(); ++w) {
        BOOST_TEST_CONTEXT("window " << w << " of " << sc.micro[w] << " micro-batches") {
          BOOST_TEST(run.inside[w] == 0);
          BOOST_TEST(run.atSync[w] == buckets);
          BOOST_TEST(run.bytes[w] == gradBytes);
        }
      }
      BOOST_TEST(maxAbsDiff(run.params, ref) <= kTolerance);
    }
  }
  // Every rank holds the same weights.
  for (size_t r = 1; r < runs.size(); ++r) BOOST_TEST(maxAbsDiff(runs[r].params, runs[0].params) == 0.0);
}


}  // namespace sftest
