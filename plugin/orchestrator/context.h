#pragma once
// A context: one data-parallel group, the orchestrator above the reducer,
// the backends and the rendezvous (which it owns and hands down; none of
// them includes this file). Responsible for the window state
// machine (what may be communicated when), argument validation and the
// stats; delegates gradients and buckets to the Reducer and transport to the
// backends. Not responsible for how bytes move.

#include <atomic>
#include <map>
#include <memory>
#include <mutex>

#include "plugin/backend/backend.h"
#include "plugin/core/tracer.h"
#include "plugin/reducer/reducer.h"
#include "plugin/rendezvous/rendezvous.h"
#include "sfsync.h"

namespace sfsync {

class NcclBackend;

class Context {
 public:
  explicit Context(const sf_options& opts);  // validated options
  ~Context();

  const sf_options& options() const { return opts_; }
  void setBucketCapMb(double mb);
  void setFirstBucketCapMb(double mb);

  int64_t registerGradient(void* data, int64_t numel, sf_dtype dtype, sf_device device,
                           const char* name);
  void buildBuckets() { reducer_.build(); }
  void* gradientData(int64_t id);
  void zeroGradients() { reducer_.zero(); }

  void beginAccumulation();
  void endAccumulation();
  bool inAccumulation() const { return inWindow_.load(std::memory_order_relaxed); }
  // Windows begun so far; readable from any thread. Counted before the window
  // state flips, so a reader that sees inAccumulation() true also sees its count.
  int64_t windowsBegun() const { return windowsBegun_.load(std::memory_order_acquire); }
  // Since 0.2, for the shim (plugin/api/sfsync_internal.h) and the warnings.
  int64_t windowsEnded() const { return windowsEnded_.load(std::memory_order_relaxed); }
  // sf_begin_accumulation calls refused inside a window (a forgotten end),
  // and the window that was open at the latest of them.
  int64_t refusedBegins() const { return refusedBegins_.load(std::memory_order_acquire); }
  int64_t refusedBeginWindow() const { return refusedBeginWindow_.load(std::memory_order_relaxed); }
  int64_t gradientsRegistered() const { return gradientCount_.load(std::memory_order_relaxed); }
  // Something acts on this context's windows besides its registered
  // gradients (the shim for the default context, a host that asks
  // sf_in_accumulation): its windows are not "windows that affect nothing".
  void markFollowed() const { followed_.store(true, std::memory_order_relaxed); }
  void gradReady(int64_t id);
  void synchronize();

  // CUDA gradients: the host's stream and, optionally, its communicator.
  void setCudaStream(void* stream);
  void adoptNcclComm(void* comm);

  sf_stats stats() const;
  void bucketInfo(int64_t index, int64_t* bytes, int64_t* grads, sf_dtype* dtype) const;

 private:
  Backend& backendFor(sf_device device);
  void checkId(int64_t id) const;
  void tracePass(bool inWindow);  // trace_ set

  sf_options opts_;
  std::unique_ptr<Tracer> trace_;  // SF_TRACE; first: outlives the backends' threads
  std::mutex traceMutex_;
  double windowStartUs_ = -1;  // trace: the window's begin, -1 outside
  double passStartUs_ = 0;     // trace: the current pass's first grad-ready
  int64_t readyInPass_ = 0;    // trace: grad-ready calls of the current pass
  std::mutex backendsMutex_;
  std::map<sf_device, std::unique_ptr<Backend>> backends_;
  NcclBackend* nccl_ = nullptr;  // backends_[SF_DEVICE_CUDA] once created
  void* cudaStream_ = nullptr;   // the host's cudaStream_t
  Reducer reducer_;  // after backends_: destroyed first, while backends live

  std::atomic<bool> inWindow_{false};
  // Since 0.2: what the shim reads, and the misuse said at once.
  std::atomic<int64_t> windowsEnded_{0};
  std::atomic<int64_t> refusedBegins_{0};
  std::atomic<int64_t> refusedBeginWindow_{0};
  mutable std::atomic<bool> followed_{false};
  std::atomic<bool> saidAffectsNothing_{false};
  std::atomic<int64_t> readyInWindow_{0};
  std::atomic<int64_t> deferredReadyCalls_{0};
  std::atomic<int64_t> gradientCount_{0};  // readable without the reducer's lock
  std::atomic<int64_t> windowsBegun_{0};
  // Counters read by sf_get_stats from any thread.
  std::atomic<int64_t> windowsCompleted_{0};
  std::atomic<int64_t> deferredPasses_{0};
  std::atomic<int64_t> syncNs_{0};

  // The window number checked across ranks at every synchronization (see
  // currentWindow): windows counted up to the last synchronization, windows
  // begun since, grad-ready calls outside a window since, and whether the
  // host reports gradients at all (then a synchronization with neither a
  // begin nor a pass since the last one is an extra one, not a window).
  int64_t currentWindow() const;
  std::atomic<int64_t> windowNumber_{0};
  std::atomic<int64_t> begunSinceSync_{0};
  std::atomic<int64_t> readyOutsideSinceSync_{0};
  std::atomic<bool> hostReportsReady_{false};
  ReducerCounters atLastSync_;  // for the INFO line of each window

  // ---- Since 0.2: the host's store, collective set-up and checks ----------
 public:
  // sf_set_store: the host's store (struct already size-checked) for every
  // rendezvous of this context. SF_ERR_INVALID_STATE once the store is in use.
  void setStore(const sf_store& store, const char* prefix);
  // sf_connect: admission (Rendezvous), the control backend's connect, then a
  // re-check of the claims combined across ranks by one small collective.
  void connect();
  // sf_broadcast of host memory from `root`; checks that every rank passed
  // the same size and root (one 32-byte collective) before moving data.
  void broadcast(void* data, uint64_t bytes, int32_t root);
  // sf_digest_gradients: chained digest of the host gradients' bytes.
  uint64_t digestGradients();
  // sf_check_replicas: allgather of digests (a max-reduction of one slot per
  // rank), SF_ERR_MISMATCH naming the ranks that differ from rank 0.
  void checkReplicas(uint64_t digest);

 private:
  // The backend for control collectives: Gloo (host memory), or NCCL when
  // backend = nccl.
  Backend& controlBackend();
  // SF_ERR_INVALID_STATE inside a window or while buckets are in flight.
  void checkIdle(const char* what) const;

  // ---- Since 0.3: sharded windows and per-bucket completion ----------------
 public:
  void setShardLayout(sf_shard_layout layout);
  void registerParameter(int64_t id, void* data, int64_t numel, sf_dtype dtype, sf_device device);
  void* parameterData(int64_t id);
  void shardRange(int64_t id, int64_t* offset, int64_t* count);
  int64_t gradientBucket(int64_t id);
  void synchronizeStart();
  void waitBucket(int64_t bucket);
  void startGather(int64_t bucket);
  void waitGather(int64_t bucket);
  void gatherParameters();
  // Since 0.4: sf_gather_gradients (SF_ERR_INVALID_STATE inside a window).
  void gatherGradients();
  void allreduceFloat64(double* values, int64_t count);

 private:
  std::shared_ptr<Rendezvous> rendezvous_;  // shared with the backends
  std::mutex connectMutex_;
  bool connected_ = false;
};

}  // namespace sfsync
