/*
 * sfsync: data-parallel gradient synchronization exactly once per
 * gradient-accumulation window.
 *
 * This is the whole public ABI. It is plain C99 (also valid C++), includes no
 * CUDA, NCCL or Gloo header, and only grows: status codes and enum values are
 * never renumbered, structs that carry a `struct_size` only grow at the end.
 *
 * Conventions for every function below unless its comment says otherwise:
 *  - The return value is an sf_status; SF_OK (0) means success. On failure the
 *    calling thread's sf_last_error() names the function, the argument and the
 *    value at fault, and out-parameters are left untouched.
 *  - No exception, abort or exit crosses this boundary.
 *  - A context may be used from several threads; sf_grad_ready may be
 *    called from any thread (e.g. autograd hooks). Since 0.5 the window
 *    calls (sf_begin_accumulation, sf_end_accumulation, sf_synchronize,
 *    sf_synchronize_start, sf_zero_gradients, sf_restore_windows,
 *    sf_gather_gradients) may come from several threads at once: they are
 *    served one at a time per context, each seeing the window before or
 *    after another thread's call, never in between (which goes first is the
 *    scheduler's choice: a call that is wrong in the order it got is refused
 *    with SF_ERR_INVALID_STATE as from one thread; two sf_synchronize calls
 *    at once synchronize once, see sf_synchronize). sf_get_stats,
 *    sf_in_accumulation and sf_bucket_info (since 0.5 also sf_bucket_state
 *    and sf_window_state) may run beside any of them.
 *    Before 0.5 the window calls had to come from one thread at a time.
 *    Registration must not race with the window calls, and sf_destroy with
 *    no call on the same context at all (see sf_destroy).
 *    The first use of a context whose buckets are not built yet may come
 *    from many threads at once (sf_grad_ready, sf_gradient_data,
 *    sf_build_buckets, sf_zero_gradients, sf_synchronize, sf_bucket_info,
 *    sf_get_stats): the buckets are built once (since 0.2).
 *  - Sizes and counts are 64-bit; byte sizes are in bytes, caps in MiB
 *    (1 MiB = 1048576 bytes, the unit of PyTorch DDP's bucket_cap_mb).
 */
#ifndef SFSYNC_H
#define SFSYNC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define SF_API
#else
#define SF_API __attribute__((visibility("default")))
#endif

/* ---- Versions ----------------------------------------------------------- */

#define SF_VERSION_MAJOR 0
#define SF_VERSION_MINOR 4
#define SF_VERSION_PATCH 0
/** MAJOR * 10000 + MINOR * 100 + PATCH; compare with sf_version_number(). */
#define SF_VERSION_NUMBER (SF_VERSION_MAJOR * 10000 + SF_VERSION_MINOR * 100 + SF_VERSION_PATCH)
/** Bumped only when an existing function or struct prefix changes meaning. */
#define SF_ABI_VERSION 1

/** @return SF_ABI_VERSION of the loaded library. A host that dlopens the
 *  library compares it with the value it was written against. Since 0.1. */
SF_API int32_t sf_abi_version(void);
/** @return SF_VERSION_NUMBER of the loaded library. Since 0.1. */
SF_API int32_t sf_version_number(void);
/** @return "MAJOR.MINOR.PATCH", static storage. Since 0.1. */
SF_API const char* sf_version_string(void);

/* ---- Status and errors -------------------------------------------------- */

typedef int32_t sf_status;
#define SF_OK 0
#define SF_ERR_INVALID_ARGUMENT 1 /* a NULL, out-of-range or malformed argument */
#define SF_ERR_INVALID_STATE 2    /* a call at the wrong time (window misuse, late registration) */
#define SF_ERR_MISMATCH 3         /* ranks disagree (gradient layout, world size, replicas, who holds a rank) */
#define SF_ERR_BACKEND 4          /* the transport failed (peer lost, connection refused) */
#define SF_ERR_TIMEOUT 5          /* a collective or rendezvous outlived timeout_ms */
#define SF_ERR_UNSUPPORTED 6      /* not available in this build or on this machine */
#define SF_ERR_OUT_OF_MEMORY 7    /* an allocation failed */
#define SF_ERR_INTERNAL 8         /* a bug in sfsync: please report it */

/** @return a static, human-readable description of `status` that says what
 *  to do next; "unknown status" for values this version does not know. */
SF_API const char* sf_status_string(sf_status status);

/** @return the message of the last failed sfsync call on this thread ("" if
 *  none). Valid until the next sfsync call on the same thread. */
SF_API const char* sf_last_error(void);

/* ---- Enumerations (int32 values, never renumbered) --------------------- */

typedef int32_t sf_dtype;
#define SF_DTYPE_FLOAT32 0
#define SF_DTYPE_FLOAT64 1
#define SF_DTYPE_FLOAT16 2
#define SF_DTYPE_BFLOAT16 3

typedef int32_t sf_device;
#define SF_DEVICE_HOST 0 /* host memory: Gloo */
#define SF_DEVICE_CUDA 1 /* CUDA device memory: NCCL */

typedef int32_t sf_reduce_op;
#define SF_REDUCE_AVERAGE 0 /* sum / world_size (default, as DDP) */
#define SF_REDUCE_SUM 1     /* plain sum */
#define SF_REDUCE_PRESCALED_SUM 2 /* sum of (prescale * gradient), e.g. 1 / global token count */
#define SF_REDUCE_WEIGHTED 3 /* sum / (the window's global weight): see "Weighted windows".
                                Since 0.4 */

typedef int32_t sf_backend;
#define SF_BACKEND_AUTO 0 /* NCCL for device gradients, Gloo for host gradients */
#define SF_BACKEND_GLOO 1
#define SF_BACKEND_NCCL 2

/* ---- Options ------------------------------------------------------------ */

/** Size of the rendezvous string field, terminating NUL included. */
#define SF_RENDEZVOUS_MAX 256

/**
 * Context options. Fill with sf_options_init(&o, sizeof o) and change what
 * you need; never initialize by hand (fields are only ever appended).
 */
