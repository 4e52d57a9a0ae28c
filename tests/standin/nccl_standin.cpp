// STAND-IN for NCCL (libnccl.so.2), for tests on machines without a GPU. It
// is NOT NCCL: collectives are host functions on the stand-in CUDA streams
// (cudart_standin.cpp) that meet the other ranks in POSIX shared memory named
// after the unique id, so ranks may be threads of one process or separate
// processes. Signatures come from the real nccl.h.
//
// Semantics kept from NCCL: stream order (a collective runs when its stream
// reaches it), in-place or out-of-place buffers, ncclReduce writing the
// root's recvbuff only, sum/prod/max/min/avg and
// ncclRedOpCreatePreMulSum (each rank multiplies its own input by its own
// scalar), non-blocking initialization (config.blocking = 0: init returns
// ncclInProgress, ncclCommGetAsyncError says when it is done), abort as
// inside one node (a collective waiting for peers gives up; the peers are
// not told: theirs wait on until they abort too), ncclCommFinalize (flushes
// this rank's queued collectives) and ncclCommDestroy (blocks while they are
// queued, as NCCL's implicit finalize does). Results are deterministic and
// identical on every rank (fixed rank order, 16-bit floats accumulated in
// float).
//
// Strict where NCCL is undefined: collectives pair by issue order, and a
// pairing whose (sequence number, kind, count, dtype, op, root) differ fails
// on every rank with ncclInvalidUsage (real NCCL would corrupt or hang); a
// collective that waits for a rank which destroyed its communicator before
// issuing it fails the same way. In the in-progress mode
// (SF_STANDIN_NCCL_IN_PROGRESS=1 or sfStandinInProgressMode) a collective on
// a non-blocking communicator returns ncclInProgress and settles after two
// ncclCommGetAsyncError polls; destroying a reduction operator before then
// fails the collective that uses it.
//
// Test hooks (not NCCL), see README.md: sfStandinNcclCounter,
// sfStandinCommCounters, sfStandinLiveComms, sfStandinInjectAsyncError,
// sfStandinFailNext, sfStandinInProgressMode, sfStandinStallFinalize.

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <cstdlib>
#include <nccl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#define SF_STANDIN_EXPORT extern "C" __attribute__((visibility("default")))

// The CUDA stand-in this NCCL stand-in runs on: the libcudart.so.13 in its
// own directory, opened by path (never by soname), so that it is the
// stand-in even in a process where a real libcudart.so.13 was loaded first
// (pip torch's, at `import torch`): a soname lookup would bind that one.
namespace standin_cuda {
struct Functions {
  cudaError_t (*launchHostFunc)(cudaStream_t, cudaHostFn_t, void*) = nullptr;
  cudaError_t (*getDevice)(int*) = nullptr;
};
const Functions& fn() {
  static const Functions f = [] {
    Functions r;
    Dl_info info{};
    std::string dir = ".";
    if (::dladdr(reinterpret_cast<void*>(&fn), &info) && info.dli_fname) {
      char* real = ::realpath(info.dli_fname, nullptr);  // the file's own directory, not a link's
      dir = real ? real : info.dli_fname;
      std::free(real);
      const size_t slash = dir.rfind('/');
      dir = slash == std::string::npos ? "." : dir.substr(0, slash);
    }
    const std::string path = dir + "/libcudart.so.13";
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) {
      r.launchHostFunc = reinterpret_cast<decltype(r.launchHostFunc)>(::dlsym(h, "cudaLaunchHostFunc"));
      r.getDevice = reinterpret_cast<decltype(r.getDevice)>(::dlsym(h, "cudaGetDevice"));
    }
    if (!h || !r.launchHostFunc || !r.getDevice || !::dlsym(h, "sfStandinCudaCounter")) {
      std::fprintf(stderr, "NCCL stand-in: cannot use the CUDA stand-in %s: %s\n", path.c_str(),
                   h ? "not the stand-in (no sfStandinCudaCounter)" : ::dlerror());
      std::abort();
    }
    return r;
  }();
  return f;
}
}  // namespace standin_cuda

