// sf_gather_gradients (Since 0.4) through libsfsync.so, ranks as threads over
// memory:// (Gloo): after a sharded window every rank's whole gradients equal
// the exact average (or sum / prescaled sum), bitwise alike on every rank,
// for both layouts, W = 2, 3, 4 (bucket sizes W does not divide), plugin-owned
// and registered gradients, float32 and bfloat16 buckets and the staged
// window-check bucket; one all-gather per bucket; the parameter gathers after
// it still exact; the states in which it is refused, with their messages.

#include <boost/test/unit_test.hpp>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "plugin/core/dtype.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

// Registration order; the buckets (one dtype each, a first bucket per dtype
// of 718 bytes or more) are [#6 #5 #4] float32, [#3 #2] bfloat16, [#1 #0]
// float32: 180, 397 and 1007 elements. In the flat layout the window check rides in the smallest
// float32 bucket, whose #6 straddles segments: that bucket is staged (the
// window-check slots cut #6). #4 is too small for every rank to own a part, #5
// never gets a gradient (an unused parameter).
struct Tensor {
  int64_t numel;
  sf_dtype dtype;
};
const std::vector<Tensor> kModel = {{1000, SF_DTYPE_FLOAT32}, {7, SF_DTYPE_FLOAT32},
                                    {333, SF_DTYPE_BFLOAT16}, {64, SF_DTYPE_BFLOAT16},
                                    {1, SF_DTYPE_FLOAT32},    {50, SF_DTYPE_FLOAT32},
                                    {129, SF_DTYPE_FLOAT32}};
constexpr int64_t kUnused = 5;
constexpr double kSentinel = 1000.0;  // exact in bfloat16: a skipped element shows
constexpr double kLr = 0.5;

// The common part of every rank's gradient (quarters of small integers) plus
// a part that sums to zero over the ranks (eighths): the average is exactly
// base(), every partial sum exact even in bfloat16.
double base(int window, int micro, int64_t id, int64_t j) {
  return double((id * 11 + j + window * 5 + micro * 3) % 9 - 4) * 0.25;
}
double gradValue(int world, int rank, int window, int micro, int64_t id, int64_t j) {
  return base(window, micro, id, j) + double(2 * rank - (world - 1)) * 0.125 * double(j % 3 - 1);
}
double initialParam(int64_t id, int64_t j) { return double((id * 13 + j) % 7 - 3) * 0.125; }

void store(void* p, int64_t i, sf_dtype dtype, double v) {
  if (dtype == SF_DTYPE_FLOAT32) {
    static_cast<float*>(p)[i] = float(v);
  } else {
    static_cast<uint16_t*>(p)[i] = sfsync::floatToBf16(float(v));
  }
}
double load(const void* p, int64_t i, sf_dtype dtype) {
  return dtype == SF_DTYPE_FLOAT32 ? static_cast<const float*>(p)[i]
                                   : sfsync::bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
}

struct Setup {
  int world = 2;
  sf_shard_layout layout = SF_SHARD_FLAT;
  bool registered = false;  // #0, #3 and #6 host-owned gradients (staged buckets)
  sf_reduce_op op = SF_REDUCE_AVERAGE;
  double prescale = 1.0;
};

// The factor that turns the exact average into what the reduction yields.
double expectedFactor(const Setup& s) {
  if (s.op == SF_REDUCE_SUM) return s.world;
  if (s.op == SF_REDUCE_PRESCALED_SUM) return s.world * s.prescale;
  return 1.0;
}

struct Rank {
  std::string error;
  int64_t buckets = 0;
  std::set<sf_dtype> bucketDtypes;
  // Per window: every gradient's bytes after sf_gather_gradients.
  std::vector<std::vector<std::vector<char>>> gathered;
  std::vector<int64_t> gathersPerCall;       // all_gathers added by each first call per window
  std::vector<int64_t> collectivesPerCall;   // collectives_issued added by it (0)
  int64_t repeatGathers = -1;                // all_gathers added by a second call
  std::vector<std::vector<double>> params;   // after window 0's parameter gather
  sf_stats stats{};
};

