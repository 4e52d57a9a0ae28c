// libsfsync_nccl.so: the NCCL backend module. Implements the C table of
// plugin/backend/nccl/module_api.h with the CUDA runtime and NCCL, which only
// this library loads (dlopen at its first use, never linked: see
// loadLibraries). Responsible for streams, events, device memory and
// communicators; not for buckets, windows or rendezvous (libsfsync.so).
//
// Ordering: the host produces and reads gradients on its stream H;
// collectives run on the plugin's own non-blocking stream P. A collective
// starts after an event recorded on H (so after the host's backward kernels
// and our staging copies, which run on H), and H waits for an event recorded
// on P after it before the host reads the result. The CPU waits by polling
// events; nothing here synchronizes a stream the host uses or the device.

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "plugin/backend/nccl/completion_poll.h"
#include "plugin/backend/nccl/module_api.h"
#include "plugin/backend/nccl/reduction_choice.h"
#include "plugin/core/dtype.h"
#include "plugin/core/env.h"
#include "sfsync.h"

#define SFN_EXPORT extern "C" __attribute__((visibility("default")))

// ---- The CUDA runtime and NCCL, loaded with dlopen at the first use ----------
//
// Not DT_NEEDED: the wheel stays manylinux with no CUDA library inside or
// required, and a host that already loaded a CUDA runtime or NCCL (PyTorch
// from its nvidia-* wheels) gets its own copy used. Every CUDA / NCCL function
// this module calls is in one of the two lists below and goes through `fn`
// (the headers give only the types). X(name): typed by its declaration;
// O(name, type): overloaded in C++ (nccl.h includes cuda_runtime.h, whose
// templates overload it), typed as the C function.

using CudaAllocFn = cudaError_t (*)(void**, size_t);  // cudaMalloc, cudaMallocHost

#define SFN_CUDART_FUNCTIONS(X, O)        \
  X(cudaDeviceGetStreamPriorityRange)     \
  X(cudaEventCreateWithFlags)             \
  X(cudaEventDestroy)                     \
  X(cudaEventQuery)                       \
  X(cudaEventRecord)                      \
  X(cudaFree)                             \
  X(cudaFreeHost)                         \
  X(cudaGetDevice)                        \
  X(cudaGetDeviceCount)                   \
  X(cudaGetDriverEntryPointByVersion)     \
  X(cudaGetErrorName)                     \
  X(cudaGetErrorString)                   \
  X(cudaGetLastError)                     \
  O(cudaMalloc, CudaAllocFn)             \
  O(cudaMallocHost, CudaAllocFn)         \
  X(cudaMemcpyAsync)                      \
  X(cudaMemsetAsync)                      \
  X(cudaPointerGetAttributes)             \
  X(cudaRuntimeGetVersion)                \
  X(cudaSetDevice)                        \
  X(cudaStreamCreateWithFlags)            \
  X(cudaStreamCreateWithPriority)         \
  X(cudaStreamDestroy)                    \
  X(cudaStreamWaitEvent)

#define SFN_NCCL_FUNCTIONS(X, O)  \
  X(ncclAllGather)             \
  X(ncclAllReduce)             \
  X(ncclBroadcast)             \
  X(ncclCommAbort)             \
  X(ncclCommCount)             \
  X(ncclCommCuDevice)          \
  X(ncclCommDestroy)           \
  X(ncclCommFinalize)          \
  X(ncclCommGetAsyncError)     \
  X(ncclCommInitRankConfig)    \
  X(ncclCommUserRank)          \
  X(ncclGetErrorString)        \
  X(ncclGetLastError)          \
  X(ncclGetUniqueId)           \
  X(ncclGetVersion)            \
  X(ncclGroupEnd)              \
  X(ncclGroupStart)            \
  X(ncclRedOpCreatePreMulSum)  \
  X(ncclRedOpDestroy)          \
  X(ncclReduce)                \
  X(ncclReduceScatter)

