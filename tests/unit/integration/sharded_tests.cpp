// Sharded windows (issue 17) through libsfsync.so, ranks as threads over
// memory:// (Gloo; world size 1: the local backend): a full training cycle
// (synchronize -> step this rank's shard with SGD + momentum -> gather) equal
// to the unsharded run and to an exact reference for W = 1..4, both layouts,
// float32/float64/bfloat16, windows of varying length, host-owned and
// plugin-owned buffers and an unused parameter; collective counts; the
// misuse errors of the contract; the window check in a sharded bucket; a lost
// peer during the reduce-scatter and during the gather.

#include <boost/test/unit_test.hpp>

#include <boost/property_tree/json_parser.hpp>
#include <boost/property_tree/ptree.hpp>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "plugin/core/dtype.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;
using Clock = std::chrono::steady_clock;

namespace {

// The model: six tensors; with the caps below, three buckets
// [#5 #4 #3 #2] [#1] [#0] (float32), #1 too small for every rank to own a
// part at W = 4, #5 never gets a gradient (an unused parameter).
const std::vector<int64_t> kSizes = {1000, 7, 333, 64, 1, 50};
constexpr int64_t kUnused = 5;
constexpr double kLr = 0.1, kMomentum = 0.9;

double gradValue(int rank, int window, int micro, int64_t id, int64_t j) {
  // Quarters of small integers: every partial sum is exact, even in bfloat16,
  // so the reduced gradients do not depend on the order of the additions.
  return double(int64_t(rank * 5 + window * 3 + micro * 7 + id * 11 + j) % 9 - 4) * 0.25;
}

double initialParam(int64_t id, int64_t j) { return double((id * 13 + j) % 7 - 3) * 0.125; }

void store(void* base, int64_t i, sf_dtype dtype, double v) {
  char* p = static_cast<char*>(base);
  switch (dtype) {
    case SF_DTYPE_FLOAT64: reinterpret_cast<double*>(p)[i] = v; break;
    case SF_DTYPE_FLOAT32: reinterpret_cast<float*>(p)[i] = float(v); break;
    default: reinterpret_cast<uint16_t*>(p)[i] = sfsync::floatToBf16(float(v)); break;
  }
}

double load(const void* base, int64_t i, sf_dtype dtype) {
  const char* p = static_cast<const char*>(base);
  switch (dtype) {
    case SF_DTYPE_FLOAT64: return reinterpret_cast<const double*>(p)[i];
    case SF_DTYPE_FLOAT32: return reinterpret_cast<const float*>(p)[i];
    default: return sfsync::bf16ToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
  }
}

struct Setup {
  int world = 2;
  sf_shard_layout layout = SF_SHARD_FLAT;
  sf_dtype dtype = SF_DTYPE_FLOAT32;
  std::vector<int> windows = {1, 3, 2};  // micro-batches per window
  bool perBucket = false;  // synchronize_start + wait_bucket + start_gather per bucket
  bool hostOwned = false;  // #0 and #3 host-owned gradients, #1 and #3 host-owned parameters
};

struct Run {
  std::string error;
  std::vector<std::vector<double>> params;  // final values, every tensor
  sf_stats stats{};
  int64_t buckets = 0;
  int64_t collectivesInsideWindows = 0;  // issued between a begin and its synchronize
  int64_t owned = 0;                     // elements this rank owns, over all tensors
};

#define SF_TRY(call)                                   \
  do {                                                 \
    if ((call) != SF_OK) {                             \
      run.error = std::string(#call) + ": " + sf_last_error(); \
      return run;                                      \
    }                                                  \
  } while (0)

// One rank's training: every window, accumulate its micro-batches (all but
// the last inside sf_begin/end_accumulation), synchronize, step the owned
// shard with SGD + momentum, gather (sharded).
Run trainRank(const Setup& s, int rank, const std::string& rdv) {
  Run run;
  const size_t esize = sfsync::dtypeSize(s.dtype);
  const double scale = 4.0 / double(esize);  // the same three buckets for every dtype
  sf_options o = rankOptions(rank, s.world, rdv, 20000);
  o.shard_layout = s.layout;
  o.first_bucket_cap_mb = 0.0005 / scale;
  o.bucket_cap_mb = 0.002 / scale;
  ContextHandle h;
  SF_TRY(sf_create(&o, &h.ctx));
  const int64_t n = int64_t(kSizes.size());
  std::vector<std::vector<char>> hostGrads(static_cast<size_t>(n)), hostParams(static_cast<size_t>(n));
  for (int64_t id = 0; id < n; ++id) {
    int64_t got = -1;
    const bool hostGrad = s.hostOwned && (id == 0 || id == 3);
    if (hostGrad) {
      hostGrads[size_t(id)].assign(size_t(kSizes[size_t(id)]) * esize, 0);
      SF_TRY(sf_register_gradient(h.ctx, hostGrads[size_t(id)].data(), kSizes[size_t(id)], s.dtype,
                                  SF_DEVICE_HOST, nullptr, &got));
    } else {
      SF_TRY(sf_add_gradient(h.ctx, kSizes[size_t(id)], s.dtype, SF_DEVICE_HOST, nullptr, &got));
    }
    if (s.layout != SF_SHARD_NONE) {
      const bool hostParam = s.hostOwned && (id == 1 || id == 3);
      void* data = nullptr;
      if (hostParam) {
        hostParams[size_t(id)].assign(size_t(kSizes[size_t(id)]) * esize, 0);
        data = hostParams[size_t(id)].data();
      }
      SF_TRY(sf_register_parameter(h.ctx, id, data, kSizes[size_t(id)], s.dtype, SF_DEVICE_HOST));
    }
  }
  std::vector<void*> grad(static_cast<size_t>(n)), param(static_cast<size_t>(n));
  std::vector<std::vector<char>> unshardedParams(static_cast<size_t>(n));
  std::vector<int64_t> bucketOf(static_cast<size_t>(n)), begin(static_cast<size_t>(n)), count(static_cast<size_t>(n));
  std::vector<std::vector<double>> velocity(static_cast<size_t>(n));
  for (int64_t id = 0; id < n; ++id) {
    SF_TRY(sf_gradient_data(h.ctx, id, &grad[size_t(id)]));
    if (s.layout != SF_SHARD_NONE) {
      SF_TRY(sf_parameter_data(h.ctx, id, &param[size_t(id)]));
    } else {
      unshardedParams[size_t(id)].assign(size_t(kSizes[size_t(id)]) * esize, 0);
      param[size_t(id)] = unshardedParams[size_t(id)].data();
    }
    for (int64_t j = 0; j < kSizes[size_t(id)]; ++j) {
      store(param[size_t(id)], j, s.dtype, initialParam(id, j));
    }
    SF_TRY(sf_gradient_bucket(h.ctx, id, &bucketOf[size_t(id)]));
    SF_TRY(sf_shard_range(h.ctx, id, &begin[size_t(id)], &count[size_t(id)]));
    velocity[size_t(id)].assign(size_t(kSizes[size_t(id)]), 0.0);
    run.owned += count[size_t(id)];
  }
  run.buckets = statsOf(h.ctx).bucket_count;

  auto accumulate = [&](int window, int micro) {
    for (int64_t id = 0; id < n; ++id) {
      if (id == kUnused) continue;
      for (int64_t j = 0; j < kSizes[size_t(id)]; ++j) {
        store(grad[size_t(id)], j, s.dtype,
              load(grad[size_t(id)], j, s.dtype) + gradValue(rank, window, micro, id, j));
      }
    }
  };
  auto stepTensor = [&](int64_t id) {
    for (int64_t j = begin[size_t(id)]; j < begin[size_t(id)] + count[size_t(id)]; ++j) {
      double& v = velocity[size_t(id)][size_t(j)];
      v = kMomentum * v + load(grad[size_t(id)], j, s.dtype);
      store(param[size_t(id)], j, s.dtype, load(param[size_t(id)], j, s.dtype) - kLr * v);
    }
  };

  for (int w = 0; w < int(s.windows.size()); ++w) {
    const int64_t before = statsOf(h.ctx).collectives_issued;
    if (s.windows[size_t(w)] > 1) {
      SF_TRY(sf_begin_accumulation(h.ctx));
      for (int m = 0; m + 1 < s.windows[size_t(w)]; ++m) accumulate(w, m);
      SF_TRY(sf_end_accumulation(h.ctx));
    }
    run.collectivesInsideWindows += statsOf(h.ctx).collectives_issued - before;
    accumulate(w, s.windows[size_t(w)] - 1);
    if (s.perBucket) {
      SF_TRY(sf_synchronize_start(h.ctx));
      for (int64_t b = 0; b < run.buckets; ++b) {
        SF_TRY(sf_wait_bucket(h.ctx, b));
        for (int64_t id = 0; id < n; ++id) {
          if (bucketOf[size_t(id)] == b) stepTensor(id);
        }
        if (s.layout != SF_SHARD_NONE) SF_TRY(sf_start_gather(h.ctx, b));
      }
      SF_TRY(sf_synchronize(h.ctx));
      if (s.layout != SF_SHARD_NONE) {
        for (int64_t b = run.buckets - 1; b >= 0; --b) SF_TRY(sf_wait_gather(h.ctx, b));
      }
    } else {
      SF_TRY(sf_synchronize(h.ctx));
      for (int64_t id = 0; id < n; ++id) stepTensor(id);
      if (s.layout != SF_SHARD_NONE) SF_TRY(sf_gather_parameters(h.ctx));
    }
    SF_TRY(sf_zero_gradients(h.ctx));
  }
  for (int64_t id = 0; id < n; ++id) {
    std::vector<double> v;
    for (int64_t j = 0; j < kSizes[size_t(id)]; ++j) v.push_back(load(param[size_t(id)], j, s.dtype));
    run.params.push_back(v);
  }
  run.stats = statsOf(h.ctx);
  return run;
}

std::vector<Run> trainAll(const Setup& s) {
  const std::string rdv = "memory://" + uniqueName("sharded");
  return runThreadRanks<Run>(s.world, [&](int r) { return trainRank(s, r, rdv); });
}

// The same training in double precision in one process: the exact result.
std::vector<std::vector<double>> reference(const Setup& s) {
  std::vector<std::vector<double>> p, v;
  for (int64_t id = 0; id < int64_t(kSizes.size()); ++id) {
    p.emplace_back();
    for (int64_t j = 0; j < kSizes[size_t(id)]; ++j) p.back().push_back(initialParam(id, j));
    v.emplace_back(size_t(kSizes[size_t(id)]), 0.0);
  }
  for (int w = 0; w < int(s.windows.size()); ++w) {
    for (int64_t id = 0; id < int64_t(kSizes.size()); ++id) {
      for (int64_t j = 0; j < kSizes[size_t(id)]; ++j) {
        double g = 0;
        if (id != kUnused) {
          for (int r = 0; r < s.world; ++r) {
            for (int m = 0; m < s.windows[size_t(w)]; ++m) g += gradValue(r, w, m, id, j);
          }
        }
        g /= s.world;
        double& vel = v[size_t(id)][size_t(j)];
        vel = kMomentum * vel + g;
        p[size_t(id)][size_t(j)] -= kLr * vel;
      }
    }
  }
  return p;
}

double worstError(const std::vector<std::vector<double>>& a,
                  const std::vector<std::vector<double>>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t j = 0; j < a[i].size(); ++j) {
      worst = std::max(worst, std::fabs(a[i][j] - b[i][j]) / (1.0 + std::fabs(b[i][j])));
    }
  }
  return worst;
}

