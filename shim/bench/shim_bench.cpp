// sfsync-shim-bench: what the LD_PRELOAD shim adds to a call.
//
// The bench links libsfsync_shim.so ahead of Gloo and of a null NCCL (every
// function returns at once), so its own calls of gloo::allreduce and
// ncclAllReduce are interposed exactly as a host's would be; the real
// functions are also called directly, through dlsym, for comparison:
//   gloo  the real gloo::allreduce on a one-rank context (Gloo returns
//         after checking the options), 16 floats in place;
//   nccl  the null ncclAllReduce, so the shim's own cost is all there is.
// Passed-through calls: a non-gradient call (int32 sum) and a gradient
// outside any window; deferred: the same gradient inside a window of the
// default context (NCCL: world size 2 from the null communicator, the local
// result launched on the null one-rank communicator; Gloo: world size 1, the
// local result is the input). Minimum over repeats of the mean per call.

#include <dlfcn.h>

#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cxxopts.hpp>
#include <functional>
#include <string>
#include <vector>

#include "sfsync.h"
#include "shim/nccl_abi.h"

// Exported by libsfsync_shim.so (shim/shim_instance.h).
extern "C" sf_status sf_shim_report_json(char* buffer, int64_t capacity, int64_t* length);

extern "C" ncclResult_t ncclAllReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                      ncclComm_t, cudaStream_t);

namespace {

double nsPerCall(const std::function<void()>& f, long iterations, int repeats) {
  double best = 1e300;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < iterations; ++i) f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count() / double(iterations));
  }
  return best;
}

void* realFrom(const char* library, const char* symbol) {
  void* h = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
  void* f = h ? dlsym(h, symbol) : nullptr;
  if (!f) {
    std::fprintf(stderr, "sfsync-shim-bench: %s not found in %s\n", symbol, library);
    std::exit(2);
  }
  return f;
}

void row(const char* what, double ns, double direct) {
  std::printf("  %-44s %9.1f ns   %+8.1f ns   x%.2f\n", what, ns, ns - direct, ns / direct);
}

}  // namespace

