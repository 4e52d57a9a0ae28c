// Sharded windows over NCCL (issue 17) on the CUDA and NCCL stand-ins: CUDA
// gradients and plugin-owned CUDA parameters, reduce-scatter at
// synchronization (ncclReduceScatter in place; since 0.5, where segments
// hold padding, a group of ncclReduce over the used elements), the host's
// step on its own part, the gather (ncclAllGather in place, or a group of
// ncclBroadcast); every rank ends with the same, exact weights. Ranks are
// threads, each on GPU `rank`.

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "sfsync.h"
#include "tests/nccl/nccl_support.h"
#include "tests/support/thread_ranks.h"

extern "C" int64_t sfStandinShardCounter(const char* name);
extern "C" void sfStandinInProgressMode(int on);

using namespace sftest;

namespace {

// What the stand-in saw (every rank of this process): collectives and
// elements of the reduce-scatters (ncclReduceScatter, or ncclReduce per
// segment) and of the gathers (ncclAllGather, or ncclBroadcast per segment).
struct ShardWire {
  int64_t reduceCalls = 0, reduceElems = 0, gatherCalls = 0, gatherElems = 0;
  static ShardWire now() {
    ShardWire w;
    w.reduceCalls = sfStandinShardCounter("ncclReduceScatter") + sfStandinNcclCounter("ncclReduce");
    w.reduceElems =
        sfStandinShardCounter("ncclReduceScatter_elems") + sfStandinNcclCounter("ncclReduce_elems");
    w.gatherCalls = sfStandinShardCounter("ncclAllGather") + sfStandinNcclCounter("ncclBroadcast");
    w.gatherElems =
        sfStandinShardCounter("ncclAllGather_elems") + sfStandinNcclCounter("ncclBroadcast_elems");
    return w;
  }
  ShardWire since(const ShardWire& before) const {
    return {reduceCalls - before.reduceCalls, reduceElems - before.reduceElems,
            gatherCalls - before.gatherCalls, gatherElems - before.gatherElems};
  }
};

struct ShardRun {
  std::string error;
  std::vector<std::vector<double>> params;
  sf_stats stats{};
  sf_status earlyGather = SF_OK;
  std::vector<std::vector<char>> gradients;  // after sf_gather_gradients (when asked)
  int64_t gradientGathers = 0;               // all_gathers it added
};

// Gradient `p` of a run with `registered` is the host's cudaMalloc'd buffer
// (its bucket then travels through a device staging buffer).
bool registeredGradient(int p) { return p == 0 || p == 3; }
constexpr double kSentinel = 1000.0;

// gatherGradients: device gradients #0 and #3 registered (cudaMalloc), and
// after synchronization what this rank does not own is overwritten with a
// sentinel and sf_gather_gradients makes every gradient whole again.
ShardRun trainSharded(int rank, int world, const std::string& rdv, sf_shard_layout layout,
                      const std::vector<int64_t>& sizes, double lr, bool gatherGradients = false,
                      sf_reduce_op op = SF_REDUCE_AVERAGE, double prescale = 1.0) {
  ShardRun out;
  sf_options o = rankOptions(rank, world, rdv);
  o.local_rank = rank;
  o.shard_layout = layout;
  o.reduce_op = op;
  o.prescale = prescale;
  o.bucket_cap_mb = 1024.0 / 1048576.0;
  o.first_bucket_cap_mb = 512.0 / 1048576.0;
  // The host's device buffers outlive the context (declared before it).
  std::vector<void*> own(sizes.size(), nullptr);
  struct Freed {
    std::vector<void*>& p;
    ~Freed() {
      for (void* x : p) cudaFree(x);
    }
  } freed{own};
  ContextHandle h;
  auto failed = [&](sf_status st) {
    if (st != SF_OK && out.error.empty()) out.error = sf_last_error();
    return st != SF_OK;
  };
  if (failed(sf_create(&o, &h.ctx))) return out;
  const int n = int(sizes.size());
  for (int p = 0; p < n; ++p) {
    int64_t id;
    if (gatherGradients && registeredGradient(p)) {
      cudaSetDevice(rank);  // this rank's GPU (local_rank)
      cudaMalloc(&own[size_t(p)], size_t(sizes[size_t(p)]) * 4);
      if (failed(sf_register_gradient(h.ctx, own[size_t(p)], sizes[size_t(p)], SF_DTYPE_FLOAT32,
                                      SF_DEVICE_CUDA, nullptr, &id))) {
        return out;
      }
    } else if (failed(sf_add_gradient(h.ctx, sizes[size_t(p)], SF_DTYPE_FLOAT32, SF_DEVICE_CUDA,
                                      nullptr, &id))) {
      return out;
    }
    if (
        failed(sf_register_parameter(h.ctx, id, nullptr, sizes[size_t(p)], SF_DTYPE_FLOAT32,
                                     SF_DEVICE_CUDA))) {
      return out;
    }
  }
  std::vector<void*> g(static_cast<size_t>(n), nullptr), w(static_cast<size_t>(n), nullptr);
  std::vector<int64_t> off(static_cast<size_t>(n)), cnt(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    if (failed(sf_gradient_data(h.ctx, p, &g[size_t(p)])) ||
        failed(sf_parameter_data(h.ctx, p, &w[size_t(p)])) ||
        failed(sf_shard_range(h.ctx, p, &off[size_t(p)], &cnt[size_t(p)]))) {
      return out;
    }
    for (int64_t i = 0; i < sizes[size_t(p)]; ++i) {  // stand-in device memory is host-visible
      storeValue(g[size_t(p)], i, SF_DTYPE_FLOAT32, gradValue(rank, 0, 0, p, i));
      storeValue(w[size_t(p)], i, SF_DTYPE_FLOAT32, 0.5 * double(p) + 0.125 * double(i % 3));
    }
  }
  if (failed(sf_synchronize_start(h.ctx))) return out;
  if (failed(sf_wait_bucket(h.ctx, 0))) return out;
  if (failed(sf_synchronize(h.ctx))) return out;
  drain(nullptr);
  if (gatherGradients) {
    for (int p = 0; p < n; ++p) {
      for (int64_t i = 0; i < sizes[size_t(p)]; ++i) {
        if (i < off[size_t(p)] || i >= off[size_t(p)] + cnt[size_t(p)]) {
          storeValue(g[size_t(p)], i, SF_DTYPE_FLOAT32, kSentinel);
        }
      }
    }
    const int64_t before = statsOf(h.ctx).all_gathers;
    if (failed(sf_gather_gradients(h.ctx))) return out;
    drain(nullptr);
    out.gradientGathers = statsOf(h.ctx).all_gathers - before;
    for (int p = 0; p < n; ++p) {
      const char* x = static_cast<const char*>(g[size_t(p)]);
      out.gradients.emplace_back(x, x + size_t(sizes[size_t(p)]) * 4);
    }
  }
  for (int p = 0; p < n; ++p) {
    for (int64_t i = off[size_t(p)]; i < off[size_t(p)] + cnt[size_t(p)]; ++i) {
      storeValue(w[size_t(p)], i, SF_DTYPE_FLOAT32,
                 loadValue(w[size_t(p)], i, SF_DTYPE_FLOAT32) -
                     lr * loadValue(g[size_t(p)], i, SF_DTYPE_FLOAT32));
    }
  }
  if (failed(sf_gather_parameters(h.ctx))) return out;
  drain(nullptr);
  for (int p = 0; p < n; ++p) {
    out.params.emplace_back();
    for (int64_t i = 0; i < sizes[size_t(p)]; ++i) {
      out.params.back().push_back(loadValue(w[size_t(p)], i, SF_DTYPE_FLOAT32));
    }
  }
  out.stats = statsOf(h.ctx);
  return out;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(nccl_sharded_tests)

BOOST_AUTO_TEST_CASE(threads3_flat_and_parameter_reduce_scatter_step_gather) {
  const std::vector<int64_t> sizes = {300, 17, 200, 5, 64};
  const double lr = 0.5;
  for (sf_shard_layout layout : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
    BOOST_TEST_CONTEXT("layout " << layout) {
      const int world = 3;
      const std::string rdv = "memory://" + uniqueName("nccl-shard");
      const ShardWire before = ShardWire::now();
      auto runs = runThreadRanks<ShardRun>(world, [&](int r) {
        return trainSharded(r, world, rdv, layout, sizes, lr);
      });
      int64_t buckets = 0;
      for (int r = 0; r < world; ++r) {
        BOOST_REQUIRE_MESSAGE(runs[size_t(r)].error.empty(), runs[size_t(r)].error);
        buckets = runs[size_t(r)].stats.bucket_count;
        BOOST_TEST(runs[size_t(r)].stats.reduce_scatters == buckets);
        BOOST_TEST(runs[size_t(r)].stats.all_gathers == buckets);
        for (size_t p = 0; p < sizes.size(); ++p) {
          for (int64_t i = 0; i < sizes[p]; ++i) {
            double avg = 0;
            for (int q = 0; q < world; ++q) avg += gradValue(q, 0, 0, int(p), i);
            avg /= world;
            const double want = 0.5 * double(p) + 0.125 * double(i % 3) - lr * avg;
            if (std::abs(runs[size_t(r)].params[p][size_t(i)] - want) > 1e-5) {
              BOOST_ERROR("rank " << r << " parameter " << p << "[" << i << "] = "
                                  << runs[size_t(r)].params[p][size_t(i)] << ", want " << want);
              break;
            }
          }
        }
      }
      BOOST_TEST(buckets > 1);
      // At least one collective per bucket and rank; the gradients' elements
      // once per rank (padding off the wire).
      const ShardWire wire = ShardWire::now().since(before);
      int64_t total = 0;
      for (int64_t n : sizes) total += n;
      BOOST_TEST(wire.reduceCalls >= world * buckets);
      BOOST_TEST(wire.gatherCalls >= world * buckets);
      BOOST_TEST(wire.reduceElems == world * total);
      BOOST_TEST(wire.gatherElems == world * total);
    }
  }
}

BOOST_AUTO_TEST_CASE(threads3_gather_gradients_makes_device_gradients_whole) {
  // sf_gather_gradients (0.4) on CUDA buckets: one ncclAllGather per bucket
  // over the gradient storage, device staging for the registered gradients;
  // then the parameter gather as before.
  const std::vector<int64_t> sizes = {300, 17, 200, 5, 64};
  const double lr = 0.5;
  for (sf_shard_layout layout : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
    BOOST_TEST_CONTEXT("layout " << layout) {
      const int world = 3;
      const std::string rdv = "memory://" + uniqueName("nccl-shard-grads");
      const ShardWire before = ShardWire::now();
      auto runs = runThreadRanks<ShardRun>(world, [&](int r) {
        return trainSharded(r, world, rdv, layout, sizes, lr, true);
      });
      int64_t buckets = 0;
      for (int r = 0; r < world; ++r) {
        const ShardRun& x = runs[size_t(r)];
        BOOST_REQUIRE_MESSAGE(x.error.empty(), x.error);
        buckets = x.stats.bucket_count;
        BOOST_TEST(x.gradientGathers == buckets);
        BOOST_TEST(x.stats.all_gathers == 2 * buckets);  // gradients, then parameters
        BOOST_REQUIRE(x.gradients.size() == sizes.size());
        for (size_t p = 0; p < sizes.size(); ++p) {
          for (int64_t i = 0; i < sizes[p]; ++i) {
            double avg = 0;
            for (int q = 0; q < world; ++q) avg += gradValue(q, 0, 0, int(p), i);
            avg /= world;
            const double got = loadValue(x.gradients[p].data(), i, SF_DTYPE_FLOAT32);
            if (got != avg) {
              BOOST_ERROR("rank " << r << " gradient " << p << "[" << i << "] = " << got
                                  << ", want " << avg);
              break;
            }
          }
          BOOST_TEST((x.gradients[p] == runs[0].gradients[p]), "rank " << r << " gradient " << p);
          for (int64_t i = 0; i < sizes[p]; ++i) {
            double avg = 0;
            for (int q = 0; q < world; ++q) avg += gradValue(q, 0, 0, int(p), i);
            const double want = 0.5 * double(p) + 0.125 * double(i % 3) - lr * avg / world;
            if (std::abs(x.params[p][size_t(i)] - want) > 1e-5) {
              BOOST_ERROR("rank " << r << " parameter " << p << "[" << i << "] = "
                                  << x.params[p][size_t(i)] << ", want " << want);
              break;
            }
          }
        }
      }
      BOOST_TEST(buckets > 1);
      const ShardWire wire = ShardWire::now().since(before);
      int64_t total = 0;
      for (int64_t n : sizes) total += n;
      BOOST_TEST(wire.gatherCalls >= world * 2 * buckets);
      BOOST_TEST(wire.gatherElems == world * 2 * total);  // gradients, then parameters
    }
  }
}

BOOST_AUTO_TEST_CASE(threads2_and_3_uneven_shards_move_only_used_elements) {
  // The parameter layout gives each rank whole parameters, so the ranks'
  // segments of a bucket have uneven used lengths (300 alone in a bucket:
  // {300, 0} at 2 ranks); the flat layout pads its last segment. The
  // reduce-scatter and both gathers move each segment's used elements:
  // per rank and per collective kind the bucket sizes summed (as Gloo's
  // ring), not world_size * segment (found on an H100: the parameter layout
  // carried 3.0x DDP's NCCL bytes instead of 1.5x). The results stay exact.
  const std::vector<int64_t> sizes = {300, 17, 200, 5, 64};
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  const double lr = 0.5;
  for (int world : {2, 3}) {
    for (sf_shard_layout layout : {SF_SHARD_PARAMETER, SF_SHARD_FLAT}) {
      BOOST_TEST_CONTEXT("world " << world << ", layout " << layout) {
        const std::string rdv = "memory://" + uniqueName("nccl-shard-used");
        const ShardWire before = ShardWire::now();
        auto runs = runThreadRanks<ShardRun>(world, [&](int r) {
          return trainSharded(r, world, rdv, layout, sizes, lr, true);
        });
        for (int r = 0; r < world; ++r) {
          const ShardRun& x = runs[size_t(r)];
          BOOST_REQUIRE_MESSAGE(x.error.empty(), x.error);
          BOOST_REQUIRE(x.gradients.size() == sizes.size());
          for (size_t p = 0; p < sizes.size(); ++p) {
            for (int64_t i = 0; i < sizes[p]; ++i) {
              double avg = 0;
              for (int q = 0; q < world; ++q) avg += gradValue(q, 0, 0, int(p), i);
              avg /= world;  // exact in float32 (gradValue's quarters)
              const double got = loadValue(x.gradients[p].data(), i, SF_DTYPE_FLOAT32);
              const float want = float(0.5 * double(p) + 0.125 * double(i % 3) - lr * avg);  // as the step
              const float param = float(x.params[p][size_t(i)]);
              if (got != avg || std::memcmp(&param, &want, 4) != 0) {
                BOOST_ERROR("rank " << r << " gradient " << p << "[" << i << "] = " << got << " (want "
                                    << avg << "), parameter " << param << " (want " << want << ")");
                break;
              }
            }
            BOOST_TEST((x.gradients[p] == runs[0].gradients[p]), "rank " << r << " gradient " << p);
            BOOST_TEST((x.params[p] == runs[0].params[p]), "rank " << r << " parameter " << p);
          }
        }
        // Every rank (a thread of this process) counted: world_size times.
        // The wire counts (sf_stats: the reduce-scatter and the gradient
        // gather's gradients, the parameter gather's parameters) say what
        // the collectives moved.
        const ShardWire wire = ShardWire::now().since(before);
        int64_t counted = 0;
        for (const ShardRun& x : runs) counted += x.stats.wire_gradient_bytes + x.stats.wire_parameter_bytes;
        BOOST_TEST(counted == 4 * (wire.reduceElems + wire.gatherElems));
        if (layout == SF_SHARD_PARAMETER) {
          // Uneven shards, padding a large share: only the used elements.
          BOOST_TEST(wire.reduceElems == world * total);
          BOOST_TEST(wire.gatherElems == world * 2 * total);  // gradients, then parameters
          for (const ShardRun& x : runs) {
            BOOST_TEST(x.stats.wire_gradient_bytes == 2 * total * 4);
            BOOST_TEST(x.stats.wire_parameter_bytes == total * 4);
          }
        } else {
          // These small flat buckets: whole segments where their padding is
          // at most a sixteenth (one reduce-scatter), the used elements where
          // more; never fewer than the used elements.
          BOOST_TEST(wire.reduceElems >= world * total);
          BOOST_TEST(wire.gatherElems >= world * 2 * total);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(threads2_flat_padding_of_a_few_elements_keeps_one_reduce_scatter) {
  // A flat bucket of 1001 elements at 2 ranks: segments of 512 (the plan
  // aligns them), 23 elements of padding in 1024: not worth two grouped
  // ncclReduce and two ncclBroadcast: one ncclReduceScatter and one
  // ncclAllGather per collective, whole segments, and the wire counts say so.
  const std::vector<int64_t> sizes = {1001};
  const int world = 2;
  const std::string rdv = "memory://" + uniqueName("nccl-shard-flat-few");
  const ShardWire before = ShardWire::now();
  const int64_t reduces0 = sfStandinNcclCounter("ncclReduce");
  const int64_t broadcasts0 = sfStandinNcclCounter("ncclBroadcast");
  auto runs = runThreadRanks<ShardRun>(world, [&](int r) {
    return trainSharded(r, world, rdv, SF_SHARD_FLAT, sizes, 0.5, true);
  });
  for (const ShardRun& x : runs) {
    BOOST_REQUIRE_MESSAGE(x.error.empty(), x.error);
    BOOST_TEST(x.stats.bucket_count == 1);
    BOOST_TEST(x.stats.wire_gradient_bytes == 2 * 2 * 512 * 4);  // reduce-scatter + gradient gather
    BOOST_TEST(x.stats.wire_parameter_bytes == 2 * 512 * 4);
  }
  const ShardWire wire = ShardWire::now().since(before);
  BOOST_TEST(sfStandinNcclCounter("ncclReduce") == reduces0);
  BOOST_TEST(sfStandinNcclCounter("ncclBroadcast") == broadcasts0);
  BOOST_TEST(wire.reduceCalls == world);      // one ncclReduceScatter per rank
  BOOST_TEST(wire.gatherCalls == world * 2);  // gradients, then parameters
  BOOST_TEST(wire.reduceElems == world * 2 * 512);
}

BOOST_AUTO_TEST_CASE(threads2_uneven_shards_prescaled_sum_settles_before_the_operator_goes) {
  // The used elements' group of ncclReduce with one pre-multiplied sum
  // operator, in the stand-in's in-progress mode (every call, a group's end
  // too, returns ncclInProgress; destroying the operator before it settled
  // fails the communicator): exact, and the operator outlives the group.
  const std::vector<int64_t> sizes = {300, 17, 200, 5, 64};
  const int world = 2;
  const double prescale = 0.5;
  const std::string rdv = "memory://" + uniqueName("nccl-shard-premul");
  const int64_t reduces0 = sfStandinNcclCounter("ncclReduce");
  sfStandinInProgressMode(1);
  auto runs = runThreadRanks<ShardRun>(world, [&](int r) {
    return trainSharded(r, world, rdv, SF_SHARD_PARAMETER, sizes, 0.5, true, SF_REDUCE_PRESCALED_SUM,
                        prescale);
  });
  sfStandinInProgressMode(0);
  BOOST_TEST(sfStandinNcclCounter("ncclReduce") > reduces0);
  for (int r = 0; r < world; ++r) {
    const ShardRun& x = runs[size_t(r)];
    BOOST_REQUIRE_MESSAGE(x.error.empty(), x.error);
    for (size_t p = 0; p < sizes.size(); ++p) {
      for (int64_t i = 0; i < sizes[p]; ++i) {
        double sum = 0;
        for (int q = 0; q < world; ++q) sum += gradValue(q, 0, 0, int(p), i);
        const double got = loadValue(x.gradients[p].data(), i, SF_DTYPE_FLOAT32);
        if (got != prescale * sum) {
          BOOST_ERROR("rank " << r << " gradient " << p << "[" << i << "] = " << got << ", want "
                              << prescale * sum);
          break;
        }
      }
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
