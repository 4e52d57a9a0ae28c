#pragma once
// The facts the interposers (shim/gloo_shim.cpp, shim/nccl_shim.cpp) extract
// from one intercepted all-reduce, and the decision ShimPolicy returns for
// it. Internal to libsfsync_shim.so: nothing here is exported.

#include <cstdint>

#include "sfsync.h"

typedef int32_t sf_shim_api;
#define SF_SHIM_API_GLOO 0 /* gloo::allreduce(const gloo::AllreduceOptions&) */
#define SF_SHIM_API_NCCL 1 /* ncclAllReduce */

/** dtype of a call whose elements are not float32/64/16 or bfloat16
 *  (integers, bool, fp8, unknown): never a gradient. */
#define SF_SHIM_DTYPE_OTHER (-1)

typedef int32_t sf_shim_op;
#define SF_SHIM_OP_SUM 0
#define SF_SHIM_OP_AVERAGE 1
#define SF_SHIM_OP_OTHER 2 /* max, min, product, bitwise, pre-multiplied sum, unknown */

/** The facts of one interposed all-reduce. */
struct sf_shim_call {
  sf_shim_api api;
  sf_dtype dtype;       /* an sf_dtype, or SF_SHIM_DTYPE_OTHER */
  sf_shim_op op;
  int32_t world_size;   /* ranks of the host's communicator */
  int32_t rank;         /* this process's rank in it; -1 if unknown */
  int32_t reserved;     /* 0 */
  const void* comm;     /* the host's communicator (identity only, never dereferenced) */
  const void* buffer;   /* the output buffer (identity only, never dereferenced) */
  int64_t bytes;        /* size of the output buffer */
};

/** count x element size as sf_shim_call.bytes; -1 when it does not fit an
 *  int64 (finding F2): such a call is never a gradient and counts 0 bytes,
 *  it passes to the real library, which judges it. */
inline int64_t sf_shim_bytes(uint64_t count, uint64_t element_size) {
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(count, element_size, &bytes) || bytes > uint64_t(INT64_MAX)) return -1;
  return int64_t(bytes);
}

typedef int32_t sf_shim_action;
#define SF_SHIM_PASS 0  /* forward the call unchanged */
#define SF_SHIM_DEFER 1 /* send nothing; the output becomes factor x input */
#define SF_SHIM_FAIL 2  /* SF_STRICT=1 and a misuse became visible at this call: fail
                           it with ShimPolicy::failure() */

struct sf_shim_decision {
  sf_shim_action action;
  int32_t reserved;
  /** DEFER: the local result "as if every rank held my values" is
   *  factor x input: the world size for a sum, 1 for an average. */
  double factor;
  /** factor encoded in the call's dtype (2, 4 or 8 bytes, little end first),
   *  as ncclRedOpCreatePreMulSum wants its scalar. */
  unsigned char factor_scalar[8];
  /** The window the call belongs to (1, 2, ...; 0 outside any). */
  int64_t window;
};