int main(int argc, char** argv) {
  cxxopts::Options o("sfsync-shim-bench", "Per-call cost of the sfsync LD_PRELOAD shim");
  o.add_options()("iterations", "calls per repeat", cxxopts::value<long>()->default_value("200000"))(
      "repeats", "repeats (the fastest counts)", cxxopts::value<int>()->default_value("7"))(
      "automatic", "time automatic windows instead (SF_ACCUMULATION_STEPS=4, 2 buckets a pass)")(
      "h,help", "this help");
  const auto args = o.parse(argc, argv);
  if (args.count("help")) {
    std::printf("%s\n", o.help().c_str());
    return 0;
  }
  const long n = args["iterations"].as<long>();
  const int repeats = args["repeats"].as<int>();
  // Every float sum is a gradient here, however small: SF_SHIM_MIN_BYTES=0.
  setenv("SF_SHIM_MIN_BYTES", "0", 1);
  unsetenv("SF_SHIM_REPORT");
  const bool automatic = args.count("automatic") > 0;
  if (automatic) {
    setenv("SF_ACCUMULATION_STEPS", "4", 1);
  } else {
    unsetenv("SF_ACCUMULATION_STEPS");
  }

  sf_context* ctx = nullptr;
  if (sf_default_context(&ctx) != SF_OK) {
    std::fprintf(stderr, "sf_default_context: %s\n", sf_last_error());
    return 2;
  }

  // Gloo: a one-rank context.
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  auto gctx = std::make_shared<gloo::rendezvous::Context>(0, 1);
  auto device = gloo::transport::tcp::CreateDevice("127.0.0.1");
  gctx->connectFullMesh(*store, device);
  std::vector<float> f(16, 1.f);
  std::vector<int32_t> ints(16, 1);
  gloo::AllreduceOptions gradient(gctx), other(gctx);
  gradient.setOutput(f.data(), f.size());
  gradient.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
  other.setOutput(ints.data(), ints.size());
  other.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<int32_t>));
  using GlooFn = void (*)(const gloo::AllreduceOptions&);
  const auto glooReal = reinterpret_cast<GlooFn>(
      realFrom("libgloo.so.0", "_ZN4gloo9allreduceERKNS_16AllreduceOptionsE"));

  // NCCL: the null library.
  using NcclFn = ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                  ncclComm_t, cudaStream_t);
  const auto ncclReal = reinterpret_cast<NcclFn>(realFrom("libsfsync_bench_nccl.so", "ncclAllReduce"));
  auto comm = reinterpret_cast<ncclComm_t>(&f);
  const ncclDataType_t f32 = sfshim::kNcclFloat32, i32 = 2;

  std::printf("sfsync-shim-bench: %ld calls x %d repeats, fastest repeat, per call\n", n, repeats);
  if (automatic) {
    // Two buckets a backward pass, 4 passes a window: once learned (5
    // passes), 3 of 4 passes deferred. Calls alternate between the buckets.
    std::vector<float> g(16, 1.f);
    const double nd = nsPerCall([&] { ncclReal(f.data(), f.data(), 16, f32, 0, comm, nullptr); }, n, repeats);
    long k = 0;
    auto pass = [&] {
      float* b = (k++ & 1) ? g.data() : f.data();
      ncclAllReduce(b, b, 16, f32, 0, comm, nullptr);
    };
    for (int i = 0; i < 10; ++i) pass();
    std::printf("ncclAllReduce (null NCCL), SF_ACCUMULATION_STEPS=4, 2 buckets a pass\n");
    std::printf("  %-44s %12s %13s %8s\n", "", "time", "vs direct", "ratio");
    row("direct call of the real function", nd, nd);
    row("interposed: passes counted, 3 of 4 deferred", nsPerCall(pass, n - n % 8, repeats), nd);
    while (k % 8 != 0) pass();  // end on a window's synchronizing pass
    char report[4096];
    sf_shim_report_json(report, sizeof report, nullptr);
    const char* a = std::strstr(report, "\"automatic\": {");
    std::printf("shim report: %.*s\n", 150, a ? a : report);
    return 0;
  }
  std::printf("  %-44s %12s %13s %8s\n", "", "time", "vs direct", "ratio");

  std::printf("gloo::allreduce (real Gloo, one rank, 16 elements)\n");
  const double gd = nsPerCall([&] { glooReal(gradient); }, n, repeats);
  row("direct call of the real function", gd, gd);
  row("interposed, passed: int32 sum", nsPerCall([&] { gloo::allreduce(other); }, n, repeats), gd);
  row("interposed, passed: float sum, no window", nsPerCall([&] { gloo::allreduce(gradient); }, n, repeats), gd);
  sf_begin_accumulation(ctx);
  row("interposed, deferred: float sum in a window", nsPerCall([&] { gloo::allreduce(gradient); }, n, repeats), gd);
  sf_end_accumulation(ctx);
  gloo::allreduce(gradient);  // the window's synchronization

  std::printf("ncclAllReduce (null NCCL: returns at once)\n");
  const double nd = nsPerCall([&] { ncclReal(f.data(), f.data(), 16, f32, 0, comm, nullptr); }, n, repeats);
  row("direct call of the real function", nd, nd);
  row("interposed, passed: int32 sum",
      nsPerCall([&] { ncclAllReduce(ints.data(), ints.data(), 16, i32, 0, comm, nullptr); }, n, repeats), nd);
  row("interposed, passed: float sum, no window",
      nsPerCall([&] { ncclAllReduce(f.data(), f.data(), 16, f32, 0, comm, nullptr); }, n, repeats), nd);
  sf_begin_accumulation(ctx);
  row("interposed, deferred: float sum in a window",
      nsPerCall([&] { ncclAllReduce(f.data(), f.data(), 16, f32, 0, comm, nullptr); }, n, repeats), nd);
  sf_end_accumulation(ctx);
  ncclAllReduce(f.data(), f.data(), 16, f32, 0, comm, nullptr);

  char report[4096];
  sf_shim_report_json(report, sizeof report, nullptr);
  std::printf("shim report: %.*s ...\n", 160, report);
  return 0;
}
