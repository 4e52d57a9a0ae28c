// STAND-IN for the CUDA runtime (libcudart.so.13), for tests on machines
// without a GPU. It is NOT CUDA: "device" memory is host memory, a stream is
// a host thread that runs its queue in order, an event is a position in a
// stream's queue. It implements the subset of the runtime API that sfsync's
// NCCL module, the NCCL stand-in and the tests use, with the real signatures
// from cuda_runtime_api.h, so the real sfsync code runs unchanged on top.
//
// Not emulated: kernels, the legacy default stream's implicit synchronization
// with other blocking streams, memory pools, graphs.
//
// Strict where CUDA is undefined or silently forgiving (README.md, "Strict
// streams and events"): a wait on an event never recorded, a destroyed event
// or stream used again, an event destroyed while a host thread waits on it.
// Each such MISUSE returns cudaErrorInvalidResourceHandle, prints one line on
// stderr, counts in sfStandinCudaCounter("misuse"), and, unless a test took
// it with sfStandinCudaTakeMisuse, makes the process exit with status 86.
//
// Test hooks (not CUDA): sfStandinCudaCounter(name), sfStandinCudaTakeMisuse,
// see README.md.
// Environment: SF_STANDIN_DEVICES (visible devices, default 8),
// SF_STANDIN_CUDA_ERROR (cudaGetDeviceCount fails with this error code).

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define SF_STANDIN_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

std::atomic<int64_t> gDeviceSynchronize{0}, gStreamSynchronize{0}, gMalloc{0}, gFree{0},
    gLaunchHostFunc{0}, gEventRecord{0}, gStreamWaitEvent{0}, gEventHostWaiters{0};
thread_local int tDevice = 0;
// Whether this thread has a current context (CUDA 12+: cudaSetDevice makes
// the device's primary context current; a fresh thread has none, and
// cudaGetDevice still says 0).
thread_local bool tHasContext = false;
thread_local cudaError_t tLastError = cudaSuccess;

cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess) tLastError = e;
  return e;
}

// Misuse of streams and events (see the file's header): counted, the last
// message kept for sfStandinCudaTakeMisuse, checked at exit.
std::mutex gMisuseMutex;
int64_t gMisuse = 0;       // all, for sfStandinCudaCounter("misuse")
int64_t gMisuseTaken = 0;  // those a test took with sfStandinCudaTakeMisuse
// A fixed buffer, not a heap string: it is read at exit, after static
// destructors may have run, and a leaked allocation would be reported by
// LeakSanitizer when a test dlclose()s this library.
char gLastMisuse[512] = "";

cudaError_t misuse(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(gMisuseMutex);
    ++gMisuse;
    std::snprintf(gLastMisuse, sizeof gLastMisuse, "%s", what.c_str());
  }
  std::fprintf(stderr, "CUDA stand-in: MISUSE: %s\n", what.c_str());
  return ret(cudaErrorInvalidResourceHandle);
}

// At exit: a misuse no test took fails the process, even where the caller
// ignored the status (a teardown path, say).
__attribute__((destructor)) void checkMisuseAtExit() {
  std::lock_guard<std::mutex> lock(gMisuseMutex);
  const int64_t unseen = gMisuse - gMisuseTaken;
  if (unseen <= 0) return;
  std::fprintf(stderr,
               "CUDA stand-in: %lld stream/event misuse(s) no test took (last: %s); "
               "exiting with status 86\n",
               static_cast<long long>(unseen), gLastMisuse);
  std::fflush(stderr);
  _exit(86);
}

int deviceCount() {
  const char* v = std::getenv("SF_STANDIN_DEVICES");
  return v && *v ? std::atoi(v) : 8;
}

// Allocations: start -> (bytes, type, device), for cudaPointerGetAttributes.
struct Allocation {
  size_t bytes;
  cudaMemoryType type;
  int device;
};
std::mutex gAllocMutex;
std::map<uintptr_t, Allocation>& allocations() {
  static auto* m = new std::map<uintptr_t, Allocation>;
  return *m;
}

}  // namespace