namespace {

// One pointer per function, typed by its declaration in the headers.
struct Functions {
#define SFN_POINTER(name) decltype(&::name) name = nullptr;
#define SFN_POINTER_AS(name, type) type name = nullptr;
  SFN_CUDART_FUNCTIONS(SFN_POINTER, SFN_POINTER_AS)
  SFN_NCCL_FUNCTIONS(SFN_POINTER, SFN_POINTER_AS)
#undef SFN_POINTER
#undef SFN_POINTER_AS
};

// Filled once by loadLibraries(); the table is handed out only after that
// succeeded, so every table function may call through it.
Functions fn;

std::string dlText() {
  const char* e = ::dlerror();
  return e ? e : "dlopen failed";
}

// The file a handle is, for messages ("" if the loader does not say).
std::string pathOf(void* handle) {
  struct link_map* map = nullptr;
  if (::dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || !map || !map->l_name) return "";
  return map->l_name;
}

// Opens one library: the file named by `envVar` if set (an explicit choice,
// the only one tried), else the copy already loaded in this process (the
// host's), else `soname` through the loader's search path (LD_LIBRARY_PATH,
// then the system's). "" on success, else why not.
std::string openLibrary(const char* soname, const char* envVar, void** handle, std::string* path) {
  const char* chosen = sfsync::envValue(envVar);
  ::dlerror();
  if (chosen) {
    *handle = ::dlopen(chosen, RTLD_NOW | RTLD_LOCAL);
    if (!*handle) return dlText() + " (from " + envVar + ")";
  } else {
    *handle = ::dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
    if (!*handle) {
      ::dlerror();
      *handle = ::dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    }
    if (!*handle) return dlText() + " (or set " + envVar + " to its path)";
  }
  *path = pathOf(*handle);
  if (path->empty()) *path = chosen && *chosen ? chosen : soname;
  return "";
}

// "" on success, else the missing symbol and the library.
template <typename T>
std::string resolve(void* handle, const std::string& path, const char* name, T* slot) {
  ::dlerror();
  void* p = ::dlsym(handle, name);
  if (!p) {
    return std::string("symbol ") + name + " not found in " + path +
           " (an older CUDA runtime / NCCL than this module was built for?)";
  }
  *slot = reinterpret_cast<T>(p);
  return "";
}

std::mutex gLoadMutex;
bool gLoaded = false;
std::string gLoadError;  // why loadLibraries() failed; "" before and on success

// Loads the CUDA runtime, then NCCL (whose stand-in needs the runtime), and
// resolves every function; once per process (the handles are never closed,
// as CUDA and NCCL cannot be unloaded). On failure closes what it opened and
// says why; the next call tries again.
bool loadLibraries() {
  std::lock_guard<std::mutex> lock(gLoadMutex);
  if (gLoaded) return true;
  void* cudart = nullptr;
  void* nccl = nullptr;
  std::string cudartPath, ncclPath;
  std::string why = openLibrary("libcudart.so.13", "SF_CUDART_LIBRARY", &cudart, &cudartPath);
  if (why.empty()) why = openLibrary("libnccl.so.2", "SF_NCCL_LIBRARY", &nccl, &ncclPath);
  Functions f;
#define SFN_RESOLVE_CUDART(name) \
  if (why.empty()) why = resolve(cudart, cudartPath, #name, &f.name);
#define SFN_RESOLVE_NCCL(name) \
  if (why.empty()) why = resolve(nccl, ncclPath, #name, &f.name);
#define SFN_RESOLVE_CUDART_AS(name, type) SFN_RESOLVE_CUDART(name)
#define SFN_RESOLVE_NCCL_AS(name, type) SFN_RESOLVE_NCCL(name)
  SFN_CUDART_FUNCTIONS(SFN_RESOLVE_CUDART, SFN_RESOLVE_CUDART_AS)
  SFN_NCCL_FUNCTIONS(SFN_RESOLVE_NCCL, SFN_RESOLVE_NCCL_AS)
#undef SFN_RESOLVE_CUDART
#undef SFN_RESOLVE_NCCL
#undef SFN_RESOLVE_CUDART_AS
#undef SFN_RESOLVE_NCCL_AS
  if (!why.empty()) {
    if (nccl) ::dlclose(nccl);
    if (cudart) ::dlclose(cudart);
    gLoadError = why;
    return false;
  }
  fn = f;
  gLoaded = true;
  gLoadError.clear();
  return true;
}

}  // namespace

struct sfn_device {
  int device = 0;
  cudaStream_t stream = nullptr;  // the plugin's
  cudaStream_t host = nullptr;    // the host's; nullptr is the legacy default stream
  // Small pinned staging for host <-> device values (window check, window
  // weight): [kStage, 2 kStage) for reads; writes take a slot of their own
  // (below), reused once the copy that read it has run.
  char* pinned = nullptr;
  struct WriteSlot {
    char* pinned = nullptr;
    cudaEvent_t copied = nullptr;  // recorded on the host's stream after the copy
  };
  std::vector<WriteSlot> writes;
};

namespace {
constexpr size_t kStage = 256;
}

struct sfn_comm {
  sfn_device* dev = nullptr;
  ncclComm_t comm = nullptr;
  bool owned = false;
  bool aborted = false;
  int world = 1, rank = 0;
  int64_t timeoutMs = 300000;  // for NCCL calls that return ncclInProgress
  // Buffers of the (rare) int64 control all-reduce, grown on demand.
  int64_t* pinned = nullptr;
  int64_t* ints = nullptr;
  int64_t intCap = 0;
  // Since 0.4: a one-rank communicator on the same device, made at the first
  // scale_start (weighted windows): NCCL's pre-multiplied sum over one rank
  // scales memory in place on the plugin's stream.
  ncclComm_t self = nullptr;
};

struct sfn_work {
  sfn_comm* comm = nullptr;
  cudaEvent_t ready = nullptr;  // on the host's stream: the inputs are final
  cudaEvent_t done = nullptr;   // on the plugin's stream: the result is there
  int64_t bytes = 0;
};

namespace {

using sfsync::nccl::Outcome;
using sfsync::nccl::Poll;

struct Failure {
  int32_t status;
  std::string message;
};

int32_t report(sfn_error* err, int32_t status, const std::string& message) {
  if (err) std::snprintf(err->message, sizeof err->message, "%s", message.c_str());
  return status;
}

std::string cudaText(cudaError_t e) {
  return std::string(fn.cudaGetErrorName(e)) + " (" + std::to_string(int(e)) + "): " +
         fn.cudaGetErrorString(e);
}

std::string ncclText(ncclComm_t comm, ncclResult_t r) {
  std::string s = std::string(fn.ncclGetErrorString(r)) + " (ncclResult_t " + std::to_string(int(r)) + ")";
  const char* last = fn.ncclGetLastError(comm);
  if (last && *last) s += ": " + std::string(last);
  return s;
}

void checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    fn.cudaGetLastError();  // clear the sticky-free error so later calls are not confused
    throw Failure{SF_ERR_BACKEND, std::string(what) + " failed: " + cudaText(e)};
  }
}

// Runs an entry point's body: every failure becomes a status and a message.
template <typename F>
int32_t entry(sfn_error* err, F&& body) noexcept {
  try {
    body();
    return SF_OK;
  } catch (const Failure& f) {
    return report(err, f.status, f.message);
  } catch (const std::bad_alloc&) {
    return report(err, SF_ERR_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& e) {
    return report(err, SF_ERR_INTERNAL, e.what());
  } catch (...) {
    return report(err, SF_ERR_INTERNAL, "unknown exception in the NCCL module");
  }
}

// The driver's current-context calls, through the runtime (no libcuda link):
// the exact state of a thread, "no context" included, which cudaGetDevice
// cannot tell (it says 0 on a thread that never chose a device).
struct CurrentContext {
  using Get = int (*)(void**);
  using Set = int (*)(void*);
  Get get = nullptr;
  Set set = nullptr;
  CurrentContext() {
    void* g = nullptr;
    void* s = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (fn.cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &g, 4000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess ||
        fn.cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &s, 4000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      fn.cudaGetLastError();
      return;
    }
    get = reinterpret_cast<Get>(g);
    set = reinterpret_cast<Set>(s);
  }
  static const CurrentContext& instance() {
    static const CurrentContext c;
    return c;
  }
};

// Makes `device` current for this thread for the scope, then gives the
// thread back exactly the context it had: the host's current device is its
// own business, and a thread that never chose a device (a context on no
// GPU) is not left on GPU 0 or any other.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    const CurrentContext& cc = CurrentContext::instance();
    if (cc.get && cc.get(&previousCtx_) == 0) {
      exact_ = true;
      int current = -1;
      // With a context current, cudaGetDevice names its device.
      if (previousCtx_ && fn.cudaGetDevice(&current) == cudaSuccess && current == device) return;
    } else {
      if (fn.cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
      if (previous_ == device) return;
    }
    checkCuda(fn.cudaSetDevice(device), "cudaSetDevice");
    switched_ = true;
  }
  ~DeviceGuard() {
    if (!switched_) return;
    if (exact_) {
      CurrentContext::instance().set(previousCtx_);
    } else if (previous_ >= 0) {
      fn.cudaSetDevice(previous_);
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  void* previousCtx_ = nullptr;
  bool exact_ = false;
  bool switched_ = false;
  int previous_ = -1;
};

ncclDataType_t ncclType(int32_t dtype) {
  switch (dtype) {
    case SF_DTYPE_FLOAT32: return ncclFloat32;
    case SF_DTYPE_FLOAT64: return ncclFloat64;
    case SF_DTYPE_FLOAT16: return ncclFloat16;
    case SF_DTYPE_BFLOAT16: return ncclBfloat16;
    default: throw Failure{SF_ERR_INVALID_ARGUMENT, "dtype " + std::to_string(dtype) + " is not an sf_dtype"};
  }
}

// The pre-multiplication factor in the reduction's own type, as
// ncclRedOpCreatePreMulSum reads it.
union Scalar {
  float f32;
  double f64;
  uint16_t bits16;
};

Scalar scalarOf(double factor, int32_t dtype) {
  Scalar s;
  std::memset(&s, 0, sizeof s);
  switch (dtype) {
    case SF_DTYPE_FLOAT32: s.f32 = float(factor); break;
    case SF_DTYPE_FLOAT64: s.f64 = factor; break;
    case SF_DTYPE_FLOAT16: s.bits16 = sfsync::floatToHalf(float(factor)); break;
    default: s.bits16 = sfsync::floatToBf16(float(factor)); break;
  }
  return s;
}

void abortComm(sfn_comm* c) {
  if (c->aborted) return;
  c->aborted = true;
  fn.ncclCommAbort(c->comm);  // also for an adopted one: its kernels would hang forever
}

// Health of a communicator for the poller; records the failure message.
Poll health(sfn_comm* c, std::string* why) {
  ncclResult_t async = ncclSuccess;
  ncclResult_t r = fn.ncclCommGetAsyncError(c->comm, &async);
  if (r != ncclSuccess) async = r;
  if (async == ncclSuccess || async == ncclInProgress) return Poll::kPending;
  *why = "NCCL asynchronous error on rank " + std::to_string(c->rank) + " of " +
         std::to_string(c->world) + ": " + ncclText(c->comm, async);
  return Poll::kFailed;
}

// Waits for a non-blocking NCCL call that returned ncclInProgress.
void settle(sfn_comm* c, ncclResult_t r, const char* what, int64_t timeoutMs) {
  if (r == ncclSuccess) return;
  if (r != ncclInProgress) {
    throw Failure{SF_ERR_BACKEND, std::string(what) + " failed on rank " + std::to_string(c->rank) +
                                      ": " + ncclText(c->comm, r)};
  }
  std::string why;
  const Outcome o = sfsync::nccl::pollUntil(
      [&] {
        ncclResult_t async = ncclSuccess;
        fn.ncclCommGetAsyncError(c->comm, &async);
        if (async == ncclInProgress) return Poll::kPending;
        if (async == ncclSuccess) return Poll::kDone;
        why = ncclText(c->comm, async);
        return Poll::kFailed;
      },
      [] { return Poll::kPending; }, std::chrono::milliseconds(timeoutMs),
      sfsync::nccl::sleepOrYield, std::chrono::microseconds(1000));
  if (o == Outcome::kDone) return;
  abortComm(c);
  if (o == Outcome::kTimedOut) {
    throw Failure{SF_ERR_TIMEOUT, std::string(what) + " on rank " + std::to_string(c->rank) + " of " +
                                      std::to_string(c->world) + " did not complete within timeout_ms = " +
                                      std::to_string(timeoutMs) +
                                      " (does every rank run?); the communicator was aborted"};
  }
  throw Failure{SF_ERR_BACKEND, std::string(what) + " failed on rank " + std::to_string(c->rank) + ": " +
                                    why + "; the communicator was aborted"};
}

// Waits for `done` (recorded on the plugin's stream), watching the
// communicator; aborts it on an error or the timeout.
void waitEvent(sfn_comm* c, cudaEvent_t done, int64_t timeoutMs, const std::string& what) {
  std::string why;
  const Outcome o = sfsync::nccl::pollUntil(
      [&] {
        const cudaError_t e = fn.cudaEventQuery(done);
        if (e == cudaSuccess) return Poll::kDone;
        if (e == cudaErrorNotReady) return Poll::kPending;
        fn.cudaGetLastError();
        why = "cudaEventQuery failed: " + cudaText(e);
        return Poll::kFailed;
      },
      [&] { return health(c, &why); }, std::chrono::milliseconds(timeoutMs),
      sfsync::nccl::sleepOrYield);
  if (o == Outcome::kDone) return;
  abortComm(c);
  if (o == Outcome::kTimedOut) {
    throw Failure{SF_ERR_TIMEOUT, what + " did not complete within timeout_ms = " +
                                      std::to_string(timeoutMs) + " on rank " + std::to_string(c->rank) +
                                      " of " + std::to_string(c->world) +
                                      " (a peer stopped or hangs); the communicator was aborted"};
  }
  throw Failure{SF_ERR_BACKEND, what + ": " + why + "; the communicator was aborted"};
}

void checkAlive(sfn_comm* c) {
  if (c->aborted) {
    throw Failure{SF_ERR_BACKEND,
                  "the NCCL communicator was aborted after an earlier failure on rank " +
                      std::to_string(c->rank)};
  }
}

// ---- The table's functions ---------------------------------------------------

int32_t probe(int32_t* count, int32_t* cudaVersion, int32_t* ncclVersion, sfn_error* err) {
  return entry(err, [&] {
    int n = 0;
    const cudaError_t e = fn.cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      fn.cudaGetLastError();
      throw Failure{SF_ERR_UNSUPPORTED, "no usable GPU: cudaGetDeviceCount failed with " + cudaText(e)};
    }
    if (n <= 0) {
      throw Failure{SF_ERR_UNSUPPORTED,
                    "no GPU is visible (cudaGetDeviceCount = 0; check CUDA_VISIBLE_DEVICES)"};
    }
    int rt = 0, nv = 0;
    fn.cudaRuntimeGetVersion(&rt);
    fn.ncclGetVersion(&nv);
    if (count) *count = n;
    if (cudaVersion) *cudaVersion = rt;
    if (ncclVersion) *ncclVersion = nv;
  });
}

int32_t deviceOpen(int32_t device, sfn_device** out, sfn_error* err) {
  return entry(err, [&] {
    DeviceGuard guard(device);
    auto* d = new sfn_device;
    d->device = device;
    int least = 0, greatest = 0;
    cudaError_t e = fn.cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (e == cudaSuccess) {
      e = fn.cudaStreamCreateWithPriority(&d->stream, cudaStreamNonBlocking, greatest);
    } else {
      fn.cudaGetLastError();
      e = fn.cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking);
    }
    if (e != cudaSuccess) {
      delete d;
      checkCuda(e, "cudaStreamCreateWithPriority (the plugin's stream)");
    }
    *out = d;
  });
}

void deviceClose(sfn_device* d) {
  if (!d) return;
  try {
    DeviceGuard guard(d->device);
    fn.cudaStreamDestroy(d->stream);
    if (d->pinned) fn.cudaFreeHost(d->pinned);
    for (auto& slot : d->writes) {
      if (slot.copied) fn.cudaEventDestroy(slot.copied);
      if (slot.pinned) fn.cudaFreeHost(slot.pinned);
    }
  } catch (...) {
  }
  delete d;
}

void setHostStream(sfn_device* d, void* stream) { d->host = static_cast<cudaStream_t>(stream); }

int32_t memAlloc(sfn_device* d, size_t bytes, void** out, sfn_error* err) {
  return entry(err, [&] {
    DeviceGuard guard(d->device);
    void* p = nullptr;
    const cudaError_t e = fn.cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
      fn.cudaGetLastError();
      throw Failure{e == cudaErrorMemoryAllocation ? SF_ERR_OUT_OF_MEMORY : SF_ERR_BACKEND,
                    "cudaMalloc of " + std::to_string(bytes) + " bytes on device " +
                        std::to_string(d->device) + " failed: " + cudaText(e)};
    }
    // Zero on our stream and wait for that alone: the memory is ready for
    // whatever stream the host uses, and nothing else is synchronized.
    cudaEvent_t zeroed = nullptr;
    try {
      checkCuda(fn.cudaMemsetAsync(p, 0, bytes, d->stream), "cudaMemsetAsync");
      checkCuda(fn.cudaEventCreateWithFlags(&zeroed, cudaEventDisableTiming), "cudaEventCreate");
      checkCuda(fn.cudaEventRecord(zeroed, d->stream), "cudaEventRecord");
      const Outcome o = sfsync::nccl::pollUntil(
          [&] {
            const cudaError_t q = fn.cudaEventQuery(zeroed);
            return q == cudaSuccess ? Poll::kDone : q == cudaErrorNotReady ? Poll::kPending : Poll::kFailed;
          },
          [] { return Poll::kPending; }, std::chrono::minutes(5), sfsync::nccl::sleepOrYield);
      if (o != Outcome::kDone) throw Failure{SF_ERR_BACKEND, "zeroing new device memory failed"};
      fn.cudaEventDestroy(zeroed);
    } catch (...) {
      if (zeroed) fn.cudaEventDestroy(zeroed);
      fn.cudaFree(p);
      throw;
    }
    *out = p;
  });
}

