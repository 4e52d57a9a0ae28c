// The reducer's gathers (plugin/reducer/reducer_gather.cpp) through a
// Reducer built directly, without the C ABI: each gradient is handed a
// Stamping backend of this file, a RecordingBackend (tests/support) whose
// all-gathers also write what the other ranks would send: segment k of the
// gathered buffer becomes 1000 * (k + 1) + its element index, for every k
// but this rank's. So the bytes after a gather tell, element by element,
// whether it is this rank's reduced value (its own segment: the mirror sum)
// or came from the right place of the right rank; the log tells which
// collectives ran, in which order and how large. Checked: sf_gather_gradients'
// path (the states it refuses, naming them and issuing nothing; a repeat in
// the same window is free; one all-gather per bucket over the segments with
// their tails; whole gradients for plugin-owned and host-owned gradients in
// both sharded layouts; nothing to do unsharded or alone), and the
// parameter gathers (forward order, their refusals, host-owned parameters
// made whole). The ABI cases (tests/unit/api/sharded_gradient_gather_tests)
// run the same states through a Context; "inside an accumulation window" is
// the Context's refusal, not the reducer's.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/core/error.h"
#include "plugin/core/options.h"
#include "plugin/reducer/reducer.h"
#include "plugin/reducer/shard_plan.h"
#include "tests/support/expect_error.h"
#include "tests/support/recording_backend.h"

using namespace sfsync;
using sftest::Call;
using sftest::RecordingBackend;

namespace {

float stamp(int64_t segment, int64_t element) { return float(1000 * (segment + 1) + element); }

class Stamping : public RecordingBackend {
 public:
  Stamping(std::vector<Call>& log, int world, int rank) : RecordingBackend(log, world, rank), world_(world), rank_(rank) {}
  bool failGathers = false;
  std::unique_ptr<Work> startAllgather(void* data, int64_t segmentElems, sf_dtype dtype,
                                       ReduceSpec spec) override {
    auto work = RecordingBackend::startAllgather(data, segmentElems, dtype, spec);
    if (failGathers) fail(SF_ERR_BACKEND, "all-gather failed (test)");
    float* v = static_cast<float*>(data);
    for (int64_t k = 0; k < world_; ++k) {
      if (k == rank_) continue;
      for (int64_t e = 0; e < segmentElems; ++e) v[k * segmentElems + e] = stamp(k, e);
    }
    return work;
  }

 private:
  int world_;
  int rank_;
};

// What gradient `id` holds at element j before the reduction.
float value(int64_t id, int64_t j) { return float(id * 10 + j % 7 + 1); }

// A Reducer of rank `rank` of `world` over a Stamping backend; float32 host
// gradients of `numels` (registration order), those in `hostOwned`
// registered from host memory, the others plugin-owned; sharded: every
// gradient's parameter, host-owned for the ids in `hostParams`.
struct Bench {
  sf_options opts;  // read by the reducer: outlives it
  std::vector<Call> log;
  std::unique_ptr<Stamping> backend;
  std::unique_ptr<Reducer> red;  // after the backend: destroyed first
  std::vector<std::vector<float>> host, hostParam;
  std::vector<int64_t> numels;
  int world, rank;

