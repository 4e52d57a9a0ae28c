// The extern "C" functions of include/sfsync.h, each one line into C++.

#include <atomic>
#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "plugin/api/default_backends.h"
#include "plugin/api/default_context.h"
#include "plugin/api/guard.h"
#include "plugin/core/log.h"
#include "plugin/launch/launch_options.h"

namespace sfsync {

namespace {
thread_local std::string tLastError;
}

void setLastError(const char* function, const char* message) noexcept {
  try {
    tLastError = std::string(function) + ": " + message;
  } catch (...) {
  }
}

// Copies `src` into the caller's struct of its own struct_size: at least the
// version-1 size `v1Size`, which stays valid forever; min(caller's size,
// library's size) bytes are written, so that a caller built against an
// older header (fewer fields) or a newer one (more) both work. The caller's
// struct_size is left as it set it.
template <typename T>
void copyOut(T* dst, const T& src, uint64_t v1Size, const char* what) {
  T& out = checked(dst, "out");
  const uint64_t callerSize = out.struct_size;
  if (callerSize < v1Size) {
    fail(SF_ERR_INVALID_ARGUMENT, "out->struct_size = " + std::to_string(callerSize) +
                                      " is smaller than sizeof(" + what + ") = " +
                                      std::to_string(v1Size) + " of ABI version 1");
  }
  const size_t n = callerSize < sizeof(T) ? size_t(callerSize) : sizeof(T);
  std::memcpy(&out, &src, n);
  out.struct_size = callerSize;
}

}  // namespace sfsync

using sfsync::checked;
using sfsync::fail;
using sfsync::guard;