typedef struct sf_options {
  uint64_t struct_size;     /* sizeof(sf_options) as the caller knows it */
  int32_t rank;             /* this process's rank; env RANK (default 0), or (since 0.3) the
                               launcher's: SF_RANK > RANK > OMPI_COMM_WORLD_RANK > PMI_RANK >
                               SLURM_PROCID (docs/launchers.md) */
  int32_t world_size;       /* number of ranks; env WORLD_SIZE (default 1), or the launcher's:
                               SF_WORLD_SIZE, OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS */
  int32_t local_rank;       /* rank on this machine (GPU local_rank % visible GPUs); env LOCAL_RANK (default 0), or
                               SF_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID,
                               SLURM_LOCALID */
  sf_backend backend;       /* env SF_BACKEND = auto|gloo|nccl (default auto) */
  sf_reduce_op reduce_op;   /* env SF_REDUCE = average|sum|prescaled_sum|weighted (default average) */
  int32_t reserved0;        /* must be 0 */
  double prescale;          /* factor for SF_REDUCE_PRESCALED_SUM; env SF_PRESCALE (default 1) */
  double bucket_cap_mb;     /* bucket cap in MiB; env SF_BUCKET_CAP_MB (default 25; since 0.5
                               a sharded context that keeps the default builds with the
                               sharded default: sf_set_bucket_cap_mb) */
  double first_bucket_cap_mb; /* the first bucket closes once it holds this much (since 0.2,
                                 DDP's rule: it takes a large last-layer weight and starts
                                 during the backward), never past max(this, bucket_cap_mb);
                                 env SF_FIRST_BUCKET_CAP_MB (default 1) */
  int64_t timeout_ms;       /* every collective and rendezvous; env SF_TIMEOUT_MS (default 300000).
                               Values above 2^40 ms (about 34.8 years; INT64_MAX is a common
                               "forever") are clamped to 2^40 ms by sf_options_init and
                               sf_create (since 0.2; sf_get_options shows the clamped value). */
  /** Where ranks meet; env SF_RENDEZVOUS, else "env://" when MASTER_ADDR is
   *  set, else (since 0.3, world_size > 1) the launcher's meeting point:
   *  "mpi://" under mpirun/mpiexec, "tcp://FIRST_HOST:PORT" under srun;
   *  else "" (only valid for world_size 1: sf_create then fails naming the
   *  launcher's variables). Forms:
   *    "env://"            a TCP store served by rank 0 on MASTER_ADDR:MASTER_PORT
   *    "tcp://host:port"   the same store at host:port (since 0.3)
   *    "mpi://"            the same store, rank 0's host and a free port
   *                        broadcast through MPI (libmpi loaded with dlopen
   *                        at the first connect; MPI_Init_thread unless MPI is
   *                        initialized; SF_MPI_LIBRARY; since 0.3)
   *    "file:///dir"       one file per key in a fresh directory (one per job)
   *    "redis://host:port[/prefix]"  a Redis server (one prefix per job)
   *    "memory://name"     an in-process store: ranks are threads of one process
   *  Every rendezvous wait ends within timeout_ms (+ at most 2 s): SF_ERR_TIMEOUT
   *  or SF_ERR_BACKEND naming what was waited for. Keys are written once and
   *  each rank is claimed once: a reused directory, prefix or live memory://
   *  name, or two processes with the same rank, is SF_ERR_MISMATCH (since 0.2).
   *  env://: with SF_AUTH_TOKEN or SF_AUTH_TOKEN_FILE set (the same on every
   *  rank; sfsync-run sets one), rank 0's store admits only clients that prove
   *  they know it; a client without it, or with another, gets SF_ERR_BACKEND
   *  (since 0.2). */
  char rendezvous[SF_RENDEZVOUS_MAX];
  /** Since 0.2. Bucket collectives that may be on the wire at once (Gloo:
   *  one worker thread per lane, all lanes sharing one connection per peer,
   *  as ProcessGroupGloo's threads do, each collective with its own tag; a
   *  bucket over 8 MiB travels as pieces of at most 8 MiB; the n-th piece
   *  started goes to lane n mod max_inflight on every rank, each lane keeps
   *  its order). 1..16; env SF_MAX_INFLIGHT (default 4). Older callers'
   *  structs get the default. The NCCL backend ignores it. */
  int32_t max_inflight;
  /** Since 0.2. How float32 buckets travel (Gloo): SF_DTYPE_FLOAT32 (0, the
   *  default: as they are), SF_DTYPE_BFLOAT16 or SF_DTYPE_FLOAT16 (half the
   *  bytes: every partial sum is computed in float32 and rounded back to 16
   *  bits, the result is widened to float32 before averaging). Since 0.5 a
   *  rank's own values are never rounded on their own: each rank adds its
   *  float32 values to the 16-bit partial sum it receives and rounds that
   *  sum once (a ring reduce-scatter, then an all-gather of the 16-bit
   *  sums), N roundings per element where 0.2-0.4 made 2N - 1; every rank
   *  still gets the same bits. Other dtypes' buckets are unaffected.
   *  env SF_WIRE_DTYPE = native|bf16|fp16. Error bound for N ranks, per
   *  element, against the exact sum S of the inputs x_1..x_N:
   *    |result - S| <= (N + 1) * u * sum_i |x_i|   (+ N * 2^-24 for fp16)
   *  with u = 2^-8 (bf16) or 2^-11 (fp16); for same-signed inputs that is a
   *  relative error of at most (N + 1) * u. At N = 2 (since 0.5) the
   *  result is round(x_own + round(x_other)), x_own the value of the rank
   *  that owns the element's segment:
   *    |result - S| <= u * (max_i |x_i| + |S|)   (+ 2^-24 for fp16)
   *  plus float32's rounding of the sum, so nearly cancelling inputs keep
   *  one input's rounding, not two. fp16 overflows to inf above
   *  65504 (scale with SF_REDUCE_PRESCALED_SUM); bf16 keeps float32's range.
   *  Averaging divides after widening (exact up to float32 rounding). */
  sf_dtype wire_dtype;
  /** Since 0.3. SF_SHARD_NONE (0, the default: every rank receives every
   *  reduced gradient, as 0.2), SF_SHARD_FLAT or SF_SHARD_PARAMETER: see
   *  "Sharded windows" below. env SF_SHARD = none|flat|parameter. Older
   *  callers' structs get the default. */
  int32_t shard_layout;
  /** Since 0.3. Must be 0. */
  int32_t reserved1;
} sf_options;

/**
 * Fill `opts` with the defaults, then apply the SF_* and torchrun
 * environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
 * MASTER_PORT). Since 0.3 also the other launchers' (SF_RANK..., Open MPI,
 * MPICH/Intel MPI's PMI, Slurm: the first group set wins, docs/launchers.md
 * "Launchers") and their meeting point (rendezvous). A group with only its
 * rank or only its size, a non-number, or a rank not below the size is
 * SF_ERR_INVALID_ARGUMENT naming the variables and values.
 * Writes min(struct_size, sizeof(sf_options)) bytes.
 * @param struct_size the caller's sizeof(sf_options); smaller than the
 *        version-1 size is SF_ERR_INVALID_ARGUMENT.
 * @return SF_ERR_INVALID_ARGUMENT for a NULL `opts` or an environment
 *         variable that does not parse (the message names it); the struct
 *         then holds the defaults and every valid variable.
 */
SF_API sf_status sf_options_init(sf_options* opts, uint64_t struct_size);

/* ---- Context ------------------------------------------------------------ */

/** Opaque handle: one data-parallel group with its gradients and window. */
typedef struct sf_context sf_context;

/**
 * Create a context. Does not connect to peers: that happens on the first
 * synchronization that needs them.
 * @param opts options filled by sf_options_init, or NULL for the defaults
 *        and environment. Copied; the caller keeps ownership.
 * @param out receives the new context; release it with sf_destroy.
 */
SF_API sf_status sf_create(const sf_options* opts, sf_context** out);

/** Destroy a context (NULL accepted and ignored). Waits for collectives in
 *  flight (bounded by the timeout). Since 0.3 it issues no collective: with
 *  NCCL the ranks say goodbye through the rendezvous store (each waits at
 *  most min(timeout_ms, 10 s) for the others), then the communicator is
 *  finalized and aborted if that does not settle within what is left of the
 *  same timeout_ms: the teardown ends within timeout_ms (+ 2 s slack).
 *  Never fails; the default context must not
 *  be passed here (it is ignored). Since 0.2 it never creates the default
 *  context and leaves sf_last_error() unchanged.
 *  It frees the handle, as free() does: it must be the last call on `ctx`,
 *  made once every other thread's call on `ctx` (sf_synchronize,
 *  sf_grad_ready, ...) has returned and none can start; a call that runs
 *  beside it or after it is undefined behaviour. Join (or otherwise wait
 *  for) the threads that use the context first. */
SF_API void sf_destroy(sf_context* ctx);

/**
 * The process-wide default context, created from the environment on first
 * use (thread-safe). It succeeds without RANK/WORLD_SIZE (then world size 1)
 * and connects to peers only when first asked to synchronize gradients of its
 * own. Owned by the library; lives until exit. Since 0.3 a launcher that says
 * the world is larger than one, with no meeting point, is
 * SF_ERR_INVALID_ARGUMENT naming its variables (never a world of one).
 */
SF_API sf_status sf_default_context(sf_context** out);

/** Copy the context's effective options into `out`. out->struct_size must be
 *  set by the caller to at least the version-1 size (320 bytes); exactly
 *  min(out->struct_size, this library's sizeof(sf_options)) bytes are written
 *  and out->struct_size is left as the caller set it, so a caller built
 *  against an older or newer header keeps working. */
SF_API sf_status sf_get_options(const sf_context* ctx, sf_options* out);

/* ---- Bucket configuration ---------------------------------------------- */

/** Set the bucket cap in MiB: positive and finite, else
 *  SF_ERR_INVALID_ARGUMENT naming the value. SF_ERR_INVALID_STATE once the
 *  buckets are built.
 *  Since 0.5 the cap counts as chosen once this is called, when
 *  SF_BUCKET_CAP_MB is set in the environment at sf_create (or at the
 *  default context's creation), or when sf_options.bucket_cap_mb differs
 *  from the default 25; a sharded context (sf_set_shard_layout) whose cap
 *  was never chosen builds with the sharded default instead of 25 (to keep
 *  25 MiB there, call this with 25). sf_get_options reports the cap the
 *  buckets were built with once they are built, the cap as set before. */
SF_API sf_status sf_set_bucket_cap_mb(sf_context* ctx, double mb);
/** Same for the first bucket (the gradients ready first). */
SF_API sf_status sf_set_first_bucket_cap_mb(sf_context* ctx, double mb);

/* ---- Gradients ---------------------------------------------------------- */

/**
 * Register a gradient buffer the host owns. The plugin reads and writes
 * `numel` elements at `data` during synchronization; the host keeps the
 * buffer alive and in place for the life of the context.
 * @param name optional (may be NULL), copied; used in error messages.
 * @param out_id receives the gradient's id (0, 1, ... in registration order).
 * SF_ERR_INVALID_STATE once the buckets are built. SF_ERR_INVALID_ARGUMENT
 * (naming the gradient) when one gradient exceeds 2^58 bytes or all
 * registered gradients together would exceed 2^62 bytes (since 0.2).
 */
SF_API sf_status sf_register_gradient(sf_context* ctx, void* data, int64_t numel, sf_dtype dtype,
                                      sf_device device, const char* name, int64_t* out_id);

/**
 * Declare a gradient whose storage the plugin owns: a view into one flat
 * buffer laid out bucket by bucket, so that synchronization copies nothing
 * (like DDP's gradient_as_bucket_view). Get its address with
 * sf_gradient_data once all gradients are declared. The flat buffer starts
 * zeroed. SF_ERR_INVALID_STATE once the buckets are built; the size limits
 * of sf_register_gradient apply. A flat buffer that cannot be allocated is
 * SF_ERR_OUT_OF_MEMORY from the call that builds the buckets.
 */
