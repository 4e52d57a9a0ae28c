// sfsync-gpu-check: the checks of tests/gpu/run.sh that need real kernels,
// real NCCL and a real GPU. One rank per process; RANK, WORLD_SIZE,
// LOCAL_RANK and SF_RENDEZVOUS come from the environment (run.sh sets them).
// Each mode prints one "RESULT <mode> rank=<r> ... OK|FAIL" line per case
// and exits 0 only if every case passed (77: no usable GPU).
//
//   parity   average, sum and pre-scaled sum in float32, bfloat16 and float16:
//            3 windows of 3 micro-batches, several buckets, exact values
//   stream   a spin kernel before sf_grad_ready and after sf_synchronize on
//            the host's stream: a missing stream wait reduces or reads stale
//   leave    world 2: rank 1 leaves after window 0 (sf_destroy); rank 0's
//            window 1 must fail within timeout_ms + 2 s, and its sf_destroy
//            must return within timeout_ms + 2 s
//   busbw    bytes (--mib, default 64) per window: sfsync's sf_synchronize
//            against raw ncclAllReduce of the same bytes (the unique id of
//            the raw communicator travels through the file $SF_GPU_ID_FILE)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "sfsync.h"

namespace {

using Clock = std::chrono::steady_clock;

int envInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

double msSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Exact in every dtype: quarters up to a few units.
__host__ __device__ double gradValue(int r, int w, int m, int64_t i) {
  return 0.25 * double((r + 1) * (m + 1) + int(i % 5) + w);
}

__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

template <typename T>
__device__ T fromDouble(double x);
template <> __device__ float fromDouble<float>(double x) { return float(x); }
template <> __device__ __half fromDouble<__half>(double x) { return __float2half(float(x)); }
template <> __device__ __nv_bfloat16 fromDouble<__nv_bfloat16>(double x) { return __float2bfloat16(float(x)); }
template <typename T>
__device__ double toDouble(T x);
template <> __device__ double toDouble<float>(float x) { return x; }
template <> __device__ double toDouble<__half>(__half x) { return __half2float(x); }
template <> __device__ double toDouble<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__global__ void addGrad(T* g, int64_t n, int r, int w, int m) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    g[i] = fromDouble<T>(toDouble<T>(g[i]) + gradValue(r, w, m, i));
  }
}

template <typename T>
__global__ void copyOut(const T* g, double* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = toDouble<T>(g[i]);
  }
}

void launchAdd(void* g, int64_t n, sf_dtype t, int r, int w, int m, cudaStream_t s) {
  switch (t) {
    case SF_DTYPE_FLOAT16: addGrad<<<64, 256, 0, s>>>(static_cast<__half*>(g), n, r, w, m); break;
    case SF_DTYPE_BFLOAT16: addGrad<<<64, 256, 0, s>>>(static_cast<__nv_bfloat16*>(g), n, r, w, m); break;
    default: addGrad<<<64, 256, 0, s>>>(static_cast<float*>(g), n, r, w, m); break;
  }
}

void launchCopyOut(const void* g, double* out, int64_t n, sf_dtype t, cudaStream_t s) {
  switch (t) {
    case SF_DTYPE_FLOAT16: copyOut<<<64, 256, 0, s>>>(static_cast<const __half*>(g), out, n); break;
    case SF_DTYPE_BFLOAT16: copyOut<<<64, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(g), out, n); break;
    default: copyOut<<<64, 256, 0, s>>>(static_cast<const float*>(g), out, n); break;
  }
}

const char* dtypeName(sf_dtype t) {
  return t == SF_DTYPE_FLOAT16 ? "float16" : t == SF_DTYPE_BFLOAT16 ? "bfloat16" : "float32";
}

const char* opName(sf_reduce_op op) {
  return op == SF_REDUCE_AVERAGE ? "avg"
         : op == SF_REDUCE_SUM   ? "sum"
         : op == SF_REDUCE_WEIGHTED ? "weighted"
                                    : "prescaled";
}

// Weighted windows (issue 31): rank r's weight for micro-batch m of window w.
double weightOf(int r, int w, int m) { return double((r * 2 + w + m * 3) % 5 + 1); }

struct Rank {
  int rank, world, local;
  std::string rdv;
};

