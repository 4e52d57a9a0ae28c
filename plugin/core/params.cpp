#include "plugin/core/params.h"

#include <cstring>

namespace sfsync {

namespace {

const Param kParams[] = {
    {"SF_RANK", "int", "0", "this process's rank (first of the launchers' rank variables)",
     "launch/launcher_env.cpp"},
    {"SF_WORLD_SIZE", "int", "1", "the number of ranks", "launch/launcher_env.cpp"},
    {"SF_LOCAL_RANK", "int", "0", "this process's rank on its host", "launch/launcher_env.cpp"},
    {"SF_RENDEZVOUS", "text", "the launcher's meeting point",
     "env://, tcp://host:port, mpi://, file:///dir, redis://host:port[/prefix], memory://name",
     "launch/launcher_env.cpp"},
    {"SF_NCCL_MODULE", "path", "libsfsync_nccl.so next to libsfsync.so",
     "the NCCL backend module to load (the only one tried)", "backend/nccl/module_loader.cpp"},
    {"SF_CUDART_LIBRARY", "path", "the loaded copy, else libcudart.so.13",
     "the CUDA runtime the NCCL module loads (the only one tried)",
     "backend/nccl/module/nccl_module.cpp"},
    {"SF_NCCL_LIBRARY", "path", "the loaded copy, else libnccl.so.2",
     "the NCCL the NCCL module loads (the only one tried)", "backend/nccl/module/nccl_module.cpp"},
    {"SF_MPI_LIBRARY", "path", "libmpi.so.40, libmpi.so (Open MPI); libmpi.so.12, ... (PMI)",
     "the libmpi the mpi:// bootstrap loads; none turns it off", "launch/mpi_bootstrap.cpp"},
    {"SF_BACKEND", "choice", "auto", "auto, gloo, nccl", "launch/launch_options.cpp"},
    {"SF_BUCKET_CAP_MB", "number", "25", "bucket cap in MiB, positive and finite",
     "launch/launch_options.cpp"},
    {"SF_FIRST_BUCKET_CAP_MB", "number", "1", "first bucket cap in MiB, positive and finite",
     "launch/launch_options.cpp"},
    {"SF_REDUCE", "choice", "average", "average, sum, prescaled_sum, weighted", "launch/launch_options.cpp"},
    {"SF_PRESCALE", "number", "1", "the pre-scale factor of prescaled_sum",
     "launch/launch_options.cpp"},
    {"SF_TIMEOUT_MS", "ms", "300000", "every rendezvous and collective, in ms (clamped to 2^40)",
     "launch/launch_options.cpp"},
    {"SF_GLOO_HOSTNAME", "text", "127.0.0.1 for local rendezvous, else the host name",
     "the address peers use to reach this rank", "rendezvous/store_factory.cpp"},
    {"SF_STRICT", "flag", "0", "1: window misuse that is otherwise a warning is an error",
     "core/strict.cpp"},
    {"SF_MAX_INFLIGHT", "int", "4", "Gloo lanes: bucket collectives on the wire at once (1..16)",
     "launch/launch_options.cpp"},
    {"SF_SHARD", "choice", "none", "none, flat, parameter: sharded windows",
     "launch/launch_options.cpp"},
    {"SF_WIRE_DTYPE", "choice", "native", "native, bf16, fp16: float32 buckets carried as 16 bits",
     "launch/launch_options.cpp"},
    {"SF_TRACE", "path", "unset", "a Chrome/Perfetto trace per rank to this path", "core/tracer.cpp"},
    {"SF_AUTH_TOKEN", "text", "unset", "the job's secret for rank 0's env:// store",
     "rendezvous/job_token.cpp"},
    {"SF_AUTH_TOKEN_FILE", "path", "unset", "a file holding the token", "rendezvous/job_token.cpp"},
    {"SF_DEBUG", "level", "WARN", "WARN, INFO, TRACE: the logger's level", "core/log.cpp"},
    {"SF_DEBUG_FILE", "path", "stderr", "the log file (%h host, %p pid, %r rank)", "core/log.cpp"},
    {"SF_ACCUMULATION_STEPS", "int", "unset",
     "the shim: automatic windows of N backward passes", "shim/policy/shim_policy.cpp"},
    {"SF_SHIM_MIN_BYTES", "int", "65536", "the shim: smaller all-reduces always pass",
     "shim/policy/shim_policy.cpp"},
    {"SF_SHIM_REPORT", "path", "unset", "the shim: JSON report at exit (%r rank, %p pid)",
     "shim/policy/shim_policy.cpp"},
    {"SF_FOLLOW_HOST", "int", "unset",
     "1: every DDP of a Python host follows its windows in-process (the shim sets it); "
     "0: the shim's own windows", "shim/python_host.cpp"},
};

}  // namespace

const Param* params(size_t* count) {
  *count = sizeof kParams / sizeof kParams[0];
  return kParams;
}

const Param* findParam(const char* name) {
  for (const Param& p : kParams) {
    if (std::strcmp(p.name, name) == 0) return &p;
  }
  return nullptr;
}

}  // namespace sfsync
