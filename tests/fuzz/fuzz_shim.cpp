// libFuzzer target: the shim's classification of intercepted all-reduces.
// (1) ReduceProbe: a host reduction function drawn from a family whose
// truth is known (sums, max, min, products, integer and bitwise ops, a sum
// off by one ulp, copies, constants; of 1, 2, 4 or 8-byte elements) is
// probed at a fuzzed element size: only a true float sum of that width may
// be classified as a sum, and of its own dtype. (2) ShimPolicy::decide on a
// fuzzed sequence of Gloo/NCCL call facts: every decision is well formed and
// the counters add up.
// The policy comes from plugin/shim_policy/ or shim/policy/ (shim_policy_api.h).

#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "plugin/core/dtype.h"
#include "tests/fuzz/shim_policy_api.h"

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_shim: invariant broken: %s\n", what);
    std::abort();
  }
}

enum Op { kSum, kMax, kMin, kProd, kIntSum, kXor, kOr, kFirst, kConst, kSumUlp, kOps };

// Element arithmetic of one "type" of width w: f32, f64, f16, bf16 or integers.
enum Kind { kF32, kF64, kF16, kBF16, kI8, kKinds };

double load(Kind k, const unsigned char* p) {
  switch (k) {
    case kF32: { float x; std::memcpy(&x, p, 4); return x; }
    case kF64: { double x; std::memcpy(&x, p, 8); return x; }
    case kF16: { uint16_t x; std::memcpy(&x, p, 2); return sfsync::halfToFloat(x); }
    case kBF16: { uint16_t x; std::memcpy(&x, p, 2); return sfsync::bf16ToFloat(x); }
    default: return double(int8_t(*p));
  }
}
void store(Kind k, unsigned char* p, double v) {
  switch (k) {
    case kF32: { float x = float(v); std::memcpy(p, &x, 4); break; }
    case kF64: std::memcpy(p, &v, 8); break;
    case kF16: { uint16_t x = sfsync::floatToHalf(float(v)); std::memcpy(p, &x, 2); break; }
    case kBF16: { uint16_t x = sfsync::floatToBf16(float(v)); std::memcpy(p, &x, 2); break; }
    default: *p = uint8_t(int8_t(std::fmax(-128, std::fmin(127, v)))); break;
  }
}
size_t width(Kind k) {
  static const size_t kW[] = {4, 8, 2, 2, 1};
  return kW[k];
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  // (1) The probe.
  {
    const Op op = Op(in.ConsumeIntegralInRange<int>(0, kOps - 1));
    const Kind kind = Kind(in.ConsumeIntegralInRange<int>(0, kKinds - 1));
    const size_t declared = in.ConsumeBool() ? width(kind) : in.ConsumeIntegral<size_t>();
    const int ulpAt = in.ConsumeIntegralInRange<int>(0, 3);
    const bool throws = in.ConsumeIntegralInRange<int>(0, 15) == 0;
    const size_t w = width(kind);
    sffuzz::shim::ReduceFunction fn = [=](void* out, const void* a, const void* b, size_t n) {
      if (throws) throw std::runtime_error("host reduction throws");
      auto* o = static_cast<unsigned char*>(out);
      auto* x = static_cast<const unsigned char*>(a);
      auto* y = static_cast<const unsigned char*>(b);
      for (size_t i = 0; i < n; ++i) {
        const double u = load(kind, x + i * w), v = load(kind, y + i * w);
        switch (op) {
          case kSum: store(kind, o + i * w, u + v); break;
          case kMax: store(kind, o + i * w, std::fmax(u, v)); break;
          case kMin: store(kind, o + i * w, std::fmin(u, v)); break;
          case kProd: store(kind, o + i * w, u * v); break;
          case kIntSum:
          case kXor:
          case kOr:
            for (size_t j = 0; j < w; ++j) {
              const unsigned char p = x[i * w + j], q = y[i * w + j];
              o[i * w + j] = op == kXor ? (p ^ q) : op == kOr ? (p | q) : (unsigned char)(p + q);
            }
            break;
          case kFirst: std::memcpy(o + i * w, x + i * w, w); break;
          case kConst: std::memset(o + i * w, 0x3c, w); break;
          case kSumUlp: {
            store(kind, o + i * w, u + v);
            if (int(i) == ulpAt) o[i * w] ^= 1;  // the lowest mantissa bit
            break;
          }
          default: break;
        }
      }
    };
    const sffuzz::shim::ReduceClass c = sffuzz::shim::probeReduce(declared, fn);
    if (c.op == SF_SHIM_OP_SUM) {
      check(!throws, "a throwing function is not a sum");
      check(op == kSum, "only a sum is classified as a sum");
      check(declared == w, "a sum of the declared width");
      const sf_dtype truth = kind == kF32 ? SF_DTYPE_FLOAT32 : kind == kF64 ? SF_DTYPE_FLOAT64
                           : kind == kF16 ? SF_DTYPE_FLOAT16 : kind == kBF16 ? SF_DTYPE_BFLOAT16 : -1;
      check(c.dtype == truth, "classified as its own float type");
    } else {
      check(c.op == SF_SHIM_OP_OTHER && c.dtype == SF_SHIM_DTYPE_OTHER, "a non-sum is (other, other)");
      // Integer kinds aside, a plain float sum at its own width must be found.
      if (!throws && op == kSum && kind != kI8 && declared == w) check(false, "a float sum is recognised");
    }
  }
  // (2) The policy on a sequence of calls.
  sffuzz::shim::ShimConfig cfg;
  cfg.minBytes = in.ConsumeIntegralInRange<int64_t>(0, 1 << 20);
  cfg.accumulationSteps = in.ConsumeIntegralInRange<int64_t>(0, 6);
  cfg.strict = in.ConsumeBool();
  int64_t lines = 0;
  auto owned = sffuzz::makePolicy(cfg, [&] { ++lines; });
  auto& policy = *owned;
  int64_t calls = 0, gloo = 0, nccl = 0;
  while (in.remaining_bytes() > 0 && calls < 4096) {
    sf_shim_call call{};
    call.api = in.ConsumeIntegralInRange<int32_t>(-1, 2);
    call.dtype = in.ConsumeIntegralInRange<int32_t>(-2, 5);
    call.op = in.ConsumeIntegralInRange<int32_t>(-1, 3);
    call.world_size = in.ConsumeIntegralInRange<int32_t>(-1, 9);
    call.rank = in.ConsumeIntegralInRange<int32_t>(-2, 9);
    call.comm = reinterpret_cast<const void*>(uintptr_t(in.ConsumeIntegralInRange<int>(0, 3)));
    call.buffer = reinterpret_cast<const void*>(uintptr_t(in.ConsumeIntegralInRange<int>(0, 15) * 4096));
    // Sizes from the whole int64 range, negative ones included (as a wrapped
    // count x element size would be): the counters saturate (finding F2 in
    // tests/fuzz/README.md, fixed; its reproducer is in regressions/fuzz_shim).
    call.bytes = in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 1 << 22)
                                  : in.ConsumeIntegral<int64_t>();
    const sf_shim_decision d = policy.decide(call);
    ++calls;
    gloo += call.api == SF_SHIM_API_GLOO;
    nccl += call.api == SF_SHIM_API_NCCL;
    check(d.action == SF_SHIM_PASS || d.action == SF_SHIM_DEFER || d.action == SF_SHIM_FAIL, "an action");
    if (d.action == SF_SHIM_DEFER) {
      check(call.dtype >= SF_DTYPE_FLOAT32 && call.dtype <= SF_DTYPE_BFLOAT16, "only float calls deferred");
      check(call.op == SF_SHIM_OP_SUM || call.op == SF_SHIM_OP_AVERAGE, "only sums deferred");
      check(call.bytes >= cfg.minBytes, "only calls of at least SF_SHIM_MIN_BYTES deferred");
      check(std::isfinite(d.factor) && d.factor >= 1, "a finite factor");
      if (call.op == SF_SHIM_OP_AVERAGE) check(d.factor == 1, "factor 1 for an average");
      if (call.op == SF_SHIM_OP_SUM && call.world_size > 0) check(d.factor == call.world_size, "world size for a sum");
    }
    check(d.window >= 0, "window not negative");
  }
  const sffuzz::shim::ShimCounters n = policy.counters();
  check(n.calls == calls, "calls counted");
  check(n.callsGloo + n.callsNccl <= n.calls, "per-API counts within the total");
  check(n.deferred + n.passed <= n.calls, "deferred + passed within the total");
  check(n.bytesDeferred >= 0 && n.bytesSent >= 0 && n.gradientBytesSent >= 0,
        "byte counters never negative (saturated, never overflowed)");
  policy.finish();
  const std::string json = policy.reportJson();
  check(!json.empty() && json.front() == '{' && json.back() != ',', "a JSON report");
  (void)gloo;
  (void)nccl;
  return 0;
}
