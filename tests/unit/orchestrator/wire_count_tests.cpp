// The wire counts (sf_stats.wire_*, plugin/backend/counting_backend.h): a
// Context over a backend that plays the transport (TransportBackend: a
// RecordingBackend that also adds up, on its own, the bytes each call
// hands it, as Gloo or NCCL would move them). Per mode, one window's
// counted payload equals the transport's count and the plan's numbers
// worked out by hand: 2 ranks, buckets of one gradient each.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/backend/counting_backend.h"
#include "plugin/core/dtype.h"
#include "plugin/orchestrator/context.h"
#include "tests/support/recording_backend.h"
#include "tests/support/thread_ranks.h"

using namespace sfsync;
using sftest::Call;
using sftest::RecordingBackend;

namespace {

// What the transport saw: bytes per call, added up independently of the
// counting layer (the buffer's elements less the padding it leaves off).
struct Transport {
  int64_t bytes = 0;
  int64_t calls = 0;
  int64_t tailBytes = 0;    // bucket collectives: reserved tails (check + limbs)
  int64_t weightBytes = 0;  // of those, from ReduceSpec::weightAt on
};

class TransportBackend : public RecordingBackend {
 public:
  TransportBackend(std::vector<Call>& log, const sf_options& o, bool padding, Transport& seen)
      : RecordingBackend(log, o.world_size, o.rank), world_(o.world_size), wire_(o.wire_dtype),
        padding_(padding), seen_(seen) {}

  sf_dtype allreduceWireDtype(sf_dtype dtype) const override {
    return dtype == SF_DTYPE_FLOAT32 && wire_ != SF_DTYPE_FLOAT32 ? wire_ : dtype;
  }
  bool movesPadding(const ReduceSpec&, int64_t) const override { return padding_; }

  std::unique_ptr<Work> startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                       ReduceSpec spec) override {
    const int64_t es = int64_t(dtypeSize(allreduceWireDtype(dtype)));
    seen_.bytes += numel * es;
    tail(numel, es, 1, spec);
    ++seen_.calls;
    return RecordingBackend::startAllreduce(data, numel, dtype, spec);
  }
  std::unique_ptr<Work> startReduceScatter(void* data, int64_t segmentElems, sf_dtype dtype,
                                           ReduceSpec spec) override {
    segments(segmentElems, dtype, spec);
    return RecordingBackend::startReduceScatter(data, segmentElems, dtype, spec);
  }
  std::unique_ptr<Work> startAllgather(void* data, int64_t segmentElems, sf_dtype dtype,
                                       ReduceSpec spec) override {
    segments(segmentElems, dtype, spec);
    return RecordingBackend::startAllgather(data, segmentElems, dtype, spec);
  }
  void allreduceSumFloat64(double* data, int64_t n) override {
    seen_.bytes += 8 * n;
    ++seen_.calls;
    RecordingBackend::allreduceSumFloat64(data, n);
  }
  void allreduceMaxInt64(int64_t* data, int64_t n) override {
    seen_.bytes += 8 * n;
    ++seen_.calls;
    RecordingBackend::allreduceMaxInt64(data, n);
  }
  void broadcast(void* data, size_t bytes, int root) override {
    seen_.bytes += int64_t(bytes);
    ++seen_.calls;
    RecordingBackend::broadcast(data, bytes, root);
  }

 private:
  // Segment by segment, as Gloo's slicePiece (no padding) or NCCL (all).
  void segments(int64_t segmentElems, sf_dtype dtype, const ReduceSpec& spec) {
    const int64_t es = int64_t(dtypeSize(dtype));
    const int64_t dataEnd = spec.scaledElems < 0 ? segmentElems : spec.scaledElems;
    for (int r = 0; r < world_; ++r) {
      if (padding_ || spec.segmentUsed.empty()) {
        seen_.bytes += segmentElems * es;
      } else {
        seen_.bytes += (spec.segmentUsed[size_t(r)] + segmentElems - dataEnd) * es;
      }
    }
    tail(segmentElems, es, world_, spec);
    ++seen_.calls;
  }
  void tail(int64_t elems, int64_t es, int64_t segments, const ReduceSpec& spec) {
    if (spec.scaledElems < 0) return;
    seen_.tailBytes += segments * (elems - spec.scaledElems) * es;
    if (spec.weightElems > 0) seen_.weightBytes += segments * (elems - spec.scaledElems - spec.weightAt) * es;
  }