SF_API sf_status sf_add_gradient(sf_context* ctx, int64_t numel, sf_dtype dtype, sf_device device,
                                 const char* name, int64_t* out_id);

/**
 * Build the buckets (reverse registration order, capped by bucket_cap_mb;
 * the first bucket closes once it holds first_bucket_cap_mb, as DDP's
 * does (since 0.2; 0.1 never let it pass first_bucket_cap_mb); one dtype
 * and device per bucket, a gradient never split) and allocate the flat
 * buffer. Local: no communication. Done implicitly by the first sf_gradient_data,
 * sf_grad_ready or sf_synchronize; a second call does nothing.
 * SF_ERR_INVALID_STATE if no gradient is registered.
 */
SF_API sf_status sf_build_buckets(sf_context* ctx);

/** Address of gradient `id`: the host's own pointer, or the view into the
 *  plugin's flat buffer (valid for the life of the context). Builds the
 *  buckets if needed. */
SF_API sf_status sf_gradient_data(sf_context* ctx, int64_t id, void** out);

/** Zero every registered gradient (host and plugin-owned), as an optimizer's
 *  zero_grad. SF_ERR_INVALID_STATE while bucket collectives started by
 *  sf_grad_ready are in flight (call sf_synchronize first). Since 0.5, one
 *  called while another thread's sf_synchronize runs waits for it and then
 *  zeroes (never zeroes a bucket on the wire). */
SF_API sf_status sf_zero_gradients(sf_context* ctx);

/* ---- The accumulation window ------------------------------------------- */

/**
 * Enter an accumulation window: until sf_end_accumulation, nothing is
 * communicated, whatever the host calls. SF_ERR_INVALID_STATE if already
 * inside a window, or if bucket collectives were started and not yet waited
 * for by sf_synchronize. Cost: well under a microsecond.
 * Since 0.2, a begin refused inside a window (a forgotten sf_end_accumulation)
 * is also said at once as a WARN line (subsystem "window"): hosts that ignore
 * the status would otherwise go on in the old window.
 */
SF_API sf_status sf_begin_accumulation(sf_context* ctx);

/** Leave the window: the next synchronization carries everything
 *  accumulated. SF_ERR_INVALID_STATE without a matching begin.
 *  Since 0.2: if nothing follows this context's windows (no gradient
 *  registered, no interposer such as libsfsync_shim.so for the default
 *  context, no sf_in_accumulation asked), the first end says once (WARN)
 *  that these windows affect nothing; with SF_STRICT=1 every such end still
 *  ends the window and returns SF_ERR_INVALID_STATE. */
SF_API sf_status sf_end_accumulation(sf_context* ctx);

/** 1 inside a window, 0 outside; -1 for a NULL context. Since 0.2, asking
 *  marks the context's windows as followed (a DDP comm hook that asks acts
 *  on them): see sf_end_accumulation. */
SF_API int32_t sf_in_accumulation(const sf_context* ctx);

/**
 * Report that gradient `id` is final for this backward pass. Inside a window
 * it is only counted. Outside, once every gradient of a bucket is ready (and
 * every earlier bucket started), that bucket's collective starts, overlapping
 * the rest of the backward pass. Reporting the same gradient twice before
 * sf_synchronize outside a window is SF_ERR_INVALID_STATE (its bucket may be
 * in flight). Thread-safe.
 * Outside a window the gradient is sfsync's from this call until
 * sf_synchronize returns: read or write it only after that. Since 0.5 an
 * averaged host gradient may be scaled here, as it is reported (where
 * that changes no bit of the result: world_size a power of two, Gloo
 * without a 16-bit wire, unsharded), and its bucket then sums; a window
 * begun before the synchronization restores it (x * world_size).
 */
SF_API sf_status sf_grad_ready(sf_context* ctx, int64_t id);

/**
 * Start what is left, wait for every bucket, and leave every rank holding
 * the same reduced gradients: exactly one collective per bucket per window.
 * SF_ERR_INVALID_STATE inside a window. The first call verifies that all
 * ranks registered the same layout (SF_ERR_MISMATCH on every rank, naming
 * the first differing gradient). A backend failure leaves the context
 * failed: every later synchronization returns the same error.
 *
 * Ranks out of step (since 0.2): every synchronization also checks, inside
 * the collective of one bucket of the layout's most exact dtype (two extra
 * elements, no extra collective; a host bucket among equals, else a device
 * bucket, whose two elements travel through a small pinned copy, Since 0.3),
 * that all ranks complete the same window; if not (a rank skipped or added
 * an sf_synchronize) it fails with SF_ERR_MISMATCH on every rank, naming the
 * window numbers, and the context is failed. A window is numbered when it is
 * synchronized: each sf_begin_accumulation since the previous
 * synchronization opens one (for a host that reports sf_grad_ready, begins
 * with no pass between them are one window, so bracketing micro-batches one
 * by one is fine); a synchronization with no begin is a window of one
 * micro-batch, except in a host that reports sf_grad_ready and reported none
 * since the previous synchronization: that is an extra synchronization.
 * Windows of different lengths on different ranks stay legal. Limits: a
 * host that never reports sf_grad_ready cannot be told apart when it adds a
 * synchronization with no begin (it is a legal window of one micro-batch),
 * nor when it skips one (its peers' last synchronization then ends in
 * SF_ERR_TIMEOUT);
 * numbers are compared modulo p (float64 buckets: p >= 2^20 up to 2^12
 * ranks; float32: p = floor(sqrt(2^24 / world_size)) + 1, e.g. 2897 for 2
 * ranks; float16 / bfloat16-only layouts: 2^11 / 2^8 instead of 2^24, e.g. 9
 * for bfloat16 on 4 ranks), so ranks a multiple of p windows apart pass; no
 * check with sharded CUDA-only layouts (NCCL's reduce-scatter scales every
 * element) or bfloat16-only layouts above 256 ranks. Since 0.4 the first
 * synchronization of a context compares the numbers exactly, in every
 * layout (they ride in the layout check's collective: sf_restore_windows).
 *
 * Threads (since 0.5): two or more threads may call it at once on one
 * context (with the other window calls, see the conventions at the top).
 * One of them synchronizes; each call that started while that one ran
 * waits for it and returns its status (SF_OK, or its error with a message
 * that says the call waited for another thread's synchronization): the
 * window is synchronized once, on every rank in step, and every call
 * returns only when the reduced gradients are in place. A call that starts
 * after another returned is a synchronization of its own (the rules above:
 * a window of one micro-batch, or an extra synchronization), so threads
 * that mean one window must overlap, or the host must call it once.
 * Before 0.5, two calls at once could fail with SF_ERR_INTERNAL, leave the
 * ranks with different values and corrupt memory.
 */
SF_API sf_status sf_synchronize(sf_context* ctx);

/* ---- Stats -------------------------------------------------------------- */