#define SF_TRY(call)                                             \
  do {                                                           \
    if ((call) != SF_OK) {                                       \
      out.error = std::string(#call) + ": " + sf_last_error();   \
      return out;                                                \
    }                                                            \
  } while (0)

// Two windows. Window 0 (one micro-batch): synchronize, overwrite what this
// rank does not own with a sentinel, gather the gradients (twice), step the
// own range, gather the parameters. Window 1 (two micro-batches, one inside
// sf_begin/end_accumulation): synchronize, sentinel, gather.
Rank runRank(const Setup& s, int rank, const std::string& rdv) {
  Rank out;
  sf_options o = rankOptions(rank, s.world, rdv, 20000);
  o.shard_layout = s.layout;
  o.reduce_op = s.op;
  o.prescale = s.prescale;
  o.bucket_cap_mb = 1.0;
  o.first_bucket_cap_mb = 718.0 / 1048576.0;  // each dtype's first bucket: 718 bytes or more
  ContextHandle h;
  SF_TRY(sf_create(&o, &h.ctx));
  const int64_t n = int64_t(kModel.size());
  std::vector<std::vector<char>> hostGrads(static_cast<size_t>(n));
  for (int64_t id = 0; id < n; ++id) {
    const Tensor& t = kModel[size_t(id)];
    int64_t got = -1;
    if (s.registered && (id == 0 || id == 3 || id == 6)) {
      hostGrads[size_t(id)].assign(size_t(t.numel) * sfsync::dtypeSize(t.dtype), 0);
      SF_TRY(sf_register_gradient(h.ctx, hostGrads[size_t(id)].data(), t.numel, t.dtype,
                                  SF_DEVICE_HOST, nullptr, &got));
    } else {
      SF_TRY(sf_add_gradient(h.ctx, t.numel, t.dtype, SF_DEVICE_HOST, nullptr, &got));
    }
    SF_TRY(sf_register_parameter(h.ctx, id, nullptr, t.numel, t.dtype, SF_DEVICE_HOST));
  }
  std::vector<void*> grad(static_cast<size_t>(n)), param(static_cast<size_t>(n));
  std::vector<int64_t> begin(static_cast<size_t>(n)), count(static_cast<size_t>(n));
  for (int64_t id = 0; id < n; ++id) {
    SF_TRY(sf_gradient_data(h.ctx, id, &grad[size_t(id)]));
    SF_TRY(sf_parameter_data(h.ctx, id, &param[size_t(id)]));
    SF_TRY(sf_shard_range(h.ctx, id, &begin[size_t(id)], &count[size_t(id)]));
    for (int64_t j = 0; j < kModel[size_t(id)].numel; ++j) {
      store(param[size_t(id)], j, kModel[size_t(id)].dtype, initialParam(id, j));
    }
  }
  out.buckets = statsOf(h.ctx).bucket_count;
  for (int64_t b = 0; b < out.buckets; ++b) {
    sf_dtype d;
    SF_TRY(sf_bucket_info(h.ctx, b, nullptr, nullptr, &d));
    out.bucketDtypes.insert(d);
  }
  auto accumulate = [&](int window, int micro) {
    for (int64_t id = 0; id < n; ++id) {
      if (id == kUnused) continue;
      const sf_dtype d = kModel[size_t(id)].dtype;
      for (int64_t j = 0; j < kModel[size_t(id)].numel; ++j) {
        store(grad[size_t(id)], j, d,
              load(grad[size_t(id)], j, d) + gradValue(s.world, rank, window, micro, id, j));
      }
    }
  };
  auto sentinelAndGather = [&]() -> bool {
    for (int64_t id = 0; id < n; ++id) {
      for (int64_t j = 0; j < kModel[size_t(id)].numel; ++j) {
        if (j >= begin[size_t(id)] && j < begin[size_t(id)] + count[size_t(id)]) continue;
        store(grad[size_t(id)], j, kModel[size_t(id)].dtype, kSentinel);
      }
    }
    const sf_stats before = statsOf(h.ctx);
    if (sf_gather_gradients(h.ctx) != SF_OK) {
      out.error = std::string("sf_gather_gradients: ") + sf_last_error();
      return false;
    }
    const sf_stats after = statsOf(h.ctx);
    out.gathersPerCall.push_back(after.all_gathers - before.all_gathers);
    out.collectivesPerCall.push_back(after.collectives_issued - before.collectives_issued);
    out.gathered.emplace_back();
    for (int64_t id = 0; id < n; ++id) {
      const char* p = static_cast<const char*>(grad[size_t(id)]);
      out.gathered.back().emplace_back(
          p, p + size_t(kModel[size_t(id)].numel) * sfsync::dtypeSize(kModel[size_t(id)].dtype));
    }
    return true;
  };

  // Window 0.
  accumulate(0, 0);
  SF_TRY(sf_synchronize(h.ctx));
  if (!sentinelAndGather()) return out;
  const int64_t again = statsOf(h.ctx).all_gathers;
  SF_TRY(sf_gather_gradients(h.ctx));  // whole already: free
  out.repeatGathers = statsOf(h.ctx).all_gathers - again;
  for (int64_t id = 0; id < n; ++id) {
    const sf_dtype d = kModel[size_t(id)].dtype;
    for (int64_t j = begin[size_t(id)]; j < begin[size_t(id)] + count[size_t(id)]; ++j) {
      store(param[size_t(id)], j, d, load(param[size_t(id)], j, d) - kLr * load(grad[size_t(id)], j, d));
    }
  }
  SF_TRY(sf_gather_parameters(h.ctx));
  for (int64_t id = 0; id < n; ++id) {
    out.params.emplace_back();
    for (int64_t j = 0; j < kModel[size_t(id)].numel; ++j) {
      out.params.back().push_back(load(param[size_t(id)], j, kModel[size_t(id)].dtype));
    }
  }
  SF_TRY(sf_zero_gradients(h.ctx));

  // Window 1.
  SF_TRY(sf_begin_accumulation(h.ctx));
  accumulate(1, 0);
  SF_TRY(sf_end_accumulation(h.ctx));
  accumulate(1, 1);
  SF_TRY(sf_synchronize(h.ctx));
  if (!sentinelAndGather()) return out;
  out.stats = statsOf(h.ctx);
  return out;
}

void checkGather(const Setup& s) {
  const std::string rdv = "memory://" + uniqueName("grad-gather");
  const std::vector<Rank> ranks =
      runThreadRanks<Rank>(s.world, [&](int r) { return runRank(s, r, rdv); });
  const double factor = expectedFactor(s);
  for (int r = 0; r < s.world; ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      const Rank& x = ranks[size_t(r)];
      BOOST_REQUIRE_MESSAGE(x.error.empty(), x.error);
      BOOST_TEST(x.buckets == 3);
      BOOST_TEST((x.bucketDtypes == std::set<sf_dtype>{SF_DTYPE_FLOAT32, SF_DTYPE_BFLOAT16}));
      // One all-gather per bucket per call, no reduction; a repeat is free.
      BOOST_TEST(x.gathersPerCall == std::vector<int64_t>(2, x.buckets), boost::test_tools::per_element());
      BOOST_TEST(x.collectivesPerCall == std::vector<int64_t>(2, 0), boost::test_tools::per_element());
      BOOST_TEST(x.repeatGathers == 0);
      BOOST_TEST(x.stats.collectives_issued == 2 * x.buckets);
      BOOST_TEST(x.stats.reduce_scatters == 2 * x.buckets);
      BOOST_TEST(x.stats.all_gathers == 3 * x.buckets);  // two gradient gathers, one parameter gather
      for (int w = 0; w < 2; ++w) {
        for (size_t id = 0; id < kModel.size(); ++id) {
          const Tensor& t = kModel[id];
          const std::vector<char>& got = x.gathered[size_t(w)][id];
          int64_t wrong = 0, first = -1;
          for (int64_t j = 0; j < t.numel; ++j) {
            double want = 0;
            if (int64_t(id) != kUnused) {
              for (int m = 0; m <= w; ++m) want += base(w, m, int64_t(id), j);
            }
            if (load(got.data(), j, t.dtype) != want * factor) {
              if (wrong++ == 0) first = j;
            }
          }
          BOOST_TEST(wrong == 0, "window " << w << " gradient #" << id << ": " << wrong
                                           << " elements differ from the exact value, the first "
                                           << first);
          // Bitwise the same on every rank.
          BOOST_TEST((got == ranks[0].gathered[size_t(w)][id]),
                     "window " << w << " gradient #" << id << " differs from rank 0's");
        }
      }
      // The parameter gather after the gradient gather: exact on every rank.
      for (size_t id = 0; id < kModel.size(); ++id) {
        for (int64_t j = 0; j < kModel[id].numel; ++j) {
          const double g = int64_t(id) == kUnused ? 0.0 : base(0, 0, int64_t(id), j) * factor;
          const double want = initialParam(int64_t(id), j) - kLr * g;
          if (x.params[id][size_t(j)] != want) {
            BOOST_ERROR("parameter #" << id << "[" << j << "] = " << x.params[id][size_t(j)]
                                      << ", want " << want);
            break;
          }
        }
      }
    }
  }
}

