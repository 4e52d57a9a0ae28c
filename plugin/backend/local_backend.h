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
  void allreduceMaxInt64(int64_t*, int64_t) override {}
  void barrierQuietly() noexcept override {}
  void broadcast(void*, size_t, int) override {}  // the only rank is the root
};

}  // namespace sfsync