/** Counters since creation; fill with sf_get_stats (struct_size first). */
typedef struct sf_stats {
  uint64_t struct_size;
  int64_t windows_begun;       /* sf_begin_accumulation calls that succeeded */
  int64_t windows_completed;   /* sf_synchronize calls that succeeded; since 0.4
                                  plus the count sf_restore_windows restored */
  int64_t deferred_passes;     /* full sets of grad-ready reports inside windows */
  int64_t deferred_ready_calls;/* sf_grad_ready calls inside windows */
  int64_t collectives_issued;  /* gradient collectives (one per bucket per window; at
                                  world size 1 the per-bucket local reduction,
                                  which sends nothing, is counted the same way) */
  int64_t early_launches;      /* of those, started by sf_grad_ready before sf_synchronize */
  int64_t bytes_reduced;       /* gradient bytes that went through collectives */
  int64_t bucket_count;        /* 0 until the buckets are built */
  int64_t largest_bucket_bytes;
  int64_t smallest_bucket_bytes;
  int64_t gradient_count;
  int64_t gradient_bytes;      /* sum of all registered gradients' sizes */
  int64_t sync_ns_total;       /* time spent inside sf_synchronize */
  /* Since 0.3 (sharded windows; 0 in an unsharded context): */
  int64_t reduce_scatters;     /* bucket reduce-scatters issued (also counted in
                                  collectives_issued and bytes_reduced) */
  int64_t all_gathers;         /* parameter bucket all-gathers issued, and since
                                  0.4 gradient ones (sf_gather_gradients; NOT
                                  in collectives_issued) */
  int64_t bytes_gathered;      /* bytes those all-gathers carried (the
                                  buckets' sizes, padding excluded) */
  /* Since 0.5: what went on the wire. Every collective this rank handed its
   * transport, counted where it is handed over (whatever asked for it: a
   * bucket, a gather, the layout or window check, sf_broadcast,
   * sf_allreduce_float64), by kind and by purpose. All 0 at world size 1
   * (nothing travels). The teardown barrier is not counted.
   *
   * Payload bytes of one collective: the elements of its buffer that the
   * transport moves, in the dtype they travel in (a float32 all-reduce on a
   * 16-bit wire_dtype with Gloo: 2 bytes each), reserved tails included,
   * the padding a sharded layout leaves off the wire excluded (Gloo leaves
   * it off; NCCL too since 0.5 where the padding is more than a sixteenth of
   * the segments, else it moves whole segments). An all-reduce: its buffer; a
   * reduce-scatter or all-gather: all world_size segments of its buffer; a
   * broadcast: its bytes; a control collective: its values (8 bytes each).
   * What the transport's algorithm sends per peer (a ring sends about
   * 2 (W-1)/W of an all-reduce's buffer) and its message headers are not
   * in these counts. */
  int64_t wire_allreduces;     /* bucket all-reduces */
  int64_t wire_reduce_scatters;/* bucket reduce-scatters */
  int64_t wire_all_gathers;    /* all-gathers, gradient and parameter ones */
  int64_t wire_broadcasts;     /* sf_broadcast's data broadcasts */
  int64_t wire_controls;       /* small control collectives: the connect's
                                  claim check, the layout check, the
                                  argument agreement of sf_broadcast and
                                  sf_allreduce_float64, the sum of
                                  sf_allreduce_float64 itself, the replica
                                  check, the window check's exact compare */
  int64_t wire_bytes;          /* payload bytes of all of them; the sum of
                                  the six purposes below */
  int64_t wire_gradient_bytes; /* gradient elements of bucket reductions and
                                  of gradient gathers (sf_gather_gradients;
                                  with NCCL these also move the window
                                  check's reserved tails, counted here) */
  int64_t wire_parameter_bytes;/* parameter gathers */
  int64_t wire_mask_bytes;     /* the used-parameter mask where it rides in
                                  a bucket: a gradient registered under the
                                  name "sfsync.used" (the Python binding's,
                                  find_unused_parameters) */
  int64_t wire_check_bytes;    /* the window check's reserved elements (and
                                  a reserved tail's alignment padding), and
                                  every control collective but the sum of
                                  sf_allreduce_float64 */
  int64_t wire_weight_bytes;   /* weighted windows: the weight's limbs and
                                  the window sums in the reserved tails */
  int64_t wire_host_bytes;     /* what the host asked to move: sf_broadcast's
                                  bytes and sf_allreduce_float64's values (the
                                  Python binding's sharded used mask, clip
                                  norms, the initial weights' broadcast) */
} sf_stats;

/** Copy the counters. out->struct_size must be set to at least the version-1
 *  size (112 bytes); exactly min(out->struct_size, this library's
 *  sizeof(sf_stats)) bytes are written and out->struct_size is left as the
 *  caller set it (0.3's size: 136 bytes; 0.5's, with the wire counts: 232). */
SF_API sf_status sf_get_stats(const sf_context* ctx, sf_stats* out);

/**
 * Describe bucket `index` (0 = the first synchronized): its size in bytes,
 * number of gradients and dtype. Any out pointer may be NULL.
 * SF_ERR_INVALID_STATE before the buckets are built.
 */
SF_API sf_status sf_bucket_info(const sf_context* ctx, int64_t index, int64_t* bytes,
                                int64_t* gradient_count, sf_dtype* dtype);

/* ---- Bucket and window states (Since 0.5) ------------------------------- */

/* Where a bucket is in its window's cycle (sf_bucket_state). Since 0.5. */
#define SF_BUCKET_IDLE 0       /* nothing of the current window in it, nothing in flight */
#define SF_BUCKET_FILLING 1    /* some of its gradients reported ready (sf_grad_ready), not started */
#define SF_BUCKET_REDUCING 2   /* its reduction started (complete, sf_synchronize_start or
                                  sf_synchronize), not waited for */
#define SF_BUCKET_REDUCED 3    /* the current window's reduction waited for and in place
                                  (sf_wait_bucket, sf_synchronize) */
#define SF_BUCKET_GATHERING 4  /* sharded: its parameter gather started (sf_start_gather),
                                  not waited for (sf_wait_gather) */
#define SF_BUCKET_GATHERING_GRADIENTS 5 /* sharded: sf_gather_gradients' all-gather in
                                  flight (that call waits for it: seen only beside it,
                                  or after it failed) */
#define SF_BUCKET_GATHERED 6   /* sharded: its parameter gather waited for (the parameters
                                  whole on this rank) and the next window's reduction of
                                  the bucket not started */

/**
 * The state of bucket `index` (0 = the first synchronized) now, one of
 * SF_BUCKET_*, into *state. A bucket's reduction stays REDUCED until the
 * next window's first sf_begin_accumulation or sf_grad_ready (then IDLE);
 * a parameter gather (GATHERING, then GATHERED) outlives its window until
 * the bucket's next reduction starts. What a host that steps bucket by
 * bucket asks instead of keeping its own record (the Python binding's
 * WindowDriver does). SF_ERR_INVALID_ARGUMENT for a NULL ctx or state or
 * an index that is no bucket (naming it and the range),
 * SF_ERR_INVALID_STATE before the buckets are built; *state untouched then.
 * Threads: as sf_bucket_info, it may run beside any call (a window call of
 * another thread in progress is waited for, as sf_get_stats waits). Since 0.5.
 */
SF_API sf_status sf_bucket_state(const sf_context* ctx, int64_t index, int32_t* state);

/* Flags of sf_window_state. Since 0.5. */
#define SF_WINDOW_SYNCHRONIZING 1    /* reductions of the window started (sf_grad_ready
                                        completed a bucket, or sf_synchronize_start) and no
                                        sf_synchronize completed the window yet (after a
                                        failed collective it stays set: the window cannot
                                        complete) */
#define SF_WINDOW_GRADIENTS_WHOLE 2  /* every bucket's reduction of the current window is
                                        in place and whole on this rank: unsharded once
                                        reduced; sharded once sf_gather_gradients gathered
                                        it (also at world size 1, where that moves nothing) */

/**
 * The current window's state as SF_WINDOW_* flags (0: none), into *flags.
 * The window is the one of the last sf_begin_accumulation, sf_grad_ready or
 * synchronization: after sf_synchronize it stays the synchronized one until
 * the next of those. Before the buckets are built: 0 (nothing reduced).
 * SF_ERR_INVALID_ARGUMENT for a NULL ctx or flags (*flags untouched).
 * Threads: as sf_bucket_state. Since 0.5.
 */
SF_API sf_status sf_window_state(const sf_context* ctx, int32_t* flags);

/* ---- Restarts (Since 0.4) ----------------------------------------------- */

/**
 * Continue a saved run's window count in a resumed one. Save
 * sf_stats.windows_completed (sf_get_stats: that field is the getter) with
 * the model and optimizer; in the resumed run create the context and call
 * this, on every rank, before training resumes. Afterwards
 * sf_stats.windows_completed starts from `windows_completed`, and the
 * out-of-step check of sf_synchronize numbers the next window
 * windows_completed + 1 (then on as in an uninterrupted run): ranks
 * continue in step only if every rank restores the same count.
 * sf_stats.windows_begun keeps counting this context's own
 * sf_begin_accumulation calls, from 0.
 *
 * Ranks that restore different counts: the first synchronization fails with
 * SF_ERR_MISMATCH ("ranks are out of step", naming the window numbers) on
 * every rank and the context is failed, never a hang (where an
 * sf_grad_ready starts the first bucket, that call reports it first and
 * sf_synchronize returns the same error). The first synchronization
 * compares the numbers exactly (inside the layout check it already makes,
 * no extra collective), so this holds for any difference, not only modulo
 * p (sf_synchronize); later ones compare modulo p.
 *
 * Only before this context's first window or synchronization: once an
 * sf_begin_accumulation, sf_grad_ready, sf_synchronize_start or
 * sf_synchronize (also a failed one) was called, SF_ERR_INVALID_STATE and
 * nothing changes. Registration, bucket set-up, sf_connect, sf_broadcast
 * and the other control collectives may come before or after it. A second
 * call before the first window replaces the first. Call it from the
 * training thread, not while sf_grad_ready may run on another.
 * @param windows_completed the saved sf_stats.windows_completed; negative
 *        is SF_ERR_INVALID_ARGUMENT naming the value. Local: no
 *        communication. Since 0.4.
 */
SF_API sf_status sf_restore_windows(sf_context* ctx, int64_t windows_completed);

/**
 * A window that the host reduced through its own collectives ended (a DDP
 * communication hook sent its last pass, sfsync.torch's attach): count it,
 * as sf_synchronize counts the windows it reduces. sf_stats.windows_completed
 * goes up by one and the window number goes on (the next window is one
 * more); nothing is sent. The plugin then holds such a host's window count
 * too, and sf_restore_windows continues it after a restart.
 *
 * SF_ERR_INVALID_STATE, changing nothing: inside an accumulation window
 * (sf_end_accumulation first: the window's last pass is still to come), or
 * on a context with registered gradients (sf_synchronize reduces and counts
 * their windows; counting one here as well would put the window numbers its
 * out-of-step check compares apart). A window call (see the conventions at
 * the top). Local: no communication. Since 0.5.
 */