void memFree(sfn_device* d, void* p) {
  if (!p) return;
  try {
    DeviceGuard guard(d->device);
    // The host's stream may still have our copies or zeroing of this memory
    // queued: wait for what it holds now (bounded), not for the device.
    cudaEvent_t drained = nullptr;
    if (fn.cudaEventCreateWithFlags(&drained, cudaEventDisableTiming) == cudaSuccess) {
      if (fn.cudaEventRecord(drained, d->host) == cudaSuccess) {
        sfsync::nccl::pollUntil(
            [&] { return fn.cudaEventQuery(drained) == cudaErrorNotReady ? Poll::kPending : Poll::kDone; },
            [] { return Poll::kPending; }, std::chrono::seconds(60), sfsync::nccl::sleepOrYield);
      }
      fn.cudaEventDestroy(drained);
    }
    fn.cudaGetLastError();
    fn.cudaFree(p);
  } catch (...) {
  }
}

int32_t memCopy(sfn_device* d, void* dst, const void* src, size_t bytes, sfn_error* err) {
  return entry(err, [&] {
    DeviceGuard guard(d->device);
    checkCuda(fn.cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, d->host),
              "cudaMemcpyAsync (gradient staging, on the host's stream)");
  });
}

int32_t memZero(sfn_device* d, void* p, size_t bytes, sfn_error* err) {
  return entry(err, [&] {
    DeviceGuard guard(d->device);
    checkCuda(fn.cudaMemsetAsync(p, 0, bytes, d->host), "cudaMemsetAsync (zeroing gradients, on the host's stream)");
  });
}

