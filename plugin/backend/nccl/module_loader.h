#pragma once
// Finds and loads libsfsync_nccl.so, the module that loads CUDA and NCCL, so
// that libsfsync.so itself never does: SF_NCCL_MODULE if set, else the
// directory of libsfsync.so, else the loader's search path. Loaded once per
// process and never unloaded (NCCL and CUDA do not support it). Not
// responsible for what the module does.

#include <string>

#include "plugin/backend/nccl/module_api.h"

namespace sfsync {

// The module's table. Throws SF_ERR_UNSUPPORTED naming what was tried and
// why it failed (the loader's message, or the module's: which library or
// symbol is missing).
const sfn_api& ncclModule();

// Where the module was loaded from ("" before it was).
std::string ncclModulePath();

}  // namespace sfsync
