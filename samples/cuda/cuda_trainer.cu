// sfsync CUDA sample: a small MLP (x -> tanh(W1 x + b1) -> W2 h + b2, MSE
// loss) whose forward and backward passes are CUDA kernels on the trainer's
// own stream, with gradient accumulation windows synchronized by sfsync's
// NCCL backend. One process per GPU; options from the environment (RANK,
// WORLD_SIZE, LOCAL_RANK and SF_RENDEZVOUS, or MASTER_ADDR/MASTER_PORT as
// sfsync-run sets them).
//
// Each window: micro-batches 1..N-1 inside sf_begin/end_accumulation
// (gradients sum locally, nothing is communicated), micro-batch N outside
// with sf_grad_ready after each layer's backward kernel is queued (buckets
// start while the rest of the backward runs), sf_synchronize, an SGD kernel
// on the same stream, sf_zero_gradients. At the end every rank compares its
// weights with a single-process CPU reference that sums the same
// micro-batches of every rank, and checks the collective counts.
//
//   sfsync-cuda-trainer [--windows W] [--own-buffers]
//
// Prints "RESULT rank=R world=N windows=W buckets=B collectives=C early=E
// inside=I max_err=X OK|FAILED"; exit 0 on OK, 77 where no GPU is usable
// (nothing run), 1 wrong, 2 setup, 3 an sfsync call failed.

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "sfsync.h"

namespace {

constexpr int kD = 32, kH = 64, kO = 8, kB = 16;  // input, hidden, output, batch
constexpr float kLr = 0.05f;
const int kSchedule[] = {3, 1, 4, 2};  // micro-batches per window, cycled

// ---- Data: a deterministic hash, identical on host and device ---------------

__host__ __device__ inline float unitNoise(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  uint32_t h = a * 0x9E3779B1u ^ (b + 0x7F4A7C15u) * 0x85EBCA77u ^ (c + 0x165667B1u) * 0xC2B2AE3Du ^
               (d + 0x27D4EB2Fu) * 0x94D049BBu;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  h *= 0x297A2D39u;
  h ^= h >> 15;
  return float(h & 0xFFFFFF) / float(0xFFFFFF) * 2.0f - 1.0f;  // [-1, 1]
}

// Sample k of micro-batch m of window w on rank r: input and target.
__host__ __device__ inline float inputAt(int r, int w, int m, int k, int d) {
  return unitNoise(uint32_t(r), uint32_t(w * 64 + m), uint32_t(k), uint32_t(d));
}
__host__ __device__ inline float targetAt(int r, int w, int m, int k, int o) {
  return 0.5f * unitNoise(uint32_t(r) + 1000u, uint32_t(w * 64 + m), uint32_t(k), uint32_t(o));
}

// ---- Kernels: one thread per output element, fixed summation order ---------

__global__ void makeBatch(float* x, float* t, int r, int w, int m) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < kB * kD) x[i] = inputAt(r, w, m, i / kD, i % kD);
  if (i < kB * kO) t[i] = targetAt(r, w, m, i / kO, i % kO);
}

__global__ void hiddenLayer(const float* W1, const float* b1, const float* x, float* h) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // b * kH + j
  if (i >= kB * kH) return;
  const int b = i / kH, j = i % kH;
  float z = b1[j];
  for (int d = 0; d < kD; ++d) z += W1[j * kD + d] * x[b * kD + d];
  h[i] = tanhf(z);
}

__global__ void outputLayer(const float* W2, const float* b2, const float* h, const float* t,
                            float* dy) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // b * kO + o
  if (i >= kB * kO) return;
  const int b = i / kO, o = i % kO;
  float y = b2[o];
  for (int j = 0; j < kH; ++j) y += W2[o * kH + j] * h[b * kH + j];
  dy[i] = (y - t[i]) / float(kB);  // d(0.5 * mean squared error)/dy
}