extern "C" {

int32_t sf_abi_version(void) { return SF_ABI_VERSION; }
int32_t sf_version_number(void) { return SF_VERSION_NUMBER; }
const char* sf_version_string(void) {
#define SF_STR2(x) #x
#define SF_STR(x) SF_STR2(x)
  return SF_STR(SF_VERSION_MAJOR) "." SF_STR(SF_VERSION_MINOR) "." SF_STR(SF_VERSION_PATCH);
}

const char* sf_status_string(sf_status status) {
  switch (status) {
    case SF_OK: return "success";
    case SF_ERR_INVALID_ARGUMENT: return "invalid argument (sf_last_error() names it)";
    case SF_ERR_INVALID_STATE:
      return "invalid state: a call at the wrong point of the accumulation window or after the "
             "buckets were built (sf_last_error() says which)";
    case SF_ERR_MISMATCH:
      return "ranks disagree: on the gradient layout, the world size, the replicas' contents, or "
             "which process holds a rank (sf_last_error() says which)";
    case SF_ERR_BACKEND: return "the transport failed: a peer was lost or could not be reached";
    case SF_ERR_TIMEOUT:
      return "timed out waiting for peers (raise SF_TIMEOUT_MS or check that every rank runs)";
    case SF_ERR_UNSUPPORTED: return "not supported in this build or on this machine";
    case SF_ERR_OUT_OF_MEMORY: return "out of memory";
    case SF_ERR_INTERNAL: return "internal error in sfsync (please report it)";
    default: return "unknown status";
  }
}

const char* sf_last_error(void) { return sfsync::tLastError.c_str(); }

sf_status sf_options_init(sf_options* opts, uint64_t struct_size) {
  return guard("sf_options_init", [&] {
    sf_options& out = checked(opts, "opts");
    if (struct_size < sfsync::kOptionsV1Size) {
      fail(SF_ERR_INVALID_ARGUMENT, "struct_size = " + std::to_string(struct_size) +
                                        " is smaller than sizeof(sf_options) = " +
                                        std::to_string(sfsync::kOptionsV1Size) + " of ABI version 1");
    }
    sf_options full;
    std::string error;
    sf_status status = SF_OK;
    try {
      sfsync::optionsFromEnvironment(full);
    } catch (const sfsync::Error& e) {  // the struct still gets every valid value
      status = e.status();
      error = e.what();
    }
    full.struct_size = struct_size < sizeof full ? struct_size : sizeof full;
    std::memcpy(&out, &full, size_t(full.struct_size));
    out.struct_size = struct_size;
    if (status != SF_OK) throw sfsync::Error(status, error);
  });
}

namespace {
// A context over validated options, with the default backends. A bucket cap
// from SF_BUCKET_CAP_MB counts as chosen even at the default's value (a
// sharded context keeps it: reducer.h).
sf_context* createContext(const sf_options& o) {
  std::unique_ptr<sf_context> ctx(new sf_context(o, sfsync::defaultBackends()));
  if (sfsync::bucketCapFromEnvironment()) ctx->setBucketCapMb(o.bucket_cap_mb);
  return ctx.release();
}
}  // namespace

sf_status sf_create(const sf_options* opts, sf_context** out) {
  return guard("sf_create", [&] {
    sf_context*& result = checked(out, "out");
    sf_options o = sfsync::optionsFromCaller(opts);
    sfsync::validateOptions(o);
    result = createContext(o);
  });
}

void sf_destroy(sf_context* ctx) {
  // Creates nothing and leaves sf_last_error() alone: the default context
  // (never destroyed) is recognised without being made.
  if (!ctx || ctx == sfsync::defaultContextIfMade()) return;
  SF_LOG(kTrace, "api", "sf_destroy");
  delete ctx;  // ~Context never throws
}

sf_status sf_default_context(sf_context** out) {
  return guard("sf_default_context", [&] {
    sf_context*& result = checked(out, "out");
    // Leaked on purpose: hosts (and the shim) may use it from atexit handlers.
    static std::mutex m;
    static sf_context* instance = nullptr;
    std::lock_guard<std::mutex> lock(m);
    if (!instance) {
      sf_options o = sfsync::optionsFromCaller(nullptr);
      sfsync::validateOptions(o);
      instance = createContext(o);
    }
    result = instance;
    sfsync::publishDefaultContext(instance);  // for the shim (plugin/api/internal_api.cpp)
  });
}

sf_status sf_get_options(const sf_context* ctx, sf_options* out) {
  return guard("sf_get_options",
               [&] {
                 sfsync::copyOut(out, checked(ctx).options(), sfsync::kOptionsV1Size, "sf_options");
               });
}

sf_status sf_set_bucket_cap_mb(sf_context* ctx, double mb) {
  return guard("sf_set_bucket_cap_mb", [&] { checked(ctx).setBucketCapMb(mb); });
}

sf_status sf_set_first_bucket_cap_mb(sf_context* ctx, double mb) {
  return guard("sf_set_first_bucket_cap_mb", [&] { checked(ctx).setFirstBucketCapMb(mb); });
}

sf_status sf_register_gradient(sf_context* ctx, void* data, int64_t numel, sf_dtype dtype,
                               sf_device device, const char* name, int64_t* out_id) {
  return guard("sf_register_gradient", [&] {
    sfsync::Context& c = checked(ctx);
    if (!data) fail(SF_ERR_INVALID_ARGUMENT, "data is NULL (use sf_add_gradient for a plugin-owned buffer)");
    int64_t& id = checked(out_id, "out_id");  // before any side effect
    id = c.registerGradient(data, numel, dtype, device, name);
  });
}

sf_status sf_add_gradient(sf_context* ctx, int64_t numel, sf_dtype dtype, sf_device device,
                          const char* name, int64_t* out_id) {
  return guard("sf_add_gradient", [&] {
    sfsync::Context& c = checked(ctx);
    int64_t& id = checked(out_id, "out_id");  // before any side effect
    id = c.registerGradient(nullptr, numel, dtype, device, name);
  });
}

sf_status sf_build_buckets(sf_context* ctx) {
  return guard("sf_build_buckets", [&] { checked(ctx).buildBuckets(); });
}

sf_status sf_gradient_data(sf_context* ctx, int64_t id, void** out) {
  return guard("sf_gradient_data", [&] {
    sfsync::Context& c = checked(ctx);
    void*& result = checked(out, "out");  // before any side effect
    result = c.gradientData(id);
  });
}

sf_status sf_zero_gradients(sf_context* ctx) {
  return guard("sf_zero_gradients", [&] { checked(ctx).zeroGradients(); });
}

sf_status sf_begin_accumulation(sf_context* ctx) {
  return guard("sf_begin_accumulation", [&] { checked(ctx).beginAccumulation(); });
}

sf_status sf_end_accumulation(sf_context* ctx) {
  return guard("sf_end_accumulation", [&] { checked(ctx).endAccumulation(); });
}

int32_t sf_in_accumulation(const sf_context* ctx) {
  if (ctx) ctx->markFollowed();  // someone acts on its windows (e.g. a DDP comm hook)
  return ctx ? (ctx->inAccumulation() ? 1 : 0) : -1;
}

sf_status sf_grad_ready(sf_context* ctx, int64_t id) {
  return guard("sf_grad_ready", [&] { checked(ctx).gradReady(id); });
}

sf_status sf_synchronize(sf_context* ctx) {
  return guard("sf_synchronize", [&] { checked(ctx).synchronize(); });
}

sf_status sf_get_stats(const sf_context* ctx, sf_stats* out) {
  return guard("sf_get_stats", [&] {
    sfsync::copyOut(out, checked(ctx).stats(), sfsync::kStatsV1Size, "sf_stats");
  });
}

sf_status sf_restore_windows(sf_context* ctx, int64_t windows_completed) {
  return guard("sf_restore_windows", [&] { checked(ctx).restoreWindows(windows_completed); });
}

sf_status sf_count_window(sf_context* ctx) {
  return guard("sf_count_window", [&] { checked(ctx).countHostWindow(); });
}

sf_status sf_add_window_weight(sf_context* ctx, double weight) {
  return guard("sf_add_window_weight", [&] { checked(ctx).addWindowWeight(weight); });
}

sf_status sf_add_window_sums(sf_context* ctx, const double* values, int32_t count) {
  return guard("sf_add_window_sums", [&] { checked(ctx).addWindowSums(values, count); });
}

sf_status sf_get_window_totals(const sf_context* ctx, double* weight, double* sums,
                               int32_t count) {
  return guard("sf_get_window_totals",
               [&] { checked(ctx).windowTotals(weight, sums, count); });
}

sf_status sf_bucket_info(const sf_context* ctx, int64_t index, int64_t* bytes,
                         int64_t* gradient_count, sf_dtype* dtype) {
  return guard("sf_bucket_info",
               [&] { checked(ctx).bucketInfo(index, bytes, gradient_count, dtype); });
}

sf_status sf_bucket_state(const sf_context* ctx, int64_t index, int32_t* state) {
  return guard("sf_bucket_state", [&] {
    const sfsync::Context& c = checked(ctx);
    int32_t& result = checked(state, "state");  // before any side effect
    result = c.bucketState(index);
  });
}

sf_status sf_window_state(const sf_context* ctx, int32_t* flags) {
  return guard("sf_window_state", [&] {
    const sfsync::Context& c = checked(ctx);
    int32_t& result = checked(flags, "flags");
    result = c.windowState();
  });
}

}  // extern "C"

