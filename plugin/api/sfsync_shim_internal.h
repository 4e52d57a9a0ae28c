/*
 * INTERNAL: the interface between libsfsync_shim.so (the LD_PRELOAD
 * interposer, shim/) and libsfsync.so. Not part of the public ABI and not
 * installed: the two libraries are built together, and the shim refuses to
 * defer anything when sf_shim_interface_version() differs from the version it
 * was built with.
 *
 * The shim only extracts facts from an interposed call (element type,
 * reduction, bytes, the host communicator's world size) and forwards. Every
 * decision is made behind these functions: whether the call is a gradient
 * all-reduce, whether it is sent or deferred (the accumulation window of the
 * default context, or SF_ACCUMULATION_STEPS), the local result of a deferred
 * call, the accounting, the unsynchronized-window guard and the report.
 *
 * Conventions of include/sfsync.h apply: sf_status results, sf_last_error()
 * on failure, nothing thrown across. Every function is thread-safe.
 */
#ifndef SFSYNC_SHIM_INTERNAL_H
#define SFSYNC_SHIM_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "sfsync.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Bumped whenever a struct or function below changes. */
#define SF_SHIM_INTERFACE_VERSION 1

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
typedef struct sf_shim_call {
  sf_shim_api api;
  sf_dtype dtype;       /* an sf_dtype, or SF_SHIM_DTYPE_OTHER */
  sf_shim_op op;
  int32_t world_size;   /* ranks of the host's communicator */
  int32_t rank;         /* this process's rank in it; -1 if unknown */
  int32_t reserved;     /* 0 */
  const void* comm;     /* the host's communicator (identity only, never dereferenced) */
  const void* buffer;   /* the output buffer (identity only, never dereferenced) */
  int64_t bytes;        /* size of the output buffer */
} sf_shim_call;

typedef int32_t sf_shim_action;
#define SF_SHIM_PASS 0  /* forward the call unchanged */
#define SF_SHIM_DEFER 1 /* send nothing; the output becomes factor x input */
#define SF_SHIM_FAIL 2  /* SF_STRICT=1 and a window was never synchronized: fail the
                           call with the message in sf_last_error() */

typedef struct sf_shim_decision {
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
} sf_shim_decision;

/** @return SF_SHIM_INTERFACE_VERSION of the loaded libsfsync.so. */
SF_API int32_t sf_shim_interface_version(void);

/**
 * Decide what to do with one interposed all-reduce and account for it.
 * The first call reads the configuration (SF_ACCUMULATION_STEPS,
 * SF_SHIM_MIN_BYTES, SF_STRICT, SF_SHIM_REPORT) and binds to
 * sf_default_context. On any failure other than SF_SHIM_FAIL the shim
 * passes the call through.
 */
SF_API sf_status sf_shim_decide(const sf_shim_call* call, sf_shim_decision* out);

/** A host reduction function, called as invoke(state, out, a, b, n):
 *  out[i] = reduce(a[i], b[i]) for n elements. */
typedef void (*sf_shim_reduce_fn)(void* state, void* out, const void* a, const void* b,
                                  size_t n);

/**
 * Classify a reduction function whose element type the API does not state
 * (Gloo's AllreduceOptions carry only a function and an element size): it is
 * probed with known inputs (a few elements on private buffers; an exception
 * thrown by it means "other"). The result is cached under `identity` (e.g. the
 * address of a plain function; NULL: not cached).
 * @param dtype receives the float type it sums, or SF_SHIM_DTYPE_OTHER.
 * @param op receives SF_SHIM_OP_SUM or SF_SHIM_OP_OTHER.
 */
SF_API sf_status sf_shim_classify_reduce(const void* identity, int64_t element_size,
                                         sf_shim_reduce_fn invoke, void* state, sf_dtype* dtype,
                                         sf_shim_op* op);

/** Write the local result of a deferred call in host memory:
 *  out[i] = factor x in[i] (in == out allowed). */
SF_API sf_status sf_shim_local_result(void* out, const void* in, int64_t numel, sf_dtype dtype,
                                      double factor);

/**
 * At exit: report a window that was left with deferred gradients and never
 * synchronized, and write SF_SHIM_REPORT. Idempotent; does nothing in a
 * process that never called sf_shim_decide.
 * @return SF_ERR_INVALID_STATE when SF_STRICT=1 and a window was never
 *         synchronized (the shim then ends the process with status 1).
 */
SF_API sf_status sf_shim_finish(void);

/**
 * The report as JSON (what SF_SHIM_REPORT receives), NUL-terminated, for
 * tests and tools. Writes at most `capacity` bytes; `length` (optional)
 * receives the full length without the NUL. "{}" before the first decision.
 */
SF_API sf_status sf_shim_report_json(char* buffer, int64_t capacity, int64_t* length);

#ifdef __cplusplus
}
#endif

#endif /* SFSYNC_SHIM_INTERNAL_H */