// Ranks run a script of calls; what each returned (status, message) comes
// back for the test thread to check.
struct Outcome {
  sf_status status;
  std::string message;
  int64_t gathers;      // all_gathers added by the call
  int64_t collectives;  // collectives_issued added by the call
};

struct Script {
  std::string error;  // a step that had to succeed failed
  std::vector<Outcome> calls;
};

Outcome gatherOnce(sf_context* ctx) {
  const sf_stats before = statsOf(ctx);
  const sf_status st = sf_gather_gradients(ctx);
  const sf_stats after = statsOf(ctx);
  return {st, st == SF_OK ? std::string() : std::string(sf_last_error()),
          after.all_gathers - before.all_gathers,
          after.collectives_issued - before.collectives_issued};
}

void expectRefused(const Outcome& o, const std::vector<std::string>& words, const std::string& what) {
  BOOST_TEST_CONTEXT(what) {
    BOOST_TEST(o.status == SF_ERR_INVALID_STATE);
    for (const auto& w : words) {
      BOOST_TEST(o.message.find(w) != std::string::npos, "'" << w << "' not in: " << o.message);
    }
    BOOST_TEST(o.gathers == 0);
    BOOST_TEST(o.collectives == 0);
  }
}

void expectDone(const Outcome& o, int64_t gathers, const std::string& what) {
  BOOST_TEST_CONTEXT(what) {
    BOOST_TEST(o.status == SF_OK, o.message);
    BOOST_TEST(o.gathers == gathers);
    BOOST_TEST(o.collectives == 0);
  }
}

