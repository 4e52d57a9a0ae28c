// A Context over an injected backend (plugin/orchestrator/context.h,
// BackendMaker): whole windows driven through the orchestrator, the reducer
// and its bucket cycles down to a RecordingBackend that writes down every
// call, with no socket, no peer and no thread rank. The recording backend
// plays `world` ranks that hold exactly this rank's values (a mirror): a
// reduction's sum is world times the values, so every scale the reducer asks
// for, the window check's tail and the averaging are checked by the bytes
// they leave, and every collective by the log: which, when, how large.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/orchestrator/context.h"
#include "tests/support/recording_backend.h"
#include "tests/support/thread_ranks.h"

using namespace sfsync;
using sftest::Call;
using sftest::RecordingBackend;

namespace {

// A Context of rank `rank` of `world` whose backends are RecordingBackends
// writing into `log` (one per device, as the default set makes them).
struct Recorded {
  std::vector<Call> log;
  std::vector<sf_device> made;  // the devices the maker was asked for, in order
  std::unique_ptr<Context> ctx;

  explicit Recorded(sf_options o, int world = 2, int rank = 0) {
    o.world_size = world;
    o.rank = rank;
    ctx = std::make_unique<Context>(
        o, [this](sf_device device, const sf_options& opts, const std::shared_ptr<Rendezvous>&) {
          made.push_back(device);
          return std::make_unique<RecordingBackend>(log, opts.world_size, opts.rank);
        });
  }
  std::vector<Call> calls(const std::string& op) const {
    std::vector<Call> out;
    for (const Call& c : log) {
      if (c.op == op) out.push_back(c);
    }
    return out;
  }
};

sf_options smallBuckets(const char* url) {
  sf_options o = sftest::rankOptions(0, 2, url);
  o.bucket_cap_mb = 1024.0 / (1 << 20);  // 1 KiB: one 256-float gradient per bucket
  o.first_bucket_cap_mb = o.bucket_cap_mb;
  return o;
}

// Gradients of 256 floats each, value g + 0.25 * i (exact in float32, and
// after * 2 and * 0.5).
struct Grads {
  std::vector<std::vector<float>> data;
  std::vector<int64_t> ids;
  Grads(Context& ctx, int n) {
    for (int g = 0; g < n; ++g) {
      data.emplace_back(256);
      for (size_t i = 0; i < 256; ++i) data.back()[i] = float(g) + 0.25f * float(i);
      ids.push_back(ctx.registerGradient(data.back().data(), 256, SF_DTYPE_FLOAT32,
                                         SF_DEVICE_HOST, nullptr));
    }
  }
  void readyAll(Context& ctx) {
    // Reverse registration order, as a backward pass reports them.
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) ctx.gradReady(*it);
  }
  float expected(int g, size_t i, float factor) const { return (float(g) + 0.25f * float(i)) * factor; }
};

// One window of `passes` micro-batches: every pass but the last inside it.
void window(Context& ctx, Grads& g, int passes) {
  ctx.beginAccumulation();
  for (int p = 0; p < passes - 1; ++p) g.readyAll(ctx);
  ctx.endAccumulation();
  g.readyAll(ctx);
  ctx.synchronize();
}

}  // namespace

BOOST_AUTO_TEST_SUITE(recording_backend_tests)

