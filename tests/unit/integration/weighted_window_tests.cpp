// Weighted windows (SF_REDUCE_WEIGHTED, issue 31) through libsfsync.so, ranks
// as threads over memory:// (Gloo; world size 1: the local backend): every
// bucket divided by the global sum of the window's weights, exactly as a
// one-process reference that divides the summed gradients by the summed
// weights, for W = 1..3, flat and sharded (both layouts), early (grad-ready)
// and at synchronize, one bucket and many, two lanes, a bfloat16 wire,
// float64 / float32 / bfloat16 gradients; window sums; collective counts
// equal to an unweighted run's; the misuse errors (not weighted, late,
// zero global weight, bad values). Issue 45: weights and sums that no 16-bit
// wire holds, exact through one; a late weight on a window of three buckets
// reaching none of them.

#include <boost/test/unit_test.hpp>

#include <algorithm>
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

// After a window's sf_synchronize: its gradients (as doubles) and its totals,
// appended to run (a Run-like struct: grads, totalWeight, totalSums, error);
// false, with run.error, when the totals cannot be read.
template <typename RunT, typename T>
bool recordWindow(sf_context* ctx, const std::vector<T*>& data, const std::vector<int64_t>& sizes,
                  RunT& run) {
  std::vector<std::vector<double>> g(data.size());
  for (size_t id = 0; id < data.size(); ++id) g[id].assign(data[id], data[id] + sizes[id]);
  run.grads.push_back(g);
  double total = -1;
  std::vector<double> sums(SF_WINDOW_SUMS, -1);
  if (sf_get_window_totals(ctx, &total, sums.data(), SF_WINDOW_SUMS) != SF_OK) {
    run.error = std::string("sf_get_window_totals: ") + sf_last_error();
    return false;
  }
  run.totalWeight.push_back(total);
  run.totalSums.push_back(sums);
  return true;
}

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
  // Each window's reference, once (every rank's result is compared with it).
  std::vector<std::vector<std::vector<double>>> refs(s.windows.size());
  std::vector<double> scales(s.windows.size(), 0.0);
  for (size_t w = 0; w < s.windows.size(); ++w) {
    for (int64_t id = 0; id < int64_t(s.sizes.size()); ++id) {
      std::vector<double> ref(size_t(s.sizes[size_t(id)]));
      for (int64_t j = 0; j < s.sizes[size_t(id)]; ++j) {
        ref[size_t(j)] = reference(s, int(w), id, j);
        scales[w] = std::max(scales[w], std::fabs(ref[size_t(j)]));
      }
      refs[w].push_back(std::move(ref));
    }
  }
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
      const double scale = scales[w];
      for (int64_t id = 0; id < int64_t(s.sizes.size()); ++id) {
        for (int64_t j = 0; j < s.sizes[size_t(id)]; ++j) {
          const double got = run.grads[w][size_t(id)][size_t(j)];
          if (std::isnan(got)) continue;  // not this rank's (sharded)
          worst = std::max(worst, std::fabs(got - refs[w][size_t(id)][size_t(j)]) / scale);
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

BOOST_AUTO_TEST_CASE(weights_no_16_bit_wire_holds_come_back_exact_2_and_3_thread_ranks_gloo) {
  // Issue 45. Float32 buckets on a bfloat16 and a float16 wire, with weights
  // and window sums that neither holds (257, 1027, 4099, ...: 8 and 11
  // significant bits), whose window totals neither holds either (asserted).
  // The limbs carry them exactly, so:
  // - the totals come back as the exact integers (not rounded to 16 bits);
  // - even tensors carry quarters of small integers, which the wire sums
  //   exactly: only the float32 scaling rounds (within 2^-21 relative, 4x
  //   its worst case), while a total rounded to the wire's 16 bits is off by
  //   1 / total or more (asserted to be over 10x that tolerance);
  // - odd tensors carry values the wire rounds: within the bound that
  //   sfsync.h states for wire_dtype, (N + 1) u sum_i |x_i| (+ N 2^-24 for
  //   float16), divided by the total, plus the scaling. That bound alone is
  //   looser than a rounded total's error; the even tensors are the check.
  const std::vector<int64_t> sizes = {300, 5, 200, 40};  // two buckets, each with both kinds
  const std::vector<int> windows = {2, 1};               // micro-batches per window
  const double kScaleTol = std::ldexp(1.0, -21);
  // Odd integers above 256 that neither wire holds; where a window's total
  // would be even (it could then fit float16), rank 0's first weight is one
  // more: every total is odd and above 2048, so neither wire holds it.
  int world = 0;
  auto rawWeight = [](int rank, int window, int micro) {
    static const double kWeights[] = {257, 1027, 4099, 515, 2051, 771, 1029};
    return kWeights[(rank * 3 + window * 2 + micro) % 7];
  };
  auto weight = [&](int rank, int window, int micro) {
    double raw = 0;
    for (int q = 0; q < world; ++q) {
      for (int m = 0; m < windows[size_t(window)]; ++m) raw += rawWeight(q, window, m);
    }
    const bool bump = rank == 0 && micro == 0 && std::fmod(raw, 2.0) == 0.0;
    return rawWeight(rank, window, micro) + (bump ? 1.0 : 0.0);
  };
  auto sumsOf = [&](int rank, int window, int micro, double* out) {
    out[0] = weight(rank, window, micro) * 0.5;
    out[1] = 4099;
    out[2] = rank == 1 ? 257.25 : 0.0;
    out[3] = 1000001;
  };
  auto grad = [](int rank, int window, int micro, int64_t id, int64_t j) {
    if (id % 2 == 0) return double(int64_t(rank * 5 + window * 3 + micro * 7 + id * 11 + j) % 9 - 4) / 4;
    return double(int64_t(rank * 131 + window * 71 + micro * 37 + id * 17 + j * 29) % 997 - 498) / 331;
  };
  struct WireRun {
    std::string error;
    std::vector<std::vector<std::vector<double>>> grads;  // [window][id][j]
    std::vector<double> totalWeight;
    std::vector<std::vector<double>> totalSums;
    int64_t buckets = 0;
  };
  for (sf_dtype wire : {SF_DTYPE_BFLOAT16, SF_DTYPE_FLOAT16}) {
    auto toWire = [wire](double v) {
      return wire == SF_DTYPE_BFLOAT16 ? double(sfsync::bf16ToFloat(sfsync::floatToBf16(float(v))))
                                       : double(sfsync::halfToFloat(sfsync::floatToHalf(float(v))));
    };
    const double u = wire == SF_DTYPE_BFLOAT16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    for (int ranks : {2, 3}) {
      world = ranks;
      const std::string rdv = "memory://" + uniqueName("weighted-wire16");
      const auto runs = runThreadRanks<WireRun>(world, [&](int rank) {
        WireRun run;
        sf_options o = rankOptions(rank, world, rdv, 20000);
        o.reduce_op = SF_REDUCE_WEIGHTED;
        o.wire_dtype = wire;
        o.first_bucket_cap_mb = 0.0005;
        o.bucket_cap_mb = 0.002;
        ContextHandle h;
        SF_TRY(sf_create(&o, &h.ctx));
        const int64_t n = int64_t(sizes.size());
        std::vector<float*> data(static_cast<size_t>(n));
        for (int64_t id = 0; id < n; ++id) {
          int64_t got = -1;
          SF_TRY(sf_add_gradient(h.ctx, sizes[size_t(id)], SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &got));
        }
        for (int64_t id = 0; id < n; ++id) {
          void* p = nullptr;
          SF_TRY(sf_gradient_data(h.ctx, id, &p));
          data[size_t(id)] = static_cast<float*>(p);
        }
        run.buckets = statsOf(h.ctx).bucket_count;
        for (int w = 0; w < int(windows.size()); ++w) {
          SF_TRY(sf_zero_gradients(h.ctx));
          for (int m = 0; m < windows[size_t(w)]; ++m) {
            const bool last = m == windows[size_t(w)] - 1;
            if (!last) SF_TRY(sf_begin_accumulation(h.ctx));
            double sums[SF_WINDOW_SUMS];
            sumsOf(rank, w, m, sums);
            SF_TRY(sf_add_window_weight(h.ctx, weight(rank, w, m)));
            SF_TRY(sf_add_window_sums(h.ctx, sums, SF_WINDOW_SUMS));
            for (int64_t id = n - 1; id >= 0; --id) {
              for (int64_t j = 0; j < sizes[size_t(id)]; ++j) {
                data[size_t(id)][j] += float(grad(rank, w, m, id, j));
              }
            }
            if (!last) SF_TRY(sf_end_accumulation(h.ctx));
          }
          SF_TRY(sf_synchronize(h.ctx));
          if (!recordWindow(h.ctx, data, sizes, run)) return run;
        }
        return run;
      });
      for (size_t w = 0; w < windows.size(); ++w) {
        // The window's exact totals, and what a 16-bit wire would make of them.
        double total = 0;
        std::vector<double> sums(SF_WINDOW_SUMS, 0.0);
        for (int q = 0; q < world; ++q) {
          for (int m = 0; m < windows[w]; ++m) {
            double s[SF_WINDOW_SUMS];
            sumsOf(q, int(w), m, s);
            total += weight(q, int(w), m);
            for (int k = 0; k < SF_WINDOW_SUMS; ++k) sums[size_t(k)] += s[k];
          }
        }
        BOOST_TEST_REQUIRE(toWire(total) != total, "window " << w << ": " << total << " fits the wire");
        const double roundedOff = std::fabs(total / toWire(total) - 1.0);
        BOOST_TEST_REQUIRE(roundedOff > 10 * kScaleTol, "window " << w << ": " << roundedOff);
        for (int r = 0; r < world; ++r) {
          const WireRun& run = runs[size_t(r)];
          BOOST_TEST_REQUIRE(run.error.empty(), "wire " << wire << " rank " << r << ": " << run.error);
          BOOST_TEST(run.buckets >= 2);
          BOOST_TEST(run.totalWeight[w] == total, "wire " << wire << " world " << world << " rank " << r
                                                          << " window " << w << ": total weight "
                                                          << run.totalWeight[w] << ", not " << total);
          BOOST_TEST(run.totalSums[w] == sums, boost::test_tools::per_element());
          // Worst error of the even tensors (relative) and of the odd ones
          // (as a fraction of the stated bound).
          double worstExact = 0, worstBound = 0;
          for (int64_t id = 0; id < int64_t(sizes.size()); ++id) {
            for (int64_t j = 0; j < sizes[size_t(id)]; ++j) {
              double s = 0, a = 0;
              for (int q = 0; q < world; ++q) {
                float x = 0;  // as rank q accumulated it
                for (int m = 0; m < windows[w]; ++m) x += float(grad(q, int(w), m, id, j));
                s += x;
                a += std::fabs(x);
              }
              const double mean = s / total;
              const double err = std::fabs(run.grads[w][size_t(id)][size_t(j)] - mean);
              if (id % 2 == 0) {
                const double rel = mean == 0 ? (err == 0 ? 0 : INFINITY) : err / std::fabs(mean);
                worstExact = std::max(worstExact, rel);
              } else {
                const double fp16Term = wire == SF_DTYPE_FLOAT16 ? world * std::ldexp(1.0, -24) : 0.0;
                const double wireBound = (world + 1) * u * a + fp16Term;
                const double bound = wireBound / total + kScaleTol * std::fabs(mean);
                worstBound = std::max(worstBound, err / bound);
              }
            }
          }
          BOOST_TEST_MESSAGE("wire " << wire << " world " << world << " rank " << r << " window " << w
                                     << ": exact sums within " << worstExact << " relative, others within "
                                     << worstBound << " of the stated bound");
          BOOST_TEST(worstExact <= kScaleTol, "wire " << wire << " world " << world << " rank " << r
                                                      << " window " << w << ": exact sums off by "
                                                      << worstExact << " relative");
          BOOST_TEST(worstBound <= 1.0, "wire " << wire << " world " << world << " rank " << r << " window "
                                                << w << ": " << worstBound << " of the stated bound");
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(a_late_weight_reaches_none_of_three_buckets_2_and_3_thread_ranks_gloo) {
  // Issue 45. Three float64 buckets (each 2,400-byte gradient is over the
  // 0.002 MB cap: a bucket of its own). In the last micro-batch of window 1
  // bucket 0's gradient is ready first: bucket 0 starts reducing, carrying
  // the window's weight; buckets 1 and 2 have not started (one collective
  // issued, asserted). A weight and sums added then are refused
  // (SF_ERR_INVALID_STATE naming bucket 0 and the window) and reach no
  // bucket: were buckets 1 and 2 to carry them, the window would be divided
  // by two totals. Every bucket is checked against the sum over ranks and
  // micro-batches divided by the accepted weight; so are the totals, and
  // window 2 (nothing carried over).
  const int64_t kNumel = 300;
  auto weight = [](int rank, int window, int micro) { return double(3 + rank + 2 * micro + 5 * window); };
  auto grad = [](int rank, int window, int micro, int64_t id, int64_t j) {
    return double(int64_t(rank * 7 + window * 5 + micro * 3 + id * 13 + j) % 11 - 5);
  };
  struct Late {
    std::string error, lateWeight, lateSums;
    sf_status weightStatus = SF_OK, sumsStatus = SF_OK;
    int64_t startedBeforeLate = -1;
    std::vector<int64_t> bucketOf;                        // per id
    std::vector<std::vector<std::vector<double>>> grads;  // [window][id][j]
    std::vector<double> totalWeight;
    std::vector<std::vector<double>> totalSums;
  };
  for (int world : {2, 3}) {
    const std::string rdv = "memory://" + uniqueName("weighted-late3");
    const auto runs = runThreadRanks<Late>(world, [&](int rank) {
      Late run;
      sf_options o = rankOptions(rank, world, rdv, 20000);
      o.reduce_op = SF_REDUCE_WEIGHTED;
      o.first_bucket_cap_mb = 0.0005;
      o.bucket_cap_mb = 0.002;
      ContextHandle h;
      SF_TRY(sf_create(&o, &h.ctx));
      std::vector<double*> data(3);
      for (int64_t id = 0; id < 3; ++id) {
        int64_t got = -1;
        SF_TRY(sf_add_gradient(h.ctx, kNumel, SF_DTYPE_FLOAT64, SF_DEVICE_HOST, nullptr, &got));
      }
      for (int64_t id = 0; id < 3; ++id) {
        void* p = nullptr;
        SF_TRY(sf_gradient_data(h.ctx, id, &p));
        data[size_t(id)] = static_cast<double*>(p);
      }
      run.bucketOf.assign(3, -1);
      std::vector<int64_t> idOf(3, -1);  // per bucket
      for (int64_t id = 0; id < 3; ++id) {
        SF_TRY(sf_gradient_bucket(h.ctx, id, &run.bucketOf[size_t(id)]));
        const int64_t b = run.bucketOf[size_t(id)];
        if (b < 0 || b > 2 || idOf[size_t(b)] >= 0) {
          run.error = "not three buckets of one gradient each";
          return run;
        }
        idOf[size_t(b)] = id;
      }
      auto fill = [&](int w, int m, int64_t id) {
        for (int64_t j = 0; j < kNumel; ++j) data[size_t(id)][j] += grad(rank, w, m, id, j);
      };
      for (int w = 0; w < 2; ++w) {
        SF_TRY(sf_zero_gradients(h.ctx));
        const int micro = w == 0 ? 2 : 1;
        const int64_t before = statsOf(h.ctx).collectives_issued;
        for (int m = 0; m < micro; ++m) {
          const bool last = m == micro - 1;
          if (!last) SF_TRY(sf_begin_accumulation(h.ctx));
          SF_TRY(sf_add_window_weight(h.ctx, weight(rank, w, m)));
          const double sums[2] = {weight(rank, w, m), 1.0};
          SF_TRY(sf_add_window_sums(h.ctx, sums, 2));
          if (!last) {
            for (int64_t id = 0; id < 3; ++id) fill(w, m, id);
            SF_TRY(sf_end_accumulation(h.ctx));
            continue;
          }
          for (int64_t b = 0; b < 3; ++b) {  // backward: bucket 0's gradient first
            fill(w, m, idOf[size_t(b)]);
            SF_TRY(sf_grad_ready(h.ctx, idOf[size_t(b)]));
            if (w == 0 && b == 0) {
              run.startedBeforeLate = statsOf(h.ctx).collectives_issued - before;
              run.weightStatus = sf_add_window_weight(h.ctx, 1000.0 + rank);
              run.lateWeight = sf_last_error();
              const double late[2] = {1000.0, 1000.0};
              run.sumsStatus = sf_add_window_sums(h.ctx, late, 2);
              run.lateSums = sf_last_error();
            }
          }
        }
        SF_TRY(sf_synchronize(h.ctx));
        if (!recordWindow(h.ctx, data, std::vector<int64_t>(3, kNumel), run)) return run;
      }
      return run;
    });
    for (int r = 0; r < world; ++r) {
      const Late& run = runs[size_t(r)];
      BOOST_TEST_REQUIRE(run.error.empty(), "world " << world << " rank " << r << ": " << run.error);
      BOOST_TEST(run.startedBeforeLate == 1, "bucket 0 alone started: " << run.startedBeforeLate);
      BOOST_TEST(run.weightStatus == SF_ERR_INVALID_STATE);
      BOOST_TEST(run.lateWeight.find("sf_add_window_weight: bucket 0 of window 1 has started reducing") !=
                     std::string::npos,
                 "world " << world << " rank " << r << ": late weight said '" << run.lateWeight << "'");
      BOOST_TEST(run.sumsStatus == SF_ERR_INVALID_STATE);
      BOOST_TEST(run.lateSums.find("sf_add_window_sums: bucket 0 of window 1 has started reducing") !=
                     std::string::npos,
                 "world " << world << " rank " << r << ": late sums said '" << run.lateSums << "'");
      for (int w = 0; w < 2; ++w) {
        const int micro = w == 0 ? 2 : 1;
        double total = 0, micros = 0;
        for (int q = 0; q < world; ++q) {
          for (int m = 0; m < micro; ++m) {
            total += weight(q, w, m);
            micros += 1;
          }
        }
        BOOST_TEST(run.totalWeight[size_t(w)] == total,
                   "world " << world << " rank " << r << " window " << w + 1);
        BOOST_TEST(run.totalSums[size_t(w)][0] == total);
        BOOST_TEST(run.totalSums[size_t(w)][1] == micros);
        for (int64_t id = 0; id < 3; ++id) {
          double worst = 0;
          for (int64_t j = 0; j < kNumel; ++j) {
            double s = 0;
            for (int q = 0; q < world; ++q) {
              for (int m = 0; m < micro; ++m) s += grad(q, w, m, id, j);
            }
            const double want = s / total;
            const double err = std::fabs(run.grads[size_t(w)][size_t(id)][size_t(j)] - want);
            worst = std::max(worst, want == 0 ? (err == 0 ? 0 : INFINITY) : err / std::fabs(want));
          }
          BOOST_TEST(worst <= 1e-15, "world " << world << " rank " << r << " window " << w + 1 << " bucket "
                                              << run.bucketOf[size_t(id)] << ": off by " << worst);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