// ---- CUDA / NCCL --------------------------------------------------------------

#include "plugin/backend/nccl/nccl_backend.h"

extern "C" {

sf_status sf_backend_available(sf_backend backend) {
  return guard("sf_backend_available", [&] {
    if (backend == SF_BACKEND_NCCL) {
      sfsync::checkNcclAvailable();
    } else if (backend != SF_BACKEND_AUTO && backend != SF_BACKEND_GLOO) {
      fail(SF_ERR_INVALID_ARGUMENT, "backend = " + std::to_string(backend) +
                                        " is not an sf_backend (0 auto, 1 gloo, 2 nccl)");
    }
  });
}

sf_status sf_set_cuda_stream(sf_context* ctx, void* stream) {
  return guard("sf_set_cuda_stream", [&] { checked(ctx).setCudaStream(stream); });
}

sf_status sf_adopt_nccl_comm(sf_context* ctx, void* comm) {
  return guard("sf_adopt_nccl_comm", [&] { checked(ctx).adoptNcclComm(comm); });
}

}  // extern "C"

extern "C" {

int32_t sf_log_level(void) {
  for (int l = SF_LOG_TRACE; l > SF_LOG_NONE; --l) {
    if (sfsync::logEnabled(sfsync::LogLevel(l))) return l;
  }
  return SF_LOG_NONE;
}

void sf_log(int32_t level, const char* subsystem, const char* message) {
  if (level < SF_LOG_WARN || level > SF_LOG_TRACE) return;
  if (!sfsync::logEnabled(sfsync::LogLevel(level))) return;
  sfsync::logWrite(sfsync::LogLevel(level), subsystem ? subsystem : "host",
                   message ? message : "");
}

}  // extern "C"