// In a script's body (a void lambda with a Script& out).
#define SCRIPT_TRY(call)                                          \
  do {                                                            \
    if ((call) != SF_OK) {                                        \
      out.error = std::string(#call) + ": " + sf_last_error();    \
      return;                                                     \
    }                                                             \
  } while (0)

// One sharded (or unsharded) context with two float32 buckets of 50 and 30
// elements; `body` runs the script on it.
template <typename Body>
Script withContext(int rank, int world, const std::string& rdv, sf_shard_layout layout, Body body) {
  Script out;
  sf_options o = rankOptions(rank, world, rdv, 20000);
  o.shard_layout = layout;
  o.first_bucket_cap_mb = 100.0 / 1048576.0;
  ContextHandle h;
  SF_TRY(sf_create(&o, &h.ctx));
  for (int64_t numel : {int64_t(50), int64_t(30)}) {
    int64_t id;
    SF_TRY(sf_add_gradient(h.ctx, numel, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id));
    if (layout != SF_SHARD_NONE) {
      SF_TRY(sf_register_parameter(h.ctx, id, nullptr, numel, SF_DTYPE_FLOAT32, SF_DEVICE_HOST));
    }
  }
  SF_TRY(sf_build_buckets(h.ctx));
  body(h.ctx, out);
  return out;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(sharded_gradient_gather_tests)

BOOST_AUTO_TEST_CASE(flat_whole_gradients_exact_and_alike_w_2_3_4_gloo) {
  for (int world : {2, 3, 4}) {
    for (bool registered : {false, true}) {
      BOOST_TEST_CONTEXT("W = " << world << (registered ? ", registered" : ", plugin-owned")) {
        Setup s;
        s.world = world;
        s.registered = registered;
        checkGather(s);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(parameter_whole_gradients_exact_and_alike_w_2_3_4_gloo) {
  for (int world : {2, 3, 4}) {
    for (bool registered : {false, true}) {
      BOOST_TEST_CONTEXT("W = " << world << (registered ? ", registered" : ", plugin-owned")) {
        Setup s;
        s.world = world;
        s.layout = SF_SHARD_PARAMETER;
        s.registered = registered;
        checkGather(s);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(sum_and_prescaled_sum_are_gathered_as_reduced_3_thread_ranks_gloo) {
  for (sf_shard_layout layout : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
    BOOST_TEST_CONTEXT("layout " << layout) {
      Setup s;
      s.world = 3;
      s.layout = layout;
      s.registered = true;
      s.op = SF_REDUCE_SUM;
      checkGather(s);
      s.op = SF_REDUCE_PRESCALED_SUM;
      s.prescale = 0.5;
      checkGather(s);
    }
  }
}

BOOST_AUTO_TEST_CASE(refused_states_are_named_and_issue_nothing_2_thread_ranks_gloo) {
  const int world = 2;
  const std::string rdv = "memory://" + uniqueName("grad-gather-states");
  const auto scripts = runThreadRanks<Script>(world, [&](int r) {
    return withContext(r, world, rdv, SF_SHARD_FLAT, [&](sf_context* ctx, Script& out) {
      const int64_t buckets = statsOf(ctx).bucket_count;
      out.calls.push_back(gatherOnce(ctx));  // 0: before any synchronization
      SCRIPT_TRY(sf_begin_accumulation(ctx));
      out.calls.push_back(gatherOnce(ctx));  // 1: inside the window
      SCRIPT_TRY(sf_end_accumulation(ctx));
      out.calls.push_back(gatherOnce(ctx));  // 2: window ended, nothing started
      SCRIPT_TRY(sf_synchronize_start(ctx));
      out.calls.push_back(gatherOnce(ctx));  // 3: reductions in flight
      for (int64_t b = 0; b < buckets; ++b) SCRIPT_TRY(sf_wait_bucket(ctx, b));
      out.calls.push_back(gatherOnce(ctx));  // 4: every bucket waited: gathers
      SCRIPT_TRY(sf_synchronize(ctx));
      out.calls.push_back(gatherOnce(ctx));  // 5: again after sf_synchronize: free
      // The next window: its parameter gather first, then the gradients.
      SCRIPT_TRY(sf_synchronize(ctx));
      SCRIPT_TRY(sf_start_gather(ctx, 0));
      out.calls.push_back(gatherOnce(ctx));  // 6: after a parameter gather started
      SCRIPT_TRY(sf_wait_gather(ctx, -1));
      SCRIPT_TRY(sf_synchronize(ctx));
      out.calls.push_back(gatherOnce(ctx));  // 7: a new window: gathers
      SCRIPT_TRY(sf_begin_accumulation(ctx));
      SCRIPT_TRY(sf_end_accumulation(ctx));
      out.calls.push_back(gatherOnce(ctx));  // 8: after the next window began
      SCRIPT_TRY(sf_synchronize(ctx));
      out.calls.push_back(gatherOnce(ctx));  // 9: its synchronization done: gathers
    });
  });
  for (int r = 0; r < world; ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      const Script& x = scripts[size_t(r)];
      BOOST_REQUIRE_MESSAGE(x.error.empty(), x.error);
      BOOST_REQUIRE(x.calls.size() == 10u);
      const int64_t buckets = 2;
      expectRefused(x.calls[0], {"sf_gather_gradients before synchronization", "sf_synchronize"},
                    "before any synchronization");
      expectRefused(x.calls[1], {"inside an accumulation window", "sf_end_accumulation"},
                    "inside a window");
      expectRefused(x.calls[2], {"before the window's reductions are complete",
                                 "bucket 0's reduction has not started"},
                    "after the end, before the synchronization");
      expectRefused(x.calls[3], {"before the window's reductions are complete",
                                 "bucket 0 is still reducing"},
                    "reductions in flight");
      expectDone(x.calls[4], buckets, "every bucket waited");
      expectDone(x.calls[5], 0, "a repeat");
      expectRefused(x.calls[6], {"after sf_start_gather", "bucket 0's parameter gather",
                                 "gather the gradients first"},
                    "after a parameter gather");
      expectDone(x.calls[7], buckets, "a later window");
      expectRefused(x.calls[8], {"after the next window began", "bucket 0 is not reduced yet"},
                    "the next window began");
      expectDone(x.calls[9], buckets, "that window synchronized");
    }
  }
}

BOOST_AUTO_TEST_CASE(unsharded_and_world_1_issue_no_collective) {
  {
    const int world = 2;
    const std::string rdv = "memory://" + uniqueName("grad-gather-none");
    const auto scripts = runThreadRanks<Script>(world, [&](int r) {
      return withContext(r, world, rdv, SF_SHARD_NONE, [&](sf_context* ctx, Script& out) {
        out.calls.push_back(gatherOnce(ctx));  // before synchronization: the same rule
        SCRIPT_TRY(sf_begin_accumulation(ctx));
        out.calls.push_back(gatherOnce(ctx));  // inside a window: the same rule
        SCRIPT_TRY(sf_end_accumulation(ctx));
        SCRIPT_TRY(sf_synchronize(ctx));
        out.calls.push_back(gatherOnce(ctx));  // whole already
      });
    });
    for (int r = 0; r < world; ++r) {
      BOOST_TEST_CONTEXT("unsharded, rank " << r) {
        const Script& x = scripts[size_t(r)];
        BOOST_REQUIRE_MESSAGE(x.error.empty(), x.error);
        BOOST_REQUIRE(x.calls.size() == 3u);
        expectRefused(x.calls[0], {"before synchronization"}, "before synchronization");
        expectRefused(x.calls[1], {"inside an accumulation window"}, "inside a window");
        expectDone(x.calls[2], 0, "after synchronization");
      }
    }
  }
  for (sf_shard_layout layout : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
    const Script x = withContext(0, 1, "", layout, [&](sf_context* ctx, Script& out) {
      SCRIPT_TRY(sf_synchronize(ctx));
      out.calls.push_back(gatherOnce(ctx));
    });
    BOOST_TEST_CONTEXT("world size 1, layout " << layout) {
      BOOST_REQUIRE_MESSAGE(x.error.empty(), x.error);
      BOOST_REQUIRE(x.calls.size() == 1u);
      expectDone(x.calls[0], 0, "after synchronization");
    }
  }
  BOOST_TEST(sf_gather_gradients(nullptr) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("sf_gather_gradients") != std::string::npos,
             sf_last_error());
}

BOOST_AUTO_TEST_SUITE_END()