// A stream: one worker thread running its queue in order. `completed` counts
// finished operations; an event is (stream, ticket) and has happened once
// completed >= ticket.
struct CUstream_st {
  std::mutex m;
  std::condition_variable cv;  // queue changed or an operation completed
  std::deque<std::function<void()>> queue;
  uint64_t enqueued = 0;
  uint64_t completed = 0;
  bool stop = false;
  std::atomic<bool> destroyed{false};  // cudaStreamDestroy ran: any further use is a misuse
  std::thread worker;

  CUstream_st() {
    worker = std::thread([this] {
      std::unique_lock<std::mutex> lock(m);
      for (;;) {
        cv.wait(lock, [this] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        auto op = std::move(queue.front());
        queue.pop_front();
        lock.unlock();
        op();
        lock.lock();
        ++completed;
        cv.notify_all();
      }
    });
  }
  // Runs what is queued, then stops the worker. The object itself is never
  // freed: events and other streams' waits may still refer to it, as CUDA
  // allows (a destroyed stream's pending work completes), and a stopped
  // stream's completed == enqueued answers them all.
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(m);
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }
  uint64_t enqueue(std::function<void()> op) {
    std::lock_guard<std::mutex> lock(m);
    queue.push_back(std::move(op));
    cv.notify_all();
    return ++enqueued;
  }
  void waitFor(uint64_t ticket) {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return completed >= ticket; });
  }
  bool reached(uint64_t ticket) {
    std::lock_guard<std::mutex> lock(m);
    return completed >= ticket;
  }
  void drain() {
    uint64_t t;
    {
      std::lock_guard<std::mutex> lock(m);
      t = enqueued;
    }
    waitFor(t);
  }
};

// An event: the (stream, ticket) of its last cudaEventRecord. Never freed
// (kept after cudaEventDestroy), so that a use after destroy is caught, not
// undefined.
struct CUevent_st {
  std::mutex m;
  CUstream_st* stream = nullptr;  // nullptr: never recorded
  uint64_t ticket = 0;
  bool destroyed = false;
  int hostWaiters = 0;  // threads inside cudaEventSynchronize on it
};

namespace {

CUstream_st* resolve(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) {
    static CUstream_st* legacy = new CUstream_st;  // leaked: lives until exit
    return legacy;
  }
  return s;
}

std::string streamName(cudaStream_t s) {
  char b[64];
  std::snprintf(b, sizeof b, "stream %p", static_cast<void*>(s));
  return b;
}

std::string eventName(cudaEvent_t e) {
  char b[64];
  std::snprintf(b, sizeof b, "event %p", static_cast<void*>(e));
  return b;
}

// The stream `s` names for `what`, or nullptr (and a misuse) if it was destroyed.
CUstream_st* usable(cudaStream_t s, const char* what) {
  CUstream_st* st = resolve(s);
  if (st->destroyed) {
    misuse(std::string(what) + " on " + streamName(s) + ", destroyed by cudaStreamDestroy");
    return nullptr;
  }
  return st;
}