  int world_;
  sf_dtype wire_;
  bool padding_;
  Transport& seen_;
};

struct Wire {
  std::vector<Call> log;
  Transport seen;
  std::unique_ptr<Context> ctx;
  std::vector<std::vector<float>> grads, params;
  std::vector<int64_t> ids;

  // `numel`: one gradient per bucket; host-owned (`owned`) or plugin-owned.
  Wire(sf_options o, std::vector<int64_t> numel, bool owned, bool padding = false,
       int64_t maskElems = 0) {
    o.world_size = 2;
    o.rank = 0;
    o.bucket_cap_mb = 1024.0 / (1 << 20);  // 1 KiB: one gradient of 250..256 floats per bucket
    o.first_bucket_cap_mb = o.bucket_cap_mb;
    ctx = std::make_unique<Context>(
        o, [this, padding](sf_device, const sf_options& opts, const std::shared_ptr<Rendezvous>&) {
          return std::make_unique<TransportBackend>(log, opts, padding, seen);
        });
    if (maskElems > 0) {  // registered first: bucketed last, as the Python binding does
      ids.push_back(ctx->registerGradient(nullptr, maskElems, SF_DTYPE_FLOAT32, SF_DEVICE_HOST,
                                          kMaskName));
    }
    for (int64_t n : numel) {
      grads.emplace_back(size_t(n), 1.0f);
      ids.push_back(ctx->registerGradient(owned ? grads.back().data() : nullptr, n,
                                          SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr));
    }
    if (o.shard_layout != SF_SHARD_NONE) {
      for (size_t k = 0; k < ids.size(); ++k) {
        const int64_t n = k < size_t(maskElems > 0) ? maskElems : numel[k - size_t(maskElems > 0)];
        params.emplace_back(size_t(n), 1.0f);
        ctx->registerParameter(ids[k], params.back().data(), n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST);
      }
    }
  }
  void readyAll() {
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) ctx->gradReady(*it);
  }
  void window(bool weighted = false) {
    ctx->beginAccumulation();
    if (weighted) ctx->addWindowWeight(3.0);
    readyAll();
    ctx->endAccumulation();
    if (weighted) ctx->addWindowWeight(5.0);
    readyAll();
    ctx->synchronize();
  }
};

// The counted difference between two stats (one window's), and the
// transport's over the same calls.
struct Delta {
  sf_stats s;
  Transport t;
};

Delta measure(Wire& w, const std::function<void()>& body) {
  const sf_stats a = w.ctx->stats();
  const Transport ta = w.seen;
  body();
  sf_stats b = w.ctx->stats();
  const int64_t* pa = &a.wire_allreduces;
  int64_t* pb = &b.wire_allreduces;
  for (int k = 0; k < 12; ++k) pb[k] -= pa[k];
  b.collectives_issued -= a.collectives_issued;
  b.bytes_reduced -= a.bytes_reduced;
  return {b, {w.seen.bytes - ta.bytes, w.seen.calls - ta.calls, w.seen.tailBytes - ta.tailBytes,
              w.seen.weightBytes - ta.weightBytes}};
}

// Counted bytes: the transport's, and the purposes add up to them.
void checkAgainstTransport(const Delta& d) {
  const sf_stats& s = d.s;
  BOOST_TEST(s.wire_bytes == d.t.bytes);
  BOOST_TEST(s.wire_allreduces + s.wire_reduce_scatters + s.wire_all_gathers + s.wire_broadcasts +
                 s.wire_controls ==
             d.t.calls);
  BOOST_TEST(s.wire_bytes == s.wire_gradient_bytes + s.wire_parameter_bytes + s.wire_mask_bytes +
                                 s.wire_check_bytes + s.wire_weight_bytes + s.wire_host_bytes);
}

sf_options base(const char* url) { return sftest::rankOptions(0, 2, url); }

}  // namespace

BOOST_AUTO_TEST_SUITE(wire_count_tests)

