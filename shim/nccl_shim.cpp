// Interposes ncclAllReduce, ncclGroupStart and ncclGroupEnd.
//
// A deferred call must still leave its local result in recvbuff, in stream
// order, on the device: it is computed by NCCL itself, as an all-reduce on a
// private one-rank communicator of the same device (a copy; for a sum,
// pre-multiplied by the world size with ncclRedOpCreatePreMulSum), so no
// kernel of our own and no CUDA call is needed. Inside a group (ncclGroupStart
// .. ncclGroupEnd) NCCL launches nothing before the outermost ncclGroupEnd and
// a communicator cannot be created, so deferred results are queued and
// launched right after it, on the host's streams.

#include <dlfcn.h>

#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "shim/forward.h"
#include "shim/nccl_abi.h"
#include "shim/shim_instance.h"

#define SF_SHIM_EXPORT extern "C" __attribute__((visibility("default")))

namespace sfshim {
namespace {

struct Nccl {
  ncclResult_t (*allReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*groupStart)();
  ncclResult_t (*groupEnd)();
  ncclResult_t (*commCount)(ncclComm_t, int*);
  ncclResult_t (*commUserRank)(ncclComm_t, int*);
  ncclResult_t (*commCuDevice)(ncclComm_t, int*);
  ncclResult_t (*getUniqueId)(ncclUniqueId*);
  ncclResult_t (*commInitRank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*preMulSum)(ncclRedOp_t*, void*, ncclDataType_t, int, ncclComm_t);
};

template <typename F>
void find(F& f, const char* name) {
  f = reinterpret_cast<F>(realSymbol(name, "libnccl.so.2"));
}

const Nccl& nccl() {
  static const Nccl n = [] {
    Nccl r{};
    find(r.allReduce, "ncclAllReduce");
    find(r.groupStart, "ncclGroupStart");
    find(r.groupEnd, "ncclGroupEnd");
    find(r.commCount, "ncclCommCount");
    find(r.commUserRank, "ncclCommUserRank");
    find(r.commCuDevice, "ncclCommCuDevice");
    find(r.getUniqueId, "ncclGetUniqueId");
    find(r.commInitRank, "ncclCommInitRank");
    find(r.preMulSum, "ncclRedOpCreatePreMulSum");
    return r;
  }();
  return n;
}

sf_dtype dtypeOf(ncclDataType_t t) {
  switch (t) {
    case kNcclFloat16: return SF_DTYPE_FLOAT16;
    case kNcclFloat32: return SF_DTYPE_FLOAT32;
    case kNcclFloat64: return SF_DTYPE_FLOAT64;
    case kNcclBfloat16: return SF_DTYPE_BFLOAT16;
    default: return SF_SHIM_DTYPE_OTHER;
  }
}

// A deferred call's local result, waiting for the end of the host's group.
struct LocalResult {
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t type;
  double factor;
  unsigned char scalar[8];
  ncclComm_t comm;
  cudaStream_t stream;
};

thread_local int tGroupDepth = 0;
thread_local std::vector<LocalResult> tQueued;

std::mutex gLocalMutex;                      // one-rank communicators are not thread-safe
std::map<int, ncclComm_t> gOneRank;          // by CUDA device
std::map<std::tuple<ncclComm_t, ncclDataType_t, double>, ncclRedOp_t> gScaleOps;
bool saidLocalFailure = false;

// The one-rank communicator on the device of `host`, created on first use
// (with that device current: the host's may differ in a multi-device process).
ncclResult_t oneRankComm(ncclComm_t host, ncclComm_t* out) {
  const Nccl& n = nccl();
  if (!n.commCuDevice || !n.getUniqueId || !n.commInitRank || !n.preMulSum) {
    return kNcclSystemError;
  }
  int device = 0;
  ncclResult_t r = n.commCuDevice(host, &device);
  if (r != kNcclSuccess) return r;
  auto it = gOneRank.find(device);
  if (it != gOneRank.end()) {
    *out = it->second;
    return kNcclSuccess;
  }
  using DeviceFn = int (*)(int*);
  using SetDeviceFn = int (*)(int);
  auto getDevice = reinterpret_cast<DeviceFn>(dlsym(RTLD_DEFAULT, "cudaGetDevice"));
  auto setDevice = reinterpret_cast<SetDeviceFn>(dlsym(RTLD_DEFAULT, "cudaSetDevice"));
  int previous = -1;
  if (getDevice && setDevice && getDevice(&previous) == 0 && previous != device) setDevice(device);
  ncclUniqueId id;
  ncclComm_t comm = nullptr;
  r = n.getUniqueId(&id);
  if (r == kNcclSuccess) r = n.commInitRank(&comm, 1, id, 0);
  if (previous >= 0 && previous != device) setDevice(previous);
  if (r != kNcclSuccess) return r;
  gOneRank[device] = comm;
  *out = comm;
  return kNcclSuccess;
}

ncclResult_t launch(const LocalResult& l) {
  if (l.factor == 1.0 && l.send == l.recv) return kNcclSuccess;  // already the result
  std::lock_guard<std::mutex> lock(gLocalMutex);
  ncclComm_t one = nullptr;
  ncclResult_t r = oneRankComm(l.comm, &one);
  if (r != kNcclSuccess) return r;
  ncclRedOp_t op = kNcclSum;
  if (l.factor != 1.0) {
    auto key = std::make_tuple(one, l.type, l.factor);
    auto it = gScaleOps.find(key);
    if (it == gScaleOps.end()) {
      unsigned char scalar[8];
      std::memcpy(scalar, l.scalar, sizeof scalar);
      r = nccl().preMulSum(&op, scalar, l.type, kNcclScalarHostImmediate, one);
      if (r != kNcclSuccess) return r;
      it = gScaleOps.emplace(key, op).first;
    }
    op = it->second;
  }
  return nccl().allReduce(l.send, l.recv, l.count, l.type, op, one, l.stream);
}

ncclResult_t launchOrQueue(const LocalResult& l) {
  ncclResult_t r = kNcclSuccess;
  if (tGroupDepth > 0) {
    tQueued.push_back(l);
  } else {
    r = launch(l);
  }
  if (r != kNcclSuccess) {
    sayOnce(saidLocalFailure,
            "could not write the local result of a deferred ncclAllReduce on a one-rank "
            "communicator; the call fails");
  }
  return r;
}

}  // namespace
}  // namespace sfshim