// The (stream, ticket) of `e`'s last record for a wait by `what`; false (and
// a misuse) for a destroyed event or one never recorded: CUDA treats the
// latter as complete, so the wait would order nothing, which is always a
// bug in sfsync's use (the event must mark work the waiter depends on).
// `hostWait`: the caller then waits on the host (counted in hostWaiters).
bool recorded(cudaEvent_t e, const char* what, CUstream_st** stream, uint64_t* ticket,
              bool hostWait = false) {
  std::lock_guard<std::mutex> lock(e->m);
  if (e->destroyed) {
    misuse(std::string(what) + " on " + eventName(e) + ", destroyed by cudaEventDestroy");
    return false;
  }
  if (!e->stream) {
    misuse(std::string(what) + " on " + eventName(e) +
           ", never recorded (CUDA would return at once: the wait would order nothing)");
    return false;
  }
  *stream = e->stream;
  *ticket = e->ticket;
  if (hostWait) {
    ++e->hostWaiters;
    ++gEventHostWaiters;
  }
  return true;
}

}  // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return ret(cudaErrorInvalidValue);
  if (const char* e = std::getenv("SF_STANDIN_CUDA_ERROR")) {
    if (*e && std::atoi(e) != 0) {
      *count = 0;
      return ret(cudaError_t(std::atoi(e)));
    }
  }
  *count = deviceCount();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= deviceCount()) return ret(cudaErrorInvalidDevice);
  tDevice = device;
  tHasContext = true;
  return cudaSuccess;
}

// The driver's cuCtxGetCurrent / cuCtxSetCurrent, as
// cudaGetDriverEntryPointByVersion hands them out: a "context" is device + 1.
static int standinCtxGetCurrent(void** ctx) {
  if (!ctx) return 1;  // CUDA_ERROR_INVALID_VALUE
  *ctx = tHasContext ? reinterpret_cast<void*>(intptr_t(tDevice) + 1) : nullptr;
  return 0;
}
static int standinCtxSetCurrent(void* ctx) {
  tHasContext = ctx != nullptr;
  tDevice = ctx ? int(reinterpret_cast<intptr_t>(ctx) - 1) : 0;
  return 0;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int,
                                             unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  if (!symbol || !fn) return ret(cudaErrorInvalidValue);
  const std::string name = symbol;
  *fn = name == "cuCtxGetCurrent"   ? reinterpret_cast<void*>(&standinCtxGetCurrent)
        : name == "cuCtxSetCurrent" ? reinterpret_cast<void*>(&standinCtxSetCurrent)
                                    : nullptr;
  if (status) *status = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (!device) return ret(cudaErrorInvalidValue);
  *device = tDevice;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  ++gDeviceSynchronize;
  resolve(nullptr)->drain();
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = tLastError;
  tLastError = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return tLastError; }

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInsufficientDriver:
      return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    default: return "unknown error (CUDA stand-in)";
  }
}

// ---- Streams and events -----------------------------------------------------

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  if (!s) return ret(cudaErrorInvalidValue);
  *s = new CUstream_st;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) { return cudaStreamCreate(s); }

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int, int) {
  return cudaStreamCreate(s);
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (!s || s == cudaStreamLegacy || s == cudaStreamPerThread) {
    return ret(cudaErrorInvalidResourceHandle);
  }
  if (s->destroyed.exchange(true)) {
    return misuse("cudaStreamDestroy of " + streamName(s) + ", already destroyed");
  }
  s->shutdown();  // runs what is queued, then joins; the object stays (see shutdown)
  static std::mutex m;
  static auto* stopped = new std::vector<CUstream_st*>;  // reachable: not a leak to LSan
  std::lock_guard<std::mutex> lock(m);
  stopped->push_back(s);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  ++gStreamSynchronize;
  CUstream_st* st = usable(s, "cudaStreamSynchronize");
  if (!st) return cudaErrorInvalidResourceHandle;
  st->drain();
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  CUstream_st* st = usable(s, "cudaStreamQuery");
  if (!st) return cudaErrorInvalidResourceHandle;
  std::lock_guard<std::mutex> lock(st->m);
  return st->completed >= st->enqueued ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  if (!e) return ret(cudaErrorInvalidValue);
  *e = new CUevent_st;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) { return cudaEventCreate(e); }