BOOST_AUTO_TEST_CASE(flat_buffer_window_counts_its_buckets_and_the_check_2_recording_ranks) {
  Wire w(base("memory://wire-flat"), {256, 256, 256}, false);
  w.window();  // the first window adds the connect's and the layout's control collectives
  BOOST_TEST(w.ctx->stats().wire_controls >= 2);
  const Delta d = measure(w, [&] { w.window(); });
  checkAgainstTransport(d);
  BOOST_TEST(d.s.wire_allreduces == 3);
  BOOST_TEST(d.s.wire_controls == 0);
  BOOST_TEST(d.s.wire_gradient_bytes == 3 * 256 * 4);
  BOOST_TEST(d.s.wire_check_bytes == 2 * 4);  // the window check: 2 float32 in one bucket's tail
  BOOST_TEST(d.s.wire_bytes == 3 * 256 * 4 + 8);
  BOOST_TEST(d.s.wire_bytes - d.s.bytes_reduced == 8);  // what bytes_reduced leaves out
}

BOOST_AUTO_TEST_CASE(per_parameter_buffers_count_the_same_2_recording_ranks) {
  Wire w(base("memory://wire-owned"), {256, 256, 256}, true);
  w.window();
  const Delta d = measure(w, [&] { w.window(); });
  checkAgainstTransport(d);
  BOOST_TEST(d.s.wire_allreduces == 3);
  BOOST_TEST(d.s.wire_bytes == 3 * 256 * 4 + 8);
}

BOOST_AUTO_TEST_CASE(sixteen_bit_wire_counts_two_bytes_an_element_2_recording_ranks) {
  sf_options o = base("memory://wire-bf16");
  o.wire_dtype = SF_DTYPE_BFLOAT16;
  Wire w(o, {256, 256, 256}, false);
  w.window();
  const Delta d = measure(w, [&] { w.window(); });
  checkAgainstTransport(d);
  BOOST_TEST(d.s.wire_gradient_bytes == 3 * 256 * 2);
  BOOST_TEST(d.s.wire_check_bytes == 2 * 2);
  BOOST_TEST(d.s.bytes_reduced == 3 * 256 * 4);  // unchanged: the buckets' own bytes
}

BOOST_AUTO_TEST_CASE(used_parameter_mask_in_a_bucket_is_counted_as_mask_2_recording_ranks) {
  Wire w(base("memory://wire-mask"), {256, 256}, false, false, 2);
  w.window();
  const Delta d = measure(w, [&] { w.window(); });
  checkAgainstTransport(d);
  BOOST_TEST(d.s.wire_mask_bytes == 2 * 4);
  BOOST_TEST(d.s.wire_gradient_bytes == 2 * 256 * 4);
  BOOST_TEST(d.s.wire_check_bytes == 2 * 4);
}

BOOST_AUTO_TEST_CASE(weighted_window_counts_the_limbs_as_weights_2_recording_ranks) {
  sf_options o = base("memory://wire-weighted");
  o.reduce_op = SF_REDUCE_WEIGHTED;
  Wire w(o, {256, 256, 256}, false);
  w.window(true);
  const Delta d = measure(w, [&] { w.window(true); });
  checkAgainstTransport(d);
  BOOST_TEST(d.s.wire_allreduces == 3);
  BOOST_TEST(d.s.wire_gradient_bytes == 3 * 256 * 4);
  BOOST_TEST(d.s.wire_weight_bytes > 0);
  BOOST_TEST(d.s.wire_weight_bytes == d.t.weightBytes);
  BOOST_TEST(d.s.wire_check_bytes + d.s.wire_weight_bytes == d.t.tailBytes);
  BOOST_TEST(d.s.wire_check_bytes == 2 * 4);
}