// Every rank of the sharded run equals the unsharded run (bit for bit: the
// reduced gradients are exact and the step is the same code) and the exact
// reference; the counts are one reduce-scatter and one all-gather per bucket
// per window, none inside a window.
void checkParity(Setup s) {
  const std::vector<Run> sharded = trainAll(s);
  const sf_shard_layout layout = s.layout;
  s.layout = SF_SHARD_NONE;
  const std::vector<Run> plain = trainAll(s);
  const auto exact = reference(s);
  const double tol = s.dtype == SF_DTYPE_FLOAT64 ? 1e-12 : s.dtype == SF_DTYPE_FLOAT32 ? 1e-6 : 5e-2;
  const int64_t windows = int64_t(s.windows.size());
  int64_t gradientBytes = 0;
  for (int64_t n : kSizes) gradientBytes += n * int64_t(sfsync::dtypeSize(s.dtype));
  int64_t ownedTotal = 0;
  for (int r = 0; r < s.world; ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_REQUIRE_MESSAGE(sharded[size_t(r)].error.empty(), sharded[size_t(r)].error);
      BOOST_REQUIRE_MESSAGE(plain[size_t(r)].error.empty(), plain[size_t(r)].error);
      BOOST_TEST(worstError(sharded[size_t(r)].params, plain[size_t(r)].params) == 0.0);
      BOOST_TEST(worstError(sharded[size_t(r)].params, exact) <= tol);
      BOOST_TEST(worstError(plain[size_t(r)].params, exact) <= tol);
      const Run& x = sharded[size_t(r)];
      BOOST_TEST(x.buckets == 3);
      BOOST_TEST(x.collectivesInsideWindows == 0);
      BOOST_TEST(x.stats.collectives_issued == windows * x.buckets);
      BOOST_TEST(x.stats.reduce_scatters == (layout == SF_SHARD_NONE ? 0 : windows * x.buckets));
      BOOST_TEST(x.stats.all_gathers == windows * x.buckets);
      BOOST_TEST(x.stats.bytes_gathered == windows * gradientBytes);
      BOOST_TEST(x.stats.bytes_reduced == windows * gradientBytes);
      BOOST_TEST(plain[size_t(r)].stats.reduce_scatters == 0);
      BOOST_TEST(plain[size_t(r)].stats.all_gathers == 0);
      ownedTotal += x.owned;
    }
  }
  int64_t total = 0;
  for (int64_t n : kSizes) total += n;
  BOOST_TEST(ownedTotal == total);  // the shards partition the model
}

}  // namespace