// Destroying an event that a stream waits on (cudaStreamWaitEvent) is
// allowed, as CUDA documents: the wait captured the record when it was
// issued. Destroying one while a host thread is inside cudaEventSynchronize
// on it is a misuse (undefined in CUDA: the handle goes while in use).
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::mutex> lock(e->m);
  if (e->destroyed) return misuse("cudaEventDestroy of " + eventName(e) + ", already destroyed");
  e->destroyed = true;
  {
    static std::mutex m;
    static auto* gone = new std::vector<CUevent_st*>;  // reachable: not a leak to LSan
    std::lock_guard<std::mutex> keep(m);
    gone->push_back(e);
  }
  if (e->hostWaiters > 0) {
    return misuse("cudaEventDestroy of " + eventName(e) + " while " +
                  std::to_string(e->hostWaiters) + " host thread(s) wait in cudaEventSynchronize on it");
  }
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  ++gEventRecord;
  CUstream_st* st = usable(s, "cudaEventRecord");
  if (!st) return cudaErrorInvalidResourceHandle;
  std::lock_guard<std::mutex> lock(e->m);
  if (e->destroyed) return misuse("cudaEventRecord of " + eventName(e) + ", destroyed by cudaEventDestroy");
  e->stream = st;
  e->ticket = st->enqueue([] {});
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  CUstream_st* st = nullptr;
  uint64_t ticket = 0;
  if (!recorded(e, "cudaEventQuery", &st, &ticket)) return cudaErrorInvalidResourceHandle;
  return st->reached(ticket) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  CUstream_st* st = nullptr;
  uint64_t ticket = 0;
  if (!recorded(e, "cudaEventSynchronize", &st, &ticket, true)) return cudaErrorInvalidResourceHandle;
  st->waitFor(ticket);
  std::lock_guard<std::mutex> lock(e->m);
  --e->hostWaiters;
  --gEventHostWaiters;
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  ++gStreamWaitEvent;
  CUstream_st* waiter = usable(s, "cudaStreamWaitEvent");
  if (!waiter) return cudaErrorInvalidResourceHandle;
  CUstream_st* other = nullptr;  // the record captured now, as CUDA does
  uint64_t ticket = 0;
  if (!recorded(e, "cudaStreamWaitEvent", &other, &ticket)) return cudaErrorInvalidResourceHandle;
  waiter->enqueue([other, ticket] { other->waitFor(ticket); });
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* userData) {
  if (!fn) return ret(cudaErrorInvalidValue);
  ++gLaunchHostFunc;
  CUstream_st* st = usable(s, "cudaLaunchHostFunc");
  if (!st) return cudaErrorInvalidResourceHandle;
  st->enqueue([fn, userData] { fn(userData); });
  return cudaSuccess;
}

// ---- Memory -----------------------------------------------------------------

static cudaError_t allocate(void** p, size_t bytes, cudaMemoryType type) {
  if (!p) return ret(cudaErrorInvalidValue);
  void* m = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  if (!m) return ret(cudaErrorMemoryAllocation);
  std::memset(m, 0xA5, bytes);  // like fresh device memory: not zeroed
  std::lock_guard<std::mutex> lock(gAllocMutex);
  allocations()[uintptr_t(m)] = Allocation{bytes, type, tDevice};
  *p = m;
  ++gMalloc;
  return cudaSuccess;
}