SF_API sf_status sf_count_window(sf_context* ctx);

/* ---- Weighted windows (Since 0.4) ---------------------------------------
 *
 * Per-token (or per-sample) normalization across a whole window and every
 * rank, with no extra collective: each rank adds its window's weight (e.g.
 * the tokens of each micro-batch) and, with reduce_op = SF_REDUCE_WEIGHTED,
 * every bucket is summed across ranks and divided by the global sum of the
 * weights. The host's loss is then a plain sum (reduction="sum").
 *
 *   for each micro-batch:  loss_sum = sum of per-token losses
 *                          sf_add_window_weight(ctx, tokens)   before its backward
 *                          backward(loss_sum)
 *   sf_synchronize(ctx)    gradients = (sum over ranks and micro-batches) / total tokens
 *
 * The weight travels in the reserved tail of every bucket's own collective
 * (each segment's, sharded), encoded as integer limbs that every wire dtype
 * (float64, float32, and the 16-bit ones) sums exactly: each rank's value
 * is taken to the nearest multiple of 2^-32 (integers, such as token counts,
 * are exact), and the global sum is exact from there. The backend divides
 * in the averaging step it already makes (Gloo: the post-scale; a 16-bit
 * wire: the widening), so there is no second pass over the gradients.
 * Collectives per window and sf_stats.bytes_reduced are those of an
 * unweighted window; the wire carries a few elements more per bucket (the
 * limbs). A bucket cut into pieces on several lanes (max_inflight) keeps
 * its limbs in the last piece, whose lane hands the weight to the others;
 * on a 16-bit wire a weighted bucket travels as one piece. CUDA buckets (NCCL): a plain
 * ncclSum, then, on the plugin's stream, the limbs read back (a few bytes
 * through the host's stream, when the bucket is waited for) and the bucket
 * multiplied by 1 / weight by a pre-multiplied sum on a one-rank NCCL
 * communicator: NCCL cannot divide by a value its own collective produced,
 * so on a GPU the division is one more pass over the bucket, ordered before
 * the bucket's completion event. A device bucket's limbs must fit one
 * 256-byte write (float32: up to 4096 ranks; bfloat16: 16), else the build
 * fails with SF_ERR_UNSUPPORTED.
 *
 * Window sums ride in the same way, in the first bucket: SF_WINDOW_SUMS
 * float64 slots that every rank adds to during the window (by convention
 * 0: loss sum, 1: token count, 2: a found-inf flag, 3: a user metric), read
 * back as global sums after the synchronization: no collective per metric.
 *
 * Rules:
 * - Weights and sums of a window are added any time from the previous
 *   synchronization until the first bucket of the window's last pass starts
 *   reducing (by sf_grad_ready or sf_synchronize); a later call is
 *   SF_ERR_INVALID_STATE naming the bucket and the window, and adds nothing.
 *   Each synchronization starts the next window's weight and sums at 0.
 * - A global weight of 0 (no rank added any) fails that sf_synchronize with
 *   SF_ERR_INVALID_STATE naming the window, on every rank; the gradients are
 *   left as the plain sums (never divided by 0), the context stays usable,
 *   the window counts as synchronized, and sf_get_window_totals reports its
 *   weight 0 (how a host tells it from other errors: skip the step).
 * - World size 1: the local weight divides; nothing travels.
 */

/* Float64 window sums per window, and the slots' conventional uses (Since 0.4). */
#define SF_WINDOW_SUMS 4
#define SF_WINDOW_SUM_LOSS 0      /* the loss summed over the window's tokens */
#define SF_WINDOW_SUM_TOKENS 1    /* the tokens (or samples) counted */
#define SF_WINDOW_SUM_FOUND_INF 2 /* 1 where a rank found an inf/NaN (sum > 0: some rank did) */
#define SF_WINDOW_SUM_USER 3      /* the host's own metric */

/**
 * Add `weight` to this rank's weight for the current window (e.g. the
 * number of tokens of a micro-batch, before its backward). Local: no
 * communication; thread-safe with sf_grad_ready.
 * @return SF_ERR_INVALID_ARGUMENT for a negative, NaN or infinite weight or
 *         one of 2^52 or more (naming the value); SF_ERR_INVALID_STATE when
 *         the context's reduce_op is not SF_REDUCE_WEIGHTED, or when the
 *         first bucket of the window's last pass has started reducing
 *         (naming the bucket and the window: the weight is not added).
 *         Since 0.4.
 */
SF_API sf_status sf_add_window_weight(sf_context* ctx, double weight);

/**
 * Add values[i] to this rank's window sum slot i, for i < count (1 <= count
 * <= SF_WINDOW_SUMS). Each value must be finite with |value| < 2^52. Same
 * timing rules and errors as sf_add_window_weight; SF_REDUCE_WEIGHTED only.
 * Since 0.4.
 */
SF_API sf_status sf_add_window_sums(sf_context* ctx, const double* values, int32_t count);

/**
 * The global weight and window sums of the last synchronized window: the
 * sums over every rank of what each added (world size 1: its own). `weight`
 * may be NULL; `sums` receives min(count, SF_WINDOW_SUMS) slots (count 0
 * with sums NULL: none).
 * @return SF_ERR_INVALID_STATE before the first weighted synchronization
 *         that completed; SF_ERR_INVALID_ARGUMENT for a negative count or
 *         sums NULL with count > 0. Since 0.4.
 */
SF_API sf_status sf_get_window_totals(const sf_context* ctx, double* weight, double* sums,
                                      int32_t count);

/* ---- CUDA / NCCL --------------------------------------------------------
 *
 * CUDA gradients (SF_DEVICE_CUDA: device pointers the host registers, or the
 * plugin's flat device buffer from sf_add_gradient) are reduced with NCCL,
 * through the same calls, window rules and bucket plan as host gradients.
 * libsfsync.so links no CUDA or NCCL library: the first call that needs them
 * (registering a CUDA gradient, sf_adopt_nccl_comm, sf_backend_available for
 * NCCL) loads the module libsfsync_nccl.so from the directory of
 * libsfsync.so (or the file named by the environment variable
 * SF_NCCL_MODULE), which loads libcudart.so.13 and libnccl.so.2 (the copies
 * already loaded in the process, else from the library path, or the files
 * SF_CUDART_LIBRARY / SF_NCCL_LIBRARY name). Where they are missing, or no GPU is visible, those calls
 * return SF_ERR_UNSUPPORTED and sf_last_error() says which; host gradients
 * keep working with Gloo.
 *
 * Rank r uses GPU local_rank % (visible GPUs) (or the adopted communicator's
 * GPU; since 0.3 the modulo, so that a launcher that shows each rank one GPU
 * with CUDA_VISIBLE_DEVICES and sets LOCAL_RANK=3 gets that GPU); a pointer
 * registered with SF_DEVICE_CUDA must be device (or managed) memory of that
 * GPU, else SF_ERR_INVALID_ARGUMENT. Without an adopted communicator one is
 * made with ncclCommInitRankConfig from a unique id that rank 0 publishes
 * through the rendezvous (file://, env://, memory://, redis://), on the first
 * synchronization.
 *
 * Ordering: collectives run on the plugin's own CUDA stream. A bucket's
 * all-reduce starts on the GPU after everything the host queued on its
 * stream (sf_set_cuda_stream) before the call that launched it (sf_grad_ready
 * or sf_synchronize); sf_synchronize returns once the results are there and
 * makes the host's stream wait for them, so kernels queued on it afterwards
 * read reduced gradients. Copies into and out of staging buffers (for
 * host-registered device pointers) and sf_zero_gradients run on the host's
 * stream. The CPU waits by polling events: the plugin never synchronizes the
 * device or the host's stream (only sf_destroy frees device memory, and
 * cudaFree may wait for the device). A collective that does not finish within
 * timeout_ms aborts the communicator (ncclCommAbort) and returns
 * SF_ERR_TIMEOUT; an NCCL asynchronous error (ncclCommGetAsyncError) aborts
 * it and returns SF_ERR_BACKEND with NCCL's message. Averages use ncclAvg,
 * SF_REDUCE_PRESCALED_SUM one ncclRedOpCreatePreMulSum operator;
 * float32, float64, float16 and bfloat16 are reduced natively.
 */

/**
 * Whether `backend` can be used in this process: SF_OK, or
 * SF_ERR_UNSUPPORTED with sf_last_error() naming what is missing (the module
 * or a library it needs, with the loader's message; the CUDA error of
 * cudaGetDeviceCount, e.g. an insufficient driver; no visible GPU).
 * SF_BACKEND_GLOO and SF_BACKEND_AUTO are always available; SF_BACKEND_NCCL
 * loads the module and the CUDA runtime (nothing else does, for host
 * gradients). SF_ERR_INVALID_ARGUMENT for a value that is not an sf_backend.
 * Thread-safe. Since 0.1.
 */
SF_API sf_status sf_backend_available(sf_backend backend);

