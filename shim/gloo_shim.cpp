// Interposes gloo::allreduce(const gloo::AllreduceOptions&), the one Gloo
// all-reduce that PyTorch's ProcessGroupGloo calls (Debian's libtorch_cpu.so
// imports it from the system libgloo.so.0). Gloo declares this function a
// friend of AllreduceOptions, so this definition can read the options: the
// buffers, the element size, the reduce function and the context (world size)
// -- of the system libgloo.so.0 only, whose headers the shim is built with. A
// host carrying its own Gloo (pip's torch, statically inside libtorch_cpu.so)
// calls this definition too, through its PLT: its calls are given to its own
// gloo::allreduce unread (shim/gloo_host.h), said at once.

#include <gloo/allreduce.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "shim/forward.h"
#include "shim/gloo_host.h"
#include "shim/shim_instance.h"

namespace {

using AllreduceFn = void (*)(const gloo::AllreduceOptions&);
using PlainReduce = void (*)(void*, const void*, const void*, size_t);

constexpr const char* kSymbol = "_ZN4gloo9allreduceERKNS_16AllreduceOptionsE";

AllreduceFn real() {
  static const AllreduceFn f =
      reinterpret_cast<AllreduceFn>(sfshim::realSymbol(kSymbol, "libgloo.so.0"));
  return f;
}

}  // namespace

namespace gloo {

__attribute__((visibility("default"))) void allreduce(const AllreduceOptions& opts) {
  const void* const caller = __builtin_return_address(0);
  const bool plugin = sfshim::calledFromPlugin(caller);
  const sfshim::GlooHost* host = plugin ? nullptr : &sfshim::glooHostFor(caller);
  if (host && !host->system) {
    // Another Gloo: its options are never read, not even to count bytes.
    const auto own = reinterpret_cast<AllreduceFn>(host->forward);
    if (!own) {
      throw std::runtime_error("sfsync shim: no gloo::allreduce found for a call from " +
                               host->caller);
    }
    if (!sfshim::pluginUsable()) return own(opts);
    std::string failure;
    if (sfshim::decideForeignGloo(host->problem, &failure).action == SF_SHIM_FAIL) {
      throw std::runtime_error(failure);
    }
    return own(opts);
  }
  const AllreduceFn forward = real();
  if (!forward) {
    throw std::runtime_error(
        "sfsync shim: the real gloo::allreduce was not found (neither after the shim nor in "
        "a loaded libgloo.so.0)");
  }
  if (plugin || !sfshim::pluginUsable()) return forward(opts);
  const auto& o = opts.impl_;
  if (o.out.empty() || !o.context) return forward(opts);  // Gloo reports the misuse

  sf_shim_call call{};
  call.api = SF_SHIM_API_GLOO;
  call.world_size = o.context->size;
  call.rank = o.context->rank;
  call.comm = o.context.get();
  call.buffer = o.out[0]->ptr;
  call.bytes = sf_shim_bytes(o.elements, o.elementSize);
  call.dtype = SF_SHIM_DTYPE_OTHER;
  call.op = SF_SHIM_OP_OTHER;
  if (o.reduce && o.elementSize > 0) {
    const PlainReduce* plain = o.reduce.target<PlainReduce>();
    const void* identity = plain ? reinterpret_cast<const void*>(*plain) : nullptr;
    const sfshim::ReduceClass r = sfshim::classifyReduce(
        identity, o.elementSize,
        [&](void* c, const void* a, const void* b, size_t n) { o.reduce(c, a, b, n); });
    call.dtype = r.dtype;
    call.op = r.op;
  }

  std::string failure;
  const sf_shim_decision d = sfshim::decide(call, &failure);
  // SF_STRICT=1 and a misuse became visible here: PyTorch raises it from backward().
  if (d.action == SF_SHIM_FAIL) throw std::runtime_error(failure);
  if (d.action != SF_SHIM_DEFER) return forward(opts);

  // Deferred: every output gets factor x (the local reduction of the inputs),
  // what Gloo would produce if every rank held this rank's values.
  const size_t bytes = o.elements * o.elementSize;
  const void* local = o.in.empty() ? o.out[0]->ptr : o.in[0]->ptr;
  const auto& inputs = o.in.empty() ? o.out : o.in;
  if (inputs.size() > 1) {
    // Gloo reduces a rank's own buffers first, with the host's function.
    void* acc = o.out[0]->ptr;
    if (acc != local) std::memcpy(acc, local, bytes);
    for (size_t i = 1; i < inputs.size(); ++i) o.reduce(acc, acc, inputs[i]->ptr, o.elements);
    local = acc;
  }
  sfshim::localResult(o.out[0]->ptr, local, int64_t(o.elements), call.dtype, d.factor);
  for (size_t i = 1; i < o.out.size(); ++i) std::memcpy(o.out[i]->ptr, o.out[0]->ptr, bytes);
}

}  // namespace gloo