__global__ void gradOutput(const float* dy, const float* h, float* gW2, float* gb2) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // o * kH + j
  if (i >= kO * kH) return;
  const int o = i / kH, j = i % kH;
  float g = 0, gb = 0;
  for (int b = 0; b < kB; ++b) {
    g += dy[b * kO + o] * h[b * kH + j];
    gb += dy[b * kO + o];
  }
  gW2[i] += g;  // accumulate across micro-batches
  if (j == 0) gb2[o] += gb;
}

__global__ void backHidden(const float* dy, const float* W2, const float* h, float* dz) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // b * kH + j
  if (i >= kB * kH) return;
  const int b = i / kH, j = i % kH;
  float s = 0;
  for (int o = 0; o < kO; ++o) s += dy[b * kO + o] * W2[o * kH + j];
  dz[i] = s * (1.0f - h[i] * h[i]);
}

__global__ void gradHidden(const float* dz, const float* x, float* gW1, float* gb1) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // j * kD + d
  if (i >= kH * kD) return;
  const int j = i / kD, d = i % kD;
  float g = 0, gb = 0;
  for (int b = 0; b < kB; ++b) {
    g += dz[b * kH + j] * x[b * kD + d];
    gb += dz[b * kH + j];
  }
  gW1[i] += g;
  if (d == 0) gb1[j] += gb;
}

__global__ void sgd(float* p, const float* g, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] -= kLr * g[i];
}

int blocks(int n) { return (n + 127) / 128; }

// ---- The CPU reference: same math, every rank's micro-batches ---------------

struct Params {
  std::vector<float> W1, b1, W2, b2;
};

Params initialParams() {
  Params p{std::vector<float>(kH * kD), std::vector<float>(kH), std::vector<float>(kO * kH),
           std::vector<float>(kO)};
  for (int i = 0; i < kH * kD; ++i) p.W1[i] = 0.3f * unitNoise(7, 1, 0, uint32_t(i));
  for (int i = 0; i < kH; ++i) p.b1[i] = 0.1f * unitNoise(7, 2, 0, uint32_t(i));
  for (int i = 0; i < kO * kH; ++i) p.W2[i] = 0.3f * unitNoise(7, 3, 0, uint32_t(i));
  for (int i = 0; i < kO; ++i) p.b2[i] = 0.1f * unitNoise(7, 4, 0, uint32_t(i));
  return p;
}

void referenceStep(Params& p, int world, int w, int micro) {
  std::vector<double> gW1(kH * kD), gb1(kH), gW2(kO * kH), gb2(kO);
  std::vector<float> x(kB * kD), t(kB * kO), h(kB * kH), dy(kB * kO);
  for (int r = 0; r < world; ++r) {
    for (int m = 0; m < micro; ++m) {
      for (int k = 0; k < kB; ++k) {
        for (int d = 0; d < kD; ++d) x[k * kD + d] = inputAt(r, w, m, k, d);
        for (int o = 0; o < kO; ++o) t[k * kO + o] = targetAt(r, w, m, k, o);
      }
      for (int b = 0; b < kB; ++b) {
        for (int j = 0; j < kH; ++j) {
          float z = p.b1[j];
          for (int d = 0; d < kD; ++d) z += p.W1[j * kD + d] * x[b * kD + d];
          h[b * kH + j] = std::tanh(z);
        }
        for (int o = 0; o < kO; ++o) {
          float y = p.b2[o];
          for (int j = 0; j < kH; ++j) y += p.W2[o * kH + j] * h[b * kH + j];
          dy[b * kO + o] = (y - t[b * kO + o]) / float(kB);
        }
      }
      for (int b = 0; b < kB; ++b) {
        for (int o = 0; o < kO; ++o) {
          gb2[o] += dy[b * kO + o];
          for (int j = 0; j < kH; ++j) gW2[o * kH + j] += dy[b * kO + o] * h[b * kH + j];
        }
        for (int j = 0; j < kH; ++j) {
          float s = 0;
          for (int o = 0; o < kO; ++o) s += dy[b * kO + o] * p.W2[o * kH + j];
          const float dz = s * (1.0f - h[b * kH + j] * h[b * kH + j]);
          gb1[j] += dz;
          for (int d = 0; d < kD; ++d) gW1[j * kD + d] += dz * x[b * kD + d];
        }
      }
    }
  }
  auto apply = [&](std::vector<float>& q, const std::vector<double>& g) {
    for (size_t i = 0; i < q.size(); ++i) q[i] -= kLr * float(g[i] / world);  // the average
  };
  apply(p.W1, gW1);
  apply(p.b1, gb1);
  apply(p.W2, gW2);
  apply(p.b2, gb2);
}