void stagingOf(sfn_device* d, size_t bytes) {
  if (bytes > kStage) {
    throw Failure{SF_ERR_INVALID_ARGUMENT, "window-check values of " + std::to_string(bytes) +
                                               " bytes exceed the " + std::to_string(kStage) +
                                               "-byte pinned staging"};
  }
  if (!d->pinned) {
    checkCuda(fn.cudaMallocHost(reinterpret_cast<void**>(&d->pinned), 2 * kStage), "cudaMallocHost (staging)");
  }
}

// The previous write's copy has run: the caller writes window-check values once
// per synchronization, and waits for that synchronization's collectives
// (which the host's stream ordered after the copy) before the next.
// A pinned slot whose last copy has run (its event complete), or a new one:
// several small writes may be queued before their collectives (a weighted
// window writes every bucket's weight), each from memory of its own.
sfn_device::WriteSlot& freeWriteSlot(sfn_device* d) {
  for (auto& slot : d->writes) {
    const cudaError_t q = fn.cudaEventQuery(slot.copied);
    if (q == cudaSuccess) return slot;
    if (q != cudaErrorNotReady) checkCuda(q, "cudaEventQuery (small write)");
  }
  constexpr size_t kMaxWriteSlots = 4096;  // 1 MiB of pinned memory
  if (d->writes.size() >= kMaxWriteSlots) {
    throw Failure{SF_ERR_BACKEND, "more than " + std::to_string(kMaxWriteSlots) +
                                      " small writes to device " + std::to_string(d->device) +
                                      " are waiting for the host's stream"};
  }
  sfn_device::WriteSlot slot;
  checkCuda(fn.cudaMallocHost(reinterpret_cast<void**>(&slot.pinned), kStage), "cudaMallocHost (staging)");
  const cudaError_t e = fn.cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming);
  if (e != cudaSuccess) fn.cudaFreeHost(slot.pinned);
  checkCuda(e, "cudaEventCreateWithFlags");
  d->writes.push_back(slot);
  return d->writes.back();
}

int32_t memWrite(sfn_device* d, void* dst, const void* src, size_t bytes, sfn_error* err) {
  return entry(err, [&] {
    DeviceGuard guard(d->device);
    stagingOf(d, bytes);
    sfn_device::WriteSlot& slot = freeWriteSlot(d);
    std::memcpy(slot.pinned, src, bytes);
    checkCuda(fn.cudaMemcpyAsync(dst, slot.pinned, bytes, cudaMemcpyHostToDevice, d->host),
              "cudaMemcpyAsync (small values to the device, on the host's stream)");
    checkCuda(fn.cudaEventRecord(slot.copied, d->host), "cudaEventRecord (host stream)");
  });
}

