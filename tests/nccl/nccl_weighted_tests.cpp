// Weighted windows (SF_REDUCE_WEIGHTED, issue 31) over NCCL on the CUDA and
// NCCL stand-ins: CUDA gradients summed by ncclAllReduce / ncclReduceScatter
// with the weight's limbs in each bucket's tail, the global weight read back
// and the bucket scaled by 1 / weight on the plugin's stream (a one-rank
// pre-multiplied sum); every rank's gradients equal the summed gradients
// divided by the summed weights, also with several buckets written before
// their collectives (one small write each), early launches, sharded, and a
// context of host and device buckets. Ranks are threads, each on GPU `rank`.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "sfsync.h"
#include "tests/nccl/nccl_support.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

const std::vector<int64_t> kSizes = {300, 7, 129, 64};

double tokens(int rank, int window, int micro) { return double((rank * 7 + window * 3 + micro * 5) % 9 + 1); }

struct Setup {
  int world = 2;
  sf_dtype dtype = SF_DTYPE_FLOAT32;
  sf_shard_layout layout = SF_SHARD_NONE;
  bool early = false;
  bool hostToo = false;  // gradient #1 in host memory (a Gloo bucket beside the NCCL ones)
  std::vector<int> windows = {2, 3};
};

struct Run {
  std::string error;
  std::vector<std::vector<std::vector<double>>> grads;  // per window, per gradient (NaN: not owned)
  std::vector<double> weights;                          // sf_get_window_totals per window
  std::vector<int64_t> collectives;
  int64_t buckets = 0;
};

Run trainRank(const Setup& s, int rank, const std::string& rdv) {
  Run out;
  sf_options o = rankOptions(rank, s.world, rdv);
  o.local_rank = rank;
  o.reduce_op = SF_REDUCE_WEIGHTED;
  o.shard_layout = s.layout;
  const double scale = double(sfsync::dtypeSize(s.dtype)) / 4;  // the same buckets for every dtype
  o.bucket_cap_mb = scale * 1024.0 / 1048576.0;
  o.first_bucket_cap_mb = scale * 512.0 / 1048576.0;
  ContextHandle h;
  auto failed = [&](sf_status st) {
    if (st != SF_OK && out.error.empty()) out.error = sf_last_error();
    return st != SF_OK;
  };
  if (failed(sf_create(&o, &h.ctx))) return out;
  const int n = int(kSizes.size());
  auto deviceOf = [&](int p) { return s.hostToo && p == 1 ? SF_DEVICE_HOST : SF_DEVICE_CUDA; };
  for (int p = 0; p < n; ++p) {
    int64_t id;
    if (failed(sf_add_gradient(h.ctx, kSizes[size_t(p)], s.dtype, deviceOf(p), nullptr, &id))) return out;
    if (s.layout != SF_SHARD_NONE &&
        failed(sf_register_parameter(h.ctx, id, nullptr, kSizes[size_t(p)], s.dtype, deviceOf(p)))) {
      return out;
    }
  }
  std::vector<void*> g(static_cast<size_t>(n), nullptr);
  for (int p = 0; p < n; ++p) {
    if (failed(sf_gradient_data(h.ctx, p, &g[size_t(p)]))) return out;
  }
  out.buckets = statsOf(h.ctx).bucket_count;
  for (int w = 0; w < int(s.windows.size()); ++w) {
    if (failed(sf_zero_gradients(h.ctx))) return out;
    drain(nullptr);
    const int64_t before = statsOf(h.ctx).collectives_issued;
    const int micro = s.windows[size_t(w)];
    for (int m = 0; m < micro; ++m) {
      const bool last = m == micro - 1;
      if (!last && failed(sf_begin_accumulation(h.ctx))) return out;
      if (failed(sf_add_window_weight(h.ctx, tokens(rank, w, m)))) return out;
      for (int p = n - 1; p >= 0; --p) {
        // The host's "backward kernel": in stream order on the host's stream
        // (the legacy default stream), before the grad-ready report; a host
        // gradient is written by the CPU, at once (Gloo reads it when its
        // bucket starts).
        void* gp = g[size_t(p)];
        const sf_dtype t = s.dtype;
        const int64_t size = kSizes[size_t(p)];
        auto add = [=] {
          for (int64_t i = 0; i < size; ++i) storeValue(gp, i, t, loadValue(gp, i, t) + gradValue(rank, w, m, p, i));
        };
        if (deviceOf(p) == SF_DEVICE_HOST) {
          add();
        } else {
          launch(nullptr, add);
        }
        if (last && s.early && failed(sf_grad_ready(h.ctx, p))) return out;
      }
      if (!last && failed(sf_end_accumulation(h.ctx))) return out;
    }
    if (failed(sf_synchronize(h.ctx))) return out;
    drain(nullptr);
    out.collectives.push_back(statsOf(h.ctx).collectives_issued - before);
    double weight = 0;
    if (failed(sf_get_window_totals(h.ctx, &weight, nullptr, 0))) return out;
    out.weights.push_back(weight);
    out.grads.emplace_back();
    for (int p = 0; p < n; ++p) {
      int64_t off = 0, cnt = 0;
      if (failed(sf_shard_range(h.ctx, p, &off, &cnt))) return out;
      std::vector<double> v(size_t(kSizes[size_t(p)]), std::nan(""));
      for (int64_t i = off; i < off + cnt; ++i) v[size_t(i)] = loadValue(g[size_t(p)], i, s.dtype);
      out.grads.back().push_back(v);
    }
    if (s.layout != SF_SHARD_NONE && failed(sf_gather_parameters(h.ctx))) return out;
    drain(nullptr);
  }
  return out;
}

