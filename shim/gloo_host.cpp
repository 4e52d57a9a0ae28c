#include "shim/gloo_host.h"

#include <dlfcn.h>
#include <gloo/config.h>

#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

#include "plugin/core/env.h"
#include "sfsync.h"
#include "shim/forward.h"
#include "shim/shim_instance.h"

#ifndef SF_SHIM_GLOO_LIBRARY
#define SF_SHIM_GLOO_LIBRARY ""
#endif

namespace sfshim {
namespace {

constexpr const char* kSymbol = "_ZN4gloo9allreduceERKNS_16AllreduceOptionsE";
constexpr const char* kSystem = "libgloo.so.0";
// The portable wheel's shim (SF_VENDORED_DEPS: Zig's libc++ and the vendored
// Gloo's headers) cannot read the structures of a system Gloo built with
// libstdc++: every Gloo is another Gloo to it.
#ifdef SF_SHIM_PORTABLE
constexpr bool kPortable = true;
#else
constexpr bool kPortable = false;
#endif

std::string builtAgainst() {
  return "built against Gloo " + std::to_string(GLOO_VERSION_MAJOR) + "." +
         std::to_string(GLOO_VERSION_MINOR) + "." + std::to_string(GLOO_VERSION_PATCH) +
         (SF_SHIM_GLOO_LIBRARY[0] ? std::string(", ") + SF_SHIM_GLOO_LIBRARY : std::string());
}

std::string objectOf(const void* address) {
  Dl_info info{};
  if (!address || !dladdr(address, &info) || !info.dli_fname) return "";
  return *info.dli_fname ? info.dli_fname : "the main program";
}

std::string realPath(const std::string& path) {
  char buf[PATH_MAX];
  return (!path.empty() && ::realpath(path.c_str(), buf)) ? std::string(buf) : path;
}

// gloo::allreduce of the loaded system libgloo.so.0 (null if not loaded).
void* systemAllreduce() {
  void* handle = dlopen(kSystem, RTLD_LAZY | RTLD_NOLOAD);
  if (!handle) return nullptr;
  void* f = dlsym(handle, kSymbol);
  dlclose(handle);  // drops only the reference RTLD_NOLOAD took
  return f;
}

GlooHost resolve(const Dl_info& caller) {
  GlooHost h;
  h.caller = caller.dli_fname && *caller.dli_fname ? caller.dli_fname : "the main program";
  // The caller's own scope: what its PLT would have bound to without the
  // preloaded shim in front (the dependency search of a dlopen handle never
  // includes the preloaded objects).
  if (caller.dli_fname && *caller.dli_fname) {
    if (void* handle = dlopen(caller.dli_fname, RTLD_LAZY | RTLD_NOLOAD)) {
      h.forward = dlsym(handle, kSymbol);
      dlclose(handle);
    }
  }
  if (!h.forward || inShim(h.forward)) h.forward = dlsym(RTLD_NEXT, kSymbol);  // the main program
  void* const system = systemAllreduce();
  if (!h.forward || inShim(h.forward)) h.forward = system;
  h.definer = objectOf(h.forward);
  const std::string built = realPath(SF_SHIM_GLOO_LIBRARY);
  const std::string loaded = realPath(objectOf(system));
  // Where the file the shim was built against exists here, the loaded
  // libgloo.so.0 must be that file (another libgloo.so.0 may be another Gloo).
  const bool builtFileHere = !built.empty() && ::access(built.c_str(), F_OK) == 0;
  h.system = !kPortable && h.forward && h.forward == system && (!builtFileHere || loaded == built);

  const std::string systemState =
      system ? "the system " + std::string(kSystem) + " loaded here is " + loaded
             : std::string(kSystem) + " is not loaded in this process";
  if (h.system) {
    h.facts = "host Gloo: gloo::allreduce called from " + h.caller + " is the system " + kSystem +
              "'s (" + loaded + "; " + builtAgainst() + "): interposed";
    return h;
  }
  std::string where;
  if (!h.forward) {
    where = "gloo::allreduce has no definition reachable from " + h.caller;
  } else if (realPath(h.definer) == realPath(h.caller)) {
    where = "gloo::allreduce statically inside " + h.definer;
  } else {
    where = "gloo::allreduce in " + h.definer + " (called from " + h.caller + ")";
  }
  const bool portableSystem = kPortable && h.forward && h.forward == system;
  h.facts = "host Gloo: " + where +
            (portableSystem ? std::string(", the system ") + kSystem + ", which the portable "
                              "wheel's shim does not read"
                            : std::string(", not the system ") + kSystem) +
            " (" + builtAgainst() + "; " + systemState + ")";
  const char* steps = sfsync::envValue("SF_ACCUMULATION_STEPS");
  const std::string windows =
      steps ? "SF_ACCUMULATION_STEPS=" + std::string(steps) + " and sf_begin_accumulation"
                      : "SF_ACCUMULATION_STEPS and sf_begin_accumulation";
  std::string resolved;
  if (portableSystem) {
    resolved = "is the system " + std::string(kSystem) + "'s, and this shim is the portable "
               "wheel's (built with libc++ and its own Gloo's headers, it cannot read a system "
               "Gloo's structures; build sfsync from source against this Gloo for its windows)";
  } else if (!h.forward) {
    resolved = "has no definition but the shim's";
  } else if (realPath(h.definer) == realPath(h.caller)) {
    resolved = "is its own (a Gloo built into it, as pip's torch builds one into libtorch_cpu.so)";
  } else {
    resolved = "is " + h.definer + "'s";
  }
  h.problem = "this host's Gloo is not the system " + std::string(kSystem) +
              " the shim was built against: gloo::allreduce called from " + h.caller + " " +
              resolved + ". The shim never reads another Gloo's structures: nothing is "
              "deferred and windows (" + windows + ") have no effect on this host's "
              "all-reduces. Use the in-process integration instead: "
              "sfsync.torch.attach(ddp_model) or sfsync.torch.GradientSync(model)";
  return h;
}

}  // namespace

const GlooHost& glooHostFor(const void* returnAddress) {
  constexpr int kSlots = 8;
  thread_local const void* seen[kSlots] = {};
  thread_local const GlooHost* hosts[kSlots] = {};
  thread_local int next = 0;
  for (int i = 0; i < kSlots; ++i) {
    if (seen[i] == returnAddress && hosts[i]) return *hosts[i];
  }
  static std::mutex m;
  // Per calling object, never freed (used until exit, from any thread).
  static auto* byObject = new std::map<const void*, std::unique_ptr<GlooHost>>();
  static GlooHost unknown;
  const GlooHost* host = &unknown;
  try {
    Dl_info info{};
    if (!dladdr(returnAddress, &info)) info = Dl_info{};
    std::string facts;
    {
      std::lock_guard<std::mutex> lock(m);
      auto& slot = (*byObject)[info.dli_fbase];
      if (!slot) {
        slot.reset(new GlooHost(resolve(info)));
        facts = slot->facts;
      }
      host = slot.get();
    }
    if (!facts.empty()) log(SF_LOG_INFO, facts);
  } catch (...) {
    return unknown;  // forward null: the interposer says the real function was not found
  }
  seen[next] = returnAddress;
  hosts[next] = host;
  next = (next + 1) % kSlots;
  return *host;
}

}  // namespace sfshim