int32_t memRead(sfn_device* d, void* dst, const void* src, size_t bytes, int64_t timeoutMs,
                sfn_error* err) {
  return entry(err, [&] {
    DeviceGuard guard(d->device);
    stagingOf(d, bytes);
    char* stage = d->pinned + kStage;
    cudaEvent_t done = nullptr;
    checkCuda(fn.cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    try {
      checkCuda(fn.cudaMemcpyAsync(stage, src, bytes, cudaMemcpyDeviceToHost, d->host),
                "cudaMemcpyAsync (window-check values from the device, on the host's stream)");
      checkCuda(fn.cudaEventRecord(done, d->host), "cudaEventRecord (host stream)");
      const Outcome o = sfsync::nccl::pollUntil(
          [&] {
            const cudaError_t q = fn.cudaEventQuery(done);
            return q == cudaSuccess ? Poll::kDone : q == cudaErrorNotReady ? Poll::kPending : Poll::kFailed;
          },
          [] { return Poll::kPending; }, std::chrono::milliseconds(timeoutMs), sfsync::nccl::sleepOrYield);
      if (o != Outcome::kDone) {
        throw Failure{o == Outcome::kTimedOut ? SF_ERR_TIMEOUT : SF_ERR_BACKEND,
                      "reading " + std::to_string(bytes) + " bytes of window-check values back from device " +
                          std::to_string(d->device) +
                          (o == Outcome::kTimedOut ? " did not complete within timeout_ms = " +
                                                         std::to_string(timeoutMs) + " (the host's stream is blocked)"
                                                   : " failed")};
      }
    } catch (...) {
      fn.cudaGetLastError();
      fn.cudaEventDestroy(done);
      throw;
    }
    fn.cudaEventDestroy(done);
    std::memcpy(dst, stage, bytes);
  });
}

const char* memoryTypeName(cudaMemoryType t) {
  switch (t) {
    case cudaMemoryTypeHost: return "pinned host memory";
    case cudaMemoryTypeDevice: return "device memory";
    case cudaMemoryTypeManaged: return "managed memory";
    default: return "not memory CUDA knows (pageable host memory?)";
  }
}

int32_t checkPointer(sfn_device* d, const void* p, size_t bytes, sfn_error* err) {
  return entry(err, [&] {
    DeviceGuard guard(d->device);
    const char* ends[] = {static_cast<const char*>(p), static_cast<const char*>(p) + (bytes ? bytes - 1 : 0)};
    for (const char* q : ends) {
      cudaPointerAttributes a;
      std::memset(&a, 0, sizeof a);
      const cudaError_t e = fn.cudaPointerGetAttributes(&a, q);
      if (e != cudaSuccess) {
        fn.cudaGetLastError();
        throw Failure{SF_ERR_INVALID_ARGUMENT, "cudaPointerGetAttributes failed: " + cudaText(e)};
      }
      char where[64];
      std::snprintf(where, sizeof where, "%p", static_cast<const void*>(q));
      if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) {
        throw Failure{SF_ERR_INVALID_ARGUMENT, std::string("address ") + where + " is " +
                                                   memoryTypeName(a.type) +
                                                   ", not CUDA device memory (SF_DEVICE_CUDA)"};
      }
      if (a.type == cudaMemoryTypeDevice && a.device != d->device) {
        throw Failure{SF_ERR_INVALID_ARGUMENT, std::string("address ") + where + " is memory of device " +
                                                   std::to_string(a.device) + ", but this rank uses device " +
                                                   std::to_string(d->device) + " (local_rank)"};
      }
    }
  });
}

int32_t uniqueId(uint8_t id[SFN_UNIQUE_ID_BYTES], sfn_error* err) {
  return entry(err, [&] {
    static_assert(sizeof(ncclUniqueId) == SFN_UNIQUE_ID_BYTES, "NCCL unique id size");
    ncclUniqueId u;
    const ncclResult_t r = fn.ncclGetUniqueId(&u);
    if (r != ncclSuccess) {
      throw Failure{SF_ERR_BACKEND, "ncclGetUniqueId failed: " + ncclText(nullptr, r)};
    }
    std::memcpy(id, &u, sizeof u);
  });
}

int32_t commInit(sfn_device* d, const uint8_t id[SFN_UNIQUE_ID_BYTES], int32_t world, int32_t rank,
                 int64_t timeoutMs, sfn_comm** out, sfn_error* err) {
  return entry(err, [&] {
    DeviceGuard guard(d->device);
    ncclUniqueId u;
    std::memcpy(&u, id, sizeof u);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // so that a missing peer is a timeout, not a hang
    auto* c = new sfn_comm;
    c->dev = d;
    c->owned = true;
    c->world = world;
    c->rank = rank;
    c->timeoutMs = timeoutMs;
    const ncclResult_t r = fn.ncclCommInitRankConfig(&c->comm, world, u, rank, &config);
    try {
      if (r != ncclSuccess && r != ncclInProgress) {
        if (c->comm) abortComm(c);
        throw Failure{SF_ERR_BACKEND,
                      "ncclCommInitRankConfig (rank " + std::to_string(rank) + " of " +
                          std::to_string(world) + ", device " + std::to_string(d->device) +
                          ") failed: " + ncclText(c->comm, r)};
      }
      settle(c, r, "ncclCommInitRankConfig", timeoutMs);
    } catch (...) {
      delete c;
      throw;
    }
    *out = c;
  });
}

int32_t commQuery(void* nccl, int32_t* world, int32_t* rank, int32_t* device, sfn_error* err) {
  return entry(err, [&] {
    ncclComm_t comm = static_cast<ncclComm_t>(nccl);
    int n = 0, r = 0, dev = 0;
    ncclResult_t e = fn.ncclCommCount(comm, &n);
    if (e == ncclSuccess) e = fn.ncclCommUserRank(comm, &r);
    if (e == ncclSuccess) e = fn.ncclCommCuDevice(comm, &dev);
    if (e != ncclSuccess) {
      throw Failure{SF_ERR_INVALID_ARGUMENT,
                    "the communicator passed in is not a usable ncclComm_t: " + ncclText(comm, e)};
    }
    *world = n;
    *rank = r;
    *device = dev;
  });
}

