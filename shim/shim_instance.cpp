#include "shim/shim_instance.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "plugin/api/sfsync_internal.h"
#include "plugin/core/dtype.h"
#include "shim/forward.h"
#include "shim/policy/shim_policy.h"
#include "shim/python_host.h"  // handPythonHost, at load

namespace sfshim {
namespace {

using WindowStateFn = sf_status (*)(const sf_context*, int32_t, sf_window_state_v1*);

// Looked up by version: a libsfsync.so without this node makes the shim pass
// everything through, rather than keep the host from starting.
WindowStateFn windowStateFn() {
  static const WindowStateFn f = [] {
    void* h = sfsyncLibrary();
    return h ? reinterpret_cast<WindowStateFn>(
                   dlvsym(h, "sf_internal_window_state_v1", SF_INTERNAL_NODE))
             : nullptr;
  }();
  return f;
}

using LogFn = void (*)(int32_t, const char*, const char*);

LogFn logFn() {
  static const LogFn f = [] {
    void* h = sfsyncLibrary();
    return h ? reinterpret_cast<LogFn>(dlvsym(h, "sf_log", "SFSYNC_1")) : nullptr;
  }();
  return f;
}

std::atomic<ShimPolicy*> gPolicy{nullptr};

// Made on the first interposed call (`foreignGloo`: a call of a foreign Gloo,
// shim/gloo_host.h). Leaked on purpose: it is used from the shim's exit hook,
// after static destructors may have run.
ShimPolicy& policy(bool foreignGloo = false) {
  if (ShimPolicy* p = gPolicy.load(std::memory_order_acquire)) return *p;
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  if (ShimPolicy* p = gPolicy.load(std::memory_order_relaxed)) return *p;
  ShimConfig config = shimConfigFromEnvironment();
  config.foreignGloo = foreignGloo;
  sf_window_state_v1 s{};
  s.struct_size = sizeof s;
  const WindowStateFn f = windowStateFn();
  if (f && f(nullptr, SF_INTERNAL_FOLLOW, &s) == SF_OK) config.strict = s.strict != 0;
  ShimPolicy::WindowSource source;
  if (f) {
    source = [f](sf_window_state_v1* out) { return f(nullptr, 0, out) == SF_OK; };
  }
  auto* p = new ShimPolicy(std::move(config), std::move(source),
                           [](int level, const std::string& line) { log(level, line); });
  gPolicy.store(p, std::memory_order_release);
  return *p;
}

// At load: tell libsfsync that the default context's windows are followed
// (so that it does not say they affect nothing). Makes nothing.
// A Python host's windows go to the in-process layer (shim/python_host.h).
__attribute__((constructor)) void followDefaultContext() {
  sf_window_state_v1 s{};
  s.struct_size = sizeof s;
  if (const WindowStateFn f = windowStateFn()) f(nullptr, SF_INTERNAL_FOLLOW, &s);
  handPythonHost();
}

}  // namespace

bool pluginUsable() {
  static const bool usable = [] {
    if (windowStateFn()) return true;
    log(SF_LOG_WARN, std::string("libsfsync.so has no sf_internal_window_state_v1@") +
                         SF_INTERNAL_NODE + " (another version than this shim): passing every "
                         "call through");
    return false;
  }();
  return usable;
}

sf_shim_decision decide(const sf_shim_call& call, std::string* failure) {
  try {
    ShimPolicy& p = policy();
    sf_shim_decision d = p.decide(call);
    if (d.action == SF_SHIM_FAIL && failure) *failure = "sfsync shim: " + p.failure();
    return d;
  } catch (...) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) log(SF_LOG_WARN, "internal error deciding a call: passing it");
    return sf_shim_decision{};  // SF_SHIM_PASS
  }
}

sf_shim_decision decideForeignGloo(const std::string& why, std::string* failure) {
  try {
    ShimPolicy& p = policy(true);
    sf_shim_decision d = p.decideForeignGloo(why);
    if (d.action == SF_SHIM_FAIL && failure) *failure = "sfsync shim: " + p.failure();
    return d;
  } catch (...) {
    return sf_shim_decision{};  // SF_SHIM_PASS: the call is forwarded unread anyway
  }
}

ReduceClass classifyReduce(const void* identity, size_t elementSize, const ReduceFunction& fn) {
  try {
    return policy().classifier().classify(identity, elementSize, fn);
  } catch (...) {
    return ReduceClass{};
  }
}

void localResult(void* out, const void* in, int64_t numel, sf_dtype dtype, double factor) {
  sfsync::copyScaled(out, in, numel, dtype, factor);
}

bool finish() {
  ShimPolicy* p = gPolicy.load(std::memory_order_acquire);
  try {
    return !p || p->finish();
  } catch (...) {
    return true;
  }
}

void log(int level, const std::string& message) {
  if (const LogFn f = logFn()) {
    f(level, "shim", message.c_str());
  } else if (level == SF_LOG_WARN) {  // no libsfsync.so: its logger's default, stderr at WARN
    std::fprintf(stderr, "sfsync shim: %s\n", message.c_str());
  }
}

}  // namespace sfshim

extern "C" void sf_shim_follow_in_process(void) {
  try {
    sfshim::policy().followInProcess();
  } catch (...) {
  }
}

extern "C" sf_status sf_shim_report_json(char* buffer, int64_t capacity, int64_t* length) {
  std::string json = "{}";
  try {
    if (sfshim::ShimPolicy* p = sfshim::gPolicy.load(std::memory_order_acquire)) {
      json = p->reportJson();
    }
  } catch (...) {
  }
  if (length) *length = int64_t(json.size());
  if (buffer && capacity > 0) {
    const size_t n = std::min(json.size(), size_t(capacity - 1));
    std::memcpy(buffer, json.data(), n);
    buffer[n] = '\0';
  }
  return SF_OK;
}