using namespace sfshim;

SF_SHIM_EXPORT ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                                          ncclDataType_t datatype, ncclRedOp_t op,
                                          ncclComm_t comm, cudaStream_t stream) {
  const Nccl& n = nccl();
  if (!n.allReduce) return kNcclSystemError;
  if (!pluginUsable() || calledFromPlugin(__builtin_return_address(0)) || !n.commCount) {
    return n.allReduce(sendbuff, recvbuff, count, datatype, op, comm, stream);
  }
  sf_shim_call call{};
  call.api = SF_SHIM_API_NCCL;
  call.dtype = dtypeOf(datatype);
  call.op = op == kNcclSum ? SF_SHIM_OP_SUM : op == kNcclAvg ? SF_SHIM_OP_AVERAGE : SF_SHIM_OP_OTHER;
  call.comm = comm;
  call.buffer = recvbuff;
  call.bytes = sf_shim_bytes(count, ncclTypeSize(datatype));
  call.rank = -1;
  if (n.commCount(comm, &call.world_size) != kNcclSuccess) call.world_size = 0;
  if (n.commUserRank) n.commUserRank(comm, &call.rank);

  std::string failure;
  const sf_shim_decision d = decide(call, &failure);
  if (d.action == SF_SHIM_FAIL) return kNcclInvalidUsage;  // SF_STRICT=1 (said by the policy)
  if (d.action != SF_SHIM_DEFER) {
    return n.allReduce(sendbuff, recvbuff, count, datatype, op, comm, stream);
  }
  LocalResult l{sendbuff, recvbuff, count, datatype, d.factor, {}, comm, stream};
  std::memcpy(l.scalar, d.factor_scalar, sizeof l.scalar);
  return launchOrQueue(l);
}

SF_SHIM_EXPORT ncclResult_t ncclGroupStart() {
  const Nccl& n = nccl();
  if (!n.groupStart) return kNcclSystemError;
  const ncclResult_t r = n.groupStart();
  if (r == kNcclSuccess) ++tGroupDepth;
  return r;
}

SF_SHIM_EXPORT ncclResult_t ncclGroupEnd() {
  const Nccl& n = nccl();
  if (!n.groupEnd) return kNcclSystemError;
  ncclResult_t r = n.groupEnd();
  if (tGroupDepth > 0) --tGroupDepth;
  if (tGroupDepth == 0 && !tQueued.empty()) {
    std::vector<LocalResult> queued;
    queued.swap(tQueued);
    for (const LocalResult& l : queued) {
      const ncclResult_t q = launchOrQueue(l);
      if (r == kNcclSuccess) r = q;
    }
  }
  return r;
}