int32_t commAdopt(sfn_device* d, void* nccl, int64_t timeoutMs, sfn_comm** out, sfn_error* err) {
  return entry(err, [&] {
    int32_t world = 0, rank = 0, device = 0;
    sfn_error e;
    const int32_t s = commQuery(nccl, &world, &rank, &device, &e);
    if (s != SF_OK) throw Failure{s, e.message};
    if (device != d->device) {
      throw Failure{SF_ERR_INVALID_ARGUMENT, "the adopted communicator is on device " +
                                                 std::to_string(device) + " but this context uses device " +
                                                 std::to_string(d->device)};
    }
    auto* c = new sfn_comm;
    c->dev = d;
    c->comm = static_cast<ncclComm_t>(nccl);
    c->owned = false;
    c->world = world;
    c->rank = rank;
    c->timeoutMs = timeoutMs;
    // A non-blocking host communicator may still be initializing.
    ncclResult_t async = ncclSuccess;
    fn.ncclCommGetAsyncError(c->comm, &async);
    try {
      settle(c, async, "the adopted communicator's initialization", timeoutMs);
    } catch (...) {
      delete c;
      throw;
    }
    *out = c;
  });
}

// Bounded by the communicator's timeout_ms: finalize (flushes this rank's
// operations; non-blocking, so it returns ncclInProgress), poll until it
// settles, then destroy; a failure or the deadline aborts instead (a plain
// ncclCommDestroy can block for ever on a peer that is gone).
void finalizeOrAbort(sfn_comm* c, int64_t timeoutMs) {
  ncclResult_t async = ncclSuccess;
  fn.ncclCommGetAsyncError(c->comm, &async);
  if (async == ncclSuccess) {
    const ncclResult_t r = fn.ncclCommFinalize(c->comm);
    if (r == ncclSuccess || r == ncclInProgress) {
      const Outcome o = sfsync::nccl::pollUntil(
          [&] {
            ncclResult_t a = ncclSuccess;
            if (fn.ncclCommGetAsyncError(c->comm, &a) != ncclSuccess) return Poll::kFailed;
            return a == ncclSuccess ? Poll::kDone : a == ncclInProgress ? Poll::kPending : Poll::kFailed;
          },
          [] { return Poll::kPending; }, std::chrono::milliseconds(timeoutMs),
          sfsync::nccl::sleepOrYield, std::chrono::microseconds(1000));
      if (o == Outcome::kDone) {
        fn.ncclCommDestroy(c->comm);
        return;
      }
    }
  }
  fn.ncclCommAbort(c->comm);
}

void commFree(sfn_comm* c, int64_t timeoutMs) {
  if (!c) return;
  try {
    DeviceGuard guard(c->dev->device);
    if (c->owned && !c->aborted) finalizeOrAbort(c, timeoutMs < 0 ? 0 : timeoutMs);
    if (c->self) fn.ncclCommDestroy(c->self);  // one rank: its work was waited for
    if (c->ints) fn.cudaFree(c->ints);
    if (c->pinned) fn.cudaFreeHost(c->pinned);
  } catch (...) {
  }
  delete c;
}

void destroyWork(sfn_work* w) {
  if (w->ready) fn.cudaEventDestroy(w->ready);
  if (w->done) fn.cudaEventDestroy(w->done);
  delete w;
}

