#include "shim/python_host.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <cstdlib>
#include <string>

#include "plugin/core/env.h"
#include "sfsync.h"
#include "shim/forward.h"
#include "shim/shim_instance.h"

namespace sfshim {
namespace {

bool isDirectory(const std::string& path) {
  struct stat st{};
  return !path.empty() && stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string dirOf(const void* address) {
  Dl_info info{};
  if (!address || !dladdr(address, &info) || !info.dli_fname) return "";
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string bootFolder() {
  // An installed package holds the shim and _boot/ side by side (setup.py).
  const std::string beside = dirOf(reinterpret_cast<const void*>(&handPythonHost)) + "/_boot";
  if (isDirectory(beside)) return beside;
#ifdef SF_SHIM_PYTHON_BOOT
  if (isDirectory(SF_SHIM_PYTHON_BOOT)) return SF_SHIM_PYTHON_BOOT;
#endif
  return "";
}

}  // namespace

void handPythonHost() {
  if (!dlsym(RTLD_DEFAULT, "Py_Main")) return;  // not a Python interpreter
  const char* follow = sfsync::envRawValue("SF_FOLLOW_HOST");
  if (follow && std::string(follow) == "0") return;  // the shim's own windows, as before 0.5
  const std::string boot = bootFolder();
  if (boot.empty()) {
    log(SF_LOG_WARN, "a Python host, but sfsync's boot folder (python/sfsync/_boot) was not "
                     "found next to the shim nor in the source tree: its windows are the "
                     "shim's own, which cannot see the optimizer step");
    return;
  }
  const char* path = std::getenv("PYTHONPATH");
  const std::string joined = path && *path ? boot + ":" + path : boot;
  setenv("PYTHONPATH", joined.c_str(), 1);
  setenv("SF_FOLLOW_HOST", "1", 1);
  if (!std::getenv("SFSYNC_LIBRARY")) {
    if (void* h = sfsyncLibrary()) {
      if (void* f = dlsym(h, "sf_abi_version")) {
        Dl_info info{};
        if (dladdr(f, &info) && info.dli_fname) setenv("SFSYNC_LIBRARY", info.dli_fname, 0);
      }
    }
  }
  log(SF_LOG_INFO, "a Python host: every DistributedDataParallel it makes follows no_sync() "
                   "and the optimizer step in-process (" + boot +
                       "); the shim passes the all-reduces of a host so followed through");
}

}  // namespace sfshim