// Sharded: 250-float gradients, so that the flat layout pads (U = 128: 128
// + 122 used) and the parameter layout leaves a segment empty (U = 256:
// 250 + 0). Gloo leaves the padding off the wire; NCCL moves it.
BOOST_AUTO_TEST_CASE(sharded_flat_counts_scatters_gathers_and_the_mask_sum_2_recording_ranks) {
  for (bool padding : {false, true}) {
    BOOST_TEST_CONTEXT("padding moved: " << padding) {
      sf_options o = base(padding ? "memory://wire-flat-nccl" : "memory://wire-flat-gloo");
      o.shard_layout = SF_SHARD_FLAT;
      Wire w(o, {250, 250}, false, padding);
      w.ctx->connect();  // its claim check (one int64) before the measured window
      w.window();
      w.ctx->gatherParameters();
      // The window: reduce-scatters, a gradient gather, the mask's
      // sum (sf_allreduce_float64: its count agreed first), parameter gathers.
      std::vector<double> mask(3, 1.0);
      const Delta d = measure(w, [&] {
        w.window();
        w.ctx->gatherGradients();
        w.ctx->allreduceFloat64(mask.data(), 3);
        w.ctx->gatherParameters();
      });
      checkAgainstTransport(d);
      BOOST_TEST(d.s.wire_reduce_scatters == 2);
      BOOST_TEST(d.s.wire_all_gathers == 4);  // 2 gradient, 2 parameter
      BOOST_TEST(d.s.wire_controls == 2);     // the count's agreement, the sum
      BOOST_TEST(d.s.wire_host_bytes == 3 * 8);
      const int64_t data = padding ? 2 * 2 * 128 * 4 : 2 * 250 * 4;  // per kind of pass
      // The scatters and the gradient gathers; a gather that moves whole
      // segments (NCCL) also moves the carrier's reserved tails (2 x 64
      // bytes), counted with the gradients it gathers.
      BOOST_TEST(d.s.wire_gradient_bytes == 2 * data + (padding ? 2 * 16 * 4 : 0));
      BOOST_TEST(d.s.wire_parameter_bytes == data);
      // A 64-byte tail per segment (the window check, aligned); the count's
      // agreement: one (x, -x) pair of int64.
      BOOST_TEST(d.s.wire_check_bytes == 2 * 16 * 4 + 16);
      BOOST_TEST(d.s.collectives_issued == 2);  // unchanged: the reductions only
    }
  }
}

BOOST_AUTO_TEST_CASE(sharded_parameter_layout_counts_whole_gradients_2_recording_ranks) {
  for (bool padding : {false, true}) {
    BOOST_TEST_CONTEXT("padding moved: " << padding) {
      sf_options o = base(padding ? "memory://wire-param-nccl" : "memory://wire-param-gloo");
      o.shard_layout = SF_SHARD_PARAMETER;
      Wire w(o, {250, 250}, false, padding);
      w.window();
      w.ctx->gatherParameters();
      const Delta d = measure(w, [&] {
        w.window();
        w.ctx->gatherParameters();
      });
      checkAgainstTransport(d);
      BOOST_TEST(d.s.wire_reduce_scatters == 2);
      BOOST_TEST(d.s.wire_all_gathers == 2);
      const int64_t data = padding ? 2 * 2 * 256 * 4 : 2 * 250 * 4;
      BOOST_TEST(d.s.wire_gradient_bytes == data);
      BOOST_TEST(d.s.wire_parameter_bytes == data);
      BOOST_TEST(d.s.wire_check_bytes == 2 * 16 * 4);
    }
  }
}

BOOST_AUTO_TEST_CASE(broadcast_counts_its_bytes_and_its_agreement_2_recording_ranks) {
  Wire w(base("memory://wire-broadcast"), {256}, false);
  w.ctx->connect();
  std::vector<char> bytes(100);
  const Delta d = measure(w, [&] { w.ctx->broadcast(bytes.data(), 100, 0); });
  checkAgainstTransport(d);
  BOOST_TEST(d.s.wire_broadcasts == 1);
  BOOST_TEST(d.s.wire_controls == 1);
  BOOST_TEST(d.s.wire_host_bytes == 100);
  BOOST_TEST(d.s.wire_check_bytes == 32);  // bytes and root agreed: two (x, -x) int64 pairs
}

BOOST_AUTO_TEST_CASE(world_size_one_counts_nothing) {
  sf_options o = sftest::rankOptions(0, 1, "memory://wire-one");
  std::vector<Call> log;
  Transport seen;
  Context ctx(o, [&](sf_device, const sf_options& opts, const std::shared_ptr<Rendezvous>&) {
    return std::make_unique<TransportBackend>(log, opts, false, seen);
  });
  std::vector<float> g(64, 1.0f);
  const int64_t id = ctx.registerGradient(g.data(), 64, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "g");
  ctx.gradReady(id);
  ctx.synchronize();
  const sf_stats s = ctx.stats();
  BOOST_TEST(s.collectives_issued == 1);
  BOOST_TEST(s.wire_allreduces == 0);
  BOOST_TEST(s.wire_bytes == 0);
}

BOOST_AUTO_TEST_SUITE_END()
