#pragma once
// The process's one ShimPolicy and what the interposers call on it: the
// decision for an all-reduce, the classification of a Gloo reduce function,
// the local result of a deferred call, the exit. Also the one connection to
// libsfsync.so's private interface (sf_internal_window_state_v1, looked up
// by version) and the messages, which go through sfsync's one logger
// (sf_log, subsystem "shim").

#include <cstdint>
#include <string>

#include "sfsync.h"
#include "shim/policy/reduce_probe.h"
#include "shim/policy/shim_call.h"

namespace sfshim {

// False (said once) if libsfsync.so lacks the private interface this shim
// speaks: then every call is forwarded untouched.
bool pluginUsable();

// The decision for one interposed all-reduce; never throws. SF_SHIM_FAIL
// comes with the reason in *failure ("sfsync shim: ..."); on an internal
// error the call passes.
sf_shim_decision decide(const sf_shim_call& call, std::string* failure);

// The decision for a Gloo all-reduce of a host whose Gloo is not the one the
// shim was built against (shim/gloo_host.h), whose arguments are never read:
// SF_SHIM_PASS, or with SF_STRICT=1 SF_SHIM_FAIL with *failure. `why` is
// said once at WARN. Never throws.
sf_shim_decision decideForeignGloo(const std::string& why, std::string* failure);

// Classifies a reduce function (see ReduceClassifier), cached under identity.
ReduceClass classifyReduce(const void* identity, size_t elementSize, const ReduceFunction& fn);

// out[i] = factor x in[i] for a deferred call in host memory (in == out allowed).
void localResult(void* out, const void* in, int64_t numel, sf_dtype dtype, double factor);

// At exit: the open window, the report. False when SF_STRICT=1 and some
// misuse was an error (the exit hook then ends the process with status 1).
bool finish();

// One line through sfsync's logger at `level` (SF_LOG_WARN, SF_LOG_INFO).
void log(int level, const std::string& message);

}  // namespace sfshim

// Called by the in-process layer (python/sfsync/torch/follow.py) when it
// follows the first DDP of a Python host: the shim passes every call from
// then on (ShimPolicy::followInProcess). Until then, and in a Python host
// without DDP, the shim's own windows apply. Exported by libsfsync_shim.so.
extern "C" __attribute__((visibility("default"))) void sf_shim_follow_in_process(void);

// The report as JSON (what SF_SHIM_REPORT receives), NUL-terminated, for
// tests and tools; exported by libsfsync_shim.so (never by libsfsync.so).
// Writes at most `capacity` bytes; `length` (optional) receives the full
// length. "{}" before the first interposed call. Never fails.
extern "C" __attribute__((visibility("default"))) sf_status sf_shim_report_json(
    char* buffer, int64_t capacity, int64_t* length);
