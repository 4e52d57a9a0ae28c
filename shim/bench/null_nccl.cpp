// A NULL NCCL for sfsync-shim-bench only: every function the shim calls
// returns at once and does nothing, so that the bench times the shim alone.
// Not NCCL, not a stand-in for tests (tests/standin is).

#include <cstring>

#include "shim/nccl_abi.h"

#define NULL_NCCL extern "C" __attribute__((visibility("default")))

namespace {
char gComm;
}

NULL_NCCL ncclResult_t ncclAllReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                     ncclComm_t, cudaStream_t) {
  return 0;
}
NULL_NCCL ncclResult_t ncclGroupStart() { return 0; }
NULL_NCCL ncclResult_t ncclGroupEnd() { return 0; }
NULL_NCCL ncclResult_t ncclCommCount(ncclComm_t, int* count) {
  *count = 2;
  return 0;
}
NULL_NCCL ncclResult_t ncclCommUserRank(ncclComm_t, int* rank) {
  *rank = 0;
  return 0;
}
NULL_NCCL ncclResult_t ncclCommCuDevice(ncclComm_t, int* device) {
  *device = 0;
  return 0;
}
NULL_NCCL ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof *id);
  return 0;
}
NULL_NCCL ncclResult_t ncclCommInitRank(ncclComm_t* comm, int, ncclUniqueId, int) {
  *comm = reinterpret_cast<ncclComm_t>(&gComm);
  return 0;
}
NULL_NCCL ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void*, ncclDataType_t, int,
                                                ncclComm_t) {
  *op = 5;
  return 0;
}