// ---- The host's store, collective set-up and checks (Since 0.2) -------------

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "plugin/core/digest.h"

namespace sfsync {
namespace {
// sf_store of ABI version 1: struct_size, user, set, get.
constexpr uint64_t kStoreV1Size = 32;
static_assert(offsetof(sf_store, struct_size) == 0 && offsetof(sf_store, user) == 8 &&
                  offsetof(sf_store, set) == 16 && offsetof(sf_store, get) == 24 &&
                  sizeof(sf_store) == kStoreV1Size,
              "the version-1 layout of sf_store is frozen");

void checkStoreSize(uint64_t size, const char* what) {
  if (size < kStoreV1Size) {
    fail(SF_ERR_INVALID_ARGUMENT, std::string(what) + " = " + std::to_string(size) +
                                      " is smaller than sizeof(sf_store) = " +
                                      std::to_string(kStoreV1Size) + " of ABI version 1");
  }
}

// The caller's struct (of its own size) over our defaults.
sf_store storeFromCaller(const sf_store* store) {
  const sf_store& in = checked(store, "store");
  checkStoreSize(in.struct_size, "store->struct_size");
  sf_store out{};
  std::memcpy(&out, &in, size_t(std::min<uint64_t>(in.struct_size, sizeof out)));
  out.struct_size = sizeof out;
  if (!out.set) fail(SF_ERR_INVALID_ARGUMENT, "store->set is NULL");
  if (!out.get) fail(SF_ERR_INVALID_ARGUMENT, "store->get is NULL");
  return out;
}
}  // namespace
}  // namespace sfsync

extern "C" {

sf_status sf_store_init(sf_store* store, uint64_t struct_size) {
  return guard("sf_store_init", [&] {
    sf_store& out = checked(store, "store");
    sfsync::checkStoreSize(struct_size, "struct_size");
    std::memset(&out, 0, size_t(std::min<uint64_t>(struct_size, sizeof(sf_store))));
    out.struct_size = struct_size;
  });
}

sf_status sf_set_store(sf_context* ctx, const sf_store* store, const char* prefix) {
  return guard("sf_set_store", [&] {
    sfsync::Context& c = checked(ctx);
    c.setStore(sfsync::storeFromCaller(store), prefix);
  });
}

sf_status sf_connect(sf_context* ctx) {
  return guard("sf_connect", [&] { checked(ctx).connect(); });
}

sf_status sf_broadcast(sf_context* ctx, void* data, uint64_t bytes, int32_t root) {
  return guard("sf_broadcast", [&] { checked(ctx).broadcast(data, bytes, root); });
}

sf_status sf_digest(const void* data, uint64_t bytes, uint64_t seed, uint64_t* out) {
  return guard("sf_digest", [&] {
    uint64_t& result = checked(out, "out");
    if (!data && bytes > 0) {
      fail(SF_ERR_INVALID_ARGUMENT, "data is NULL with bytes = " + std::to_string(bytes));
    }
    if (bytes > uint64_t(SIZE_MAX)) fail(SF_ERR_INVALID_ARGUMENT, "bytes is too large");
    result = sfsync::digest64(data, size_t(bytes), seed);
  });
}

sf_status sf_digest_gradients(sf_context* ctx, uint64_t* out) {
  return guard("sf_digest_gradients", [&] {
    sfsync::Context& c = checked(ctx);
    uint64_t& result = checked(out, "out");  // before any side effect
    result = c.digestGradients();
  });
}

sf_status sf_check_replicas(sf_context* ctx, uint64_t digest) {
  return guard("sf_check_replicas", [&] { checked(ctx).checkReplicas(digest); });
}

}  // extern "C"