static cudaError_t release(void* p) {
  if (!p) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(gAllocMutex);
    if (allocations().erase(uintptr_t(p)) == 0) return ret(cudaErrorInvalidValue);
  }
  ++gFree;
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) { return allocate(p, bytes, cudaMemoryTypeDevice); }
cudaError_t cudaFree(void* p) { return release(p); }
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  return allocate(p, bytes, cudaMemoryTypeHost);
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned int) {
  return allocate(p, bytes, cudaMemoryTypeHost);
}
cudaError_t cudaFreeHost(void* p) { return release(p); }

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  if (!a) return ret(cudaErrorInvalidValue);
  std::memset(a, 0, sizeof *a);
  a->type = cudaMemoryTypeUnregistered;
  a->device = -2;
  std::lock_guard<std::mutex> lock(gAllocMutex);
  auto& m = allocations();
  auto it = m.upper_bound(uintptr_t(p));
  if (it != m.begin()) {
    --it;
    if (uintptr_t(p) < it->first + it->second.bytes) {
      a->type = it->second.type;
      a->device = it->second.device;
      a->devicePointer = const_cast<void*>(p);
      a->hostPointer = const_cast<void*>(p);
    }
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t s) {
  if ((!dst || !src) && n) return ret(cudaErrorInvalidValue);
  CUstream_st* st = usable(s, "cudaMemcpyAsync");
  if (!st) return cudaErrorInvalidResourceHandle;
  st->enqueue([dst, src, n] { std::memmove(dst, src, n); });
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  cudaError_t e = cudaMemcpyAsync(dst, src, n, kind, nullptr);
  if (e == cudaSuccess) resolve(nullptr)->drain();
  return e;
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t s) {
  if (!p && n) return ret(cudaErrorInvalidValue);
  CUstream_st* st = usable(s, "cudaMemsetAsync");
  if (!st) return cudaErrorInvalidResourceHandle;
  st->enqueue([p, value, n] { std::memset(p, value, n); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void* p, int value, size_t n) {
  cudaError_t e = cudaMemsetAsync(p, value, n, nullptr);
  if (e == cudaSuccess) resolve(nullptr)->drain();
  return e;
}

cudaError_t cudaRuntimeGetVersion(int* v) {
  if (!v) return ret(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* v) {
  if (!v) return ret(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

}  // extern "C"

// ---- Test hooks (not part of CUDA) --------------------------------------------

// How many times a function ran in this process: "cudaDeviceSynchronize",
// "cudaStreamSynchronize", "cudaMalloc" (all allocations), "cudaFree" (all
// frees), "cudaLaunchHostFunc", "cudaEventRecord", "cudaStreamWaitEvent";
// "misuse" the stream/event misuses so far (taken or not);
// "event_host_waiters" the threads inside cudaEventSynchronize now;
// "live_allocations" is the number not yet freed; "thread_device" the device
// of the calling thread's current context (-1: none). -1 for an unknown name.
SF_STANDIN_EXPORT int64_t sfStandinCudaCounter(const char* name) {
  const std::string n = name ? name : "";
  if (n == "cudaDeviceSynchronize") return gDeviceSynchronize;
  if (n == "cudaStreamSynchronize") return gStreamSynchronize;
  if (n == "cudaMalloc") return gMalloc;
  if (n == "cudaFree") return gFree;
  if (n == "cudaLaunchHostFunc") return gLaunchHostFunc;
  if (n == "cudaEventRecord") return gEventRecord;
  if (n == "cudaStreamWaitEvent") return gStreamWaitEvent;
  if (n == "event_host_waiters") return gEventHostWaiters;  // threads in cudaEventSynchronize
  if (n == "misuse") {
    std::lock_guard<std::mutex> lock(gMisuseMutex);
    return gMisuse;
  }
  if (n == "thread_device") return tHasContext ? tDevice : -1;  // this thread's current context
  if (n == "live_allocations") {
    std::lock_guard<std::mutex> lock(gAllocMutex);
    return int64_t(allocations().size());
  }
  return -1;
}

// Takes the misuses not taken yet: returns how many, copies the last
// message into `last` (NUL-terminated, `cap` bytes; may be NULL). A test
// that provokes a misuse on purpose takes it, so that the exit check (status
// 86) fails only a process whose misuse nobody looked at.
SF_STANDIN_EXPORT int64_t sfStandinCudaTakeMisuse(char* last, size_t cap) {
  std::lock_guard<std::mutex> lock(gMisuseMutex);
  const int64_t n = gMisuse - gMisuseTaken;
  gMisuseTaken = gMisuse;
  if (last && cap) std::snprintf(last, cap, "%s", n ? gLastMisuse : "");
  return n;
}