BOOST_AUTO_TEST_SUITE(sharded_tests)

BOOST_AUTO_TEST_CASE(flat_float32_matches_unsharded_and_reference_w_1_2_3_4_gloo) {
  for (int w : {1, 2, 3, 4}) {
    BOOST_TEST_CONTEXT("W = " << w) {
      Setup s;
      s.world = w;
      checkParity(s);
    }
  }
}

BOOST_AUTO_TEST_CASE(parameter_float32_per_bucket_host_owned_w_2_3_4_gloo) {
  for (int w : {2, 3, 4}) {
    BOOST_TEST_CONTEXT("W = " << w) {
      Setup s;
      s.world = w;
      s.layout = SF_SHARD_PARAMETER;
      s.perBucket = true;
      s.hostOwned = true;
      checkParity(s);
    }
  }
}

BOOST_AUTO_TEST_CASE(flat_host_owned_per_bucket_float64_3_ranks_gloo) {
  Setup s;
  s.world = 3;
  s.dtype = SF_DTYPE_FLOAT64;
  s.perBucket = true;
  s.hostOwned = true;
  s.windows = {2, 1, 4};
  checkParity(s);
}

BOOST_AUTO_TEST_CASE(bfloat16_both_layouts_4_ranks_gloo) {
  for (sf_shard_layout layout : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
    BOOST_TEST_CONTEXT("layout " << layout) {
      Setup s;
      s.world = 4;
      s.dtype = SF_DTYPE_BFLOAT16;
      s.layout = layout;
      s.perBucket = layout == SF_SHARD_FLAT;
      checkParity(s);
    }
  }
}

