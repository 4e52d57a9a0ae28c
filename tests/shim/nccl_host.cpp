// A host that calls NCCL itself, as a trainer with gradient accumulation
// would, for testing the shim's NCCL half: run it with LD_PRELOAD=
// libsfsync_shim.so, against the NCCL stand-in (tests/standin, host memory,
// on GPU-less machines) or against the real NCCL (tests/gpu/run.sh).
//
// R ranks are forked processes (one GPU each when there are GPUs). Every
// micro-batch (backward pass) p adds a known local gradient g(r, p) to the
// rank's accumulator and all-reduces it in two buckets, DDP style: bucket 1
// pre-divided by R with ncclSum in place, bucket 2 with ncclAvg out of place,
// both inside nested ncclGroupStart/End. Pass 1 uses one other buffer of both
// buckets' size (DDP's bucket rebuild). Each pass also all-reduces what must
// always pass: a small float sum (a loss), a large int32 sum, a large float max.
//
// --mode calls   sf_begin_accumulation before micro-batch 1, sf_end_accumulation
//                before micro-batch N (on sfsync's default context)
// --mode auto    nothing: SF_ACCUMULATION_STEPS=N is expected in the environment
// --mode none    nothing: every pass synchronized (the shim, if present, idle)
//
// Checked on every rank, each a failing exit status with a message:
//  - every all-reduce result: the local result ("as if every rank held my
//    values") for a deferred pass, the global one otherwise, the exact global
//    value for the int/max/loss calls;
//  - the final weights against a single-process reference that sums all
//    ranks' micro-batches (double precision);
//  - the bytes that went over the host's communicator (stand-in hook, when
//    present) and the shim's own count of deferred calls (its report, when
//    the shim is loaded).

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "sfsync.h"

