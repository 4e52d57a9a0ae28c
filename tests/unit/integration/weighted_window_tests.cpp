// Weighted windows (SF_REDUCE_WEIGHTED, issue 31) through libsfsync.so, ranks
// as threads over memory:// (Gloo; world size 1: the local backend): every
// bucket divided by the global sum of the window's weights, exactly as a
// one-process reference that divides the summed gradients by the summed
// weights, for W = 1..3, flat and sharded (both layouts), early (grad-ready)
// and at synchronize, one bucket and many, two lanes, a bfloat16 wire,
// float64 / float32 / bfloat16 gradients; window sums; collective counts
// equal to an unweighted run's; the misuse errors (not weighted, late,
// zero global weight, bad values).

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "plugin/core/dtype.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

// Six tensors; with the small caps below, several buckets.
const std::vector<int64_t> kSizes = {1000, 7, 333, 64, 1, 50};

double gradValue(int rank, int window, int micro, int64_t id, int64_t j) {
  // Quarters of small integers: every partial sum is exact, even in
  // bfloat16, so the reference does not depend on the order of additions.
  return double(int64_t(rank * 5 + window * 3 + micro * 7 + id * 11 + j) % 9 - 4) * 0.25;
}

// Tokens of a micro-batch: unequal per rank and micro-batch (so that the
// mean of means differs from the token mean).
double tokens(int rank, int window, int micro) {
  return double((rank * 13 + window * 5 + micro * 3) % 11 + 1);
}

double load(const void* base, int64_t i, sf_dtype dtype) {
  const char* p = static_cast<const char*>(base);
  switch (dtype) {
    case SF_DTYPE_FLOAT64: return reinterpret_cast<const double*>(p)[i];
    case SF_DTYPE_FLOAT32: return reinterpret_cast<const float*>(p)[i];
    default: return sfsync::bf16ToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
  }
}

void addTo(void* base, int64_t i, sf_dtype dtype, double v) {
  char* p = static_cast<char*>(base);
  switch (dtype) {
    case SF_DTYPE_FLOAT64: reinterpret_cast<double*>(p)[i] += v; break;
    case SF_DTYPE_FLOAT32: reinterpret_cast<float*>(p)[i] += float(v); break;
    default: {
      uint16_t* h = reinterpret_cast<uint16_t*>(p);
      h[i] = sfsync::floatToBf16(sfsync::bf16ToFloat(h[i]) + float(v));
    }
  }
}

struct Setup {
  std::vector<int64_t> sizes = kSizes;
  int world = 2;
  sf_shard_layout layout = SF_SHARD_NONE;
  sf_dtype dtype = SF_DTYPE_FLOAT64;
  sf_dtype wire = SF_DTYPE_FLOAT32;  // float32: native
  sf_reduce_op op = SF_REDUCE_WEIGHTED;
  std::vector<int> windows = {2, 1, 3};  // micro-batches per window
  bool early = false;                    // sf_grad_ready in each last micro-batch
  bool manyBuckets = true;
  int lanes = 1;
};

struct Run {
  std::string error;
  // Per window: this rank's gradients after synchronization (its own range
  // where sharded, NaN elsewhere), the totals and the collectives issued.
  std::vector<std::vector<std::vector<double>>> grads;
  std::vector<double> totalWeight;
  std::vector<std::vector<double>> totalSums;
  std::vector<int64_t> collectives;
  int64_t buckets = 0;
};

