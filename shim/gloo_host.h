#pragma once
// Which Gloo is behind a call of the interposed gloo::allreduce: the system
// libgloo.so.0 whose headers the shim was built against (Debian's torch links
// it), or a Gloo the host carries inside itself (pip's torch builds its own,
// of another layout, into libtorch_cpu.so, and calls its gloo::allreduce
// through the PLT, so the preloaded definition takes those calls too). The
// shim reads AllreduceOptions only of the system one; another Gloo's calls go
// to that Gloo's own gloo::allreduce unread.

#include <string>

namespace sfshim {

struct GlooHost {
  // The gloo::allreduce the caller would have called without the shim: the
  // first definition in the caller's own lookup scope (its object and its
  // dependencies), else the next one in the global scope after the shim, else
  // the loaded libgloo.so.0's. Null if none.
  void* forward = nullptr;
  // `forward` is the system libgloo.so.0's (the loaded one's, and the file
  // the shim was built against where that file exists here).
  bool system = false;
  std::string caller;   // the object that called (its path)
  std::string definer;  // the object defining `forward`
  std::string facts;    // said at INFO once per caller object: "host Gloo: ..."
  std::string problem;  // !system: the WARN (and SF_STRICT=1 error) without its prefix
};

// The Gloo behind a call returning to `returnAddress`. Cached per call site
// (per thread) and per calling object; the facts are said at INFO the first
// time an object calls. Never throws.
const GlooHost& glooHostFor(const void* returnAddress);

}  // namespace sfshim