namespace {

struct Args {
  int ranks = 2;
  int steps = 4;
  int windows = 6;
  std::string mode = "calls";
  size_t n1 = 60000;  // bucket 1 elements (float)
  size_t n2 = 20000;  // bucket 2
  size_t nInt = 40000;
  size_t nMax = 40000;
};

constexpr float kLr = 0.1f;
constexpr size_t kLoss = 4;

int failures = 0;

#define CHECK(cond, ...)                                \
  do {                                                  \
    if (!(cond)) {                                      \
      std::fprintf(stderr, "rank %d: FAILED: ", rank);  \
      std::fprintf(stderr, __VA_ARGS__);                \
      std::fprintf(stderr, "\n");                       \
      ++failures;                                       \
    }                                                   \
  } while (0)

#define CUDA(call)                                                                    \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));               \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

#define NCCL(call)                                                                    \
  do {                                                                                \
    ncclResult_t r_ = (call);                                                         \
    if (r_ != ncclSuccess) {                                                          \
      std::fprintf(stderr, "%s: %s\n", #call, ncclGetErrorString(r_));               \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

float gradient(int r, int p, size_t k) {
  return float(std::sin(0.001 * double(k) + 0.1 * p + 1.3 * r));
}

bool near(double a, double b, double tol) { return std::fabs(a - b) <= tol * (1 + std::fabs(b)); }

// Whether the shim is expected to defer backward pass p (1-based).
bool deferred(const Args& a, int p) {
  const int i = (p - 1) % a.steps;  // micro-batch in its window
  if (a.mode == "calls") return i < a.steps - 1;
  if (a.mode == "auto") return p > 5 && p % a.steps != 0;  // learned after pass 5
  return false;
}

int run(const Args& a, int rank, const ncclUniqueId& id) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) devices = 1;
  CUDA(cudaSetDevice(rank % devices));
  ncclComm_t comm;
  NCCL(ncclCommInitRank(&comm, a.ranks, id, rank));
  cudaStream_t stream;
  CUDA(cudaStreamCreate(&stream));
  const size_t n = a.n1 + a.n2;
  float *first, *b1, *b2in, *b2out, *loss, *mx;
  int32_t* ints;
  CUDA(cudaMalloc(reinterpret_cast<void**>(&first), n * 4));
  CUDA(cudaMalloc(reinterpret_cast<void**>(&b1), a.n1 * 4));
  CUDA(cudaMalloc(reinterpret_cast<void**>(&b2in), a.n2 * 4));
  CUDA(cudaMalloc(reinterpret_cast<void**>(&b2out), a.n2 * 4));
  CUDA(cudaMalloc(reinterpret_cast<void**>(&loss), kLoss * 4));
  CUDA(cudaMalloc(reinterpret_cast<void**>(&mx), a.nMax * 4));
  CUDA(cudaMalloc(reinterpret_cast<void**>(&ints), a.nInt * 4));

  sf_context* ctx = nullptr;
  if (a.mode == "calls" && sf_default_context(&ctx) != SF_OK) {
    std::fprintf(stderr, "sf_default_context: %s\n", sf_last_error());
    return 2;
  }
  const float R = float(a.ranks);
  std::vector<float> w(n, 0.f), acc(n, 0.f), out(n), tmp(std::max(a.nInt, a.nMax));
  // Every rank's accumulator, to know the global results.
  std::vector<std::vector<float>> all(size_t(a.ranks), std::vector<float>(n, 0.f));
  std::vector<double> ref(n, 0.0), refAcc(n, 0.0);
  int64_t gradientBytes = 0, otherBytes = 0, deferredCalls = 0;

  for (int win = 1; win <= a.windows; ++win) {
    for (int i = 0; i < a.steps; ++i) {
      const int p = (win - 1) * a.steps + i + 1;
      if (ctx && a.steps > 1 && i == 0) sf_begin_accumulation(ctx);
      if (ctx && a.steps > 1 && i == a.steps - 1) sf_end_accumulation(ctx);
      for (int r = 0; r < a.ranks; ++r) {
        for (size_t k = 0; k < n; ++k) {
          all[size_t(r)][k] += gradient(r, p, k);
          if (r == rank) acc[k] = all[size_t(r)][k];
          refAcc[k] += gradient(r, p, k) / double(a.ranks);
        }
      }
      // Bucket 1 (and pass 1's single bucket) is pre-divided, as DDP does.
      std::vector<float> staged(acc);
      for (size_t k = 0; k < (p == 1 ? n : a.n1); ++k) staged[k] = acc[k] / R;
      if (p == 1) {
        CUDA(cudaMemcpyAsync(first, staged.data(), n * 4, cudaMemcpyHostToDevice, stream));
        NCCL(ncclAllReduce(first, first, n, ncclFloat32, ncclSum, comm, stream));
        CUDA(cudaMemcpyAsync(out.data(), first, n * 4, cudaMemcpyDeviceToHost, stream));
        deferredCalls += deferred(a, p) ? 1 : 0;
      } else {
        CUDA(cudaMemcpyAsync(b1, staged.data(), a.n1 * 4, cudaMemcpyHostToDevice, stream));
        CUDA(cudaMemcpyAsync(b2in, staged.data() + a.n1, a.n2 * 4, cudaMemcpyHostToDevice, stream));
        NCCL(ncclGroupStart());
        NCCL(ncclAllReduce(b1, b1, a.n1, ncclFloat32, ncclSum, comm, stream));
        NCCL(ncclGroupStart());
        NCCL(ncclAllReduce(b2in, b2out, a.n2, ncclFloat32, ncclAvg, comm, stream));
        NCCL(ncclGroupEnd());
        NCCL(ncclGroupEnd());
        CUDA(cudaMemcpyAsync(out.data(), b1, a.n1 * 4, cudaMemcpyDeviceToHost, stream));
        CUDA(cudaMemcpyAsync(out.data() + a.n1, b2out, a.n2 * 4, cudaMemcpyDeviceToHost, stream));
        deferredCalls += deferred(a, p) ? 2 : 0;
      }
      if (!deferred(a, p)) gradientBytes += int64_t(n * 4);
      CUDA(cudaStreamSynchronize(stream));

      // Gradients: the local result when deferred, the global one otherwise.
      std::vector<float> global(n, 0.f);
      for (size_t k = 0; k < n; ++k) {
        double s = 0;
        for (int r = 0; r < a.ranks; ++r) s += all[size_t(r)][k];
        global[k] = float(s / a.ranks);
      }
      size_t bad = 0, firstBad = 0;
      for (size_t k = 0; k < n; ++k) {
        const float local = k < (p == 1 ? n : a.n1) ? (acc[k] / R) * R : acc[k];
        const float want = deferred(a, p) ? local : global[k];
        if (!near(out[k], want, 1e-5) && bad++ == 0) firstBad = k;
      }
      CHECK(bad == 0, "pass %d (%s): %zu of %zu gradient elements wrong, first [%zu] = %.8g, want %.8g",
            p, deferred(a, p) ? "deferred" : "synchronized", bad, n, firstBad, out[firstBad],
            deferred(a, p) ? acc[firstBad] : global[firstBad]);
      // As DDP writes the bucket back into the gradients.
      for (int r = 0; r < a.ranks; ++r) {
        if (!deferred(a, p)) all[size_t(r)] = global;
      }
      all[size_t(rank)] = out;
      acc = out;

      // What must always pass: a loss, an int32 sum, a float max.
      std::vector<float> l(kLoss, float(rank + 1));
      std::vector<int32_t> iv(a.nInt, rank + 1);
      std::vector<float> mv(a.nMax, float(rank) * 0.5f);
      CUDA(cudaMemcpyAsync(loss, l.data(), kLoss * 4, cudaMemcpyHostToDevice, stream));
      CUDA(cudaMemcpyAsync(ints, iv.data(), a.nInt * 4, cudaMemcpyHostToDevice, stream));
      CUDA(cudaMemcpyAsync(mx, mv.data(), a.nMax * 4, cudaMemcpyHostToDevice, stream));
      NCCL(ncclAllReduce(loss, loss, kLoss, ncclFloat32, ncclSum, comm, stream));
      NCCL(ncclAllReduce(ints, ints, a.nInt, ncclInt32, ncclSum, comm, stream));
      NCCL(ncclAllReduce(mx, mx, a.nMax, ncclFloat32, ncclMax, comm, stream));
      CUDA(cudaMemcpyAsync(l.data(), loss, kLoss * 4, cudaMemcpyDeviceToHost, stream));
      CUDA(cudaMemcpyAsync(iv.data(), ints, a.nInt * 4, cudaMemcpyDeviceToHost, stream));
      CUDA(cudaMemcpyAsync(mv.data(), mx, a.nMax * 4, cudaMemcpyDeviceToHost, stream));
      CUDA(cudaStreamSynchronize(stream));
      otherBytes += int64_t(kLoss * 4 + a.nInt * 4 + a.nMax * 4);
      const int sum = a.ranks * (a.ranks + 1) / 2;
      CHECK(l[0] == float(sum) && l[kLoss - 1] == float(sum), "pass %d: loss %g, want %d", p, l[0], sum);
      CHECK(iv[0] == sum && iv[a.nInt - 1] == sum, "pass %d: int sum %d, want %d", p, iv[0], sum);
      CHECK(mv[0] == float(a.ranks - 1) * 0.5f, "pass %d: max %g", p, mv[0]);
    }
    // The optimizer step.
    for (size_t k = 0; k < n; ++k) {
      w[k] -= kLr * acc[k];
      ref[k] -= double(kLr) * refAcc[k];
      refAcc[k] = 0;
      acc[k] = 0;
    }
    for (auto& r : all) std::fill(r.begin(), r.end(), 0.f);
  }

  double worst = 0;
  for (size_t k = 0; k < n; ++k) worst = std::max(worst, std::fabs(w[k] - ref[k]));
  std::printf("rank %d: max |weight - single-process reference| = %.3g\n", rank, worst);
  CHECK(worst < 1e-4, "weights differ from the reference by %g", worst);

  // Bytes over the host's communicator (the stand-in counts them).
  using CommCounters = int (*)(ncclComm_t, int64_t*, int64_t*);
  if (auto counters = reinterpret_cast<CommCounters>(dlsym(RTLD_DEFAULT, "sfStandinCommCounters"))) {
    int64_t calls = 0, bytes = 0;
    counters(comm, &calls, &bytes);
    const int64_t perPass = int64_t(n * 4);
    std::printf("rank %d: bytes over the communicator: %lld gradient (%.2f x the gradient bytes "
                "per window) + %lld other; %lld calls\n",
                rank, (long long)(bytes - otherBytes),
                double(bytes - otherBytes) / double(perPass) / a.windows, (long long)otherBytes,
                (long long)calls);
    CHECK(bytes == gradientBytes + otherBytes, "%lld bytes went over the communicator, want %lld",
          (long long)bytes, (long long)(gradientBytes + otherBytes));
  }
  // The shim's own account.
  using Report = sf_status (*)(char*, int64_t, int64_t*);
  if (auto report = reinterpret_cast<Report>(dlsym(RTLD_DEFAULT, "sf_shim_report_json"))) {
    std::vector<char> json(1 << 16);
    report(json.data(), int64_t(json.size()), nullptr);
    const std::string s(json.data());
    if (s != "{}") {
      const size_t b = s.find("\"calls\""), e = s.find(",\n \"windows\"");
      if (b != std::string::npos && e != std::string::npos) {
        std::printf("rank %d: shim: %s\n", rank, s.substr(b, e - b).c_str());
      }
      const std::string want = "\"deferred\": " + std::to_string(deferredCalls) + ",";
      CHECK(s.find(want) != std::string::npos, "shim report lacks %s: %s", want.c_str(), s.c_str());
      CHECK(s.find("\"unsynchronized_windows\": []") != std::string::npos,
            "shim report: %s", s.c_str());
    }
  }
  ncclCommDestroy(comm);
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--ranks") a.ranks = std::atoi(v.c_str());
    else if (k == "--steps") a.steps = std::atoi(v.c_str());
    else if (k == "--windows") a.windows = std::atoi(v.c_str());
    else if (k == "--mode") a.mode = v;
    else {
      std::fprintf(stderr, "usage: %s [--ranks R] [--steps N] [--windows W] [--mode calls|auto|none]\n",
                   argv[0]);
      return 2;
    }
  }
  // Rank 0 makes the unique id after the fork (no NCCL state crosses it) and
  // hands it to the others through pipes.
  std::vector<int> pipes(size_t(2 * a.ranks));
  for (int r = 0; r < a.ranks; ++r) {
    if (pipe(&pipes[size_t(2 * r)]) != 0) return 2;
  }
  std::vector<pid_t> children;
  for (int rank = 0; rank < a.ranks; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      ncclUniqueId id;
      if (rank == 0) {
        NCCL(ncclGetUniqueId(&id));
        for (int r = 1; r < a.ranks; ++r) {
          if (write(pipes[size_t(2 * r + 1)], &id, sizeof id) != ssize_t(sizeof id)) _exit(2);
        }
      } else if (read(pipes[size_t(2 * rank)], &id, sizeof id) != ssize_t(sizeof id)) {
        _exit(2);
      }
      std::exit(run(a, rank, id));  // exit(): the shim's report and guard run
    }
    children.push_back(pid);
  }
  int status = 0;
  for (const pid_t pid : children) {
    int s = 0;
    waitpid(pid, &s, 0);
    if (!WIFEXITED(s) || WEXITSTATUS(s) != 0) status = 1;
  }
  std::printf(status ? "FAILED\n" : "OK\n");
  return status;
}