  Bench(int world_, int rank_, sf_shard_layout shard, std::vector<int64_t> numels_,
        std::vector<int64_t> hostOwned = {}, std::vector<int64_t> hostParams = {},
        sf_reduce_op op = SF_REDUCE_AVERAGE, double capBytes = 100)
      : numels(std::move(numels_)), world(world_), rank(rank_) {
    setDefaultOptions(opts);
    opts.world_size = world;
    opts.rank = rank;
    opts.shard_layout = shard;
    opts.reduce_op = op;
    opts.bucket_cap_mb = 1.0;
    opts.first_bucket_cap_mb = capBytes / 1048576.0;
    backend = std::make_unique<Stamping>(log, world, rank);
    red = std::make_unique<Reducer>(opts);
    host.resize(numels.size());
    hostParam.resize(numels.size());
    for (size_t id = 0; id < numels.size(); ++id) {
      void* data = nullptr;
      if (std::find(hostOwned.begin(), hostOwned.end(), int64_t(id)) != hostOwned.end()) {
        host[id].assign(size_t(numels[id]), 0.0f);
        data = host[id].data();
      }
      BOOST_REQUIRE_EQUAL(
          red->addGradient(data, numels[id], SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, *backend),
          int64_t(id));
      if (shard == SF_SHARD_NONE) continue;
      void* param = nullptr;
      if (std::find(hostParams.begin(), hostParams.end(), int64_t(id)) != hostParams.end()) {
        hostParam[id].assign(size_t(numels[id]), 0.0f);
        param = hostParam[id].data();
      }
      red->addParameter(int64_t(id), param, numels[id], SF_DTYPE_FLOAT32, SF_DEVICE_HOST);
    }
    red->build();
  }
  // The passes as the Context's WindowClock hands them to the reducer
  // (pass_ref.h): a begin, a grad-ready outside a window or a
  // synchronization opens the next one; a successful synchronization closes it.
  PassRef pass;  // the pass under way, or the last one
  int64_t readyWindow = 0;  // the window number a grad-ready's pass opens with
  const PassRef& opened(int64_t window) {
    if (!pass.open) {
      ++pass.number;
      pass.open = true;
    }
    pass.window = window;
    return pass;
  }
  bool beginPass() {
    if (!red->beginPass(pass.open ? pass.number : pass.number + 1)) return false;
    opened(pass.window);
    return true;
  }
  void markReady(int64_t id, int64_t window) {
    readyWindow = window;
    red->markReady(id, opened(readyWindow));
  }
  void synchronizeStart(int64_t window) { red->synchronizeStart(opened(window)); }
  // The pass closes only once the synchronization succeeded.
  void synchronize(int64_t window) {
    red->synchronize(opened(window));
    pass.open = false;
  }
  void waitBucket(int64_t bucket) { red->waitBucket(bucket, pass); }
  void startGather(int64_t bucket) { red->startGather(bucket, pass); }
  void gatherGradients() { red->gatherGradients(pass); }
  float* grad(int64_t id) { return static_cast<float*>(red->gradientData(id)); }
  float* param(int64_t id) { return static_cast<float*>(red->parameterData(id)); }
  void fill() {
    for (size_t id = 0; id < numels.size(); ++id) {
      for (int64_t j = 0; j < numels[id]; ++j) grad(int64_t(id))[j] = value(int64_t(id), j);
    }
  }
  size_t count(const std::string& op) const {
    size_t n = 0;
    for (const Call& c : log) n += c.op == op ? 1 : 0;
    return n;
  }
  // Each bucket's shard layout as the reducer plans it (the plan and
  // planShards, rank loads carried bucket to bucket), cross-checked against
  // the reducer's shard ranges.
  std::vector<ShardLayout> layouts() {
    std::vector<ShardLayout> out;
    std::vector<int64_t> load;
    for (const PlannedBucket& b : red->plan()) {
      std::vector<int64_t> n;
      for (int64_t id : b.grads) n.push_back(numels[size_t(id)]);
      out.push_back(planShards(n, 4, world, opts.shard_layout, 0, &load));
      for (size_t j = 0; j < b.grads.size(); ++j) {
        const int64_t id = b.grads[j];
        const ShardRange mine = ownedRange(out.back(), out.back().offsets[j], numels[size_t(id)], rank);
        const ShardRange got = red->shardRange(id);
        BOOST_REQUIRE_EQUAL(mine.offset, got.offset);
        BOOST_REQUIRE_EQUAL(mine.count, got.count);
      }
    }
    return out;
  }
  // Gradient id's logical offset in its bucket and the bucket's segment size.
  void where(const std::vector<ShardLayout>& l, int64_t id, int64_t& offset, int64_t& u) {
    const PlannedBucket& b = red->plan()[size_t(red->gradientBucket(id))];
    for (size_t j = 0; j < b.grads.size(); ++j) {
      if (b.grads[j] == id) offset = l[size_t(red->gradientBucket(id))].offsets[j];
    }
    u = l[size_t(red->gradientBucket(id))].shardElems;
  }
};

// `f` must throw `status` naming every fragment.
template <typename F>
void expectRefused(F f, sf_status status, const std::vector<std::string>& fragments) {
  sftest::expectError(f, status, fragments);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(reducer_gather_tests)

// ---- sf_gather_gradients' path -------------------------------------------------

BOOST_AUTO_TEST_CASE(refused_states_are_named_and_issue_nothing_flat_2_ranks_recording) {
  // Two buckets: [#1 (30)] and [#0 (50)].
  Bench b(2, 0, SF_SHARD_FLAT, {50, 30});
  BOOST_REQUIRE_EQUAL(b.red->bucketCount(), 2);
  auto refused = [&](const std::vector<std::string>& words, const char* what) {
    BOOST_TEST_CONTEXT(what) {
      const size_t before = b.log.size();
      const int64_t gathers = b.red->counters().allGathers;
      expectRefused([&] { b.gatherGradients(); }, SF_ERR_INVALID_STATE, words);
      BOOST_TEST(b.log.size() == before);  // nothing issued
      BOOST_TEST(b.red->counters().allGathers == gathers);
    }
  };
  auto gathers = [&](size_t want, const char* what) {
    BOOST_TEST_CONTEXT(what) {
      const size_t before = b.count("allgather");
      const ReducerCounters c = b.red->counters();
      b.gatherGradients();
      BOOST_TEST(b.count("allgather") - before == want);
      BOOST_TEST(b.red->counters().allGathers - c.allGathers == int64_t(want));
      BOOST_TEST(b.red->counters().collectives == c.collectives);  // no reduction
    }
  };
  refused({"sf_gather_gradients before synchronization", "no window's gradients have been reduced yet",
           "call sf_synchronize"},
          "built, before any pass");
  BOOST_TEST(b.beginPass());
  refused({"before the window's reductions are complete", "bucket 0's reduction has not started in this window"},
          "a pass open, nothing started");
  b.synchronizeStart(1);
  refused({"before the window's reductions are complete", "bucket 0 is still reducing (started, not waited for)"},
          "reductions in flight");
  b.waitBucket(0);
  refused({"bucket 1 is still reducing"}, "one bucket waited");
  b.waitBucket(1);
  gathers(2, "every bucket waited");
  b.synchronize(1);
  gathers(0, "a repeat in the same window is free");
  gathers(0, "and again");
  b.synchronize(2);
  b.startGather(0);
  refused({"sf_gather_gradients after sf_start_gather", "bucket 0's parameter gather started in this window",
           "gather the gradients first"},
          "after a parameter gather started");
  b.red->waitGather(-1);
  b.synchronize(3);
  gathers(2, "the next window");
  BOOST_TEST(b.beginPass());
  refused({"after the next window began", "bucket 0 is not reduced yet in the new window"},
          "the next window began");
  // Grad-ready of bucket 0's only gradient (#1) starts it early.
  b.markReady(1, 4);
  refused({"after the next window began", "bucket 0 is reducing in the new window"},
          "a bucket started early in the new window");
  b.synchronize(4);
  gathers(2, "that window synchronized");
}

BOOST_AUTO_TEST_CASE(one_allgather_per_bucket_in_bucket_order_over_segments_and_tails_3_ranks) {
  Bench b(3, 1, SF_SHARD_FLAT, {50, 30, 70});
  b.fill();
  b.synchronize(1);
  const size_t before = b.log.size();
  b.gatherGradients();
  const auto layouts = b.layouts();
  const size_t n = layouts.size();
  BOOST_REQUIRE_EQUAL(b.log.size() - before, n);
  int64_t withTail = 0, bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    const Call& c = b.log[before + i];
    BOOST_TEST(c.op == "allgather");
    BOOST_TEST(c.bucket == int64_t(i));  // bucket order
    // Each segment with its reserved tail (16 floats in the check's carrier).
    BOOST_TEST((c.elems == layouts[i].shardElems || c.elems == layouts[i].shardElems + 16));
    withTail += c.elems == layouts[i].shardElems + 16 ? 1 : 0;
    bytes += b.red->plan()[i].bytes;
  }
  BOOST_TEST(withTail == 1);  // the window check's carrier only
  BOOST_TEST(b.red->counters().bytesGathered == bytes);
  BOOST_TEST(b.red->counters().allGathers == int64_t(n));
}

// The gathered bytes: own segment = the reduction's result (sum over 3
// mirror ranks), every other segment from its rank.
void checkWholeGradients(sf_shard_layout shard, std::vector<int64_t> hostOwned) {
  Bench b(3, 1, shard, {100, 37, 64, 50, 9}, hostOwned, {}, SF_REDUCE_SUM, 400);
  BOOST_REQUIRE(b.red->bucketCount() >= 2);
  b.fill();
  for (int64_t id : hostOwned) {
    for (int64_t j = 0; j < b.numels[size_t(id)]; ++j) b.host[size_t(id)][size_t(j)] = value(id, j);
  }
  b.synchronize(1);
  b.gatherGradients();
  const auto layouts = b.layouts();
  int64_t own = 0, others = 0;
  for (int64_t id = 0; id < int64_t(b.numels.size()); ++id) {
    int64_t offset = 0, u = 0;
    b.where(layouts, id, offset, u);
    const float* g = b.grad(id);
    int64_t wrong = 0, first = -1;
    for (int64_t j = 0; j < b.numels[size_t(id)]; ++j) {
      const int64_t l = offset + j, k = l / u;
      const float want = k == b.rank ? 3.0f * value(id, j) : stamp(k, l % u);
      (k == b.rank ? own : others) += 1;
      if (g[j] != want && wrong++ == 0) first = j;
    }
    BOOST_TEST(wrong == 0, "gradient #" << id << ": " << wrong << " elements wrong, the first " << first
                                         << " = " << (first >= 0 ? g[first] : 0.0f));
  }
  BOOST_TEST(own > 0);  // both kinds of element were checked
  BOOST_TEST(others > 0);
}

BOOST_AUTO_TEST_CASE(whole_gradients_flat_plugin_owned_and_host_owned_3_ranks) {
  for (bool registered : {false, true}) {
    BOOST_TEST_CONTEXT((registered ? "#0 #3 host-owned" : "plugin-owned")) {
      checkWholeGradients(SF_SHARD_FLAT, registered ? std::vector<int64_t>{0, 3} : std::vector<int64_t>{});
    }
  }
}

BOOST_AUTO_TEST_CASE(whole_gradients_parameter_layout_plugin_owned_and_host_owned_3_ranks) {
  for (bool registered : {false, true}) {
    BOOST_TEST_CONTEXT((registered ? "#1 #4 host-owned" : "plugin-owned")) {
      checkWholeGradients(SF_SHARD_PARAMETER, registered ? std::vector<int64_t>{1, 4} : std::vector<int64_t>{});
    }
  }
}

BOOST_AUTO_TEST_CASE(unsharded_and_alone_apply_the_same_rules_and_issue_nothing) {
  {
    Bench b(2, 1, SF_SHARD_NONE, {50, 30});
    expectRefused([&] { b.gatherGradients(); }, SF_ERR_INVALID_STATE, {"before synchronization"});
    b.synchronize(1);
    const size_t before = b.log.size();
    b.gatherGradients();
    BOOST_TEST(b.log.size() == before);
    BOOST_TEST(b.red->counters().allGathers == 0);
    BOOST_TEST(b.beginPass());
    expectRefused([&] { b.gatherGradients(); }, SF_ERR_INVALID_STATE, {"after the next window began"});
  }
  for (sf_shard_layout shard : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
    BOOST_TEST_CONTEXT("world size 1, layout " << shard) {
      Bench b(1, 0, shard, {50, 30});
      b.synchronize(1);
      const size_t before = b.log.size();
      b.gatherGradients();
      BOOST_TEST(b.log.size() == before);
      BOOST_TEST(b.red->counters().allGathers == 0);
    }
  }
}

BOOST_AUTO_TEST_CASE(a_failed_gather_fails_the_reducer_for_good) {
  Bench b(2, 0, SF_SHARD_FLAT, {50, 30});
  b.synchronize(1);
  b.backend->failGathers = true;
  expectRefused([&] { b.gatherGradients(); }, SF_ERR_BACKEND, {"all-gather failed (test)"});
  b.backend->failGathers = false;
  expectRefused([&] { b.gatherGradients(); }, SF_ERR_BACKEND,
                {"failed earlier", "all-gather failed (test)"});
  expectRefused([&] { b.synchronize(2); }, SF_ERR_BACKEND, {"failed earlier"});
}

// ---- Parameter gathers ----------------------------------------------------------

BOOST_AUTO_TEST_CASE(parameter_gathers_need_a_sharded_context) {
  Bench b(2, 0, SF_SHARD_NONE, {50, 30});
  b.synchronize(1);
  for (auto call : {+[](Reducer& r) { r.startGather(-1, PassRef{1, false, 1}); }, +[](Reducer& r) { r.waitGather(-1); }}) {
    expectRefused([&] { call(*b.red); }, SF_ERR_INVALID_STATE, {"needs a sharded context", "shard_layout = none"});
  }
  BOOST_TEST(b.count("allgather") == 0u);
}

BOOST_AUTO_TEST_CASE(parameter_gathers_run_in_forward_order_and_refuse_what_is_wrong_2_ranks) {
  Bench b(2, 0, SF_SHARD_FLAT, {50, 30});
  expectRefused([&] { b.startGather(-1); }, SF_ERR_INVALID_STATE,
                {"sf_start_gather: bucket 1 has not completed its reduction of this window",
                 "gathering before synchronization"});
  expectRefused([&] { b.startGather(2); }, SF_ERR_INVALID_ARGUMENT,
                {"sf_start_gather: bucket = 2 is not a bucket (0..1)"});
  BOOST_TEST(b.count("allgather") == 0u);
  b.synchronize(1);
  expectRefused([&] { b.red->waitGather(1); }, SF_ERR_INVALID_STATE,
                {"sf_wait_gather: bucket 1's gather was never started in this window"});
  const size_t before = b.log.size();
  b.startGather(-1);
  BOOST_REQUIRE_EQUAL(b.log.size() - before, 2u);
  const auto layouts = b.layouts();
  // Forward order (the last bucket first), each over the parameter segments.
  BOOST_TEST(b.log[before].bucket == 1);
  BOOST_TEST(b.log[before + 1].bucket == 0);
  BOOST_TEST(b.log[before].elems == layouts[1].shardElems);
  BOOST_TEST(b.log[before + 1].elems == layouts[0].shardElems);
  expectRefused([&] { b.startGather(0); }, SF_ERR_INVALID_STATE,
                {"sf_start_gather: bucket 0's gather was already started in this window"});
  BOOST_TEST(b.log.size() - before == 2u);
  b.red->waitGather(-1);
  BOOST_TEST(b.red->counters().allGathers == 2);
  // A started bucket -1 skips what is already gathering: bucket 0 alone, then the rest.
  b.synchronize(2);
  b.startGather(0);
  b.startGather(-1);
  BOOST_TEST(b.count("allgather") == 4u);
  b.red->waitGather(0);
  b.red->waitGather(1);
}

BOOST_AUTO_TEST_CASE(host_owned_parameters_are_made_whole_3_ranks) {
  // #0's parameter host-owned, #1's plugin-owned; rank 2 steps its own
  // range (here: writes -(j + 1)), the gather brings the other ranks' parts.
  for (sf_shard_layout shard : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
    BOOST_TEST_CONTEXT("layout " << shard) {
      Bench b(3, 2, shard, {50, 30, 41}, {}, {0});
      b.synchronize(1);
      for (int64_t id = 0; id < 3; ++id) {
        const ShardRange r = b.red->shardRange(id);
        for (int64_t j = r.offset; j < r.offset + r.count; ++j) b.param(id)[j] = -float(j + 1);
      }
      BOOST_TEST(b.param(0) == b.hostParam[0].data());
      b.startGather(-1);
      b.red->waitGather(-1);
      const auto layouts = b.layouts();
      for (int64_t id = 0; id < 3; ++id) {
        int64_t offset = 0, u = 0;
        b.where(layouts, id, offset, u);
        const float* p = b.param(id);
        int64_t wrong = 0;
        for (int64_t j = 0; j < b.numels[size_t(id)]; ++j) {
          const int64_t l = offset + j, k = l / u;
          if (p[j] != (k == 2 ? -float(j + 1) : stamp(k, l % u))) ++wrong;
        }
        BOOST_TEST(wrong == 0, "parameter #" << id);
      }
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