sf_context* makeContext(const Rank& k, sf_reduce_op op, double prescale, double capMb, int64_t timeoutMs) {
  sf_options o;
  sf_options_init(&o, sizeof o);
  o.rank = k.rank;
  o.world_size = k.world;
  o.local_rank = k.local;
  o.reduce_op = op;
  o.prescale = prescale;
  o.bucket_cap_mb = capMb;
  o.first_bucket_cap_mb = capMb / 2;
  o.timeout_ms = timeoutMs;
  o.backend = SF_BACKEND_NCCL;
  // One rendezvous per context: a file:// directory holds one job's roster,
  // and every rank makes its contexts in the same order, so the N-th context
  // of each rank meets at "<rdv>-N" (the first real two-rank run reused one
  // directory and every case after the first was refused as a second job).
  static int made = 0;
  const std::string rdv = k.rdv.empty() ? k.rdv : k.rdv + "-" + std::to_string(made++);
  std::snprintf(o.rendezvous, sizeof o.rendezvous, "%s", rdv.c_str());
  sf_context* ctx = nullptr;
  if (sf_create(&o, &ctx) != SF_OK) {
    std::printf("sf_create failed: %s\n", sf_last_error());
    return nullptr;
  }
  return ctx;
}

#define SF_CHECK(call)                                                                    \
  do {                                                                                    \
    const sf_status st_ = (call);                                                         \
    if (st_ != SF_OK) {                                                                   \
      std::printf("%s failed: %s (%s)\n", #call, sf_status_string(st_), sf_last_error()); \
      return false;                                                                       \
    }                                                                                     \
  } while (0)

// One (op, dtype) case: 3 windows of 3 micro-batches over 5 gradients in
// several buckets; exact comparison with the reference after each window.
bool parityCase(const Rank& k, sf_reduce_op op, sf_dtype t, cudaStream_t s, bool spinBefore) {
  const double prescale = 0.5;
  sf_context* ctx = makeContext(k, op, prescale, 64.0 / 1024.0, 60000);
  if (!ctx) return false;
  struct Destroy {
    sf_context* c;
    ~Destroy() { sf_destroy(c); }
  } destroy{ctx};
  SF_CHECK(sf_set_cuda_stream(ctx, s));
  const std::vector<int64_t> sizes = {20000, 17, 8000, 5, 30000};
  std::vector<void*> data(sizes.size());
  for (size_t p = 0; p < sizes.size(); ++p) {
    int64_t id;
    SF_CHECK(sf_add_gradient(ctx, sizes[p], t, SF_DEVICE_CUDA, "g", &id));
  }
  for (size_t p = 0; p < sizes.size(); ++p) SF_CHECK(sf_gradient_data(ctx, int64_t(p), &data[p]));
  double* out = nullptr;
  cudaMalloc(&out, 30000 * sizeof(double));
  std::vector<double> host(30000);
  double worst = 0;
  int64_t collectives = 0, inside = 0, buckets = 0;
  for (int w = 0; w < 3; ++w) {
    sf_stats before{};
    before.struct_size = sizeof before;
    sf_get_stats(ctx, &before);
    SF_CHECK(sf_zero_gradients(ctx));
    SF_CHECK(sf_begin_accumulation(ctx));
    for (int m = 0; m < 2; ++m) {
      if (op == SF_REDUCE_WEIGHTED) SF_CHECK(sf_add_window_weight(ctx, weightOf(k.rank, w, m)));
      for (size_t p = 0; p < sizes.size(); ++p) launchAdd(data[p], sizes[p], t, k.rank, w, m, s);
      for (int p = int(sizes.size()) - 1; p >= 0; --p) SF_CHECK(sf_grad_ready(ctx, p));
    }
    sf_stats mid{};
    mid.struct_size = sizeof mid;
    sf_get_stats(ctx, &mid);
    inside += mid.collectives_issued - before.collectives_issued;
    SF_CHECK(sf_end_accumulation(ctx));
    // The last micro-batch's "backward" starts after a long kernel: the
    // collectives must wait for the host's stream, not for the CPU's calls.
    if (spinBefore) spin<<<1, 1, 0, s>>>(200LL * 1000 * 1000);
    if (op == SF_REDUCE_WEIGHTED) SF_CHECK(sf_add_window_weight(ctx, weightOf(k.rank, w, 2)));
    for (size_t p = 0; p < sizes.size(); ++p) launchAdd(data[p], sizes[p], t, k.rank, w, 2, s);
    for (int p = int(sizes.size()) - 1; p >= 0; --p) SF_CHECK(sf_grad_ready(ctx, p));
    SF_CHECK(sf_synchronize(ctx));
    sf_stats after{};
    after.struct_size = sizeof after;
    sf_get_stats(ctx, &after);
    collectives += after.collectives_issued - mid.collectives_issued;
    buckets = after.bucket_count;
    for (size_t p = 0; p < sizes.size(); ++p) {
      // Reading after a long kernel: the host's stream must wait for the result.
      if (spinBefore) spin<<<1, 1, 0, s>>>(200LL * 1000 * 1000);
      launchCopyOut(data[p], out, sizes[p], t, s);
      cudaMemcpyAsync(host.data(), out, size_t(sizes[p]) * sizeof(double), cudaMemcpyDeviceToHost, s);
      cudaStreamSynchronize(s);
      for (int64_t i = 0; i < sizes[p]; ++i) {
        double sum = 0, weight = 0;
        for (int r = 0; r < k.world; ++r) {
          for (int m = 0; m < 3; ++m) {
            sum += gradValue(r, w, m, i);
            weight += weightOf(r, w, m);
          }
        }
        const double want = op == SF_REDUCE_AVERAGE ? sum / k.world
                            : op == SF_REDUCE_SUM   ? sum
                            : op == SF_REDUCE_WEIGHTED ? sum / weight
                                                       : sum * prescale;
        worst = std::max(worst, std::fabs(host[size_t(i)] - want) / std::max(1.0, std::fabs(want)));
      }
    }
  }
  cudaFree(out);
  const cudaError_t e = cudaGetLastError();
  // bfloat16 / float16 sums are rounded in their own type by NCCL: the
  // values are exact, so any error is a wrong result.
  // Weighted: the sums exact, 1 / weight and the product rounded to the dtype.
  const double tolerance =
      op != SF_REDUCE_WEIGHTED ? 0.0 : t == SF_DTYPE_FLOAT32 ? 1e-6 : t == SF_DTYPE_FLOAT16 ? 2e-3 : 1.6e-2;
  const bool ok = e == cudaSuccess && worst <= tolerance && inside == 0 && collectives == 3 * buckets;
  std::printf("RESULT %s rank=%d world=%d op=%s dtype=%s buckets=%lld collectives=%lld/%lld inside=%lld "
              "max_rel_err=%g %s\n",
              spinBefore ? "stream" : "parity", k.rank, k.world, opName(op), dtypeName(t),
              (long long)buckets, (long long)collectives, (long long)(3 * buckets), (long long)inside, worst,
              ok ? "OK" : "FAIL");
  return ok;
}

bool parity(const Rank& k, cudaStream_t s) {
  bool ok = true;
  for (sf_reduce_op op : {SF_REDUCE_AVERAGE, SF_REDUCE_SUM, SF_REDUCE_PRESCALED_SUM, SF_REDUCE_WEIGHTED}) {
    for (sf_dtype t : {SF_DTYPE_FLOAT32, SF_DTYPE_BFLOAT16, SF_DTYPE_FLOAT16}) ok = parityCase(k, op, t, s, false) && ok;
  }
  return ok;
}

bool stream(const Rank& k, cudaStream_t s) {
  return parityCase(k, SF_REDUCE_AVERAGE, SF_DTYPE_FLOAT32, s, true);
}

bool leave(const Rank& k, cudaStream_t s) {
  const int64_t timeoutMs = 3000;
  sf_context* ctx = makeContext(k, SF_REDUCE_AVERAGE, 1.0, 1.0, timeoutMs);
  if (!ctx) return false;
  int64_t id;
  void* g = nullptr;
  sf_set_cuda_stream(ctx, s);
  SF_CHECK(sf_add_gradient(ctx, 4096, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &id));
  SF_CHECK(sf_gradient_data(ctx, id, &g));
  launchAdd(g, 4096, SF_DTYPE_FLOAT32, k.rank, 0, 0, s);
  SF_CHECK(sf_synchronize(ctx));
  if (k.rank != 0) {
    const auto t0 = Clock::now();
    sf_destroy(ctx);
    std::printf("RESULT leave rank=%d left after window 0, sf_destroy_ms=%.0f OK\n", k.rank, msSince(t0));
    return true;
  }
  launchAdd(g, 4096, SF_DTYPE_FLOAT32, k.rank, 1, 0, s);
  auto t0 = Clock::now();
  const sf_status st = sf_synchronize(ctx);
  const double syncMs = msSince(t0);
  const std::string why = sf_last_error();
  t0 = Clock::now();
  sf_destroy(ctx);
  const double destroyMs = msSince(t0);
  const bool ok = (st == SF_ERR_TIMEOUT || st == SF_ERR_BACKEND) && syncMs <= timeoutMs + 2000 &&
                  destroyMs <= timeoutMs + 2000;
  std::printf("RESULT leave rank=0 status=%s sync_ms=%.0f destroy_ms=%.0f timeout_ms=%lld %s (%s)\n",
              sf_status_string(st), syncMs, destroyMs, (long long)timeoutMs, ok ? "OK" : "FAIL", why.c_str());
  return ok;
}

// The raw communicator's unique id through a file (rank 0 writes it).
bool rawComm(const Rank& k, ncclComm_t* comm) {
  ncclUniqueId id;
  const char* path = std::getenv("SF_GPU_ID_FILE");
  if (k.world > 1 && !path) {
    std::printf("busbw: SF_GPU_ID_FILE is not set\n");
    return false;
  }
  if (k.rank == 0) {
    ncclGetUniqueId(&id);
    if (k.world > 1) {
      const std::string tmp = std::string(path) + ".tmp";
      std::ofstream(tmp, std::ios::binary).write(id.internal, sizeof id.internal);
      std::rename(tmp.c_str(), path);
    }
  } else {
    const auto t0 = Clock::now();
    for (;;) {
      std::ifstream in(path, std::ios::binary);
      if (in.read(id.internal, sizeof id.internal)) break;
      if (msSince(t0) > 60000) {
        std::printf("busbw: no unique id in %s within 60 s\n", path);
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  return ncclCommInitRank(comm, k.world, id, k.rank) == ncclSuccess;
}

bool busbw(const Rank& k, cudaStream_t s, int mib) {
  const int64_t n = int64_t(mib) << 18;  // float32 elements
  const int iters = 20;
  sf_context* ctx = makeContext(k, SF_REDUCE_AVERAGE, 1.0, 25.0, 60000);
  if (!ctx) return false;
  int64_t id;
  void* g = nullptr;
  sf_set_cuda_stream(ctx, s);
  SF_CHECK(sf_add_gradient(ctx, n, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &id));
  SF_CHECK(sf_gradient_data(ctx, id, &g));
  SF_CHECK(sf_synchronize(ctx));  // connect, layout check
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) SF_CHECK(sf_synchronize(ctx));
  cudaStreamSynchronize(s);
  const double sfMs = msSince(t0) / iters;
  sf_destroy(ctx);
  ncclComm_t comm = nullptr;
  if (!rawComm(k, &comm)) return false;
  float* raw = nullptr;
  cudaMalloc(&raw, size_t(n) * 4);
  ncclAllReduce(raw, raw, size_t(n), ncclFloat32, ncclAvg, comm, s);
  cudaStreamSynchronize(s);
  t0 = Clock::now();
  for (int i = 0; i < iters; ++i) ncclAllReduce(raw, raw, size_t(n), ncclFloat32, ncclAvg, comm, s);
  cudaStreamSynchronize(s);
  const double rawMs = msSince(t0) / iters;
  ncclCommDestroy(comm);
  cudaFree(raw);
  const double bytes = double(n) * 4, factor = k.world > 1 ? 2.0 * (k.world - 1) / k.world : 1.0;
  const double sfBus = bytes * factor / (sfMs * 1e6), rawBus = bytes * factor / (rawMs * 1e6);
  std::printf("RESULT busbw rank=%d world=%d bytes=%.0f sfsync_ms=%.3f raw_ms=%.3f sfsync_busbw_GBps=%.2f "
              "raw_busbw_GBps=%.2f ratio=%.3f OK\n",
              k.rank, k.world, bytes, sfMs, rawMs, sfBus, rawBus, rawMs / sfMs);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s parity|stream|leave|busbw [--mib N]\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  int mib = 64;
  for (int i = 2; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--mib")) mib = std::atoi(argv[++i]);
  }
  Rank k{envInt("RANK", 0), envInt("WORLD_SIZE", 1), envInt("LOCAL_RANK", 0), ""};
  const char* rdv = std::getenv("SF_RENDEZVOUS");
  k.rdv = rdv ? rdv : "";
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no usable GPU (%s)\n", cudaGetErrorString(cudaGetLastError()));
    return 77;
  }
  cudaSetDevice(k.local % devices);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  bool ok = false;
  if (mode == "parity") {
    ok = parity(k, s);
  } else if (mode == "stream") {
    ok = stream(k, s);
  } else if (mode == "leave") {
    ok = leave(k, s);
  } else if (mode == "busbw") {
    ok = busbw(k, s, mib);
  } else {
    std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
    return 2;
  }
  cudaStreamDestroy(s);
  return ok ? 0 : 1;
}