BOOST_AUTO_TEST_CASE(shard_ranges_partition_each_gradient_flat_3_ranks_gloo) {
  // Rank r's ranges: flat = the bucket's r-th third, so #0 (1000 floats in a
  // bucket of its own, segments of 336) is split 336 / 336 / 328.
  const std::string rdv = "memory://" + uniqueName("ranges");
  struct R {
    std::string error;
    int64_t off = -1, cnt = -1, unOff = -1, unCnt = -1;
  };
  auto runs = runThreadRanks<R>(3, [&](int r) {
    R out;
    sf_options o = rankOptions(r, 3, rdv);
    o.shard_layout = SF_SHARD_FLAT;
    ContextHandle h;
    if (sf_create(&o, &h.ctx) != SF_OK) { out.error = sf_last_error(); return out; }
    int64_t id;
    sf_add_gradient(h.ctx, 1000, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
    sf_register_parameter(h.ctx, id, nullptr, 1000, SF_DTYPE_FLOAT32, SF_DEVICE_HOST);
    if (sf_shard_range(h.ctx, id, &out.off, &out.cnt) != SF_OK) out.error = sf_last_error();
    return out;
  });
  const int64_t expectOff[] = {0, 336, 672}, expectCnt[] = {336, 336, 328};
  for (int r = 0; r < 3; ++r) {
    BOOST_REQUIRE_MESSAGE(runs[size_t(r)].error.empty(), runs[size_t(r)].error);
    BOOST_TEST(runs[size_t(r)].off == expectOff[r]);
    BOOST_TEST(runs[size_t(r)].cnt == expectCnt[r]);
  }
  // Unsharded: the whole gradient.
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int64_t id, off = -1, cnt = -1;
  sf_add_gradient(h.ctx, 77, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
  BOOST_TEST(sf_shard_range(h.ctx, id, &off, nullptr) == SF_OK);
  BOOST_TEST(sf_shard_range(h.ctx, id, nullptr, &cnt) == SF_OK);
  BOOST_TEST(off == 0);
  BOOST_TEST(cnt == 77);
}

BOOST_AUTO_TEST_CASE(sharded_calls_on_an_unsharded_context_say_the_layout) {
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int64_t id;
  BOOST_REQUIRE(sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "w", &id) == SF_OK);
  BOOST_TEST(sf_register_parameter(h.ctx, id, nullptr, 16, SF_DTYPE_FLOAT32, SF_DEVICE_HOST) ==
             SF_ERR_INVALID_STATE);
  BOOST_TEST(std::string(sf_last_error()).find("shard_layout = none") != std::string::npos,
             sf_last_error());
  BOOST_TEST(sf_synchronize(h.ctx) == SF_OK);
  void* p = nullptr;
  BOOST_TEST(sf_parameter_data(h.ctx, id, &p) == SF_ERR_INVALID_STATE);
  BOOST_TEST(sf_start_gather(h.ctx, 0) == SF_ERR_INVALID_STATE);
  BOOST_TEST(std::string(sf_last_error()).find("sf_start_gather") != std::string::npos);
  BOOST_TEST(sf_wait_gather(h.ctx, -1) == SF_ERR_INVALID_STATE);
  BOOST_TEST(sf_gather_parameters(h.ctx) == SF_ERR_INVALID_STATE);
  // Per-bucket completion works unsharded.
  BOOST_TEST(sf_synchronize_start(h.ctx) == SF_OK);
  BOOST_TEST(sf_wait_bucket(h.ctx, 0) == SF_OK);
  BOOST_TEST(sf_wait_bucket(h.ctx, 0) == SF_OK);  // twice is free
  BOOST_TEST(sf_synchronize(h.ctx) == SF_OK);
  BOOST_TEST(statsOf(h.ctx).collectives_issued == 2);
}

BOOST_AUTO_TEST_CASE(bad_inputs_are_named) {
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  BOOST_TEST(sf_set_shard_layout(h.ctx, 7) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("layout = 7") != std::string::npos, sf_last_error());
  BOOST_TEST(sf_set_shard_layout(h.ctx, SF_SHARD_PARAMETER) == SF_OK);
  int64_t a, b;
  BOOST_REQUIRE(sf_add_gradient(h.ctx, 4, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "a", &a) == SF_OK);
  BOOST_REQUIRE(sf_add_gradient(h.ctx, 8, SF_DTYPE_FLOAT64, SF_DEVICE_HOST, "b", &b) == SF_OK);
  // Size, dtype, device unlike the gradient: named with both values.
  BOOST_TEST(sf_register_parameter(h.ctx, a, nullptr, 5, SF_DTYPE_FLOAT32, SF_DEVICE_HOST) ==
             SF_ERR_INVALID_ARGUMENT);
  std::string e = sf_last_error();
  BOOST_TEST((e.find("numel = 5") != std::string::npos && e.find("numel = 4") != std::string::npos), e);
  BOOST_TEST(sf_register_parameter(h.ctx, a, nullptr, 4, SF_DTYPE_BFLOAT16, SF_DEVICE_HOST) ==
             SF_ERR_INVALID_ARGUMENT);
  e = sf_last_error();
  BOOST_TEST((e.find("dtype = 3") != std::string::npos && e.find("float32") != std::string::npos), e);
  BOOST_TEST(sf_register_parameter(h.ctx, a, nullptr, 4, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA) ==
             SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("device = 1") != std::string::npos, sf_last_error());
  BOOST_TEST(sf_register_parameter(h.ctx, 9, nullptr, 4, SF_DTYPE_FLOAT32, SF_DEVICE_HOST) ==
             SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("id = 9") != std::string::npos, sf_last_error());
  BOOST_TEST(sf_register_parameter(h.ctx, a, nullptr, 4, SF_DTYPE_FLOAT32, SF_DEVICE_HOST) == SF_OK);
  BOOST_TEST(sf_register_parameter(h.ctx, a, nullptr, 4, SF_DTYPE_FLOAT32, SF_DEVICE_HOST) ==
             SF_ERR_INVALID_ARGUMENT);  // twice
  // A gradient without a parameter: the build names it.
  BOOST_TEST(sf_build_buckets(h.ctx) == SF_ERR_INVALID_STATE);
  BOOST_TEST(std::string(sf_last_error()).find("gradient 1 ('b')") != std::string::npos,
             sf_last_error());
  std::vector<double> hostB(8, 1.0);
  BOOST_TEST(sf_register_parameter(h.ctx, b, hostB.data(), 8, SF_DTYPE_FLOAT64, SF_DEVICE_HOST) ==
             SF_OK);
  BOOST_TEST(sf_build_buckets(h.ctx) == SF_OK);
  BOOST_TEST(sf_set_shard_layout(h.ctx, SF_SHARD_FLAT) == SF_ERR_INVALID_STATE);
  BOOST_TEST(sf_register_parameter(h.ctx, b, nullptr, 8, SF_DTYPE_FLOAT64, SF_DEVICE_HOST) ==
             SF_ERR_INVALID_STATE);  // after the build
  void* p = nullptr;
  BOOST_TEST(sf_parameter_data(h.ctx, b, &p) == SF_OK);
  BOOST_TEST(p == static_cast<void*>(hostB.data()));
  BOOST_TEST(sf_parameter_data(h.ctx, b, nullptr) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(sf_gradient_bucket(h.ctx, 2, &a) == SF_ERR_INVALID_ARGUMENT);
  // Waits for what never started; gathers before synchronization.
  BOOST_TEST(sf_wait_bucket(h.ctx, 0) == SF_ERR_INVALID_STATE);
  BOOST_TEST(std::string(sf_last_error()).find("bucket 0 was not started") != std::string::npos,
             sf_last_error());
  BOOST_TEST(sf_wait_bucket(h.ctx, 2) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(sf_wait_bucket(h.ctx, -1) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(sf_start_gather(h.ctx, 0) == SF_ERR_INVALID_STATE);
  BOOST_TEST(std::string(sf_last_error()).find("gathering before synchronization") !=
                 std::string::npos,
             sf_last_error());
  BOOST_TEST(sf_start_gather(h.ctx, -1) == SF_ERR_INVALID_STATE);
  BOOST_TEST(sf_start_gather(h.ctx, 5) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(sf_start_gather(h.ctx, -2) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(sf_wait_gather(h.ctx, 0) == SF_ERR_INVALID_STATE);
  BOOST_TEST(std::string(sf_last_error()).find("never started") != std::string::npos);
  BOOST_TEST(statsOf(h.ctx).all_gathers == 0);  // nothing started by the refused calls
  // Window 1: synchronized; a gather is allowed once, a wait twice.
  BOOST_TEST(sf_synchronize(h.ctx) == SF_OK);
  BOOST_TEST(sf_wait_bucket(h.ctx, 0) == SF_OK);
  BOOST_TEST(sf_start_gather(h.ctx, 0) == SF_OK);
  BOOST_TEST(sf_start_gather(h.ctx, 0) == SF_ERR_INVALID_STATE);
  BOOST_TEST(sf_wait_gather(h.ctx, 0) == SF_OK);
  BOOST_TEST(sf_wait_gather(h.ctx, 0) == SF_OK);
  // Window 2 has begun: window 1's reduction does not count as its own.
  BOOST_TEST(sf_begin_accumulation(h.ctx) == SF_OK);
  BOOST_TEST(sf_wait_bucket(h.ctx, 0) == SF_ERR_INVALID_STATE);
  BOOST_TEST(sf_start_gather(h.ctx, 1) == SF_ERR_INVALID_STATE);
  BOOST_TEST(sf_synchronize_start(h.ctx) == SF_ERR_INVALID_STATE);  // inside a window
  BOOST_TEST(sf_end_accumulation(h.ctx) == SF_OK);
  BOOST_TEST(sf_synchronize_start(h.ctx) == SF_OK);
  BOOST_TEST(sf_begin_accumulation(h.ctx) == SF_ERR_INVALID_STATE);  // not yet complete
  BOOST_TEST(sf_synchronize(h.ctx) == SF_OK);
  BOOST_TEST(sf_gather_parameters(h.ctx) == SF_OK);
  const sf_stats s = statsOf(h.ctx);
  BOOST_TEST(s.reduce_scatters == 2 * s.bucket_count);
  BOOST_TEST(s.all_gathers == 1 + s.bucket_count);
}

BOOST_AUTO_TEST_CASE(allreduce_float64_sums_and_checks_counts_3_thread_ranks_gloo) {
  const std::string rdv = "memory://" + uniqueName("f64");
  struct R {
    std::string error;
    std::vector<double> v;
    sf_status bad = SF_OK, inWindow = SF_OK, mismatch = SF_OK, afterMismatch = SF_OK;
  };
  auto runs = runThreadRanks<R>(3, [&](int r) {
    R out;
    sf_options o = rankOptions(r, 3, rdv, 10000);
    ContextHandle h;
    if (sf_create(&o, &h.ctx) != SF_OK) { out.error = sf_last_error(); return out; }
    out.v = {double(r), 0.5 * r, 1e300 * (r == 1)};
    if (sf_allreduce_float64(h.ctx, out.v.data(), 3) != SF_OK) out.error = sf_last_error();
    out.bad = sf_allreduce_float64(h.ctx, nullptr, 2);
    sf_begin_accumulation(h.ctx);
    out.inWindow = sf_allreduce_float64(h.ctx, out.v.data(), 1);
    sf_end_accumulation(h.ctx);
    std::vector<double> x(4, 1.0);
    out.mismatch = sf_allreduce_float64(h.ctx, x.data(), r == 2 ? 4 : 3);
    out.afterMismatch = sf_allreduce_float64(h.ctx, x.data(), 0);
    return out;
  });
  for (int r = 0; r < 3; ++r) {
    BOOST_REQUIRE_MESSAGE(runs[size_t(r)].error.empty(), runs[size_t(r)].error);
    BOOST_TEST(runs[size_t(r)].v == (std::vector<double>{3.0, 1.5, 1e300}),
               boost::test_tools::per_element());
    BOOST_TEST(runs[size_t(r)].bad == SF_ERR_INVALID_ARGUMENT);
    BOOST_TEST(runs[size_t(r)].inWindow == SF_ERR_INVALID_STATE);
    BOOST_TEST(runs[size_t(r)].mismatch == SF_ERR_MISMATCH);
    BOOST_TEST(runs[size_t(r)].afterMismatch == SF_OK);
  }
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  double one = 2.5;
  BOOST_TEST(sf_allreduce_float64(h.ctx, &one, 1) == SF_OK);  // free at world size 1
  BOOST_TEST(one == 2.5);
  BOOST_TEST(sf_allreduce_float64(h.ctx, &one, -1) == SF_ERR_INVALID_ARGUMENT);
}

BOOST_AUTO_TEST_CASE(out_of_step_ranks_fail_in_a_sharded_bucket_3_thread_ranks_gloo) {
  // Rank 2 counts one window more; each rank checks its own segment's
  // window-check slot, and every rank fails.
  const std::string rdv = "memory://" + uniqueName("step");
  struct R {
    std::string error, message;
    sf_status second = SF_OK;
  };
  auto runs = runThreadRanks<R>(3, [&](int r) {
    R out;
    sf_options o = rankOptions(r, 3, rdv, 10000);
    o.shard_layout = SF_SHARD_FLAT;
    ContextHandle h;
    if (sf_create(&o, &h.ctx) != SF_OK) { out.error = sf_last_error(); return out; }
    for (int64_t n : {100, 3000}) {
      int64_t id;
      sf_add_gradient(h.ctx, n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
      sf_register_parameter(h.ctx, id, nullptr, n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST);
    }
    if (sf_synchronize(h.ctx) != SF_OK) { out.error = sf_last_error(); return out; }
    const int begins = r == 2 ? 2 : 1;
    for (int i = 0; i < begins; ++i) {
      sf_begin_accumulation(h.ctx);
      sf_end_accumulation(h.ctx);
    }
    out.second = sf_synchronize(h.ctx);
    out.message = sf_last_error();
    return out;
  });
  for (const auto& r : runs) {
    BOOST_REQUIRE_MESSAGE(r.error.empty(), r.error);
    BOOST_TEST(r.second == SF_ERR_MISMATCH);
    BOOST_TEST(r.message.find("out of step") != std::string::npos, r.message);
  }
}

BOOST_AUTO_TEST_CASE(lost_peer_during_reduce_scatter_and_gather_ends_within_the_timeout_2_thread_ranks_gloo) {
  const int64_t timeoutMs = 1000;
  for (bool inGather : {false, true}) {
    BOOST_TEST_CONTEXT((inGather ? "gather" : "reduce-scatter")) {
      const std::string rdv = "memory://" + uniqueName("lost");
      std::atomic<bool> rank0Done{false};
      struct R {
        std::string error;
        sf_status status = SF_OK;
        double seconds = 0;
        std::string message;
      };
      auto runs = runThreadRanks<R>(2, [&](int r) {
        R out;
        sf_options o = rankOptions(r, 2, rdv, timeoutMs);
        o.shard_layout = SF_SHARD_PARAMETER;
        ContextHandle h;
        if (sf_create(&o, &h.ctx) != SF_OK) { out.error = sf_last_error(); return out; }
        for (int g = 0; g < 4; ++g) {
          int64_t id;
          sf_add_gradient(h.ctx, 4096, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
          sf_register_parameter(h.ctx, id, nullptr, 4096, SF_DTYPE_FLOAT32, SF_DEVICE_HOST);
        }
        if (sf_synchronize(h.ctx) != SF_OK) { out.error = sf_last_error(); return out; }
        if (inGather && sf_synchronize(h.ctx) != SF_OK) { out.error = sf_last_error(); return out; }
        if (r == 1) {  // silent from now on, until rank 0 has seen the failure
          while (!rank0Done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
          return out;
        }
        const auto t0 = Clock::now();
        out.status = inGather ? sf_gather_parameters(h.ctx) : sf_synchronize(h.ctx);
        out.message = sf_last_error();
        out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        rank0Done.store(true);
        return out;
      });
      BOOST_REQUIRE_MESSAGE(runs[0].error.empty(), runs[0].error);
      BOOST_REQUIRE_MESSAGE(runs[1].error.empty(), runs[1].error);
      BOOST_TEST(runs[0].status == SF_ERR_TIMEOUT, runs[0].message);
      BOOST_TEST(runs[0].seconds < 1.0 + 2.0 + 1.0);  // the timeout + the documented slack + load
    }
  }
}

BOOST_AUTO_TEST_CASE(shard_env_variable_is_parsed) {
  ::setenv("SF_SHARD", "parameter", 1);
  sf_options o;
  BOOST_TEST(sf_options_init(&o, sizeof o) == SF_OK);
  BOOST_TEST(o.shard_layout == SF_SHARD_PARAMETER);
  ::setenv("SF_SHARD", "zero3", 1);
  BOOST_TEST(sf_options_init(&o, sizeof o) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("SF_SHARD='zero3'") != std::string::npos,
             sf_last_error());
  ::unsetenv("SF_SHARD");
  BOOST_TEST(sf_options_init(&o, sizeof o) == SF_OK);
  BOOST_TEST(o.shard_layout == SF_SHARD_NONE);
  o.shard_layout = 3;
  sf_context* ctx = nullptr;
  BOOST_TEST(sf_create(&o, &ctx) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("shard_layout = 3") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(trace_has_reduce_scatters_and_gathers_with_their_bytes_2_thread_ranks_gloo) {
  // One bucket of 4000 float32 (W = 2): segments of U = 2000 plus a 16-element
  // window-check slot; each rank sends (W-1) x 2016 x 4 bytes in the reduce-scatter
  // and (W-1) x 2000 x 4 in the all-gather, per window.
  const std::string dir = "/tmp/" + uniqueName("sfshardtrace");
  BOOST_REQUIRE(::system(("mkdir -p " + dir).c_str()) == 0);
  ::setenv("SF_TRACE", (dir + "/trace.json").c_str(), 1);
  const std::string rdv = "memory://" + uniqueName("trace");
  auto errors = runThreadRanks<std::string>(2, [&](int r) -> std::string {
    sf_options o = rankOptions(r, 2, rdv);
    o.shard_layout = SF_SHARD_FLAT;
    ContextHandle h;
    if (sf_create(&o, &h.ctx) != SF_OK) return sf_last_error();
    for (int64_t n : {1000, 3000}) {
      int64_t id;
      sf_add_gradient(h.ctx, n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
      sf_register_parameter(h.ctx, id, nullptr, n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST);
    }
    for (int w = 0; w < 2; ++w) {
      if (sf_synchronize(h.ctx) != SF_OK || sf_gather_parameters(h.ctx) != SF_OK) {
        return sf_last_error();
      }
    }
    return "";
  });
  ::unsetenv("SF_TRACE");
  for (int r = 0; r < 2; ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_REQUIRE_MESSAGE(errors[size_t(r)].empty(), errors[size_t(r)]);
      std::ifstream f(dir + "/trace.rank" + std::to_string(r) + ".json");
      BOOST_REQUIRE(f.good());
      boost::property_tree::ptree root;
      boost::property_tree::read_json(f, root);
      std::map<std::string, int> count;
      std::map<std::string, int64_t> wireBytes;
      int reduceScatterLaunches = 0;
      for (const auto& kv : root.get_child("traceEvents")) {
        const auto& e = kv.second;
        const std::string name = e.get<std::string>("name");
        ++count[name];
        if (name == "reduce_scatter" || name == "all_gather") {
          wireBytes[name] += e.get<int64_t>("args.wire_bytes");
        }
        if (name == "launch" && e.get<std::string>("args.collective") == "reduce_scatter") {
          ++reduceScatterLaunches;
        }
      }
      BOOST_TEST(count["reduce_scatter"] == 2);
      BOOST_TEST(count["all_gather"] == 2);
      BOOST_TEST(count["gather"] == 2);
      BOOST_TEST(count["gathered"] == 2);
      BOOST_TEST(reduceScatterLaunches == 2);
      BOOST_TEST(wireBytes["reduce_scatter"] == 2 * 2016 * 4);
      BOOST_TEST(wireBytes["all_gather"] == 2 * 2000 * 4);
    }
  }
  BOOST_TEST(::system(("rm -rf " + dir).c_str()) == 0);
}

BOOST_AUTO_TEST_SUITE_END()
