#include "plugin/backend/local_backend.h"

#include <algorithm>

#include "plugin/core/dtype.h"

namespace sfsync {

namespace {
class DoneWork : public Work {
 public:
  void wait() override {}
};
}  // namespace

std::unique_ptr<Work> LocalBackend::startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                                   ReduceSpec spec) {
  const int64_t scaled = spec.dataEnd(numel);
  const double factor = spec.prescale * spec.postscale;
  if (factor != 1.0) scaleInPlace(data, scaled, dtype, factor);
  return std::make_unique<DoneWork>();
}

std::unique_ptr<Work> LocalBackend::startReduceScatter(void* data, int64_t segmentElems,
                                                       sf_dtype dtype, ReduceSpec spec) {
  return startAllreduce(data, segmentElems, dtype, spec);  // one rank: its segment is everything
}

std::unique_ptr<Work> LocalBackend::startAllgather(void*, int64_t, sf_dtype, ReduceSpec) {
  return std::make_unique<DoneWork>();  // the only segment is already in place
}

}  // namespace sfsync
