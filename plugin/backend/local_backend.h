#pragma once
// The world-size-1 backend: every reduction is the identity (after scaling),
// no peer, no thread, no connection.

#include "plugin/backend/backend.h"

namespace sfsync {

class LocalBackend : public Backend {
 public:
  const char* name() const override { return "local"; }
  void connect() override {}
  std::unique_ptr<Work> startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                       ReduceSpec spec) override;
  // Since 0.3: one segment, the identity after scaling.
  std::unique_ptr<Work> startReduceScatter(void* data, int64_t segmentElems, sf_dtype dtype,
                                           ReduceSpec spec) override;
  std::unique_ptr<Work> startAllgather(void*, int64_t, sf_dtype, ReduceSpec) override;
  void allreduceSumFloat64(double*, int64_t) override {}
  void allreduceMaxInt64(int64_t*, int64_t) override {}
  void barrierQuietly() noexcept override {}
  void broadcast(void*, size_t, int) override {}  // the only rank is the root
};

}  // namespace sfsync