/**
 * Set the CUDA stream (a cudaStream_t passed as void*; NULL, the default, is
 * the legacy default stream) on which the host produces and reads this
 * context's CUDA gradients. See "Ordering" above. The stream stays the
 * host's; it must stay valid until sf_destroy or until another stream
 * replaces it (sf_destroy records an event on it, so that the device buffers
 * it frees are no longer used by the host's queued copies). Loads nothing.
 * SF_ERR_INVALID_STATE
 * while bucket collectives started by sf_grad_ready are in flight (change it
 * between windows). Since 0.1.
 */
SF_API sf_status sf_set_cuda_stream(sf_context* ctx, void* stream);

/**
 * Use the host's NCCL communicator (an ncclComm_t passed as void*: from
 * cudarc, NCCL.jl, a C++ trainer) for this context's CUDA gradients instead
 * of making one; no rendezvous is done for NCCL. Its rank and size must be
 * the context's rank and world_size (else SF_ERR_INVALID_ARGUMENT), and its
 * GPU becomes the context's: call before registering CUDA gradients. Call
 * before the first synchronization, else SF_ERR_INVALID_STATE. The host keeps
 * ownership: sf_destroy never destroys it, and the host must not destroy it
 * before sf_destroy. The host must not use it from another thread while a
 * collective of this context is being launched. A collective that times out
 * or fails asynchronously aborts it (its kernels could not finish
 * otherwise): after such an error the host must not use it again.
 * SF_ERR_UNSUPPORTED where NCCL cannot be used or backend = gloo. Since 0.1.
 */
SF_API sf_status sf_adopt_nccl_comm(sf_context* ctx, void* comm);


/* ---- Logging (Since 0.2) ------------------------------------------------
 *
 * One logger for the library, the shim and the bindings. SF_DEBUG = WARN
 * (default) | INFO | TRACE | NONE; SF_DEBUG_FILE = path (%h host, %p pid,
 * %r rank substituted) instead of stderr. Lines look like NCCL_DEBUG's:
 *   sfsync <host>:<pid>:<rank> <LEVEL> <subsystem> message
 */

#define SF_LOG_NONE 0
#define SF_LOG_WARN 1
#define SF_LOG_INFO 2
#define SF_LOG_TRACE 3

/** @return the level in force (SF_LOG_NONE..SF_LOG_TRACE). Thread-safe. Since 0.2. */
SF_API int32_t sf_log_level(void);

/** Write one line through sfsync's logger if `level` is enabled (bindings use
 *  this so that their lines look like the library's). `subsystem` and
 *  `message` may be NULL. Never fails. Thread-safe. Since 0.2. */
SF_API void sf_log(int32_t level, const char* subsystem, const char* message);

/* ---- The host's own key-value store (Since 0.2) --------------------------
 *
 * A host that already has a store (PyTorch's c10d store under torchrun, a
 * Rust trainer's etcd client) hands it to a context with sf_set_store; every
 * rendezvous of that context (Gloo pairs, the NCCL unique id, the layout
 * check) then goes through it, and sfsync opens no port of its own.
 * The callbacks may be called from threads sfsync owns, never after
 * sf_destroy returns, and must be thread-safe. They return SF_STORE_OK,
 * SF_STORE_TIMEOUT (get: the key did not appear within timeout_ms) or
 * SF_STORE_ERROR; sfsync turns the last two into SF_ERR_TIMEOUT and
 * SF_ERR_BACKEND naming the key (so does any other return value, or a get
 * that returns SF_STORE_OK without setting *bytes).
 *
 * Keys are "<prefix>/sfsync/<name>" ("sfsync/<name>" without a prefix) and
 * values are bytes (not NUL-terminated, possibly empty). sfsync only sets and
 * gets; it never deletes. Each rank sets about three keys per context (its
 * claim, its Gloo address, rank 0 also the roster) of under 100 bytes per
 * rank in the job, and reads about as many.
 */

#define SF_STORE_OK 0
#define SF_STORE_TIMEOUT 1
#define SF_STORE_ERROR 2

typedef struct sf_store {
  uint64_t struct_size; /* sizeof(sf_store) as the caller knows it */
  void* user;           /* passed back to every callback */
  /** Store `bytes` bytes at `value` under `key` (NUL-terminated), replacing
   *  any value; then wake getters waiting for it. */
  int32_t (*set)(void* user, const char* key, const void* value, uint64_t bytes);
  /** Wait up to timeout_ms (>= 0; what is left of sfsync's own deadline,
   *  never more than the context's timeout_ms) for `key`, then write its
   *  size to *bytes and, if it fits in `capacity`, its value to `buffer`.
   *  A value larger than `capacity` is not an error: sfsync calls again with
   *  a buffer of the reported size. Must return by timeout_ms (sfsync cannot
   *  interrupt a callback, so a get that never returns is a wait that never
   *  ends); 0 means "look, do not wait". */
  int32_t (*get)(void* user, const char* key, int64_t timeout_ms, void* buffer,
                 uint64_t capacity, uint64_t* bytes);
} sf_store;

/** Zero `store` and set its struct_size (bindings cannot expand macros).
 *  SF_ERR_INVALID_ARGUMENT for NULL or a struct_size below the version-1
 *  size. Since 0.2. */
SF_API sf_status sf_store_init(sf_store* store, uint64_t struct_size);

/**
 * Use the host's store for this context's rendezvous instead of
 * opts.rendezvous (which may then be "host://", valid for any world_size;
 * a context created with "host://" and no sf_set_store fails its first
 * collective with SF_ERR_INVALID_STATE). `prefix` (may be NULL or "",
 * copied) is put before every key, so that several contexts or jobs share
 * one store; it must be the same on every rank and differ between contexts
 * (sfsync never deletes its keys: a prefix reused by a later job finds the
 * earlier job's claims and fails with SF_ERR_MISMATCH). The struct is copied (min(store->struct_size,
 * sizeof(sf_store)) bytes); `user` must stay valid until sf_destroy. Call
 * before the first collective (sf_connect, sf_synchronize, ...), else
 * SF_ERR_INVALID_STATE; a second call before that replaces the first. NULL
 * store, set or get, or a struct_size below the version-1 size, is
 * SF_ERR_INVALID_ARGUMENT. At world size 1 the store is never used.
 * Since 0.2.
 */
SF_API sf_status sf_set_store(sf_context* ctx, const sf_store* store, const char* prefix);

/* ---- Collective set-up and checks (Since 0.2) --------------------------- */

/**
 * Join the peers now (collective: every rank calls it): connect the host
 * transport and check that every rank agrees on world_size and that each
 * rank number is claimed once. Done implicitly by the first collective;
 * calling it at set-up makes rendezvous errors surface there, not inside a
 * backward pass. Bounded by timeout_ms. Idempotent. Since 0.2.
 *
 * Admission goes through the store: each rank publishes a claim (world_size,
 * a random nonce, host, pid); rank 0 waits for every claim and publishes the
 * roster, or the reason it refuses the job, which every rank then returns.
 * The first use of the store by any collective does the same (so the
 * checks below also hold without sf_connect, except the last).
 *  - SF_ERR_TIMEOUT: ranks missing after timeout_ms (rank 0 names them), or
 *    rank 0's roster missing (rank 0 not running, another rendezvous);
 *  - SF_ERR_MISMATCH: world sizes differ (every rank that meets rank 0 says
 *    which); a rank claimed by two processes: the one rank 0 did not admit
 *    always, and, when the second claim arrives while the ranks connect,
 *    every rank of the job (sf_connect re-reads the claims after connecting
 *    and agrees on the result with one 8-byte collective);
 *  - SF_ERR_BACKEND: the store or the transport failed.
 * The transport connected is Gloo's, or NCCL's with backend = nccl (the
 * communicator is made here, or the adopted one used: then no store is
 * opened at all).
 */
SF_API sf_status sf_connect(sf_context* ctx);

/**
 * Copy `bytes` bytes of host memory at `data` from rank `root` to every
 * rank (collective), e.g. initial weights and buffers, as DDP does at
 * construction. SF_ERR_INVALID_STATE inside a window or while bucket
 * collectives are in flight; SF_ERR_INVALID_ARGUMENT for a root outside
 * [0, world_size) or a NULL `data` with bytes > 0. Every rank must pass the
 * same `bytes` and `root`: a small collective checks that first, and a
 * difference is SF_ERR_MISMATCH on every rank (saying the range seen), never
 * a hang or an overrun. bytes = 0 only does that check. Connects first if
 * needed (as sf_connect). Moves the bytes with Gloo's broadcast;
 * SF_ERR_UNSUPPORTED with backend = nccl. Free at world size 1. Since 0.2.
 */
SF_API sf_status sf_broadcast(sf_context* ctx, void* data, uint64_t bytes, int32_t root);

/**
 * A fast, non-cryptographic 64-bit digest of `bytes` bytes at `data`,
 * bit-exact and the same on every machine for the same bytes and seed: it is
 * XXH64 (xxHash's 64-bit hash; `xxhsum -H64` prints the seed-0 value), any
 * alignment. Chain buffers by passing the previous digest as `seed` (a chain
 * is not the digest of the concatenation). Not a defence against an
 * attacker who chooses the bytes. `data` may be NULL when bytes is 0.
 * Pure; thread-safe. Since 0.2.
 */
