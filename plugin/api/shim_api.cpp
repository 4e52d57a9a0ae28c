// The extern "C" functions of plugin/api/sfsync_shim_internal.h: the
// interface the LD_PRELOAD shim calls. Each is one line into ShimPolicy.

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "plugin/api/guard.h"
#include "plugin/api/sfsync_shim_internal.h"
#include "plugin/core/dtype.h"
#include "plugin/shim_policy/shim_policy.h"

namespace sfsync {
namespace {

std::atomic<ShimPolicy*> gPolicy{nullptr};

// Made on the first interposed call, bound to the default context. Leaked on
// purpose: it is used from the shim's exit hook, after static destructors may
// have run.
ShimPolicy& policy() {
  if (ShimPolicy* p = gPolicy.load(std::memory_order_acquire)) return *p;
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  if (ShimPolicy* p = gPolicy.load(std::memory_order_relaxed)) return *p;
  sf_context* ctx = nullptr;
  std::string problem;
  if (sf_default_context(&ctx) != SF_OK) problem = sf_last_error();
  auto* p = new ShimPolicy(shimConfigFromEnvironment(), ctx);
  if (!problem.empty()) {
    std::fprintf(stderr, "sfsync shim: no default context (%s): windows from "
                         "sf_begin_accumulation are not available\n", problem.c_str());
  }
  gPolicy.store(p, std::memory_order_release);
  return *p;
}

}  // namespace
}  // namespace sfsync

using sfsync::checked;
using sfsync::fail;
using sfsync::guard;

extern "C" {

int32_t sf_shim_interface_version(void) { return SF_SHIM_INTERFACE_VERSION; }

sf_status sf_shim_decide(const sf_shim_call* call, sf_shim_decision* out) {
  return guard("sf_shim_decide", [&] {
    const sf_shim_call& c = checked(call, "call");
    sf_shim_decision& d = checked(out, "out");
    d = sfsync::policy().decide(c);
    if (d.action == SF_SHIM_FAIL) {
      fail(SF_ERR_INVALID_STATE, "a window before window " + std::to_string(d.window) +
                                     " was never synchronized and SF_STRICT=1 (see stderr)");
    }
  });
}

sf_status sf_shim_classify_reduce(const void* identity, int64_t element_size,
                                  sf_shim_reduce_fn invoke, void* state, sf_dtype* dtype,
                                  sf_shim_op* op) {
  return guard("sf_shim_classify_reduce", [&] {
    if (!invoke) fail(SF_ERR_INVALID_ARGUMENT, "invoke is NULL");
    if (element_size <= 0) {
      fail(SF_ERR_INVALID_ARGUMENT, "element_size = " + std::to_string(element_size));
    }
    sf_dtype& t = checked(dtype, "dtype");
    sf_shim_op& o = checked(op, "op");
    const sfsync::ReduceClass r = sfsync::policy().classifier().classify(
        identity, size_t(element_size),
        [&](void* c, const void* a, const void* b, size_t n) { invoke(state, c, a, b, n); });
    t = r.dtype;
    o = r.op;
  });
}

sf_status sf_shim_local_result(void* out, const void* in, int64_t numel, sf_dtype dtype,
                               double factor) {
  return guard("sf_shim_local_result", [&] {
    if (!out || !in) fail(SF_ERR_INVALID_ARGUMENT, out ? "in is NULL" : "out is NULL");
    if (numel < 0) fail(SF_ERR_INVALID_ARGUMENT, "numel = " + std::to_string(numel));
    if (!sfsync::dtypeValid(dtype)) {
      fail(SF_ERR_INVALID_ARGUMENT, "dtype = " + std::to_string(dtype) + " is not a float sf_dtype");
    }
    sfsync::copyScaled(out, in, numel, dtype, factor);
  });
}

sf_status sf_shim_finish(void) {
  return guard("sf_shim_finish", [&] {
    sfsync::ShimPolicy* p = sfsync::gPolicy.load(std::memory_order_acquire);
    if (p && !p->finish()) {
      fail(SF_ERR_INVALID_STATE, "a window was never synchronized and SF_STRICT=1");
    }
  });
}

sf_status sf_shim_report_json(char* buffer, int64_t capacity, int64_t* length) {
  return guard("sf_shim_report_json", [&] {
    sfsync::ShimPolicy* p = sfsync::gPolicy.load(std::memory_order_acquire);
    const std::string json = p ? p->reportJson() : "{}";
    if (length) *length = int64_t(json.size());
    if (buffer && capacity > 0) {
      const size_t n = std::min(json.size(), size_t(capacity - 1));
      std::memcpy(buffer, json.data(), n);
      buffer[n] = '\0';
    }
  });
}

}  // extern "C"