BOOST_AUTO_TEST_CASE(a_window_makes_one_allreduce_per_bucket_and_averages) {
  Recorded r(smallBuckets("memory://recording-average"));
  Grads g(*r.ctx, 3);
  window(*r.ctx, g, 4);
  // The host backend, made once; connected once, with the one duplicate-claim
  // control collective, before any gradient collective.
  BOOST_TEST(r.made.size() == 1u);
  BOOST_TEST(r.made[0] == SF_DEVICE_HOST);
  BOOST_REQUIRE(r.log.size() >= 3u);
  BOOST_TEST(r.log[0].op == "host_stream");  // as it was made: the host's stream (none here)
  BOOST_TEST(r.log[1].op == "connect");
  BOOST_TEST(r.calls("connect").size() == 1u);
  const auto reductions = r.calls("allreduce");
  BOOST_REQUIRE_EQUAL(reductions.size(), 3u);  // one bucket per gradient, once
  std::vector<int64_t> buckets;
  int64_t carried = 0;
  for (const Call& c : reductions) {
    buckets.push_back(c.bucket);
    BOOST_TEST(c.dtype == SF_DTYPE_FLOAT32);
    BOOST_TEST(c.scale == 0.5);  // average over 2 ranks
    // 256 elements, plus the window check's 2 reserved ones in its carrier.
    BOOST_TEST((c.elems == 256 || c.elems == 258));
    if (c.elems == 258) {
      ++carried;
      BOOST_TEST(c.scaledElems == 256);
    }
  }
  BOOST_TEST(carried == 1);  // exactly one bucket carries the window check
  std::sort(buckets.begin(), buckets.end());
  BOOST_TEST(buckets == std::vector<int64_t>({0, 1, 2}), boost::test_tools::per_element());
  // The average over 2 mirror ranks of what the host left in its buffers
  // (it accumulates in place; here it wrote once): the values, unchanged.
  for (int k = 0; k < 3; ++k) {
    for (size_t i = 0; i < 256; ++i) {
      BOOST_REQUIRE_EQUAL(g.data[size_t(k)][i], g.expected(k, i, 1.0f));
    }
  }
  const sf_stats s = r.ctx->stats();
  BOOST_TEST(s.collectives_issued == 3);
  BOOST_TEST(s.windows_completed == 1);
  BOOST_TEST(s.deferred_passes == 3);
  BOOST_TEST(s.bytes_reduced == int64_t(3 * 256 * sizeof(float)));
}

BOOST_AUTO_TEST_CASE(nothing_crosses_inside_a_window) {
  Recorded r(smallBuckets("memory://recording-inside"));
  Grads g(*r.ctx, 3);
  r.ctx->synchronize();  // connect first: the log then holds gradient traffic only
  const size_t before = r.log.size();
  r.ctx->beginAccumulation();
  for (int p = 0; p < 5; ++p) g.readyAll(*r.ctx);
  BOOST_TEST(r.log.size() == before);  // 15 grad-ready calls, no call reached the backend
  // sf_synchronize inside the window is refused, and still nothing crosses.
  try {
    r.ctx->synchronize();
    BOOST_FAIL("synchronize inside a window was accepted");
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_INVALID_STATE);
  }
  BOOST_TEST(r.log.size() == before);
  r.ctx->endAccumulation();
  g.readyAll(*r.ctx);  // the last micro-batch: every bucket starts as it fills
  BOOST_TEST(r.calls("allreduce").size() == 3u + 3u);  // the connecting sync's 3, then 3 early
  r.ctx->synchronize();
  BOOST_TEST(r.calls("allreduce").size() == 6u);  // waits only: nothing more
  BOOST_TEST(r.ctx->stats().early_launches == 3);  // the window's; the first sync's were not early
}

BOOST_AUTO_TEST_CASE(every_window_repeats_the_same_collectives) {
  sf_options o = smallBuckets("memory://recording-sum");
  o.reduce_op = SF_REDUCE_SUM;
  Recorded r(o, 4, 1);
  Grads g(*r.ctx, 2);
  for (int w = 0; w < 5; ++w) window(*r.ctx, g, 3);
  const auto reductions = r.calls("allreduce");
  BOOST_REQUIRE_EQUAL(reductions.size(), 10u);
  for (size_t i = 0; i < reductions.size(); ++i) {
    BOOST_TEST(reductions[i].scale == 1.0);  // a plain sum
    BOOST_TEST(reductions[i].bucket == reductions[i % 2].bucket);  // the same order every window
  }
  // 5 sums over 4 mirror ranks: 4^5 times the values.
  for (int k = 0; k < 2; ++k) {
    for (size_t i = 0; i < 256; i += 37) {
      BOOST_TEST(g.data[size_t(k)][i] == g.expected(k, i, 1024.0f));
    }
  }
  BOOST_TEST(r.ctx->stats().windows_completed == 5);
  BOOST_TEST(r.calls("connect").size() == 1u);
}

