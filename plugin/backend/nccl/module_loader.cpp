#include "plugin/backend/nccl/module_loader.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "plugin/core/env.h"
#include "plugin/core/error.h"

namespace sfsync {

namespace {

constexpr const char* kModuleName = "libsfsync_nccl.so";

std::mutex gMutex;
const sfn_api* gApi = nullptr;
std::string gPath;

// The directory of the binary that holds this code (libsfsync.so, or a test
// executable that links the internals statically), with a trailing '/'.
std::string ownDirectory() {
  Dl_info info;
  if (::dladdr(reinterpret_cast<void*>(&ownDirectory), &info) == 0 || !info.dli_fname) return "";
  const std::string self = info.dli_fname;
  const size_t slash = self.rfind('/');
  return slash == std::string::npos ? "" : self.substr(0, slash + 1);
}

// Loads one candidate; "" on success, else why not. A candidate that was
// opened is never closed, even when it is refused: its static constructors
// have run, and a library whose startup files do not call __cxa_finalize at
// dlclose (the portable wheel's, built by Zig) leaves the destructors they
// registered pointing into unmapped memory, which the process then calls at
// exit (a crash after "NCCL backend not available").
std::string tryLoad(const std::string& path) {
  ::dlerror();
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* e = ::dlerror();
    return e ? e : "dlopen failed";
  }
  auto entry = reinterpret_cast<sfn_entry_fn>(::dlsym(handle, SFN_ENTRY_POINT));
  if (!entry) return path + ": no symbol " SFN_ENTRY_POINT " (not an sfsync NCCL module)";
  const sfn_api* api = entry(SFN_ABI_VERSION);
  if (!api) {
    // The module loaded but could not load the CUDA runtime or NCCL (or a
    // function of theirs): its reason.
    auto initError = reinterpret_cast<sfn_init_error_fn>(::dlsym(handle, SFN_INIT_ERROR_ENTRY));
    const char* why = initError ? initError() : nullptr;
    if (why && *why) return why;
  }
  // The table up to 0.4's scale_start is required; entries appended since
  // (0.5's *_used_start) are optional: NcclBackend checks struct_size
  // before it uses one, and a module without them moves whole segments.
  if (!api || api->struct_size < offsetof(sfn_api, scale_start) + sizeof api->scale_start) {
    return path + ": module of another interface version (this libsfsync.so needs " +
           std::to_string(SFN_ABI_VERSION) + "); use the module built with it";
  }
  gApi = api;
  gPath = path;
  return "";
}

}  // namespace

const sfn_api& ncclModule() {
  std::lock_guard<std::mutex> lock(gMutex);
  if (gApi) return *gApi;
  std::vector<std::string> candidates;
  const char* env = envValue("SF_NCCL_MODULE");
  if (env) {
    candidates.push_back(env);  // an explicit choice is the only one tried
  } else {
    // Next to libsfsync.so; only if it is not there, the loader's search path.
    const std::string dir = ownDirectory();
    if (!dir.empty()) candidates.push_back(dir + kModuleName);
    if (candidates.empty() || ::access(candidates.front().c_str(), F_OK) != 0) {
      candidates.push_back(kModuleName);
    }
  }
  std::string why;
  for (const auto& c : candidates) {
    const std::string e = tryLoad(c);
    if (e.empty()) return *gApi;
    why += (why.empty() ? "" : "; ") + c + ": " + e;
  }
  fail(SF_ERR_UNSUPPORTED,
       std::string("the NCCL backend is not available: cannot load its module ") + kModuleName +
           (env && *env ? " (from SF_NCCL_MODULE)" : "") + " (" + why +
           "). It needs the CUDA runtime (libcudart.so.13) and NCCL (libnccl.so.2), which it "
           "loads itself: the copies already loaded in the process, else from the library "
           "path, or the files SF_CUDART_LIBRARY / SF_NCCL_LIBRARY name; host gradients work "
           "with Gloo without them");
}

std::string ncclModulePath() {
  std::lock_guard<std::mutex> lock(gMutex);
  return gPath;
}

}  // namespace sfsync
