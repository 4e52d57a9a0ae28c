#pragma once
// The backends a context of libsfsync.so makes (the orchestrator names none:
// plugin/orchestrator/context.h, BackendMaker): host memory over Gloo, or
// locally at world size 1; CUDA memory over NCCL (its module, loaded at the
// first use: SF_ERR_UNSUPPORTED without CUDA, NCCL or a GPU).

#include "plugin/orchestrator/context.h"

namespace sfsync {

BackendMaker defaultBackends();

}  // namespace sfsync