BOOST_AUTO_TEST_CASE(a_sharded_window_reduce_scatters_and_gathers) {
  sf_options o = smallBuckets("memory://recording-sharded");
  o.shard_layout = SF_SHARD_FLAT;
  Recorded r(o);
  Grads g(*r.ctx, 2);
  std::vector<std::vector<float>> params(2, std::vector<float>(256, 1.0f));
  for (size_t k = 0; k < 2; ++k) {
    r.ctx->registerParameter(g.ids[k], params[k].data(), 256, SF_DTYPE_FLOAT32, SF_DEVICE_HOST);
  }
  window(*r.ctx, g, 2);
  BOOST_TEST(r.calls("allreduce").empty());
  const auto scatters = r.calls("reduce_scatter");
  BOOST_REQUIRE_EQUAL(scatters.size(), 2u);  // one per bucket
  for (const Call& c : scatters) {
    BOOST_TEST(c.scale == 0.5);
    BOOST_TEST(c.elems >= 128);  // half of each 256-element bucket per segment, padded
  }
  r.ctx->gatherParameters();
  BOOST_TEST(r.calls("allgather").size() == 2u);
  BOOST_TEST(r.ctx->stats().reduce_scatters == 2);
}

BOOST_AUTO_TEST_CASE(device_checks_go_to_the_device_backend) {
  sf_options o = smallBuckets("memory://recording-device");
  o.backend = SF_BACKEND_AUTO;
  Recorded r(o);
  std::vector<float> fake(64);
  r.ctx->setCudaStream(&fake);  // before the device backend exists: kept for it
  const int64_t id = r.ctx->registerGradient(fake.data(), 64, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "d");
  BOOST_TEST(id == 0);
  BOOST_REQUIRE_EQUAL(r.made.size(), 1u);
  BOOST_TEST(r.made[0] == SF_DEVICE_CUDA);
  const auto checks = r.calls("check_device_memory");
  BOOST_REQUIRE_EQUAL(checks.size(), 1u);
  BOOST_TEST(checks[0].elems == int64_t(64 * sizeof(float)));
  BOOST_TEST(r.calls("host_stream").size() == 1u);  // the stream, handed over as it was made
  r.ctx->setCudaStream(nullptr);
  BOOST_TEST(r.calls("host_stream").size() == 2u);
  // backend = gloo refuses CUDA gradients before asking the maker.
  sf_options gloo = smallBuckets("memory://recording-gloo");
  gloo.backend = SF_BACKEND_GLOO;
  Recorded refused(gloo);
  try {
    refused.ctx->registerGradient(fake.data(), 64, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "d");
    BOOST_FAIL("a CUDA gradient was accepted with backend = gloo");
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_UNSUPPORTED);
  }
  BOOST_TEST(refused.made.empty());
}

BOOST_AUTO_TEST_CASE(host_control_collectives_refused_with_backend_nccl) {
  // Context::controlDevice: with backend = nccl the control backend is the
  // device's, so the host-memory control collectives are refused before
  // any backend is made.
  sf_options o = smallBuckets("memory://recording-nccl-control");
  o.backend = SF_BACKEND_NCCL;
  Recorded r(o);
  double values[2] = {1.0, 2.0};
  for (int call = 0; call < 2; ++call) {
    try {
      if (call == 0) r.ctx->broadcast(values, sizeof values, 0);
      if (call == 1) r.ctx->allreduceFloat64(values, 2);
      BOOST_FAIL("a host-memory control collective ran with backend = nccl");
    } catch (const Error& e) {
      BOOST_TEST(e.status() == SF_ERR_UNSUPPORTED);
      BOOST_TEST(std::string(e.what()).find("needs the Gloo") != std::string::npos, e.what());
    }
  }
  BOOST_TEST(r.made.empty());
}

BOOST_AUTO_TEST_SUITE_END()