SF_API sf_status sf_digest(const void* data, uint64_t bytes, uint64_t seed, uint64_t* out);

/** The digest (sf_digest chained in registration order, seed 0) of every
 *  registered host gradient's bytes (CUDA gradients are skipped). Builds the
 *  buckets if needed. SF_ERR_INVALID_STATE with no gradient registered or
 *  while bucket collectives are in flight. Local: no communication.
 *  Since 0.2. */
SF_API sf_status sf_digest_gradients(sf_context* ctx, uint64_t* out);

/**
 * Compare a host-computed digest (e.g. of the weights, from sf_digest)
 * across ranks with one small collective: SF_OK when every rank passed the
 * same value, else SF_ERR_MISMATCH on every rank with a message naming the
 * ranks that differ from rank 0 (and their digests). The collective carries
 * 8 bytes per rank (an all-gather). SF_ERR_INVALID_STATE inside a window or
 * while bucket collectives are in flight (call it between sf_synchronize
 * and the next window, e.g. after the optimizer step). Connects first if
 * needed (as sf_connect). Free and SF_OK at world size 1. Since 0.2.
 */
SF_API sf_status sf_check_replicas(sf_context* ctx, uint64_t digest);

/* ---- Sharded windows (Since 0.3) ----------------------------------------
 *
 * Megatron-core's distributed optimizer for any host. In a sharded context
 * (sf_options.shard_layout, SF_SHARD or sf_set_shard_layout) every bucket is
 * reduce-scattered at synchronization instead of all-reduced: each rank
 * receives only the part of every bucket it owns (sf_shard_range), averaged
 * (or summed / prescaled, as set), steps its optimizer on that part of the
 * parameters only, and then all-gathers the parameters bucket by bucket
 * (sf_start_gather / sf_wait_gather, or sf_gather_parameters), in forward
 * order (the last bucket, which holds the first layers, first), so that the
 * next forward can start on the first layers while the others still travel.
 *
 * Every gradient has a parameter of the same numel, dtype and device
 * (sf_register_parameter): the host's own buffer, or a view into a flat
 * parameter buffer laid out exactly as the gradients' buckets (a gather then
 * copies nothing). Host-owned gradients or parameters travel through a
 * staging buffer per bucket (copied in before, out after).
 *
 * Layout of a bucket of B bytes on W ranks: a segment of S elements per rank,
 * W * S elements in all, S a multiple of the elements in 64 bytes (so every
 * rank's segment starts 64-byte aligned). Padding stays off the wire on Gloo
 * (only the gradients and control elements of each segment travel; Since
 * 0.3): the reduce-scatter and the all-gather together move what one ring
 * all-reduce of the bucket moves; NCCL (equal counts) moves the padded
 * segments. A host
 * bucket of a context with world size > 1 also carries the two window-check
 * elements at the end of EVERY rank's segment (each rank checks its own).
 *  - SF_SHARD_FLAT: the gradients contiguous (as unsharded), the bucket
 *    padded at the end; rank r owns elements [r*S, (r+1)*S) of the bucket,
 *    so a gradient may straddle two ranks (or more) and a rank may own none
 *    of a small one.
 *  - SF_SHARD_PARAMETER: whole gradients per rank: the bucket's gradients,
 *    in order, are cut into W contiguous groups balanced by bytes, each
 *    segment padded to the largest group. Which rank holds which group
 *    balances the ranks over all buckets (bucket by bucket, the largest
 *    group to the rank holding the fewest elements so far, ties to the lower
 *    rank), so a rank holds at most 1/W of the elements plus the largest
 *    group. A rank owns each of its gradients whole and no part of the
 *    others (for matrix optimizers: Muon, Shampoo); sf_shard_range says which.
 *
 * Nothing changes in the window rules: nothing is sent inside a window, one
 * reduce-scatter per bucket per window, one all-gather per bucket per
 * gathered window, the layout check (it includes the shard layout), the
 * out-of-step check, timeouts. sf_check_replicas over a digest of the
 * gathered parameters is the host's. Gathers in flight: sf_begin_accumulation
 * does not wait for them (nothing is sent inside a window, and a gather
 * writes the parameters, not the gradients), so the next window's forward
 * can overlap them: the host waits for each bucket's gather before that
 * bucket's first use; the next reduction of a bucket (sf_grad_ready,
 * sf_synchronize_start, sf_synchronize) first completes that bucket's
 * gather. Sharded buckets travel in their own dtype (wire_dtype does not
 * apply). Backends: Gloo for host buckets (a ring over unbound buffers;
 * gathers on a worker of their own), NCCL for CUDA buckets
 * (ncclReduceScatter / ncclAllGather on the plugin's stream, one order with
 * the reductions: a CUDA bucket's gather may start only once every bucket's
 * reduction of the window has started, else SF_ERR_INVALID_STATE), the
 * identity at world size 1.
 */
typedef int32_t sf_shard_layout;
#define SF_SHARD_NONE 0      /* every rank receives every reduced gradient (all-reduce): as 0.2 */
#define SF_SHARD_FLAT 1      /* contiguous 1/W of each padded bucket per rank (Megatron's) */
#define SF_SHARD_PARAMETER 2 /* whole gradients per rank, W groups balanced by bytes */

/** Set the shard layout (overrides sf_options.shard_layout). Until the
 *  buckets are built, else SF_ERR_INVALID_STATE; a value that is not an
 *  sf_shard_layout is SF_ERR_INVALID_ARGUMENT naming it. Since 0.3.
 *  Since 0.5 a sharded context whose bucket cap was never chosen builds
 *  its buckets with the sharded default cap: the registered gradients'
 *  bytes / 8, within 1..25 MiB (about 8 buckets; see sf_set_bucket_cap_mb
 *  for what counts as chosen). Before 0.5 only the Python binding applied
 *  it (GradientSync(shard_optimizer=True)); every host now gets it. */
SF_API sf_status sf_set_shard_layout(sf_context* ctx, sf_shard_layout layout);

/**
 * Register the parameter whose gradient is `id` (sharded contexts only:
 * else SF_ERR_INVALID_STATE naming the layout). `data` = NULL: plugin-owned,
 * a view into a flat parameter buffer laid out exactly as the gradients'
 * buckets (zero-copy gathers), zeroed; get its address with
 * sf_parameter_data and copy the initial values in. Otherwise the host's
 * buffer of `numel` elements, kept alive and in place for the life of the
 * context. numel, dtype or device unlike gradient id's:
 * SF_ERR_INVALID_ARGUMENT naming which and both values; an id that is not a
 * gradient, or one that already has a parameter: SF_ERR_INVALID_ARGUMENT.
 * Before the buckets are built (SF_ERR_INVALID_STATE after). Building the
 * buckets of a sharded context in which some gradient has no parameter is
 * SF_ERR_INVALID_STATE naming the first such gradient. Since 0.3.
 */
SF_API sf_status sf_register_parameter(sf_context* ctx, int64_t id, void* data, int64_t numel,
                                       sf_dtype dtype, sf_device device);

/** Address of parameter `id`: the host's pointer or the view into the flat
 *  parameter buffer (valid for the life of the context). Builds the buckets
 *  if needed. SF_ERR_INVALID_STATE in an unsharded context or for a
 *  gradient without a parameter. Since 0.3. */
SF_API sf_status sf_parameter_data(sf_context* ctx, int64_t id, void** out);

/**
 * Elements [*offset, *offset + *count) of gradient/parameter `id` that this
 * rank owns (count may be 0, then offset is 0). After synchronization the
 * gradient holds the reduced values there (elsewhere it holds unspecified
 * values); the host's optimizer updates the parameter there; the gather
 * brings the rest from the other ranks. Unsharded context: (0, numel).
 * Builds the buckets. Either pointer may be NULL. Since 0.3.
 */
SF_API sf_status sf_shard_range(sf_context* ctx, int64_t id, int64_t* offset, int64_t* count);

/** The bucket (0 = the first synchronized) that holds gradient `id`, in
 *  *bucket. Builds the buckets. Since 0.3. */
SF_API sf_status sf_gradient_bucket(sf_context* ctx, int64_t id, int64_t* bucket);

/**
 * Per-bucket completion, for an optimizer that steps each bucket as soon as
 * it is reduced (sharded or not): start every bucket collective not yet
 * started (the same rules and errors as sf_synchronize: SF_ERR_INVALID_STATE
 * inside a window; the layout check first) and return without waiting.
 * Then sf_wait_bucket per bucket, and sf_synchronize to finish the window.
 * Since 0.3.
 */
SF_API sf_status sf_synchronize_start(sf_context* ctx);