void check(const Setup& s, double tolerance) {
  const std::string rdv = "memory://" + uniqueName("nccl-weighted");
  const auto runs = runThreadRanks<Run>(s.world, [&](int r) { return trainRank(s, r, rdv); });
  for (int r = 0; r < s.world; ++r) {
    const Run& run = runs[size_t(r)];
    BOOST_TEST_REQUIRE(run.error.empty(), "rank " << r << ": " << run.error);
    BOOST_TEST(run.buckets >= 2);
    for (size_t w = 0; w < s.windows.size(); ++w) {
      double weight = 0;
      for (int q = 0; q < s.world; ++q) {
        for (int m = 0; m < s.windows[w]; ++m) weight += tokens(q, int(w), m);
      }
      BOOST_TEST(run.weights[w] == weight, "rank " << r << " window " << w);
      BOOST_TEST(run.collectives[w] == run.buckets, "window " << w << ": one collective per bucket");
      double worst = 0;
      for (int p = 0; p < int(kSizes.size()); ++p) {
        for (int64_t i = 0; i < kSizes[size_t(p)]; ++i) {
          const double got = run.grads[w][size_t(p)][size_t(i)];
          if (std::isnan(got)) continue;
          double sum = 0;
          for (int q = 0; q < s.world; ++q) {
            for (int m = 0; m < s.windows[w]; ++m) sum += gradValue(q, int(w), m, p, i);
          }
          worst = std::max(worst, std::fabs(got - sum / weight) / std::fabs(sum / weight));
        }
      }
      BOOST_TEST(worst <= tolerance, "rank " << r << " window " << w << ": relative " << worst);
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(nccl_weighted_tests)

BOOST_AUTO_TEST_CASE(threads2_and_3_every_bucket_divided_by_the_global_weight) {
  for (int world : {2, 3}) {
    for (bool early : {false, true}) {
      Setup s;
      s.world = world;
      s.early = early;
      check(s, 1e-6);
    }
  }
}

BOOST_AUTO_TEST_CASE(threads2_float64_and_bfloat16) {
  Setup s;
  s.dtype = SF_DTYPE_FLOAT64;
  check(s, 1e-15);
  s.dtype = SF_DTYPE_BFLOAT16;
  check(s, 1.0 / 64);  // the sums exact, 1/weight and the product each rounded to 8 bits
}

BOOST_AUTO_TEST_CASE(threads2_sharded_flat_and_parameter) {
  for (sf_shard_layout layout : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
    Setup s;
    s.layout = layout;
    s.early = layout == SF_SHARD_FLAT;
    check(s, 1e-6);
  }
}

BOOST_AUTO_TEST_CASE(threads2_host_and_device_buckets_in_one_context) {
  Setup s;
  s.hostToo = true;
  s.early = true;
  check(s, 1e-6);
}

BOOST_AUTO_TEST_SUITE_END()