// Events and ordering around `launch` (which enqueues the collective on the
// plugin's stream): the plugin's stream waits for everything the host queued
// on its stream so far; `done` marks the end of the collective.
template <typename F>
int32_t startOrdered(sfn_comm* c, int64_t bytes, sfn_work** out, sfn_error* err, F&& launch) {
  return entry(err, [&] {
    checkAlive(c);
    sfn_device* d = c->dev;
    DeviceGuard guard(d->device);
    auto* w = new sfn_work;
    w->comm = c;
    w->bytes = bytes;
    try {
      checkCuda(fn.cudaEventCreateWithFlags(&w->ready, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      checkCuda(fn.cudaEventCreateWithFlags(&w->done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      // P waits for everything the host queued on H so far.
      checkCuda(fn.cudaEventRecord(w->ready, d->host), "cudaEventRecord (host stream)");
      checkCuda(fn.cudaStreamWaitEvent(d->stream, w->ready, 0), "cudaStreamWaitEvent (plugin stream)");
      launch(d);
      checkCuda(fn.cudaEventRecord(w->done, d->stream), "cudaEventRecord (plugin stream)");
    } catch (...) {
      destroyWork(w);
      throw;
    }
    *out = w;
  });
}

// The NCCL reduction for (prescale, postscale): ncclSum, ncclAvg, or a
// PreMulSum op (custom), which the caller destroys with ncclRedOpDestroy.
struct ReduceOp {
  ncclRedOp_t op = ncclSum;
  bool custom = false;
};

ReduceOp reduceOp(sfn_comm* c, double prescale, double postscale, int32_t dtype, ncclDataType_t type) {
  const auto choice = sfsync::nccl::chooseReduction(prescale, postscale, c->world);
  ReduceOp o;
  if (choice.kind == sfsync::nccl::Reduction::kAverage) {
    o.op = ncclAvg;
  } else if (choice.kind == sfsync::nccl::Reduction::kPreMulSum) {
    Scalar s = scalarOf(choice.factor, dtype);
    const ncclResult_t r = fn.ncclRedOpCreatePreMulSum(&o.op, &s, type, ncclScalarHostImmediate, c->comm);
    if (r != ncclSuccess) {
      throw Failure{SF_ERR_BACKEND, "ncclRedOpCreatePreMulSum failed: " + ncclText(c->comm, r)};
    }
    o.custom = true;
  }
  return o;
}

// Settles the call that used `op`, then destroys a custom operator: allowed
// only once that call returned and settled (nccl.h: a non-blocking
// communicator may return ncclInProgress). On failure the operator is
// destroyed too unless the communicator was aborted.
void settleThenDestroyOp(sfn_comm* c, ncclResult_t r, const char* what, ncclRedOp_t op,
                         bool custom) {
  try {
    settle(c, r, what, c->timeoutMs);
  } catch (...) {
    if (custom && !c->aborted) fn.ncclRedOpDestroy(op, c->comm);
    throw;
  }
  if (custom) fn.ncclRedOpDestroy(op, c->comm);
}

int32_t allreduceStart(sfn_comm* c, void* data, int64_t numel, int64_t scaledNumel, int32_t dtype,
                       double prescale, double postscale, sfn_work** out, sfn_error* err) {
  return startOrdered(c, numel * int64_t(sfsync::dtypeSize(dtype)), out, err, [&](sfn_device* d) {
    const ncclDataType_t type = ncclType(dtype);
    const auto [op, custom] = reduceOp(c, prescale, postscale, dtype, type);
    // Elements past scaledNumel (the window check's) are summed exactly,
    // unscaled: a second all-reduce in the same group, one launch.
    const int64_t scaled = scaledNumel < 0 || scaledNumel > numel ? numel : scaledNumel;
    const bool split = scaled < numel && op != ncclSum;
    ncclResult_t r = ncclSuccess;
    if (split) {
      char* rest = static_cast<char*>(data) + size_t(scaled) * sfsync::dtypeSize(dtype);
      r = fn.ncclGroupStart();
      if (r == ncclSuccess) r = fn.ncclAllReduce(data, data, size_t(scaled), type, op, c->comm, d->stream);
      if (r == ncclSuccess) r = fn.ncclAllReduce(rest, rest, size_t(numel - scaled), type, ncclSum, c->comm, d->stream);
      const ncclResult_t end = fn.ncclGroupEnd();
      if (r == ncclSuccess) r = end;
    } else {
      r = fn.ncclAllReduce(data, data, size_t(numel), type, op, c->comm, d->stream);
    }
    settleThenDestroyOp(c, r, "ncclAllReduce", op, custom);
  });
}

int32_t workWait(sfn_work* w, int64_t timeoutMs, sfn_error* err) {
  const int32_t status = entry(err, [&] {
    sfn_comm* c = w->comm;
    checkAlive(c);
    DeviceGuard guard(c->dev->device);
    waitEvent(c, w->done, timeoutMs, "NCCL all-reduce of " + std::to_string(w->bytes) + " bytes");
    // The host's stream reads the result only after it is there (already
    // true for the CPU now, but the order must hold on the GPU too).
    checkCuda(fn.cudaStreamWaitEvent(c->dev->host, w->done, 0), "cudaStreamWaitEvent (host stream)");
  });
  destroyWork(w);
  return status;
}

// The one-rank communicator of scale_start, made on first use (blocking: one
// rank meets only itself).
ncclComm_t selfComm(sfn_comm* c) {
  if (c->self) return c->self;
  ncclUniqueId u;
  ncclResult_t r = fn.ncclGetUniqueId(&u);
  if (r == ncclSuccess) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    r = fn.ncclCommInitRankConfig(&c->self, 1, u, 0, &config);
  }
  if (r != ncclSuccess) {
    c->self = nullptr;
    throw Failure{SF_ERR_BACKEND, "a one-rank NCCL communicator for scaling (device " +
                                      std::to_string(c->dev->device) + ") failed: " + ncclText(nullptr, r)};
  }
  return c->self;
}

int32_t scaleStart(sfn_comm* c, void* data, int64_t numel, int32_t dtype, double factor,
                   sfn_work** out, sfn_error* err) {
  return startOrdered(c, numel * int64_t(sfsync::dtypeSize(dtype)), out, err, [&](sfn_device* d) {
    const ncclDataType_t type = ncclType(dtype);
    ncclComm_t self = selfComm(c);
    Scalar s = scalarOf(factor, dtype);
    ncclRedOp_t op;
    ncclResult_t r = fn.ncclRedOpCreatePreMulSum(&op, &s, type, ncclScalarHostImmediate, self);
    if (r != ncclSuccess) {
      throw Failure{SF_ERR_BACKEND, "ncclRedOpCreatePreMulSum (scaling) failed: " + ncclText(self, r)};
    }
    r = fn.ncclAllReduce(data, data, size_t(numel), type, op, self, d->stream);
    fn.ncclRedOpDestroy(op, self);
    if (r != ncclSuccess) {
      throw Failure{SF_ERR_BACKEND, "ncclAllReduce (scaling by " + std::to_string(factor) +
                                        " on one rank) failed: " + ncclText(self, r)};
    }
  });
}

int32_t allreduceMaxInt64(sfn_comm* c, int64_t* data, int64_t n, int64_t timeoutMs, sfn_error* err) {
  return entry(err, [&] {
    checkAlive(c);
    if (n <= 0) return;
    sfn_device* d = c->dev;
    DeviceGuard guard(d->device);
    if (n > c->intCap) {
      if (c->ints) fn.cudaFree(c->ints);
      if (c->pinned) fn.cudaFreeHost(c->pinned);
      c->ints = nullptr;
      c->pinned = nullptr;
      c->intCap = 0;
      checkCuda(fn.cudaMalloc(reinterpret_cast<void**>(&c->ints), size_t(n) * 8), "cudaMalloc");
      // Pinned, so that the copies are truly asynchronous and the wait below
      // (with its timeout) is the only place that waits.
      checkCuda(fn.cudaMallocHost(reinterpret_cast<void**>(&c->pinned), size_t(n) * 8), "cudaMallocHost");
      c->intCap = n;
    }
    std::memcpy(c->pinned, data, size_t(n) * 8);
    cudaEvent_t done = nullptr;
    checkCuda(fn.cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    try {
      checkCuda(fn.cudaMemcpyAsync(c->ints, c->pinned, size_t(n) * 8, cudaMemcpyHostToDevice, d->stream),
                "cudaMemcpyAsync");
      const ncclResult_t r = fn.ncclAllReduce(c->ints, c->ints, size_t(n), ncclInt64, ncclMax, c->comm, d->stream);
      settle(c, r, "ncclAllReduce (layout check)", timeoutMs);
      checkCuda(fn.cudaMemcpyAsync(c->pinned, c->ints, size_t(n) * 8, cudaMemcpyDeviceToHost, d->stream),
                "cudaMemcpyAsync");
      checkCuda(fn.cudaEventRecord(done, d->stream), "cudaEventRecord");
      waitEvent(c, done, timeoutMs, "NCCL all-reduce of the gradient layout check");
    } catch (...) {
      fn.cudaEventDestroy(done);
      throw;
    }
    fn.cudaEventDestroy(done);
    std::memcpy(data, c->pinned, size_t(n) * 8);
  });
}

// ---- Since 0.3: reduce-scatter and all-gather (sharded windows) ---------------

int32_t reduceScatterStart(sfn_comm* c, void* data, int64_t segment, int32_t dtype, double prescale,
                           double postscale, sfn_work** out, sfn_error* err) {
  const size_t es = sfsync::dtypeSize(dtype);
  return startOrdered(c, segment * int64_t(es) * c->world, out, err, [&](sfn_device* d) {
    const ncclDataType_t type = ncclType(dtype);
    const auto [op, custom] = reduceOp(c, prescale, postscale, dtype, type);
    // In place: recvbuff = sendbuff + rank * recvcount (NCCL's rule).
    char* base = static_cast<char*>(data);
    const ncclResult_t r = fn.ncclReduceScatter(base, base + size_t(c->rank) * size_t(segment) * es,
                                             size_t(segment), type, op, c->comm, d->stream);
    settleThenDestroyOp(c, r, "ncclReduceScatter", op, custom);
  });
}

int32_t allgatherStart(sfn_comm* c, void* data, int64_t segment, int32_t dtype, sfn_work** out,
                       sfn_error* err) {
  const size_t es = sfsync::dtypeSize(dtype);
  return startOrdered(c, segment * int64_t(es) * c->world, out, err, [&](sfn_device* d) {
    // In place: sendbuff = recvbuff + rank * sendcount.
    char* base = static_cast<char*>(data);
    const ncclResult_t r = fn.ncclAllGather(base + size_t(c->rank) * size_t(segment) * es, base,
                                         size_t(segment), ncclType(dtype), c->comm, d->stream);
    settle(c, r, "ncclAllGather", c->timeoutMs);
  });
}

// ---- Since 0.5: uneven shards, only the used elements on the wire -----------
// The parameter layout gives each rank whole parameters, so segment r holds
// used[r] elements and padding up to the segment's data end; the flat layout
// pads its last segments. ncclReduceScatter / ncclAllGather need one count
// for every rank, so they would move the padding (at 2 ranks the parameter
// layout carried 2x the gradients' bytes). Instead, one NCCL group: per rank
// r, an ncclReduce (or ncclBroadcast) with root r over the used elements of
// segment r, in place. On a ring each of them moves (W - 1) times its count,
// as a reduce-scatter moves (W - 1) times a segment: the padding off the
// wire, nothing else added. Segments with nothing to move are skipped (every
// rank skips the same: `used` is the bucket's layout, the same everywhere).

// Checks used[0..world) against the data end; the elements moved, summed.
int64_t usedTotal(sfn_comm* c, const int64_t* used, int64_t dataEnd) {
  if (!used) throw Failure{SF_ERR_INVALID_ARGUMENT, "no used lengths"};
  int64_t total = 0;
  for (int r = 0; r < c->world; ++r) {
    if (used[r] < 0 || used[r] > dataEnd) {
      throw Failure{SF_ERR_INVALID_ARGUMENT, "segment " + std::to_string(r) + " uses " +
                                                 std::to_string(used[r]) + " elements of " +
                                                 std::to_string(dataEnd)};
    }
    total += used[r];
  }
  return total;
}

int32_t reduceScatterUsedStart(sfn_comm* c, void* data, int64_t segment, int64_t scaledNumel,
                               const int64_t* used, int32_t dtype, double prescale, double postscale,
                               sfn_work** out, sfn_error* err) {
  const size_t es = sfsync::dtypeSize(dtype);
  const int64_t dataEnd = scaledNumel < 0 || scaledNumel > segment ? segment : scaledNumel;
  const int64_t tail = segment - dataEnd;
  int64_t total = 0;
  const int32_t checked = entry(err, [&] { total = usedTotal(c, used, dataEnd); });
  if (checked != SF_OK) return checked;
  return startOrdered(c, (total + tail * c->world) * int64_t(es), out, err, [&](sfn_device* d) {
    const ncclDataType_t type = ncclType(dtype);
    const auto [op, custom] = reduceOp(c, prescale, postscale, dtype, type);
    char* base = static_cast<char*>(data);
    // Root r's result lands in its own segment; the others' buffers are
    // only read (NCCL uses recvbuff on the root alone), as ncclReduceScatter
    // reads them. The reserved tail after dataEnd is summed unscaled (as
    // allreduce_start's): with ncclSum and a full segment, one call.
    ncclResult_t r = fn.ncclGroupStart();
    for (int root = 0; r == ncclSuccess && root < c->world; ++root) {
      char* seg = base + size_t(root) * size_t(segment) * es;
      const int64_t n = used[root];
      const bool whole = op == ncclSum && n == dataEnd;
      const int64_t count = whole ? segment : n;
      if (count > 0) r = fn.ncclReduce(seg, seg, size_t(count), type, op, root, c->comm, d->stream);
      if (r == ncclSuccess && !whole && tail > 0) {
        char* rest = seg + size_t(dataEnd) * es;
        r = fn.ncclReduce(rest, rest, size_t(tail), type, ncclSum, root, c->comm, d->stream);
      }
    }
    const ncclResult_t end = fn.ncclGroupEnd();
    if (r == ncclSuccess) r = end;
    settleThenDestroyOp(c, r, "ncclReduce (reduce-scatter of the used elements)", op, custom);
  });
}

int32_t allgatherUsedStart(sfn_comm* c, void* data, int64_t segment, const int64_t* used,
                           int32_t dtype, sfn_work** out, sfn_error* err) {
  const size_t es = sfsync::dtypeSize(dtype);
  int64_t total = 0;
  const int32_t checked = entry(err, [&] { total = usedTotal(c, used, segment); });
  if (checked != SF_OK) return checked;
  return startOrdered(c, total * int64_t(es), out, err, [&](sfn_device* d) {
    const ncclDataType_t type = ncclType(dtype);
    char* base = static_cast<char*>(data);
    ncclResult_t r = fn.ncclGroupStart();
    for (int root = 0; r == ncclSuccess && root < c->world; ++root) {
      char* seg = base + size_t(root) * size_t(segment) * es;
      if (used[root] > 0) r = fn.ncclBroadcast(seg, seg, size_t(used[root]), type, root, c->comm, d->stream);
    }
    const ncclResult_t end = fn.ncclGroupEnd();
    if (r == ncclSuccess) r = end;
    settle(c, r, "ncclBroadcast (all-gather of the used elements)", c->timeoutMs);
  });
}

const sfn_api kApi = {
    SFN_ABI_VERSION,
    sizeof(sfn_api),
    probe,
    deviceOpen,
    deviceClose,
    setHostStream,
    memAlloc,
    memFree,
    memCopy,
    memZero,
    checkPointer,
    uniqueId,
    commInit,
    commQuery,
    commAdopt,
    commFree,
    allreduceStart,
    workWait,
    allreduceMaxInt64,
    memWrite,
    memRead,
    reduceScatterStart,  // since 0.3
    allgatherStart,
    scaleStart,  // since 0.4
    reduceScatterUsedStart,  // since 0.5
    allgatherUsedStart,
};

}  // namespace

// The first use: loads the CUDA runtime and NCCL. NULL if this is not the
// interface asked for, or if they cannot be loaded (then
// sf_nccl_module_init_error says why).
SFN_EXPORT const sfn_api* sf_nccl_module_api(uint32_t abi_version) {
  if (abi_version != SFN_ABI_VERSION) return nullptr;
  return loadLibraries() ? &kApi : nullptr;
}

SFN_EXPORT const char* sf_nccl_module_init_error(void) {
  std::lock_guard<std::mutex> lock(gLoadMutex);
  // Valid until the next sf_nccl_module_api call; the loader copies it.
  return gLoadError.c_str();
}