// ---- Sharded windows (Since 0.3) ---------------------------------------------

extern "C" {

sf_status sf_set_shard_layout(sf_context* ctx, sf_shard_layout layout) {
  return guard("sf_set_shard_layout", [&] { checked(ctx).setShardLayout(layout); });
}

sf_status sf_register_parameter(sf_context* ctx, int64_t id, void* data, int64_t numel,
                                sf_dtype dtype, sf_device device) {
  return guard("sf_register_parameter",
               [&] { checked(ctx).registerParameter(id, data, numel, dtype, device); });
}

sf_status sf_parameter_data(sf_context* ctx, int64_t id, void** out) {
  return guard("sf_parameter_data", [&] {
    sfsync::Context& c = checked(ctx);
    void*& result = checked(out, "out");  // before any side effect
    result = c.parameterData(id);
  });
}

sf_status sf_shard_range(sf_context* ctx, int64_t id, int64_t* offset, int64_t* count) {
  return guard("sf_shard_range", [&] { checked(ctx).shardRange(id, offset, count); });
}

sf_status sf_gradient_bucket(sf_context* ctx, int64_t id, int64_t* bucket) {
  return guard("sf_gradient_bucket", [&] {
    sfsync::Context& c = checked(ctx);
    int64_t& result = checked(bucket, "bucket");  // before any side effect
    result = c.gradientBucket(id);
  });
}

sf_status sf_synchronize_start(sf_context* ctx) {
  return guard("sf_synchronize_start", [&] { checked(ctx).synchronizeStart(); });
}

sf_status sf_wait_bucket(sf_context* ctx, int64_t bucket) {
  return guard("sf_wait_bucket", [&] { checked(ctx).waitBucket(bucket); });
}

sf_status sf_start_gather(sf_context* ctx, int64_t bucket) {
  return guard("sf_start_gather", [&] { checked(ctx).startGather(bucket); });
}

sf_status sf_wait_gather(sf_context* ctx, int64_t bucket) {
  return guard("sf_wait_gather", [&] { checked(ctx).waitGather(bucket); });
}

sf_status sf_gather_parameters(sf_context* ctx) {
  return guard("sf_gather_parameters", [&] { checked(ctx).gatherParameters(); });
}

sf_status sf_gather_gradients(sf_context* ctx) {
  return guard("sf_gather_gradients", [&] { checked(ctx).gatherGradients(); });
}

sf_status sf_allreduce_float64(sf_context* ctx, double* values, int64_t count) {
  return guard("sf_allreduce_float64", [&] { checked(ctx).allreduceFloat64(values, count); });
}

sf_status sf_discover_launcher(sf_launch_info* out, uint64_t struct_size, const char* const* env) {
  return guard("sf_discover_launcher",
               [&] { sfsync::discoverLaunchInfo(checked(out, "out"), struct_size, env); });
}

}  // extern "C"