namespace {

constexpr size_t kChunk = size_t(1) << 20;  // bytes per rank per round

// The segment every rank maps. All-zero is the valid initial state, so
// ranks may create it in any order.
struct Shared {
  std::atomic<int32_t> joined;
  std::atomic<int32_t> abortedBy;  // rank + 1 of a rank that aborted, 0 if none
  std::atomic<uint64_t> count;     // barrier arrivals in this generation
  std::atomic<uint64_t> generation;
};

// What one rank's current collective is, for the pairing check, and whether
// the rank destroyed its communicator (after issuing `issued` collectives).
struct Desc {
  std::atomic<uint64_t> seq, count;
  std::atomic<int32_t> kind, type, op, root;
  std::atomic<int32_t> departed;
  std::atomic<uint64_t> issued;
};

size_t headerBytes(int nranks) {
  return (sizeof(Shared) + size_t(nranks) * sizeof(Desc) + 4095) / 4096 * 4096;
}
size_t segmentBytes(int nranks) { return headerBytes(nranks) + size_t(nranks) * kChunk; }

std::atomic<int64_t> gAllReduceCalls{0}, gAllReduceBytes{0}, gBroadcastCalls{0}, gBroadcastElems{0};
std::atomic<int64_t> gReduceCalls{0}, gReduceElems{0};
std::atomic<int64_t> gAborts{0}, gDestroys{0}, gFinalizes{0}, gMismatches{0};
std::atomic<bool> gInProgressMode{std::getenv("SF_STANDIN_NCCL_IN_PROGRESS") != nullptr &&
                                  std::string(std::getenv("SF_STANDIN_NCCL_IN_PROGRESS")) == "1"};
std::atomic<bool> gStallFinalize{false};
thread_local int tGroupDepth = 0;
thread_local std::vector<std::shared_ptr<struct CommState>> tGroupPending;  // in-progress mode
// How long ncclCommDestroy blocks for queued collectives before the stand-in
// gives up (NCCL would block for ever; a test must not).
constexpr auto kDestroyCap = std::chrono::seconds(20);
thread_local std::string tLastError;

// The state a communicator and its queued collectives share: the segment is
// unmapped when the last of them lets go.
struct CommState {
  int nranks = 0, rank = 0, device = 0;
  bool blocking = true;
  std::string name;
  Shared* shared = nullptr;
  Desc* descs = nullptr;
  char* slots = nullptr;
  std::atomic<uint64_t> issued{0};  // collectives enqueued (their sequence numbers)
  std::atomic<int> queued{0};       // enqueued and not finished
  std::atomic<int> inProgressPolls{0};  // in-progress mode: polls until the last call settles
  std::atomic<bool> finalizing{false};
  std::atomic<bool> aborted{false};
  std::atomic<int> running{0};  // collectives of this rank executing now
  std::atomic<int> asyncError{ncclSuccess};
  std::mutex errorMutex;
  std::string errorMessage;
  std::atomic<int64_t> allReduceCalls{0}, allReduceBytes{0};
  std::thread initThread;
  std::map<int, std::pair<ncclDataType_t, double>> preMulOps;  // op -> (type, scalar)
  int nextOp = ncclNumOps;

  ~CommState() {
    if (initThread.joinable()) initThread.join();
    if (shared) ::munmap(shared, segmentBytes(nranks));
  }
  void setError(ncclResult_t r, const std::string& message) {
    std::lock_guard<std::mutex> lock(errorMutex);
    if (asyncError.load() == ncclSuccess || asyncError.load() == ncclInProgress) {
      errorMessage = message;
      asyncError = r;
    }
  }
  char* slot(int r) { return slots + size_t(r) * kChunk; }

