#pragma once
// The part of NCCL's C ABI (nccl.h, NCCL 2.x) that the shim touches, so that
// the shim builds without CUDA or NCCL headers. Values are NCCL's own, which
// NCCL never renumbers.

#include <cstddef>

extern "C" {
typedef struct ncclComm* ncclComm_t;
typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef void* cudaStream_t;
typedef struct {
  char internal[128];
} ncclUniqueId;
}

namespace sfshim {

constexpr ncclResult_t kNcclSuccess = 0;
constexpr ncclResult_t kNcclSystemError = 2;
constexpr ncclResult_t kNcclInternalError = 3;
constexpr ncclResult_t kNcclInvalidUsage = 5;

constexpr ncclDataType_t kNcclFloat16 = 6;
constexpr ncclDataType_t kNcclFloat32 = 7;
constexpr ncclDataType_t kNcclFloat64 = 8;
constexpr ncclDataType_t kNcclBfloat16 = 9;

constexpr ncclRedOp_t kNcclSum = 0;
constexpr ncclRedOp_t kNcclAvg = 4;

constexpr int kNcclScalarHostImmediate = 1;

// Bytes per element of every NCCL type (int8 .. fp8); 0 if unknown.
inline size_t ncclTypeSize(ncclDataType_t t) {
  switch (t) {
    case 0: case 1: case 10: case 11: return 1;  // int8, uint8, fp8 e4m3, fp8 e5m2
    case 2: case 3: return 4;                     // int32, uint32
    case 4: case 5: return 8;                     // int64, uint64
    case 6: case 9: return 2;                     // float16, bfloat16
    case 7: return 4;                             // float32
    case 8: return 8;                             // float64
    default: return 0;
  }
}

}  // namespace sfshim
