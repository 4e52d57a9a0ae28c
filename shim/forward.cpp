#include "shim/forward.h"

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "sfsync.h"
#include "shim/shim_instance.h"

namespace sfshim {

namespace {

// libsfsync.so and its NCCL module libsfsync_nccl.so (loaded later, with dlopen).
bool isPluginFile(const char* path) {
  if (!path) return false;
  const char* base = std::strrchr(path, '/');
  base = base ? base + 1 : path;
  return std::strncmp(base, "libsfsync.so", 12) == 0 ||
         std::strncmp(base, "libsfsync_nccl.so", 17) == 0;
}

}  // namespace

void* realSymbol(const char* name, const char* library) {
  if (void* f = dlsym(RTLD_NEXT, name)) return f;
  // Loaded RTLD_LOCAL by someone else: not in the global scope, but a handle
  // to it can still be had without loading anything.
  if (void* handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD)) {
    void* f = dlsym(handle, name);
    dlclose(handle);  // drops only the reference RTLD_NOLOAD took
    return f;
  }
  return nullptr;
}

bool calledFromPlugin(const void* returnAddress) {
  // A host calls from a handful of places: remember the last few per thread,
  // so that dladdr (a lookup under the loader's lock) runs once per place.
  constexpr int kSlots = 8;
  thread_local const void* seen[kSlots] = {};
  thread_local bool fromPlugin[kSlots] = {};
  thread_local int next = 0;
  for (int i = 0; i < kSlots; ++i) {
    if (seen[i] == returnAddress) return fromPlugin[i];
  }
  Dl_info info{};
  const bool plugin = dladdr(returnAddress, &info) && isPluginFile(info.dli_fname);
  seen[next] = returnAddress;
  fromPlugin[next] = plugin;
  next = (next + 1) % kSlots;
  return plugin;
}

void sayOnce(bool& flag, const char* message) {
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  if (flag) return;
  flag = true;
  log(SF_LOG_WARN, message);
}

bool inShim(const void* address) {
  static const void* base = [] {
    Dl_info self{};
    return dladdr(reinterpret_cast<const void*>(&inShim), &self) ? self.dli_fbase : nullptr;
  }();
  Dl_info info{};
  return address && base && dladdr(address, &info) && info.dli_fbase == base;
}

void* sfsyncLibrary() {
  static void* const handle = [] {
    constexpr const char* kName = "libsfsync.so.1";
    constexpr int kFlags = RTLD_NOW | RTLD_LOCAL;
    // As a DT_NEEDED entry would be found (the shim's RUNPATH, LD_LIBRARY_PATH,
    // the system's directories), else next to the shim (an installed pair).
    void* h = dlopen(kName, kFlags);
    std::string firstError = h ? "" : dlerror();
    Dl_info self{};
    if (!h && dladdr(reinterpret_cast<const void*>(&sfsyncLibrary), &self) && self.dli_fname) {
      std::string dir = self.dli_fname;
      const size_t slash = dir.rfind('/');
      if (slash != std::string::npos) h = dlopen((dir.substr(0, slash + 1) + kName).c_str(), kFlags);
    }
    if (!h) {
      std::fprintf(stderr,
                   "sfsync shim: cannot load %s (%s): passing every call through\n", kName,
                   firstError.c_str());
    }
    return h;
  }();
  return handle;
}

}  // namespace sfshim
