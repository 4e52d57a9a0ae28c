#pragma once
// The Gloo backend: host-memory buckets reduced with gloo::allreduce over TCP.
// Everything Gloo does runs on worker threads (OrderedExecutor): buckets
// started by grad-ready overlap the host's backward pass, and no socket work
// happens on a host thread (where a dead peer's SIGPIPE would kill the
// process). Every Gloo exception is turned into sfsync::Error here.
//
// Lanes: max_inflight worker threads that share the one Gloo context
// connectHere makes (one connection per peer, as ProcessGroupGloo's threads
// share theirs), so that several bucket collectives are on the wire at once;
// each piece has a Gloo tag of its own, which keeps concurrent collectives
// on a pair apart. Buckets over 8 MiB travel as pieces on consecutive lanes.
// The n-th piece (all-reduces and reduce-scatters, one sequence) goes to
// lane n mod max_inflight with tag 1 + n: the reducer starts buckets in the
// same order on every rank, so every rank uses the same lane and tag for the
// same piece, and each lane keeps its order. Parameter all-gathers have a
// worker and a tag sequence of their own; the small control collectives
// (float64 sum, layout max, broadcast, barrier) run on lane 0 with tag 0.
// When one lane fails, the collectives still queued on the others fail at
// once with that error (the whole synchronization fails, as with one lane).
//
// Wire dtype: with wire_dtype bf16/fp16 a float32 bucket is rounded into a
// per-lane 16-bit scratch buffer, reduced there (float32 sums rounded back to
// 16 bits) and widened back; see sf_options.wire_dtype for the error bound.

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/backend/ordered_executor.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}
namespace transport {
class Device;
}
}  // namespace gloo

namespace sfsync {

class Rendezvous;

class GlooBackend : public Backend {
 public:
  // `rendezvous` is the context's: connect() takes the store from it.
  GlooBackend(const sf_options& opts, std::shared_ptr<Rendezvous> rendezvous);
  // A backend with a rendezvous of its own and no admission check: the
  // transport alone (tools and tests of the connect; a Context passes its
  // one Rendezvous, which admits ranks, to all its backends).
  explicit GlooBackend(const sf_options& opts);
  ~GlooBackend() override;

  const char* name() const override { return "gloo"; }
  void connect() override;
  std::unique_ptr<Work> startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                       ReduceSpec spec) override;
  // Since 0.3: ring reduce-scatter on the lanes (pieces and tags as the
  // all-reduces'), ring all-gather on a worker of its own (its own tag
  // sequence: gathers are ordered among themselves, and may be on the wire
  // while the next window's reductions start).
  std::unique_ptr<Work> startReduceScatter(void* data, int64_t segmentElems, sf_dtype dtype,
                                           ReduceSpec spec) override;
  std::unique_ptr<Work> startAllgather(void* data, int64_t segmentElems, sf_dtype dtype,
                                       ReduceSpec spec) override;
  void allreduceSumFloat64(double* data, int64_t n) override;
  // Bytes this rank sent in reduce-scatters and all-gathers (payload).
  int64_t ringBytesSent() const { return ringBytesSent_.load(); }
  // The reduce-scatters' receive scratch held by all lanes (bytes; each
  // lane's is two chunks, gloo_ring.h). Call with no reduce-scatter in flight.
  size_t ringScratchBytes() const {
    size_t n = 0;
    for (const auto& s : ringScratch_) n += s.size();
    return n;
  }
  void allreduceMaxInt64(int64_t* data, int64_t n) override;
  void barrierQuietly() noexcept override;
  void broadcast(void* data, size_t bytes, int root) override;
  sf_dtype allreduceWireDtype(sf_dtype dtype) const override {
    return dtype == SF_DTYPE_FLOAT32 && opts_.wire_dtype != SF_DTYPE_FLOAT32 ? opts_.wire_dtype
                                                                             : dtype;
  }
  bool movesPadding(const ReduceSpec&, int64_t) const override {
    return false;  // slicePiece: used elements and tails
  }
  bool scalesInAPass(sf_dtype dtype) const override {
    // scaleInPlace around reduceNative (startAllreduce); the 16-bit wire
    // fuses its scales into the narrowing and widening.
    return (dtype == SF_DTYPE_FLOAT32 || dtype == SF_DTYPE_FLOAT64) &&
           allreduceWireDtype(dtype) == dtype;
  }

 private:
  void connectHere();  // on the worker thread
  // Gloo's full mesh through `store`, bounded by timeout_ms (connectGlooMesh).
  std::shared_ptr<gloo::Context> connectMesh(gloo::rendezvous::Store& store,
                                             const std::shared_ptr<gloo::transport::Device>& device);
  OrderedExecutor& executorOf(size_t lane) { return lane == 0 ? executor_ : *laneExecutors_[lane - 1]; }
  // The next piece's tag and lane (see Lanes above).
  struct PieceSlot {
    uint32_t tag;
    size_t lane;
  };
  PieceSlot nextPieceSlot();
  // Records the first failure of any lane; later tasks fail with it.
  void noteFailure(sf_status status, const std::string& message);
  void throwIfFailed();

  sf_options opts_;
  std::shared_ptr<Rendezvous> rendezvous_;
  std::shared_ptr<gloo::rendezvous::Store> store_;
  std::shared_ptr<gloo::Context> context_;                 // every lane's, once connected
  // World size 2: a second mesh, the rings' bytes from rank 1 to rank 0
  // (gloo_backend.cpp's [Note: a mesh per direction]); null otherwise.
  std::shared_ptr<gloo::Context> reverse_;
  size_t lanes_ = 0;                                       // 0 until connected
  std::vector<std::vector<uint16_t>> wireScratch_;         // per lane, used by its thread only
  uint64_t nextPiece_ = 0;                                 // of the next piece (nextPieceSlot)
  std::atomic<bool> failed_{false};
  std::mutex failureMutex_;
  sf_status failureStatus_ = SF_OK;
  std::string failure_;
  std::vector<std::unique_ptr<OrderedExecutor>> laneExecutors_;  // lanes 1..: joined before contexts go
  std::vector<std::vector<char>> ringScratch_;             // per lane: reduce-scatter receives
  uint64_t nextGather_ = 0;                                // of the next startAllgather
  std::atomic<int64_t> ringBytesSent_{0};
  OrderedExecutor gatherExecutor_;  // parameter all-gathers: joined before the lanes' context goes
  OrderedExecutor executor_;  // declared last: joined first
};

}  // namespace sfsync
