#pragma once
// The Gloo backend: host-memory buckets reduced with gloo::allreduce over TCP.
// Collectives run one at a time on a worker thread (OrderedExecutor) so that
// buckets started by grad-ready overlap the host's backward pass. Every Gloo
// exception is turned into sfsync::Error here.

#include <memory>

#include "plugin/backend/backend.h"
#include "plugin/backend/ordered_executor.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}
}  // namespace gloo

namespace sfsync {

class GlooBackend : public Backend {
 public:
  explicit GlooBackend(const sf_options& opts);
  ~GlooBackend() override;

  const char* name() const override { return "gloo"; }
  void connect() override;
  std::unique_ptr<Work> startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                       ReduceSpec spec) override;
  void allreduceMaxInt64(int64_t* data, int64_t n) override;
  void barrierQuietly() noexcept override;

 private:
  sf_options opts_;
  std::shared_ptr<gloo::rendezvous::Store> store_;
  std::shared_ptr<gloo::Context> context_;
  OrderedExecutor executor_;  // declared last: joined first
};

}  // namespace sfsync
