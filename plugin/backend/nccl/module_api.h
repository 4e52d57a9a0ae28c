/*
 * The interface between libsfsync.so and its NCCL backend module,
 * libsfsync_nccl.so: one table of plain C functions. libsfsync.so links
 * neither CUDA nor NCCL; it dlopens the module only when CUDA gradients or
 * backend = nccl are asked for. The module links neither either: its entry
 * point dlopens libcudart.so.13 and libnccl.so.2 (the host's copies if
 * already loaded) and resolves what it calls.
 *
 * Nothing but C types crosses: every function returns an sf_status (SF_OK or
 * an SF_ERR_* code of sfsync.h) and, on failure, writes a NUL-terminated
 * message into `err`. No C++ exception or type crosses (typeinfo differs
 * between the two hidden-visibility libraries). CUDA streams and NCCL
 * communicators travel as void*.
 *
 * Threads: a device and its communicator may be used from several threads,
 * but not concurrently (libsfsync.so serializes calls per context).
 */
#ifndef SFSYNC_NCCL_MODULE_API_H
#define SFSYNC_NCCL_MODULE_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SFN_ABI_VERSION 1
#define SFN_UNIQUE_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */
#define SFN_ENTRY_POINT "sf_nccl_module_api"

typedef struct sfn_error {
  char message[1024];
} sfn_error;

/* One GPU as sfsync uses it: the plugin's own (non-blocking) stream, the
 * host's stream (default: the legacy default stream), memory operations. */
typedef struct sfn_device sfn_device;
/* An NCCL communicator on a device, created here or adopted from the host. */
typedef struct sfn_comm sfn_comm;
/* One collective in flight. */
typedef struct sfn_work sfn_work;