  // false if this rank aborted. A peer's abort is not noticed (inside one
  // node NCCL does not tell): this rank waits on until it aborts itself.
  bool stillGoing() { return !aborted.load(); }
  // A rank that destroyed its communicator before issuing collective `seq`,
  // which therefore can never pair; -1 if none.
  int departedBefore(uint64_t seq) {
    for (int r = 0; seq && r < nranks; ++r) {
      if (descs[r].departed.load() && descs[r].issued.load() < seq) return r;
    }
    return -1;
  }
  template <typename Pred>
  bool spinUntil(Pred done, uint64_t seq = 0) {
    for (int spins = 0; !done(); ++spins) {
      if (!stillGoing()) return false;
      const int gone = departedBefore(seq);
      if (gone >= 0) {
        if (done()) return true;
        setError(ncclInvalidUsage, "NCCL stand-in: rank " + std::to_string(rank) + "'s collective #" +
                                       std::to_string(seq) + " waits for rank " + std::to_string(gone) +
                                       ", which destroyed its communicator after issuing " +
                                       std::to_string(descs[gone].issued.load()) +
                                       " collectives (real NCCL: undefined, a hang or garbage)");
        return false;
      }
      if (spins < 200) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    return true;
  }
  bool barrier(uint64_t seq = 0) {
    const uint64_t g = shared->generation.load();
    if (shared->count.fetch_add(1) + 1 == uint64_t(nranks)) {
      shared->count.store(0);
      shared->generation.fetch_add(1);
      return true;
    }
    return spinUntil([&] { return shared->generation.load() != g; }, seq);
  }
  bool join() {
    shared->joined.fetch_add(1);
    bool ok = spinUntil([&] { return shared->joined.load() >= nranks; });
    ::shm_unlink(name.c_str());  // every rank has it mapped now (ENOENT is fine)
    return ok;
  }
};

}  // namespace

struct ncclComm {
  std::shared_ptr<CommState> state;
};

namespace {

std::mutex gLiveMutex;
std::set<ncclComm*>& live() {
  static auto* s = new std::set<ncclComm*>;
  return *s;
}

std::mutex gFailMutex;
std::map<std::string, ncclResult_t>& failNext() {
  static auto* m = new std::map<std::string, ncclResult_t>;
  return *m;
}

ncclResult_t error(ncclResult_t r, const std::string& message) {
  tLastError = message;
  return r;
}

// An injected synchronous failure of `function`, if one is armed.
bool injected(const char* function, ncclResult_t* r) {
  std::lock_guard<std::mutex> lock(gFailMutex);
  auto it = failNext().find(function);
  if (it == failNext().end()) return false;
  *r = it->second;
  failNext().erase(it);
  tLastError = std::string("NCCL stand-in: injected failure of ") + function;
  return true;
}

CommState* stateOf(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(gLiveMutex);
  return live().count(comm) ? comm->state.get() : nullptr;
}

size_t typeSize(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

float halfToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t floatToHalf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (abs < 0x38800000u) {  // subnormal half: round(value * 2^24)
    float a;
    std::memcpy(&a, &abs, 4);
    return uint16_t(sign | uint16_t(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t mant = abs & 0x7fffffu, exp = (abs >> 23) - 112;
  uint32_t h = (exp << 10) | (mant >> 13), rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) ++h;
  return uint16_t(sign | h);
}

float bf16ToFloat(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t floatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

double load(const char* p, ncclDataType_t t) {
  switch (t) {
    case ncclInt8: return double(*reinterpret_cast<const int8_t*>(p));
    case ncclUint8: return double(*reinterpret_cast<const uint8_t*>(p));
    case ncclInt32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case ncclUint32: { uint32_t v; std::memcpy(&v, p, 4); return v; }
    case ncclFloat32: { float v; std::memcpy(&v, p, 4); return v; }
    case ncclFloat64: { double v; std::memcpy(&v, p, 8); return v; }
    case ncclFloat16: { uint16_t v; std::memcpy(&v, p, 2); return halfToFloat(v); }
    case ncclBfloat16: { uint16_t v; std::memcpy(&v, p, 2); return bf16ToFloat(v); }
    default: return 0;
  }
}

void store(char* p, ncclDataType_t t, double x) {
  switch (t) {
    case ncclInt8: *reinterpret_cast<int8_t*>(p) = int8_t(x); break;
    case ncclUint8: *reinterpret_cast<uint8_t*>(p) = uint8_t(x); break;
    case ncclInt32: { int32_t v = int32_t(x); std::memcpy(p, &v, 4); break; }
    case ncclUint32: { uint32_t v = uint32_t(x); std::memcpy(p, &v, 4); break; }
    case ncclFloat32: { float v = float(x); std::memcpy(p, &v, 4); break; }
    case ncclFloat64: std::memcpy(p, &x, 8); break;
    case ncclFloat16: { uint16_t v = floatToHalf(float(x)); std::memcpy(p, &v, 2); break; }
    case ncclBfloat16: { uint16_t v = floatToBf16(float(x)); std::memcpy(p, &v, 2); break; }
    default: break;
  }
}

// 64-bit integers are reduced exactly, not through double.
template <typename T>
T combine64(T a, T b, ncclRedOp_t op) {
  switch (op) {
    case ncclProd: return a * b;
    case ncclMax: return std::max(a, b);
    case ncclMin: return std::min(a, b);
    default: return a + b;
  }
}

// What a collective is, for the pairing check and its run: the three the
// stand-in runs itself (ncclReduceScatter and ncclAllGather are all-reduces
// of a scratch buffer, below).
enum Kind : int32_t { kAllReduce = 0, kBroadcast = 1, kReduce = 2 };
const char* kindName(int32_t k) {
  return k == kBroadcast ? "ncclBroadcast" : k == kReduce ? "ncclReduce" : "ncclAllReduce";
}

struct Collective {
  std::shared_ptr<CommState> comm;
  const char* send;
  char* recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;      // ncclSum for a pre-multiplied sum
  double prescale;     // this rank's own factor (1 unless pre-multiplied)
  int root;            // broadcast or reduce root, -1 for an all-reduce
  uint64_t seq = 0;    // this rank's issue number (1, 2, ...), set by enqueue
  int32_t opClass = 0; // the op as paired ranks must agree on it (ncclNumOps: pre-multiplied sum)
  const char* kind = "ncclAllReduce";
  int32_t code = kAllReduce;
};

const char* typeName(int t) {
  switch (t) {
    case ncclInt8: return "int8"; case ncclUint8: return "uint8"; case ncclInt32: return "int32";
    case ncclUint32: return "uint32"; case ncclInt64: return "int64"; case ncclUint64: return "uint64";
    case ncclFloat16: return "float16"; case ncclBfloat16: return "bfloat16";
    case ncclFloat32: return "float32"; case ncclFloat64: return "float64"; default: return "?";
  }
}

std::string describe(const std::string& kind, int32_t code, uint64_t seq, uint64_t count, int type,
                     int op, int root) {
  static const char* ops[] = {"sum", "prod", "max", "min", "avg", "premulsum"};
  std::string s = kind + " #" + std::to_string(seq) + " (" + std::to_string(count) + " x " + typeName(type);
  if (code != kBroadcast) s += std::string(", ") + ops[std::min(op, 5)];
  if (root >= 0) s += ", root " + std::to_string(root);
  return s + ")";
}

// The pairing check, at the start of every collective: each rank publishes
// what it runs, all meet, all compare. Every rank sees the same descriptors,
// so either all fail or none; a second meeting keeps the descriptors until
// everyone read them. false: the collective must not run.
bool pairs(Collective& c) {
  CommState& s = *c.comm;
  Desc& mine = s.descs[s.rank];
  const int32_t kind = c.code;
  mine.seq = c.seq;
  mine.count = c.count;
  mine.kind = kind;
  mine.type = int32_t(c.type);
  mine.op = kind != kBroadcast ? c.opClass : 0;
  mine.root = c.root;
  if (!s.barrier(c.seq)) return false;
  std::string why;
  for (int r = 0; r < s.nranks && why.empty(); ++r) {
    const Desc& d = s.descs[r];
    if (d.seq != mine.seq || d.kind != kind || d.count != mine.count || d.type != mine.type ||
        d.op != mine.op || d.root != mine.root) {
      why = "NCCL stand-in: rank " + std::to_string(s.rank) + "'s " +
            describe(c.kind, kind, c.seq, c.count, c.type, mine.op, c.root) + " was paired with rank " +
            std::to_string(r) + "'s " +
            describe(kindName(d.kind), d.kind, d.seq, d.count, d.type, d.op, d.root) +
            " (real NCCL: undefined, corrupt results or a hang)";
    }
  }
  if (!s.barrier(c.seq)) return false;
  if (why.empty()) return true;
  ++gMismatches;
  s.setError(ncclInvalidUsage, why);
  return false;
}

// An all-reduce, or a reduce (the same sum; only the root writes its
// output: NCCL uses recvbuff on the root only).
void runAllReduce(Collective& c) {
  CommState& s = *c.comm;
  const size_t es = typeSize(c.type), perRound = kChunk / es;
  const bool wide = c.type == ncclInt64 || c.type == ncclUint64;
  const bool writes = c.code != kReduce || s.rank == c.root;
  for (size_t first = 0; first < c.count; first += perRound) {
    const size_t n = std::min(perRound, c.count - first);
    char* mine = s.slot(s.rank);
    const char* in = c.send + first * es;
    if (c.prescale != 1.0 && !wide) {
      for (size_t i = 0; i < n; ++i) store(mine + i * es, c.type, load(in + i * es, c.type) * c.prescale);
    } else {
      std::memcpy(mine, in, n * es);
    }
    if (!s.barrier()) return;
    char* out = c.recv + first * es;
    for (size_t i = 0; writes && i < n; ++i) {
      if (wide) {
        int64_t acc;
        std::memcpy(&acc, s.slot(0) + i * 8, 8);
        for (int r = 1; r < s.nranks; ++r) {
          int64_t v;
          std::memcpy(&v, s.slot(r) + i * 8, 8);
          acc = c.type == ncclInt64 ? combine64<int64_t>(acc, v, c.op)
                                    : int64_t(combine64<uint64_t>(uint64_t(acc), uint64_t(v), c.op));
        }
        if (c.op == ncclAvg) acc /= s.nranks;
        std::memcpy(out + i * 8, &acc, 8);
        continue;
      }
      double acc = load(s.slot(0) + i * es, c.type);
      for (int r = 1; r < s.nranks; ++r) {
        const double v = load(s.slot(r) + i * es, c.type);
        switch (c.op) {
          case ncclProd: acc *= v; break;
          case ncclMax: acc = std::max(acc, v); break;
          case ncclMin: acc = std::min(acc, v); break;
          default: acc += v; break;
        }
        // NCCL keeps 16-bit and 32-bit sums in their own type.
        if (c.type == ncclFloat32 || c.type == ncclFloat16 || c.type == ncclBfloat16) {
          acc = double(float(acc));
        }
      }
      if (c.op == ncclAvg) acc /= s.nranks;
      store(out + i * es, c.type, acc);
    }
    if (!s.barrier()) return;
  }
}

void runBroadcast(Collective& c) {
  CommState& s = *c.comm;
  const size_t es = typeSize(c.type), perRound = kChunk / es;
  for (size_t first = 0; first < c.count; first += perRound) {
    const size_t n = std::min(perRound, c.count - first);
    if (s.rank == c.root) std::memcpy(s.slot(c.root), c.send + first * es, n * es);
    if (!s.barrier()) return;
    std::memmove(c.recv + first * es, s.slot(c.root), n * es);
    if (!s.barrier()) return;
  }
}

void CUDART_CB runCollective(void* arg) {
  std::unique_ptr<Collective> c(static_cast<Collective*>(arg));
  CommState& s = *c->comm;
  s.running.fetch_add(1);  // before the check: an abort that misses us waits for us
  if (s.stillGoing() && pairs(*c)) {
    if (c->code == kBroadcast) {
      runBroadcast(*c);
    } else {
      runAllReduce(*c);
    }
  }
  s.queued.fetch_sub(1);
  s.running.fetch_sub(1);
}

// `code`: kAllReduce (root -1), kBroadcast or kReduce (root checked by the
// caller); `op` applies to the reductions.
ncclResult_t enqueue(const char* function, ncclComm_t comm, const void* send, void* recv,
                     size_t count, ncclDataType_t type, ncclRedOp_t op, int root,
                     cudaStream_t stream, int32_t code = kAllReduce) {
  ncclResult_t r;
  if (injected(function, &r)) return r;
  CommState* s = stateOf(comm);
  if (!s) return error(ncclInvalidArgument, std::string(function) + ": invalid or destroyed communicator");
  if (s->asyncError.load() == ncclInProgress) {
    return error(ncclInvalidUsage, std::string(function) + ": communicator initialization not finished");
  }
  if (s->aborted.load()) return error(ncclInvalidUsage, std::string(function) + ": communicator was aborted");
  if (typeSize(type) == 0) return error(ncclInvalidArgument, std::string(function) + ": unsupported datatype");
  // A reduce's recvbuff is used on the root only (nccl.h).
  const bool needsRecv = code != kReduce || s->rank == root;
  if (count && (!send || (needsRecv && !recv))) {
    return error(ncclInvalidArgument, std::string(function) + ": NULL buffer");
  }
  auto* c = new Collective{comm->state, static_cast<const char*>(send), static_cast<char*>(recv),
                           count, type, op, 1.0, root};
  c->code = code;
  const bool reduces = code != kBroadcast;
  if (reduces && op >= ncclNumOps) {
    auto it = s->preMulOps.find(int(op));
    if (it == s->preMulOps.end() || it->second.first != type) {
      delete c;
      return error(ncclInvalidArgument, std::string(function) + ": unknown reduction operator");
    }
    c->op = ncclSum;
    c->prescale = it->second.second;
    c->opClass = ncclNumOps;
  } else if (reduces && (op < ncclSum || op > ncclAvg)) {
    delete c;
    return error(ncclInvalidArgument, std::string(function) + ": invalid reduction operator");
  }
  if (reduces && op < ncclNumOps) c->opClass = int32_t(op);
  c->kind = function;
  c->seq = s->issued.load() + 1;
  s->queued.fetch_add(1);
  if (standin_cuda::fn().launchHostFunc(stream, runCollective, c) != cudaSuccess) {
    s->queued.fetch_sub(1);
    delete c;
    return error(ncclUnhandledCudaError, std::string(function) + ": cannot enqueue on the stream");
  }
  s->issued.fetch_add(1);
  s->descs[s->rank].issued = s->issued.load();
  if (!s->blocking && gInProgressMode.load() && tGroupDepth > 0) {
    tGroupPending.push_back(comm->state);  // ncclGroupEnd returns ncclInProgress
  } else if (!s->blocking && gInProgressMode.load()) {
    // As NCCL may on a non-blocking communicator: the call is still being
    // enqueued; ncclCommGetAsyncError says when it settled.
    s->inProgressPolls = 2;
    s->asyncError = ncclInProgress;
    return ncclInProgress;
  }
  return ncclSuccess;
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (!version) return error(ncclInvalidArgument, "ncclGetVersion: NULL");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  if (CommState* s = stateOf(comm)) {
    std::lock_guard<std::mutex> lock(s->errorMutex);
    if (!s->errorMessage.empty()) {
      tLastError = s->errorMessage;
    }
  }
  return tLastError.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  ncclResult_t r;
  if (injected("ncclGetUniqueId", &r)) return r;
  if (!id) return error(ncclInvalidArgument, "ncclGetUniqueId: NULL");
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  std::memset(id->internal, 0, sizeof id->internal);
  std::snprintf(id->internal, sizeof id->internal, "/sfsync-standin-%d-%llu-%08x%08x",
                int(::getpid()), (unsigned long long)counter.fetch_add(1), rd(), rd());
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  ncclResult_t r;
  if (injected("ncclCommInitRank", &r)) return r;
  if (!out || nranks < 1 || rank < 0 || rank >= nranks) {
    return error(ncclInvalidArgument, "ncclCommInitRank: invalid arguments");
  }
  if (std::strncmp(id.internal, "/sfsync-standin-", 16) != 0) {
    return error(ncclInvalidArgument, "ncclCommInitRank: not a unique id from ncclGetUniqueId");
  }
  auto state = std::make_shared<CommState>();
  state->nranks = nranks;
  state->rank = rank;
  state->name.assign(id.internal, strnlen(id.internal, sizeof id.internal));
  standin_cuda::fn().getDevice(&state->device);
  const int fd = ::shm_open(state->name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0) return error(ncclSystemError, "ncclCommInitRank: shm_open failed");
  if (::ftruncate(fd, off_t(segmentBytes(nranks))) != 0) {
    ::close(fd);
    return error(ncclSystemError, "ncclCommInitRank: ftruncate failed");
  }
  void* m = ::mmap(nullptr, segmentBytes(nranks), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) return error(ncclSystemError, "ncclCommInitRank: mmap failed");
  state->shared = static_cast<Shared*>(m);
  state->descs = reinterpret_cast<Desc*>(static_cast<char*>(m) + sizeof(Shared));
  state->slots = static_cast<char*>(m) + headerBytes(nranks);

  auto* comm = new ncclComm{state};
  {
    std::lock_guard<std::mutex> lock(gLiveMutex);
    live().insert(comm);
  }
  *out = comm;
  const bool blocking = !config || config->blocking != 0;
  state->blocking = blocking;
  if (blocking) {
    if (!state->join()) return error(ncclRemoteError, "ncclCommInitRank: aborted while joining");
    return ncclSuccess;
  }
  state->asyncError = ncclInProgress;
  CommState* raw = state.get();
  state->initThread = std::thread([raw] {
    if (raw->join()) {
      int expected = ncclInProgress;
      raw->asyncError.compare_exchange_strong(expected, ncclSuccess);
    }
  });
  return ncclInProgress;
}

ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(out, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* result) {
  CommState* s = stateOf(comm);
  if (!s || !result) return error(ncclInvalidArgument, "ncclCommGetAsyncError: invalid arguments");
  if (s->asyncError.load() == ncclInProgress && s->inProgressPolls.load() > 0 &&
      s->inProgressPolls.fetch_sub(1) == 1) {
    int expected = ncclInProgress;
    s->asyncError.compare_exchange_strong(expected, ncclSuccess);
  }
  if (s->asyncError.load() == ncclInProgress && s->finalizing.load() && s->queued.load() == 0 &&
      !gStallFinalize.load()) {
    int expected = ncclInProgress;
    s->asyncError.compare_exchange_strong(expected, ncclSuccess);
  }
  *result = ncclResult_t(s->asyncError.load());
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  CommState* s = stateOf(comm);
  if (!s || !count) return error(ncclInvalidArgument, "ncclCommCount: invalid arguments");
  *count = s->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  CommState* s = stateOf(comm);
  if (!s || !rank) return error(ncclInvalidArgument, "ncclCommUserRank: invalid arguments");
  *rank = s->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  CommState* s = stateOf(comm);
  if (!s || !device) return error(ncclInvalidArgument, "ncclCommCuDevice: invalid arguments");
  *device = s->device;
  return ncclSuccess;
}

static ncclResult_t release(ncclComm_t comm, bool abort) {
  std::shared_ptr<CommState> state;
  {
    std::lock_guard<std::mutex> lock(gLiveMutex);
    if (!live().count(comm)) {
      return error(ncclInvalidArgument, abort ? "ncclCommAbort: invalid or destroyed communicator"
                                              : "ncclCommDestroy: invalid or destroyed communicator");
    }
    state = comm->state;
  }
  if (!abort) {
    // NCCL's destroy finalizes first: it blocks while this rank's collectives
    // are queued (for ever if a peer never comes; the stand-in gives up).
    ++gDestroys;
    const auto until = std::chrono::steady_clock::now() + kDestroyCap;
    while ((state->queued.load() != 0 || gStallFinalize.load()) && !state->aborted.load() &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  {
    std::lock_guard<std::mutex> lock(gLiveMutex);
    if (!live().erase(comm)) return error(ncclInvalidArgument, "ncclCommDestroy: destroyed meanwhile");
    delete comm;
  }
  if (abort) {
    ++gAborts;
    state->aborted = true;
    int expected = 0;
    state->shared->abortedBy.compare_exchange_strong(expected, state->rank + 1);
    ::shm_unlink(state->name.c_str());
    // As NCCL's abort: the collectives in flight have stopped when it returns
    // (they no longer touch the caller's buffers).
    while (state->running.load() != 0) std::this_thread::yield();
  }
  if (!abort) {
    // Departed: a peer's collective this rank never issued can never pair.
    // (An abort tells nobody, as inside one node: peers wait for their own.)
    state->descs[state->rank].issued = state->issued.load();
    state->descs[state->rank].departed = 1;
  }
  if (state->initThread.joinable()) state->initThread.join();
  return ncclSuccess;  // queued collectives keep the state alive until they ran
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) { return release(comm, false); }
ncclResult_t ncclCommAbort(ncclComm_t comm) { return release(comm, true); }
// Flushes this rank's queued collectives: on a non-blocking communicator it
// returns ncclInProgress and ncclCommGetAsyncError says ncclSuccess once they
// ran (never, with sfStandinStallFinalize); a blocking one waits (capped).
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  CommState* s = stateOf(comm);
  if (!s) return error(ncclInvalidArgument, "ncclCommFinalize: invalid communicator");
  if (s->asyncError.load() == ncclInProgress) {
    return error(ncclInvalidUsage, "ncclCommFinalize: the communicator's last call has not settled");
  }
  ++gFinalizes;
  s->finalizing = true;
  if (s->blocking) {
    const auto until = std::chrono::steady_clock::now() + kDestroyCap;
    while ((s->queued.load() != 0 || gStallFinalize.load()) && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return ncclSuccess;
  }
  int expected = ncclSuccess;
  s->asyncError.compare_exchange_strong(expected, ncclInProgress);
  return ncclInProgress;
}

ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t type,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
  CommState* s = stateOf(comm);
  if (!s || !op || !scalar || typeSize(type) == 0) {
    return error(ncclInvalidArgument, "ncclRedOpCreatePreMulSum: invalid arguments");
  }
  if (residence != ncclScalarHostImmediate) {
    return error(ncclInvalidArgument, "ncclRedOpCreatePreMulSum: the stand-in supports ncclScalarHostImmediate only");
  }
  const int id = s->nextOp++;
  s->preMulOps[id] = {type, load(static_cast<const char*>(scalar), type)};
  *op = ncclRedOp_t(id);
  return ncclSuccess;
}

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  CommState* s = stateOf(comm);
  if (!s || !s->preMulOps.count(int(op))) {
    return error(ncclInvalidArgument, "ncclRedOpDestroy: unknown operator");
  }
  s->preMulOps.erase(int(op));
  if (s->asyncError.load() == ncclInProgress) {
    // nccl.h: only once the call that uses it has returned and settled.
    // Undefined in NCCL; here the communicator fails.
    const std::string m = "NCCL stand-in: ncclRedOpDestroy while the call using the operator is still "
                          "in progress (ncclInProgress not yet settled)";
    s->setError(ncclInvalidUsage, m);
    return error(ncclInvalidUsage, m);
  }
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  ncclResult_t r = enqueue("ncclAllReduce", comm, send, recv, count, type, op, -1, stream);
  if (r == ncclSuccess) {
    const int64_t bytes = int64_t(count * typeSize(type));
    ++gAllReduceCalls;
    gAllReduceBytes += bytes;
    ++comm->state->allReduceCalls;
    comm->state->allReduceBytes += bytes;
  }
  return r;
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  CommState* s = stateOf(comm);
  if (s && (root < 0 || root >= s->nranks)) return error(ncclInvalidArgument, "ncclBroadcast: invalid root");
  ncclResult_t r = enqueue("ncclBroadcast", comm, send, recv, count, type, ncclSum, root, stream, kBroadcast);
  if (r == ncclSuccess) {
    ++gBroadcastCalls;
    gBroadcastElems += int64_t(count);
  }
  return r;
}

// The sum (or op) of every rank's `count` elements at sendbuff into the
// root's recvbuff (in place: the same pointer); the other ranks' recvbuff is
// not used (may be NULL) and not written. Root, count, dtype and op are
// paired across ranks as an all-reduce's.
ncclResult_t ncclReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  CommState* s = stateOf(comm);
  if (s && (root < 0 || root >= s->nranks)) return error(ncclInvalidArgument, "ncclReduce: invalid root");
  ncclResult_t r = enqueue("ncclReduce", comm, send, recv, count, type, op, root, stream, kReduce);
  if (r == ncclSuccess) {
    ++gReduceCalls;
    gReduceElems += int64_t(count);
  }
  return r;
}

ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                       cudaStream_t stream) {
  return ncclBroadcast(buff, buff, count, type, root, comm, stream);
}

// Collectives are enqueued as they are called, so a group needs no extra
// work here: every rank must issue a group's calls in the same order (as
// NCCL asks), and then they run one after another on each rank's stream,
// each meeting the same call of the peers (a group of ncclReduce with roots
// 0..n-1 cannot deadlock, ranks as threads or processes); a rank issuing
// them in another order fails the pairing check.
// In the in-progress mode, a group with a call on a non-blocking
// communicator ends with ncclInProgress (as NCCL's ncclGroupEnd may).
ncclResult_t ncclGroupStart() {
  ++tGroupDepth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (tGroupDepth == 0) return error(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--tGroupDepth > 0 || tGroupPending.empty()) return ncclSuccess;
  for (auto& s : tGroupPending) {
    s->inProgressPolls = 2;
    s->asyncError = ncclInProgress;
  }
  tGroupPending.clear();
  return ncclInProgress;
}

}  // extern "C"

// ---- Test hooks (not part of NCCL) ----------------------------------------

// Process-wide counts: "ncclAllReduce" (calls enqueued), "ncclAllReduce_bytes",
// "ncclBroadcast", "ncclBroadcast_elems" (their counts summed), "ncclReduce",
// "ncclReduce_elems". -1 for an unknown name.
SF_STANDIN_EXPORT int64_t sfStandinNcclCounter(const char* name) {
  const std::string n = name ? name : "";
  if (n == "ncclAllReduce") return gAllReduceCalls;
  if (n == "ncclAllReduce_bytes") return gAllReduceBytes;
  if (n == "ncclBroadcast") return gBroadcastCalls;
  if (n == "ncclBroadcast_elems") return gBroadcastElems;
  if (n == "ncclReduce") return gReduceCalls;
  if (n == "ncclReduce_elems") return gReduceElems;
  if (n == "ncclCommAbort") return gAborts;
  if (n == "ncclCommDestroy") return gDestroys;
  if (n == "ncclCommFinalize") return gFinalizes;
  if (n == "mismatches") return gMismatches;
  return -1;
}

// All-reduce calls and bytes enqueued on one live communicator; -1 if not live.
SF_STANDIN_EXPORT int sfStandinCommCounters(ncclComm_t comm, int64_t* calls, int64_t* bytes) {
  CommState* s = stateOf(comm);
  if (!s) return -1;
  if (calls) *calls = s->allReduceCalls;
  if (bytes) *bytes = s->allReduceBytes;
  return 0;
}

// Communicators created and neither destroyed nor aborted, in this process.
SF_STANDIN_EXPORT int sfStandinLiveComms(void) {
  std::lock_guard<std::mutex> lock(gLiveMutex);
  return int(live().size());
}

// From now on ncclCommGetAsyncError(comm) reports `r` and ncclGetLastError
// returns `message`, as after a failure inside a running collective.
SF_STANDIN_EXPORT int sfStandinInjectAsyncError(ncclComm_t comm, ncclResult_t r, const char* message) {
  CommState* s = stateOf(comm);
  if (!s) return -1;
  s->setError(r, message ? message : "injected");
  return 0;
}

// The next call of `function` ("ncclAllReduce", "ncclBroadcast",
// "ncclGetUniqueId", "ncclCommInitRank") in this process fails with `r`.
SF_STANDIN_EXPORT void sfStandinFailNext(const char* function, ncclResult_t r) {
  std::lock_guard<std::mutex> lock(gFailMutex);
  failNext()[function] = r;
}

// In-progress mode on (1) or off (0): a collective on a non-blocking
// communicator returns ncclInProgress and settles after two
// ncclCommGetAsyncError polls (also SF_STANDIN_NCCL_IN_PROGRESS=1).
SF_STANDIN_EXPORT void sfStandinInProgressMode(int on) { gInProgressMode = on != 0; }

// While on: ncclCommFinalize never settles and ncclCommDestroy blocks (for
// at most 20 s), as with a peer whose network flush never ends.
SF_STANDIN_EXPORT void sfStandinStallFinalize(int on) { gStallFinalize = on != 0; }

// ---- Since 0.3 (issue 17): ncclReduceScatter and ncclAllGather ----------------
// As the stand-in's all-reduce of a full-size scratch buffer plus a copy on the
// same stream (not NCCL's algorithm; the same results and ordering). NCCL's
// in-place forms (recv = send + rank * count, send = recv + rank * count) work.

namespace {

std::atomic<int64_t> gReduceScatterCalls{0}, gAllGatherCalls{0};
std::atomic<int64_t> gReduceScatterElems{0}, gAllGatherElems{0};  // count x nranks per call

struct Scratch {
  std::vector<char> buf;
  const char* send;
  char* recv;
  size_t offset, bytes;  // this rank's segment in buf
  bool gather;
};

void CUDART_CB scratchIn(void* arg) {  // all-gather: this rank's segment, zeros elsewhere
  auto* s = static_cast<Scratch*>(arg);
  std::fill(s->buf.begin(), s->buf.end(), char(0));
  std::memmove(s->buf.data() + s->offset, s->send, s->bytes);
}

void CUDART_CB scratchOut(void* arg) {
  std::unique_ptr<Scratch> s(static_cast<Scratch*>(arg));
  if (s->gather) {
    std::memmove(s->recv, s->buf.data(), s->buf.size());
  } else {
    std::memmove(s->recv, s->buf.data() + s->offset, s->bytes);
  }
}

ncclResult_t scratchCollective(const char* function, const void* send, void* recv, size_t count,
                               ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream, bool gather) {
  CommState* st = stateOf(comm);
  if (!st) return error(ncclInvalidArgument, std::string(function) + ": invalid or destroyed communicator");
  const size_t es = typeSize(type);
  auto* s = new Scratch{std::vector<char>(count * size_t(st->nranks) * es), static_cast<const char*>(send),
                        static_cast<char*>(recv), size_t(st->rank) * count * es, count * es, gather};
  if (gather && standin_cuda::fn().launchHostFunc(stream, scratchIn, s) != cudaSuccess) {
    delete s;
    return error(ncclUnhandledCudaError, std::string(function) + ": cannot enqueue on the stream");
  }
  const ncclResult_t r = enqueue(function, comm, gather ? s->buf.data() : send, s->buf.data(),
                                 count * size_t(st->nranks), type, op, -1, stream);
  if (r != ncclSuccess || standin_cuda::fn().launchHostFunc(stream, scratchOut, s) != cudaSuccess) {
    if (r != ncclSuccess && !gather) delete s;  // nothing on the stream refers to it
    return r != ncclSuccess ? r : error(ncclUnhandledCudaError, std::string(function) + ": cannot enqueue");
  }
  return ncclSuccess;
}

}  // namespace

extern "C" {

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const ncclResult_t r =
      scratchCollective("ncclReduceScatter", send, recv, recvcount, type, op, comm, stream, false);
  if (r == ncclSuccess) {
    ++gReduceScatterCalls;
    gReduceScatterElems += int64_t(recvcount) * comm->state->nranks;
  }
  return r;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  const ncclResult_t r =
      scratchCollective("ncclAllGather", send, recv, sendcount, type, ncclSum, comm, stream, true);
  if (r == ncclSuccess) {
    ++gAllGatherCalls;
    gAllGatherElems += int64_t(sendcount) * comm->state->nranks;
  }
  return r;
}

}  // extern "C"

// "ncclReduceScatter" / "ncclAllGather": calls enqueued in this process;
// "ncclReduceScatter_elems" / "ncclAllGather_elems": the elements of their
// whole buffers (count x nranks per call), summed; -1 otherwise.
SF_STANDIN_EXPORT int64_t sfStandinShardCounter(const char* name) {
  const std::string n = name ? name : "";
  if (n == "ncclReduceScatter") return gReduceScatterCalls;
  if (n == "ncclAllGather") return gAllGatherCalls;
  if (n == "ncclReduceScatter_elems") return gReduceScatterElems;
  if (n == "ncclAllGather_elems") return gAllGatherElems;
  return -1;
}
