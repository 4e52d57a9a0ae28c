#pragma once
// The NCCL backend as libsfsync.so sees it: sfsync::Backend over the C table
// of the module (module_api.h). Responsible for choosing the GPU, meeting the
// peers (the NCCL unique id travels through the rendezvous store) or adopting
// the host's communicator, and turning module statuses into sfsync::Error.
// Not responsible for CUDA or NCCL calls: those live in the module only.

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/backend/nccl/module_api.h"
#include "plugin/core/deadline.h"

namespace gloo {
namespace rendezvous {
class Store;
}
}  // namespace gloo

namespace sfsync {

class Rendezvous;

// Loads the module and probes for a GPU; throws SF_ERR_UNSUPPORTED saying
// what is missing (sf_backend_available).
void checkNcclAvailable();

class NcclBackend : public Backend {
 public:
  // Loads the module and checks that a GPU is visible: SF_ERR_UNSUPPORTED
  // (naming the missing library or the CUDA error) otherwise.
  // `rendezvous` is the context's: the unique id travels through its store.
  NcclBackend(const sf_options& opts, std::shared_ptr<Rendezvous> rendezvous);
  ~NcclBackend() override;

  const char* name() const override { return "nccl"; }
  void connect() override;
  std::unique_ptr<Work> startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                       ReduceSpec spec) override;
  void allreduceMaxInt64(int64_t* data, int64_t n) override;
  // Since 0.3: ncclReduceScatter / ncclAllGather in place, on the plugin's
  // stream, in one sequence with the all-reduces (NCCL keeps one order).
  // Since 0.5, where spec.segmentUsed leaves padding in a segment: one NCCL
  // group of ncclReduce / ncclBroadcast calls (root r over segment r's used
  // elements, and for the reduce-scatter its reserved tail), so that the
  // padding stays off the wire as on Gloo (a module without those entries:
  // whole segments, as before).
  std::unique_ptr<Work> startReduceScatter(void* data, int64_t segmentElems, sf_dtype dtype,
                                           ReduceSpec spec) override;
  std::unique_ptr<Work> startAllgather(void* data, int64_t segmentElems, sf_dtype dtype,
                                       ReduceSpec spec) override;
  // False where the module has the 0.5 entries (the padding stays off).
  bool movesPadding(const ReduceSpec& spec, int64_t segmentElems) const override;
  // A goodbye through the rendezvous store, not a collective: publishes
  // "nccl_bye/<rank>" and waits (at most min(timeout_ms, 10 s)) until every
  // rank published its own, so that the communicator is torn down once no
  // peer uses it. A peer still synchronizing waits in its bucket's
  // collective, which fails at its timeout (or at this rank's departure),
  // instead of pairing with a teardown collective.
  void barrierQuietly() noexcept override;
  // SF_ERR_UNSUPPORTED: sf_broadcast moves host memory, which is Gloo's.
  void broadcast(void* data, size_t bytes, int root) override;

  void* allocate(size_t bytes) override;
  void deallocate(void* p) noexcept override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void zero(void* p, size_t bytes) override;
  void writeSmall(void* dst, const void* src, size_t bytes) override;
  void readSmall(void* dst, const void* src, size_t bytes) override;

  // The host's cudaStream_t (NULL: the legacy default stream).
  void setHostStream(void* stream) override;
  // Use the host's ncclComm_t from now on (before the first collective);
  // checks its rank, size and device against the options.
  void adopt(void* ncclComm) override;
  // SF_ERR_INVALID_ARGUMENT unless [p, p + bytes) is memory of this rank's GPU.
  void checkDeviceMemory(const void* p, size_t bytes) override;

  // `numel` elements at `data` times `factor` on the plugin's stream, after
  // the bucket's sum (a weighted window's division: NCCL cannot divide by a
  // value its own collective produces, so on a GPU it is a pass of its own,
  // one NCCL kernel on one rank).
  std::unique_ptr<Work> startScale(void* data, int64_t numel, sf_dtype dtype,
                                   double factor) override;

 private:
  sfn_device* device();  // opened on first use; mutex_ held
  // Whether the module's table has reduce_scatter_used_start and
  // allgather_used_start (since 0.5; the table carries its size).
  bool movesOnlyUsed() const;
  // spec.segmentUsed clamped to [0, dataEnd] when the segments' padding
  // before dataEnd is more than a sixteenth of them (uneven shards: the
  // parameter layout) and the module can leave it off; empty: whole
  // segments, one ncclReduceScatter / ncclAllGather (a flat layout's last
  // segment, short by fewer than world elements: W grouped calls would cost
  // more than its padding).
  std::vector<int64_t> paddedUsed(const ReduceSpec& spec, int64_t dataEnd) const;
  void check(int32_t status, const sfn_error& err) const;

  const sf_options opts_;
  const std::shared_ptr<Rendezvous> rendezvous_;
  const sfn_api& api_;
  int32_t deviceCount_ = 0;
  std::mutex mutex_;
  void* hostStream_ = nullptr;
  void* adopted_ = nullptr;
  // The GPU: the adopted communicator's, else local_rank % (visible GPUs), so
  // that a launcher that shows each rank one GPU (CUDA_VISIBLE_DEVICES per
  // rank, LOCAL_RANK=3) gets GPU 0 of its own.
  int32_t deviceIndex_ = -1;
  sfn_device* device_ = nullptr;
  sfn_comm* comm_ = nullptr;
  bool barrierDone_ = false;
  // From the goodbye on: the goodbye and the communicator's finalize share
  // one timeout_ms, so that sf_destroy ends within it (+ slack).
  std::unique_ptr<Deadline> teardown_;
  std::shared_ptr<gloo::rendezvous::Store> store_;  // kept for peers still reading the id
};

}  // namespace sfsync