typedef struct sfn_api {
  uint32_t abi_version; /* SFN_ABI_VERSION */
  uint32_t struct_size; /* sizeof(sfn_api) of the module */

  /* CUDA runtime and NCCL versions and the number of visible GPUs.
   * SF_ERR_UNSUPPORTED, naming the CUDA error, if none can be used. */
  int32_t (*probe)(int32_t* device_count, int32_t* cuda_runtime_version,
                   int32_t* nccl_version, sfn_error* err);

  /* Open `device`: creates the plugin's stream. */
  int32_t (*device_open)(int32_t device, sfn_device** out, sfn_error* err);
  /* Waits for nothing; the device's collectives must be finished. */
  void (*device_close)(sfn_device* dev);
  /* The stream (cudaStream_t, NULL = legacy default stream) on which the host
   * produces and reads gradients. */
  void (*set_host_stream)(sfn_device* dev, void* stream);

  /* Device memory of `bytes` bytes, zeroed when this returns. */
  int32_t (*mem_alloc)(sfn_device* dev, size_t bytes, void** out, sfn_error* err);
  void (*mem_free)(sfn_device* dev, void* p);
  /* Ordered on the host's stream: after what the host queued, before what
   * it queues next and before the next collective's start. */
  int32_t (*mem_copy)(sfn_device* dev, void* dst, const void* src, size_t bytes, sfn_error* err);
  int32_t (*mem_zero)(sfn_device* dev, void* p, size_t bytes, sfn_error* err);
  /* SF_ERR_INVALID_ARGUMENT unless `p .. p + bytes` is memory of `dev`. */
  int32_t (*check_pointer)(sfn_device* dev, const void* p, size_t bytes, sfn_error* err);

  /* ncclGetUniqueId. */
  int32_t (*unique_id)(uint8_t id[SFN_UNIQUE_ID_BYTES], sfn_error* err);
  /* ncclCommInitRankConfig (non-blocking), bounded by timeout_ms: on expiry
   * the communicator is aborted and SF_ERR_TIMEOUT returned. */
  int32_t (*comm_init)(sfn_device* dev, const uint8_t id[SFN_UNIQUE_ID_BYTES], int32_t world_size,
                       int32_t rank, int64_t timeout_ms, sfn_comm** out, sfn_error* err);
  /* Rank, size and device of a host's ncclComm_t, without adopting it. */
  int32_t (*comm_query)(void* nccl_comm, int32_t* world_size, int32_t* rank, int32_t* device,
                        sfn_error* err);
  /* Use the host's communicator; comm_free never destroys it. */
  int32_t (*comm_adopt)(sfn_device* dev, void* nccl_comm, int64_t timeout_ms, sfn_comm** out,
                        sfn_error* err);
  /* Destroys an own communicator within timeout_ms: ncclCommFinalize,
   * polled until it settles, then ncclCommDestroy; ncclCommAbort if it
   * failed or at the deadline. An adopted one is left to the host unless a
   * timeout aborted it. */
  void (*comm_free)(sfn_comm* comm, int64_t timeout_ms);

  /* In-place all-reduce of `numel` elements (sf_dtype) at `data` on the
   * plugin's stream, after everything the host queued on its stream so far:
   * average (ncclAvg) when postscale == 1/world_size and prescale == 1, sum
   * when both are 1, else a pre-multiplied sum by prescale * postscale. The
   * scales apply to the first `scaled_numel` elements (-1: all); the rest
   * (the window check's two elements) are summed unscaled, in the same
   * NCCL group. */
  int32_t (*allreduce_start)(sfn_comm* comm, void* data, int64_t numel, int64_t scaled_numel,
                             int32_t dtype, double prescale, double postscale, sfn_work** out,
                             sfn_error* err);
  /* Wait (polling, never blocking the device) until the work is done, then
   * order the host's stream after it. An NCCL asynchronous error or the
   * timeout aborts the communicator (SF_ERR_BACKEND / SF_ERR_TIMEOUT).
   * Frees the work in every case. */
  int32_t (*work_wait)(sfn_work* work, int64_t timeout_ms, sfn_error* err);

  /* Blocking elementwise max of `n` int64 values in host memory. */
  int32_t (*allreduce_max_int64)(sfn_comm* comm, int64_t* data, int64_t n, int64_t timeout_ms,
                                 sfn_error* err);

  /* Small values (at most 256 bytes; the window check's two elements, a
   * weighted window's limbs): mem_write copies host memory at `src` to device
   * memory at `dst` on the host's stream through pinned staging (`src` may be
   * reused at once; since 0.4 each write stages in a slot of its own until
   * its copy ran, so several may precede their collectives);
   * mem_read copies device memory at `src` on the host's stream into host
   * memory at `dst` and waits for that copy alone, bounded by timeout_ms. */
  int32_t (*mem_write)(sfn_device* dev, void* dst, const void* src, size_t bytes, sfn_error* err);
  int32_t (*mem_read)(sfn_device* dev, void* dst, const void* src, size_t bytes, int64_t timeout_ms,
                      sfn_error* err);

  /* ---- Since 0.3 (sharded windows), appended ---- */
  /* In-place reduce-scatter: `data` holds world_size segments of
   * `segment_numel` elements; afterwards segment `rank` holds the reduction
   * (the operator chosen as allreduce_start's, on every element: a reserved
   * tail is scaled too) of every rank's segment `rank` (ncclReduceScatter
   * with recvbuff = data + rank * segment: NCCL's in-place rule). Ordered
   * and waited for as allreduce_start's work. Segments with padding: the
   * *_used_start entries below (since 0.5). */
  int32_t (*reduce_scatter_start)(sfn_comm* comm, void* data, int64_t segment_numel, int32_t dtype,
                                  double prescale, double postscale, sfn_work** out, sfn_error* err);
  /* In-place all-gather: segment `rank` of `data` to every rank
   * (ncclAllGather with sendbuff = data + rank * segment). */
  int32_t (*allgather_start)(sfn_comm* comm, void* data, int64_t segment_numel, int32_t dtype,
                             sfn_work** out, sfn_error* err);

  /* ---- Since 0.4 (weighted windows), appended ---- */
  /* Multiply `numel` elements (sf_dtype) at `data` by `factor` in place, on
   * the plugin's stream after everything queued there so far (the bucket's
   * sum) and after what the host queued on its stream: ncclAllReduce with a
   * pre-multiplied sum on a one-rank communicator of the same device (NCCL's
   * own kernel; made at the first call). Waited for as a collective's work
   * (work_wait orders the host's stream after it). mem_write may be called
   * several times before the collectives that read it (each write stages in
   * pinned memory of its own). */
  int32_t (*scale_start)(sfn_comm* comm, void* data, int64_t numel, int32_t dtype, double factor,
                         sfn_work** out, sfn_error* err);

  /* ---- Since 0.5 (uneven shards), appended; a caller checks struct_size ---- */
  /* reduce_scatter_start moving only what each segment holds: `used`
   * (world_size values, each at most the data end, read during the call)
   * says how many leading elements of segment r hold data. Afterwards
   * segment `rank` holds, in its first used[rank] elements, the reduction
   * (the operator chosen as allreduce_start's) of every rank's; its
   * elements from scaled_numel to the segment's end (a reserved tail;
   * scaled_numel -1: none) the unscaled sum; the elements between
   * (padding) are not moved and keep their values, as every other segment
   * does. One NCCL group of ncclReduce calls, root r over segment r, in
   * place; segments with nothing to move are skipped. Ordered and waited
   * for as allreduce_start's work. */
  int32_t (*reduce_scatter_used_start)(sfn_comm* comm, void* data, int64_t segment_numel,
                                       int64_t scaled_numel, const int64_t* used, int32_t dtype,
                                       double prescale, double postscale, sfn_work** out,
                                       sfn_error* err);
  /* allgather_start moving only the first used[r] elements of segment r
   * (each at most segment_numel) from rank r to every rank; the rest of
   * each segment is not moved. One NCCL group of ncclBroadcast calls,
   * root r, in place; empty segments skipped. */
  int32_t (*allgather_used_start)(sfn_comm* comm, void* data, int64_t segment_numel,
                                  const int64_t* used, int32_t dtype, sfn_work** out,
                                  sfn_error* err);
} sfn_api;

/* The module's entry point: loads the CUDA runtime and NCCL (first call) and
 * returns its table, or NULL if it does not provide `abi_version` or if they
 * cannot be loaded. */
typedef const sfn_api* (*sfn_entry_fn)(uint32_t abi_version);

/* Its second export, asked after the entry point returned NULL: why the CUDA
 * runtime or NCCL could not be loaded ("" if that was not the reason: then
 * the interface version differs). Valid until the next entry point call. */
#define SFN_INIT_ERROR_ENTRY "sf_nccl_module_init_error"
typedef const char* (*sfn_init_error_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* SFSYNC_NCCL_MODULE_API_H */
