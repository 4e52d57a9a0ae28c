#pragma once
// Test support for the NCCL backend on the CUDA and NCCL stand-ins
// (tests/standin): device buffers, "kernels" as host functions on a stream
// (stand-in device memory is host memory), exactly representable gradient
// values, and the stand-ins' counters.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "plugin/core/dtype.h"
#include "sfsync.h"

extern "C" {
int64_t sfStandinCudaCounter(const char* name);
int64_t sfStandinNcclCounter(const char* name);
int sfStandinCommCounters(ncclComm_t comm, int64_t* calls, int64_t* bytes);
int sfStandinLiveComms(void);
int sfStandinInjectAsyncError(ncclComm_t comm, ncclResult_t r, const char* message);
void sfStandinFailNext(const char* function, ncclResult_t r);
}

namespace sftest {

inline double loadValue(const void* base, int64_t i, sf_dtype t) {
  const char* p = static_cast<const char*>(base);
  switch (t) {
    case SF_DTYPE_FLOAT32: { float v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case SF_DTYPE_FLOAT64: { double v; std::memcpy(&v, p + 8 * i, 8); return v; }
    case SF_DTYPE_FLOAT16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return sfsync::halfToFloat(v); }
    default: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return sfsync::bf16ToFloat(v); }
  }
}

inline void storeValue(void* base, int64_t i, sf_dtype t, double x) {
  char* p = static_cast<char*>(base);
  switch (t) {
    case SF_DTYPE_FLOAT32: { float v = float(x); std::memcpy(p + 4 * i, &v, 4); break; }
    case SF_DTYPE_FLOAT64: std::memcpy(p + 8 * i, &x, 8); break;
    case SF_DTYPE_FLOAT16: { uint16_t v = sfsync::floatToHalf(float(x)); std::memcpy(p + 2 * i, &v, 2); break; }
    default: { uint16_t v = sfsync::floatToBf16(float(x)); std::memcpy(p + 2 * i, &v, 2); break; }
  }
}

// The gradient rank r computes for element i of gradient p in micro-batch
// m of window w: quarters up to a few units, so that sums over micro-batches
// and ranks, averages over 2 or 4 ranks and a pre-scale of 0.5 are exact in
// every dtype (bfloat16 included).
inline double gradValue(int r, int w, int m, int p, int64_t i) {
  return 0.25 * double((r + 1) * (m + 1) + int(i % 5) + p + w);
}

// A host function queued on a stream: the stand-in's way of running a
// "kernel" that reads or writes device memory in stream order.
inline void launch(cudaStream_t s, std::function<void()> f) {
  auto* heap = new std::function<void()>(std::move(f));
  cudaLaunchHostFunc(
      s,
      [](void* arg) {
        std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(arg));
        (*fn)();
      },
      heap);
}

// Waits for what is queued on `s` so far without cudaStreamSynchronize (whose
// calls the tests count to show that the plugin never makes them).
inline void drain(cudaStream_t s) {
  cudaEvent_t e;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  cudaEventRecord(e, s);
  cudaEventSynchronize(e);
  cudaEventDestroy(e);
}

inline std::vector<double> readDevice(cudaStream_t s, const void* p, int64_t numel, sf_dtype t) {
  std::vector<char> host(size_t(numel) * sfsync::dtypeSize(t));
  cudaMemcpyAsync(host.data(), p, host.size(), cudaMemcpyDeviceToHost, s);
  drain(s);
  std::vector<double> out(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) out[size_t(i)] = loadValue(host.data(), i, t);
  return out;
}

}  // namespace sftest
