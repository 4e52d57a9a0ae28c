#pragma once
// Classifies a host reduction function that comes without a type (Gloo's
// AllreduceOptions carry a std::function and an element size) by calling it
// on known inputs. Responsible for "is this a float sum, and of which float
// type"; not for deciding what to do with the call (ShimPolicy).

#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <utility>

#include "shim/policy/shim_call.h"

namespace sfshim {

struct ReduceClass {
  sf_dtype dtype = SF_SHIM_DTYPE_OTHER;
  sf_shim_op op = SF_SHIM_OP_OTHER;
};

using ReduceFunction = std::function<void(void* out, const void* a, const void* b, size_t n)>;

// Probes `fn` on four elements of each float type of `elementSize` bytes
// (float32; float64; float16 then bfloat16) and compares the output bit for
// bit with the sum. Chosen so that no max, min, product, integer or bitwise
// reduction, nor a sum of another float type, gives the same bits. A
// function that throws is "other".
ReduceClass probeReduce(size_t elementSize, const ReduceFunction& fn);

// probeReduce with a cache keyed by (identity, element size): host functions
// are plain function pointers whose addresses do not change (template
// instantiations may differ between shared objects, hence probing at all).
class ReduceClassifier {
 public:
  ReduceClass classify(const void* identity, size_t elementSize, const ReduceFunction& fn);
  size_t probes() const;  // how many times a function was actually probed

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<const void*, size_t>, ReduceClass> cache_;
  size_t probes_ = 0;
};

}  // namespace sfshim