#define CUDA_CHECK(x)                                                                       \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "rank %d: %s: %s\n", rank, #x, cudaGetErrorString(e_));          \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

#define SF_CHECK(x)                                                                         \
  do {                                                                                      \
    sf_status s_ = (x);                                                                     \
    if (s_ != SF_OK) {                                                                      \
      std::fprintf(stderr, "rank %d: %s failed (%s): %s\n", rank, #x, sf_status_string(s_), \
                   sf_last_error());                                                        \
      std::printf("RESULT rank=%d status=%d FAILED\n", rank, int(s_));                      \
      std::exit(3);                                                                         \
    }                                                                                       \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  int windows = 6;
  bool ownBuffers = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--windows") && i + 1 < argc) {
      windows = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--own-buffers")) {
      ownBuffers = true;
    } else {
      std::fprintf(stderr, "usage: %s [--windows W] [--own-buffers]\n", argv[0]);
      return 2;
    }
  }
  sf_options o;
  int rank = 0;
  if (sf_options_init(&o, sizeof o) != SF_OK) {
    std::fprintf(stderr, "sf_options_init: %s\n", sf_last_error());
    return 2;
  }
  rank = o.rank;
  const int world = o.world_size;
  // Small caps so that the model spans several buckets: [b2] [W2 b1] [W1].
  o.bucket_cap_mb = 4096.0 / 1048576.0;
  o.first_bucket_cap_mb = 1024.0 / 1048576.0;
  o.backend = SF_BACKEND_NCCL;

  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe != cudaSuccess || devices == 0) {
    std::printf("SKIPPED rank=%d: no usable GPU (%s); nothing was run\n", rank,
                probe != cudaSuccess ? cudaGetErrorString(probe) : "cudaGetDeviceCount = 0");
    return 77;
  }
  CUDA_CHECK(cudaSetDevice(o.local_rank));
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  sf_context* ctx = nullptr;
  SF_CHECK(sf_create(&o, &ctx));
  SF_CHECK(sf_set_cuda_stream(ctx, stream));

  // Parameters and gradients in registration order W1, b1, W2, b2.
  const int sizes[4] = {kH * kD, kH, kO * kH, kO};
  const char* names[4] = {"W1", "b1", "W2", "b2"};
  Params init = initialParams();
  const std::vector<float>* initial[4] = {&init.W1, &init.b1, &init.W2, &init.b2};
  float* param[4];
  float* grad[4];
  float* own[4] = {nullptr, nullptr, nullptr, nullptr};
  for (int p = 0; p < 4; ++p) {
    CUDA_CHECK(cudaMalloc(&param[p], sizes[p] * sizeof(float)));
    CUDA_CHECK(cudaMemcpyAsync(param[p], initial[p]->data(), sizes[p] * sizeof(float),
                               cudaMemcpyHostToDevice, stream));
    int64_t id;
    if (ownBuffers) {
      CUDA_CHECK(cudaMalloc(&own[p], sizes[p] * sizeof(float)));
      SF_CHECK(sf_register_gradient(ctx, own[p], sizes[p], SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, names[p], &id));
    } else {
      SF_CHECK(sf_add_gradient(ctx, sizes[p], SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, names[p], &id));
    }
  }
  for (int p = 0; p < 4; ++p) {
    void* g;
    SF_CHECK(sf_gradient_data(ctx, p, &g));
    grad[p] = static_cast<float*>(g);
  }
  SF_CHECK(sf_zero_gradients(ctx));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // the initial uploads' host buffers

  float *x, *t, *h, *dy, *dz;
  CUDA_CHECK(cudaMalloc(&x, kB * kD * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&t, kB * kO * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&h, kB * kH * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&dy, kB * kO * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&dz, kB * kH * sizeof(float)));

  sf_stats s{};
  s.struct_size = sizeof s;
  int64_t inside = 0;
  for (int w = 0; w < windows; ++w) {
    const int micro = kSchedule[w % 4];
    SF_CHECK(sf_begin_accumulation(ctx));
    SF_CHECK(sf_get_stats(ctx, &s));
    const int64_t before = s.collectives_issued;
    for (int m = 0; m < micro; ++m) {
      const bool last = m == micro - 1;
      if (last) {
        SF_CHECK(sf_get_stats(ctx, &s));
        inside += s.collectives_issued - before;
        SF_CHECK(sf_end_accumulation(ctx));
      }
      makeBatch<<<blocks(kB * kD), 128, 0, stream>>>(x, t, rank, w, m);
      hiddenLayer<<<blocks(kB * kH), 128, 0, stream>>>(param[0], param[1], x, h);
      outputLayer<<<blocks(kB * kO), 128, 0, stream>>>(param[2], param[3], h, t, dy);
      gradOutput<<<blocks(kO * kH), 128, 0, stream>>>(dy, h, grad[2], grad[3]);
      SF_CHECK(sf_grad_ready(ctx, 3));  // b2, W2: their bucket may start now
      SF_CHECK(sf_grad_ready(ctx, 2));
      backHidden<<<blocks(kB * kH), 128, 0, stream>>>(dy, param[2], h, dz);
      gradHidden<<<blocks(kH * kD), 128, 0, stream>>>(dz, x, grad[0], grad[1]);
      SF_CHECK(sf_grad_ready(ctx, 1));
      SF_CHECK(sf_grad_ready(ctx, 0));
      CUDA_CHECK(cudaGetLastError());
    }
    SF_CHECK(sf_synchronize(ctx));  // the stream now waits for the reduced gradients
    for (int p = 0; p < 4; ++p) sgd<<<blocks(sizes[p]), 128, 0, stream>>>(param[p], grad[p], sizes[p]);
    SF_CHECK(sf_zero_gradients(ctx));  // after the SGD kernels, on the same stream
  }
  SF_CHECK(sf_get_stats(ctx, &s));

  // Compare with the reference.
  Params ref = initialParams();
  for (int w = 0; w < windows; ++w) referenceStep(ref, world, w, kSchedule[w % 4]);
  const std::vector<float>* want[4] = {&ref.W1, &ref.b1, &ref.W2, &ref.b2};
  double maxErr = 0;
  for (int p = 0; p < 4; ++p) {
    std::vector<float> got(sizes[p]);
    CUDA_CHECK(cudaMemcpyAsync(got.data(), param[p], sizes[p] * sizeof(float), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int i = 0; i < sizes[p]; ++i) maxErr = std::fmax(maxErr, std::fabs(double(got[i]) - (*want[p])[i]));
  }
  const bool countsOk = s.collectives_issued == s.bucket_count * windows &&
                        s.early_launches == s.bucket_count * windows && inside == 0 &&
                        s.windows_completed == windows && s.bucket_count == 3;
  const bool ok = countsOk && maxErr < 1e-4;
  std::printf("RESULT rank=%d world=%d windows=%d buckets=%lld collectives=%lld early=%lld inside=%lld "
              "max_err=%.3g %s\n",
              rank, world, windows, (long long)s.bucket_count, (long long)s.collectives_issued,
              (long long)s.early_launches, (long long)inside, maxErr, ok ? "OK" : "FAILED");
  std::fflush(stdout);

  sf_destroy(ctx);
  for (int p = 0; p < 4; ++p) {
    cudaFree(param[p]);
    cudaFree(own[p]);
  }
  for (float* b : {x, t, h, dy, dz}) cudaFree(b);
  cudaStreamDestroy(stream);
  return ok ? 0 : 1;
}