#define SF_TRY(call)                                             \
  do {                                                           \
    if ((call) != SF_OK) {                                       \
      run.error = std::string(#call) + ": " + sf_last_error();   \
      return run;                                                \
    }                                                            \
  } while (0)

Run trainRank(const Setup& s, int rank, const std::string& rdv) {
  Run run;
  sf_options o = rankOptions(rank, s.world, rdv, 20000);
  o.reduce_op = s.op;
  o.shard_layout = s.layout;
  o.wire_dtype = s.wire;
  o.max_inflight = s.lanes;
  if (s.manyBuckets) {
    o.first_bucket_cap_mb = 0.0005;
    o.bucket_cap_mb = 0.002;
  }
  ContextHandle h;
  SF_TRY(sf_create(&o, &h.ctx));
  const int64_t n = int64_t(s.sizes.size());
  for (int64_t id = 0; id < n; ++id) {
    int64_t got = -1;
    SF_TRY(sf_add_gradient(h.ctx, s.sizes[size_t(id)], s.dtype, SF_DEVICE_HOST, nullptr, &got));
    if (s.layout != SF_SHARD_NONE) {
      SF_TRY(sf_register_parameter(h.ctx, id, nullptr, s.sizes[size_t(id)], s.dtype, SF_DEVICE_HOST));
    }
  }
  std::vector<void*> data(static_cast<size_t>(n));
  for (int64_t id = 0; id < n; ++id) SF_TRY(sf_gradient_data(h.ctx, id, &data[size_t(id)]));
  run.buckets = statsOf(h.ctx).bucket_count;
  for (int w = 0; w < int(s.windows.size()); ++w) {
    const int micro = s.windows[size_t(w)];
    SF_TRY(sf_zero_gradients(h.ctx));
    const int64_t before = statsOf(h.ctx).collectives_issued;
    for (int m = 0; m < micro; ++m) {
      const bool last = m == micro - 1;
      if (!last) SF_TRY(sf_begin_accumulation(h.ctx));
      if (s.op == SF_REDUCE_WEIGHTED) {
        SF_TRY(sf_add_window_weight(h.ctx, tokens(rank, w, m)));
        const double sums[3] = {tokens(rank, w, m) * 0.5, 1.0, rank == 1 ? 1.0 : 0.0};
        SF_TRY(sf_add_window_sums(h.ctx, sums, 3));
      }
      for (int64_t id = n - 1; id >= 0; --id) {  // backward: the last layers first
        for (int64_t j = 0; j < s.sizes[size_t(id)]; ++j) {
          addTo(data[size_t(id)], j, s.dtype, gradValue(rank, w, m, id, j));
        }
        if (last && s.early) SF_TRY(sf_grad_ready(h.ctx, id));
      }
      if (!last) SF_TRY(sf_end_accumulation(h.ctx));
    }
    SF_TRY(sf_synchronize(h.ctx));
    run.collectives.push_back(statsOf(h.ctx).collectives_issued - before);
    std::vector<std::vector<double>> g(static_cast<size_t>(n));
    for (int64_t id = 0; id < n; ++id) {
      int64_t off = 0, cnt = 0;
      SF_TRY(sf_shard_range(h.ctx, id, &off, &cnt));
      g[size_t(id)].assign(size_t(s.sizes[size_t(id)]), std::nan(""));
      for (int64_t j = off; j < off + cnt; ++j) g[size_t(id)][size_t(j)] = load(data[size_t(id)], j, s.dtype);
    }
    run.grads.push_back(g);
    if (s.op == SF_REDUCE_WEIGHTED) {
      double weight = -1;
      std::vector<double> sums(SF_WINDOW_SUMS, -1);
      SF_TRY(sf_get_window_totals(h.ctx, &weight, sums.data(), SF_WINDOW_SUMS));
      run.totalWeight.push_back(weight);
      run.totalSums.push_back(sums);
    }
    if (s.layout != SF_SHARD_NONE) SF_TRY(sf_gather_parameters(h.ctx));
  }
  return run;
}

std::vector<Run> train(const Setup& s) {
  const std::string rdv = "memory://" + uniqueName("weighted");
  return runThreadRanks<Run>(s.world, [&](int rank) { return trainRank(s, rank, rdv); });
}

// The one-process reference: window w's gradients summed over ranks and
// micro-batches, divided by the summed tokens.
double reference(const Setup& s, int w, int64_t id, int64_t j) {
  double sum = 0, weight = 0;
  for (int r = 0; r < s.world; ++r) {
    for (int m = 0; m < s.windows[size_t(w)]; ++m) {
      sum += gradValue(r, w, m, id, j);
      weight += tokens(r, w, m);
    }
  }
  return sum / weight;
}

// Largest |got - reference| / max|reference| over every window, rank and
// element this rank holds; BOOST-checks errors, totals and counts.
double check(const Setup& s, const std::vector<Run>& runs) {
  double worst = 0;
  for (int r = 0; r < s.world; ++r) {
    const Run& run = runs[size_t(r)];
    BOOST_TEST_REQUIRE(run.error.empty(), "rank " << r << ": " << run.error);
    BOOST_TEST_REQUIRE(run.grads.size() == s.windows.size());
    for (size_t w = 0; w < s.windows.size(); ++w) {
      BOOST_TEST(run.collectives[w] == run.buckets, "window " << w << ": one collective per bucket");
      double weight = 0, half = 0, micro = 0;
      for (int q = 0; q < s.world; ++q) {
        for (int m = 0; m < s.windows[w]; ++m) {
          weight += tokens(q, int(w), m);
          half += tokens(q, int(w), m) * 0.5;
          micro += 1;
        }
      }
      BOOST_TEST(run.totalWeight[w] == weight, "rank " << r << " window " << w);
      BOOST_TEST(run.totalSums[w][0] == half);
      BOOST_TEST(run.totalSums[w][1] == micro);
      BOOST_TEST(run.totalSums[w][2] == (s.world > 1 ? double(s.windows[w]) : 0.0));
      BOOST_TEST(run.totalSums[w][3] == 0.0);
      double scale = 0;
      for (int64_t id = 0; id < int64_t(s.sizes.size()); ++id) {
        for (int64_t j = 0; j < s.sizes[size_t(id)]; ++j) {
          scale = std::max(scale, std::fabs(reference(s, int(w), id, j)));
        }
      }
      for (int64_t id = 0; id < int64_t(s.sizes.size()); ++id) {
        for (int64_t j = 0; j < s.sizes[size_t(id)]; ++j) {
          const double got = run.grads[w][size_t(id)][size_t(j)];
          if (std::isnan(got)) continue;  // not this rank's (sharded)
          worst = std::max(worst, std::fabs(got - reference(s, int(w), id, j)) / scale);
        }
      }
    }
  }
  return worst;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(weighted_window_tests)

BOOST_AUTO_TEST_CASE(every_bucket_is_divided_by_the_global_weight_1_to_3_thread_ranks_gloo) {
  for (int world : {1, 2, 3}) {
    for (bool early : {false, true}) {
      Setup s;
      s.world = world;
      s.early = early;
      const double worst = check(s, train(s));
      BOOST_TEST(worst <= 1e-15, "world " << world << (early ? " early" : "") << ": " << worst);
    }
  }
}

BOOST_AUTO_TEST_CASE(a_bucket_in_pieces_on_four_lanes_2_and_3_thread_ranks_gloo) {
  // A 12 MB bucket travels as pieces of at most 8 MiB on the lanes; the last
  // piece (the limbs') publishes the weight, every piece is scaled once.
  for (int world : {2, 3}) {
    for (sf_shard_layout layout : {SF_SHARD_NONE, SF_SHARD_FLAT}) {
      Setup s;
      s.sizes = {3000000, 5000, 7};
      s.world = world;
      s.layout = layout;
      s.manyBuckets = false;
      s.lanes = 4;
      s.windows = {2, 1};
      const double worst = check(s, train(s));
      BOOST_TEST(worst <= 1e-15, "world " << world << " layout " << layout << ": " << worst);
    }
  }
}

BOOST_AUTO_TEST_CASE(one_bucket_and_two_lanes_2_thread_ranks_gloo) {
  Setup s;
  s.manyBuckets = false;
  BOOST_TEST(check(s, train(s)) <= 1e-15);
  s.manyBuckets = true;
  s.lanes = 2;
  s.early = true;
  BOOST_TEST(check(s, train(s)) <= 1e-15);
}

BOOST_AUTO_TEST_CASE(sharded_layouts_divide_each_shard_by_the_same_total_2_and_3_thread_ranks_gloo) {
  for (int world : {2, 3}) {
    for (sf_shard_layout layout : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
      for (bool early : {false, true}) {
        Setup s;
        s.world = world;
        s.layout = layout;
        s.early = early;
        const double worst = check(s, train(s));
        BOOST_TEST(worst <= 1e-15, "world " << world << " layout " << layout << ": " << worst);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(float32_on_a_bfloat16_wire_keeps_the_weight_exact_3_thread_ranks_gloo) {
  // The weight's limbs are exact in bfloat16; the gradients here are
  // quarters, exact too, so only the float32 division rounds.
  Setup s;
  s.world = 3;
  s.dtype = SF_DTYPE_FLOAT32;
  s.wire = SF_DTYPE_BFLOAT16;
  BOOST_TEST(check(s, train(s)) <= 1e-6);
  s.wire = SF_DTYPE_FLOAT16;
  s.early = true;
  BOOST_TEST(check(s, train(s)) <= 1e-6);
}

BOOST_AUTO_TEST_CASE(bfloat16_and_float32_gradients_2_and_3_thread_ranks_gloo) {
  Setup s;
  s.world = 3;
  s.dtype = SF_DTYPE_FLOAT32;
  BOOST_TEST(check(s, train(s)) <= 1e-6);
  s.dtype = SF_DTYPE_BFLOAT16;
  s.world = 2;
  s.layout = SF_SHARD_FLAT;
  BOOST_TEST(check(s, train(s)) <= 1.0 / 128);
}

BOOST_AUTO_TEST_CASE(collectives_per_window_equal_an_unweighted_run_2_thread_ranks_gloo) {
  Setup s;
  s.early = true;
  const std::vector<Run> weighted = train(s);
  s.op = SF_REDUCE_SUM;
  const std::vector<Run> plain = train(s);
  for (int r = 0; r < 2; ++r) {
    BOOST_TEST_REQUIRE(weighted[size_t(r)].error.empty(), weighted[size_t(r)].error);
    BOOST_TEST_REQUIRE(plain[size_t(r)].error.empty(), plain[size_t(r)].error);
    BOOST_TEST(weighted[size_t(r)].buckets > 2);
    BOOST_TEST(weighted[size_t(r)].collectives == plain[size_t(r)].collectives,
               boost::test_tools::per_element());
  }
}

BOOST_AUTO_TEST_CASE(misuse_is_reported_where_it_happens_2_thread_ranks_gloo) {
  const std::string rdv = "memory://" + uniqueName("weighted-misuse");
  struct Seen {
    std::string notWeighted, late, lateSums, zero, after, badValues;
    double weightAfterLate = -1, weightAfterZero = -1, grad = 0;
    sf_status lateStatus = SF_OK, zeroStatus = SF_OK;
  };
  const auto seen = runThreadRanks<Seen>(2, [&](int rank) {
    Seen seen;
    {
      sf_options o = rankOptions(0, 1, "memory://" + uniqueName("unweighted"));
      ContextHandle h;
      sf_create(&o, &h.ctx);
      if (sf_add_window_weight(h.ctx, 1.0) != SF_OK) seen.notWeighted = sf_last_error();
    }
    sf_options o = rankOptions(rank, 2, rdv, 20000);
    o.reduce_op = SF_REDUCE_WEIGHTED;
    ContextHandle h;
    if (sf_create(&o, &h.ctx) != SF_OK) return seen;
    int64_t id = -1;
    sf_add_gradient(h.ctx, 4, SF_DTYPE_FLOAT64, SF_DEVICE_HOST, "w", &id);
    void* p = nullptr;
    sf_gradient_data(h.ctx, id, &p);
    double* g = static_cast<double*>(p);
    // Bad values: named, nothing added.
    const double bad[] = {-1.0, std::nan(""), INFINITY, 4503599627370496.0};
    for (double v : bad) {
      if (sf_add_window_weight(h.ctx, v) != SF_ERR_INVALID_ARGUMENT) seen.badValues += "accepted;";
      else seen.badValues += std::string(sf_last_error()) + ";";
    }
    const double five[5] = {1, 2, 3, 4, 5};
    if (sf_add_window_sums(h.ctx, five, 5) != SF_ERR_INVALID_ARGUMENT) seen.badValues += "count 5 accepted;";
    // Window 1: a weight after the first bucket started (by grad-ready) is
    // late. (Each window opens with an empty begin/end: numbered windows.)
    sf_begin_accumulation(h.ctx);
    sf_end_accumulation(h.ctx);
    sf_add_window_weight(h.ctx, 2.0 + rank);
    for (int j = 0; j < 4; ++j) g[j] = 10.0;
    sf_grad_ready(h.ctx, id);
    seen.lateStatus = sf_add_window_weight(h.ctx, 100.0);
    seen.late = sf_last_error();
    const double one = 1.0;
    if (sf_add_window_sums(h.ctx, &one, 1) != SF_OK) seen.lateSums = sf_last_error();
    sf_synchronize(h.ctx);
    sf_get_window_totals(h.ctx, &seen.weightAfterLate, nullptr, 0);
    seen.grad = g[0];
    // Window 2: no weight anywhere: the named error, the sums undivided.
    sf_zero_gradients(h.ctx);
    for (int j = 0; j < 4; ++j) g[j] = 1.0;
    sf_begin_accumulation(h.ctx);
    sf_end_accumulation(h.ctx);
    seen.zeroStatus = sf_synchronize(h.ctx);
    seen.zero = sf_last_error();
    sf_get_window_totals(h.ctx, &seen.weightAfterZero, nullptr, 0);
    if (g[0] != 2.0) seen.after = "window 2 left " + std::to_string(g[0]) + ", not the plain sum 2";
    // Window 3: the context goes on.
    sf_zero_gradients(h.ctx);
    for (int j = 0; j < 4; ++j) g[j] = 3.0;
    sf_add_window_weight(h.ctx, 3.0);
    if (sf_synchronize(h.ctx) != SF_OK) seen.after += std::string(" window 3: ") + sf_last_error();
    else if (g[0] != 1.0) seen.after += " window 3 gave " + std::to_string(g[0]);
    return seen;
  });
  for (const Seen& s : seen) {
    BOOST_TEST(s.notWeighted.find("not SF_REDUCE_WEIGHTED") != std::string::npos, s.notWeighted);
    BOOST_TEST(s.badValues.find("accepted") == std::string::npos, s.badValues);
    BOOST_TEST(s.badValues.find("weight = -1 is negative") != std::string::npos, s.badValues);
    BOOST_TEST(s.badValues.find("weight = nan is not finite") != std::string::npos, s.badValues);
    BOOST_TEST(s.badValues.find("2^52 or more") != std::string::npos, s.badValues);
    BOOST_TEST(s.lateStatus == SF_ERR_INVALID_STATE);
    BOOST_TEST(s.late.find("bucket 0 of window 1 has started reducing") != std::string::npos, s.late);
    BOOST_TEST(s.lateSums.find("sf_add_window_sums: bucket 0 of window 1 has") != std::string::npos, s.lateSums);
    BOOST_TEST(s.weightAfterLate == 5.0);  // 2 + 3: the late 100s were not added
    BOOST_TEST(s.grad == 4.0);             // (10 + 10) / 5
    BOOST_TEST(s.zeroStatus == SF_ERR_INVALID_STATE);
    BOOST_TEST(s.zero.find("window 2: the global window weight is 0") != std::string::npos, s.zero);
    BOOST_TEST(s.weightAfterZero == 0.0);
    BOOST_TEST(s.after.empty(), s.after);
  }
}

BOOST_AUTO_TEST_SUITE_END()
