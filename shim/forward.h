#pragma once
// What every interposer of the shim shares: finding the real function it
// stands in front of, recognizing calls made by libsfsync.so itself. No
// decisions live here (shim/policy/).

namespace sfshim {

// The real definition of `name`: the next one after the shim in the global
// scope (dlsym(RTLD_NEXT)), else the one in `library` if that is already
// loaded, even RTLD_LOCAL (PyTorch loads libgloo.so.0 that way). Null if
// neither has it.
void* realSymbol(const char* name, const char* library);

// True if `returnAddress` lies in libsfsync.so or its NCCL module
// libsfsync_nccl.so: the plugin's own collectives are forwarded untouched and
// not counted.
bool calledFromPlugin(const void* returnAddress);

// Says `message` (sfsync's logger, WARN, subsystem "shim") the first time
// `flag` is seen false.
void sayOnce(bool& flag, const char* message);

// libsfsync.so.1, opened by the shim itself (RTLD_LOCAL) at its load, not a
// DT_NEEDED dependency: its own dependency, the system libgloo.so.0, must not
// join the global scope, where it would stand in front of the Gloo that a host
// carries inside itself (pip's torch: libtorch_cpu.so) and take its symbols
// (shim/README.md, "Supported hosts"). A host that loads libsfsync.so.1 too
// (ctypes, or linked) gets the same instance. Null (said once on stderr) if it
// cannot be loaded: then every call passes through.
void* sfsyncLibrary();

// True if `address` lies in libsfsync_shim.so itself.
bool inShim(const void* address);

}  // namespace sfshim
