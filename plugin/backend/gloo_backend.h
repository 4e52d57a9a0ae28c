#pragma once
// The Gloo backend: host-memory buckets reduced with gloo::allreduce over TCP.
// Everything Gloo does runs on one worker thread (OrderedExecutor): buckets
// started by grad-ready overlap the host's backward pass, and no socket work
// happens on a host thread (where a dead peer's SIGPIPE would kill the
// process). Every Gloo exception is turned into sfsync::Error here.

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

class Rendezvous;

class GlooBackend : public Backend {
 public:
  // `rendezvous` is the context's: connect() takes the store from it.
  GlooBackend(const sf_options& opts, std::shared_ptr<Rendezvous> rendezvous);
  ~GlooBackend() override;

  const char* name() const override { return "gloo"; }
  void connect() override;
  std::unique_ptr<Work> startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                       ReduceSpec spec) override;
  void allreduceMaxInt64(int64_t* data, int64_t n) override;
  void barrierQuietly() noexcept override;
  void broadcast(void* data, size_t bytes, int root) override;

 private:
  void connectHere();  // on the worker thread

  sf_options opts_;
  std::shared_ptr<Rendezvous> rendezvous_;
  std::shared_ptr<gloo::rendezvous::Store> store_;
  std::shared_ptr<gloo::Context> context_;
  OrderedExecutor executor_;  // declared last: joined first
};

}  // namespace sfsync