/**
 * Wait for bucket `bucket`'s reduction (the reduce-scatter in a sharded
 * context) and put its results in place (staged gradients copied back).
 * SF_ERR_INVALID_STATE for a bucket not started in this window (naming it);
 * SF_ERR_INVALID_ARGUMENT for an index out of range. Waiting twice is free.
 * sf_synchronize afterwards waits for whatever is left, runs the window
 * check and counts the window; until then the window is not complete (a
 * begin is SF_ERR_INVALID_STATE). Errors as sf_synchronize's (the context
 * fails). Since 0.3.
 */
SF_API sf_status sf_wait_bucket(sf_context* ctx, int64_t bucket);

/**
 * Start the all-gather of bucket `bucket`'s parameters (every rank's owned
 * part to every rank). bucket = -1: every bucket not yet started, in
 * forward order (the LAST bucket first). Sharded contexts only (else
 * SF_ERR_INVALID_STATE). Allowed once the bucket's reduction of the current
 * window completed (sf_wait_bucket or sf_synchronize) and at most once per
 * bucket per window: a host that steps and gathers before synchronization
 * gets SF_ERR_INVALID_STATE naming the bucket. The same buckets must be
 * started in the same order on every rank. Host-owned parameters are copied
 * into the bucket's staging buffer at this call (so step first). Since 0.3.
 */
SF_API sf_status sf_start_gather(sf_context* ctx, int64_t bucket);

/**
 * Wait for bucket `bucket`'s gather (-1: every started one); afterwards its
 * parameters are whole on this rank (host-owned ones copied back).
 * SF_ERR_INVALID_STATE for a bucket whose gather was never started this
 * window; SF_ERR_INVALID_ARGUMENT for an index out of range. Waiting twice
 * is free. Bounded by timeout_ms. Since 0.3.
 */
SF_API sf_status sf_wait_gather(sf_context* ctx, int64_t bucket);

/** Blocking: start every gather not yet started (forward order) and wait for
 *  all. Errors as sf_start_gather's. Since 0.3. */
SF_API sf_status sf_gather_parameters(sf_context* ctx);
/**
 * Collective, blocking: make the whole reduced gradients final on every
 * rank after a sharded window. After sf_synchronize (or once sf_wait_bucket
 * returned for every bucket) a rank's gradients hold the reduced values only
 * in its own range (sf_shard_range); this all-gathers every bucket's reduced
 * segments, one all-gather per bucket in bucket order (bucket 0 first) on
 * every rank, so that every rank's gradients (views into the flat buffer, or
 * the host's registered buffers, copied back) hold the whole averaged
 * (summed / prescaled, as configured) gradient, bitwise equal on every
 * rank: what a host's gradient-norm clipping, loss-scale unscaling or
 * logging over all gradients reads. Each rank sends its own range as it
 * holds it at this call; gradients of unused parameters are gathered like
 * any other (what was reduced). Bounded by timeout_ms; a failure fails the
 * context, as a synchronization's does.
 * Order: every rank calls it in the same window, before any sf_start_gather
 * or sf_gather_parameters of that window (gradient and parameter gathers
 * are one sequence of all-gathers, matched by issue order): synchronize,
 * sf_gather_gradients, step, gather the parameters.
 * Unsharded context or world size 1: SF_OK and no collective (the gradients
 * are whole already); a second call in the same window: SF_OK and no
 * collective. SF_ERR_INVALID_STATE, in every layout, with a message naming
 * the state: inside a window; before the window's reductions are complete
 * (no synchronization yet, or a bucket not started or still reducing: the
 * message names it); after the next window began (sf_begin_accumulation,
 * sf_grad_ready or sf_synchronize_start since the synchronization); after a
 * parameter gather of the window started. Counted in sf_stats.all_gathers
 * and bytes_gathered. Since 0.4.
 */
SF_API sf_status sf_gather_gradients(sf_context* ctx);

/**
 * Collective: replace `count` float64 values at `values` (host memory) by
 * their sum over ranks, e.g. the squared global gradient norm for clipping
 * or a used-parameter mask in a sharded context. Not inside a window, not
 * while bucket reductions are in flight (SF_ERR_INVALID_STATE); a NULL
 * `values` with count > 0 or a negative count is SF_ERR_INVALID_ARGUMENT.
 * Every rank must pass the same count: a 16-byte collective checks that
 * first and a difference is SF_ERR_MISMATCH on every rank (never a hang).
 * Free at world size 1. Connects first if needed. Small collectives on the
 * control path (Gloo; SF_ERR_UNSUPPORTED with backend = nccl). Since 0.3.
 */
SF_API sf_status sf_allreduce_float64(sf_context* ctx, double* values, int64_t count);

/* ---- Launcher discovery (Since 0.4) -------------------------------------
 *
 * What sf_options_init takes from the launchers' environment (rank
 * variables and meeting point, docs/launchers.md), as a report for people
 * and tools: `sfsync-run --discover`, `python3 -m sfsync` and
 * sfsync.launch.discover() print this one answer. The same code fills
 * sf_options_init's rank, world_size, local_rank and rendezvous.
 */

/** Size of each text field of sf_launch_info, terminating NUL included. */
#define SF_LAUNCH_TEXT_MAX 1024
/** Size of sf_launch_info.launcher, terminating NUL included. */
#define SF_LAUNCHER_NAME_MAX 16

/** Filled by sf_discover_launcher (struct_size first; fields only ever
 *  appended). Every text field is NUL-terminated; a longer text is cut to
 *  fit, ending in "..." (then `truncated` is 1). Since 0.4. */
typedef struct sf_launch_info {
  uint64_t struct_size; /* sizeof(sf_launch_info) as the caller knows it */
  int32_t rank;         /* what sf_options_init puts in sf_options.rank */
  int32_t world_size;   /* ... in sf_options.world_size */
  int32_t local_rank;   /* ... in sf_options.local_rank (0 when the launcher gives none) */
  int32_t truncated;    /* 1 when a text field below was cut to fit, else 0 */
  /** "none" (no group set), "sfsync" (SF_RANK...), "torchrun" (RANK...),
   *  "openmpi", "pmi" (MPICH/Intel MPI) or "slurm": the group that won. */
  char launcher[SF_LAUNCHER_NAME_MAX];
  /** The group's variables as read, e.g. "OMPI_COMM_WORLD_RANK=1,
   *  OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_LOCAL_RANK=1" ("" for none). */
  char rank_vars[SF_LAUNCH_TEXT_MAX];
  /** The meeting point: what sf_options_init puts in sf_options.rendezvous
   *  ("" for none: a world of one, or `error` / `unmet` set). */
  char rendezvous[SF_RENDEZVOUS_MAX];
  /** Where the meeting point came from, for people, e.g. "MASTER_ADDR=h,
   *  MASTER_PORT unset (29500)" ("" when there is none). */
  char meeting[SF_LAUNCH_TEXT_MAX];
  /** Non-empty: contradictory or malformed variables (a group with only its
   *  rank or only its size, a non-number, a rank not below the size, a bad
   *  Slurm node list, an SF_RENDEZVOUS that does not fit): the message
   *  sf_options_init fails with (SF_ERR_INVALID_ARGUMENT). rank, world_size
   *  and local_rank then hold what sf_options_init leaves there. */
  char error[SF_LAUNCH_TEXT_MAX];
  /** Non-empty: a world above one with no meeting point; the message
   *  sf_create and sf_default_context fail with (SF_ERR_INVALID_ARGUMENT),
   *  naming the variables. sf_options_init itself succeeds then. */
  char unmet[SF_LAUNCH_TEXT_MAX];
} sf_launch_info;

/**
 * Report what sf_options_init would discover from the launchers'
 * variables, by the same code: launcher, rank variables, rank, world size,
 * local rank, meeting point and where it came from, and the error or
 * "unmet" message (see sf_launch_info). Under an MPI launcher with a world
 * above one and no MASTER_ADDR / SF_RENDEZVOUS, libmpi is loaded to see
 * whether "mpi://" can serve (as sf_options_init does); MPI is not
 * initialized and nothing is communicated.
 * @param out receives the report: min(struct_size, sizeof(sf_launch_info))
 *        bytes are written, and out->struct_size is set to struct_size.
 * @param struct_size the caller's sizeof(sf_launch_info); smaller than the
 *        0.4 size (4392 bytes) is SF_ERR_INVALID_ARGUMENT.
 * @param env NULL: this process's environment (getenv, what sf_options_init
 *        reads); else a NULL-terminated array of "NAME=VALUE" strings, as
 *        execve's envp (the first entry of a name wins; an entry without '='
 *        is ignored; SF_MPI_LIBRARY is read from it too). Not kept.
 * @return SF_OK whenever the report is filled, even when it holds an error
 *         or unmet message (those are the findings, not a failure of this
 *         call); SF_ERR_INVALID_ARGUMENT for a NULL `out` or a too-small
 *         struct_size. Thread-safe (with env = NULL, as getenv). Since 0.4.
 */
SF_API sf_status sf_discover_launcher(sf_launch_info* out, uint64_t struct_size,
                                      const char* const* env);

#ifdef __cplusplus
}
#endif

#endif /* SFSYNC_H */
