#pragma once
// A context: one data-parallel group, the orchestrator above the reducer,
// the backends and the rendezvous (which it owns and hands down; none of
// them includes this file). Responsible for what may be communicated when
// (asking its WindowClock, which owns the window state and number), argument
// validation and the stats; delegates gradients and buckets to the Reducer
// and transport to the backends. Not responsible for how bytes move.
//
// Threads (since 0.5): the window calls (begin, end, synchronize,
// synchronizeStart, zeroGradients, restoreWindows, gatherGradients) hold
// one lock, windowMutex_, for their whole run, so two host threads that make
// them at once are served one after the other and each sees the window
// before or after the other's call, never between (the clock's counters and
// the reducer's bucket cycles then change only under it). A synchronize that
// waited for the lock while another thread's synchronize ran does not
// synchronize again: it returns that synchronization's outcome (see
// synchronize()). grad-ready never takes the lock (autograd hooks call it
// while the training thread waits in synchronize; it meets a synchronization
// on the reducer's lock, as before; a pass a synchronization closed after the
// hook read it is refused there and asked again: pass_ref.h), nor do the
// counters' readers (stats, the shim's window state). The lock order is
// windowMutex_, then the reducer's lock, then backendsMutex_; the reducer
// never calls back into the Context or its clock.

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "plugin/backend/backend.h"
#include "plugin/backend/counting_backend.h"
#include "plugin/core/tracer.h"
#include "plugin/orchestrator/window_clock.h"
#include "plugin/reducer/reducer.h"
#include "plugin/rendezvous/rendezvous.h"
#include "sfsync.h"

namespace sfsync {

// What a Context makes its backends with: the backend for one device's
// memory, made at its first use, over the context's options and rendezvous
// (which a backend uses at connect()). The Context names no concrete
// backend: api/ hands it the default set (plugin/api/default_backends.h), a
// test its own (tests/unit/orchestrator/recording_backend_tests.cpp).
using BackendMaker = std::function<std::unique_ptr<Backend>(
    sf_device device, const sf_options& opts, const std::shared_ptr<Rendezvous>& rendezvous)>;

class Context {
 public:
  Context(const sf_options& opts, BackendMaker makeBackend);  // validated options
  ~Context();

  // ---- Options and registration -------------------------------------------
  // The options in force: the reducer's, the one copy (since 0.5 the Context
  // keeps none of its own: before, it kept the creation's values, caps and
  // shard layout stale once set). Rank, world size, backend, reduce op and
  // the rest never change after creation; the caps and the shard layout
  // change only through the setters below, before the build, and the build
  // settles a sharded context's default cap (reducer.h).
  const sf_options& options() const { return reducer_.options(); }
  void setBucketCapMb(double mb);
  void setFirstBucketCapMb(double mb);
  void setShardLayout(sf_shard_layout layout);
  int64_t registerGradient(void* data, int64_t numel, sf_dtype dtype, sf_device device,
                           const char* name);
  void registerParameter(int64_t id, void* data, int64_t numel, sf_dtype dtype, sf_device device);
  int64_t gradientsRegistered() const { return reducer_.gradientCount(); }
  // CUDA gradients: the host's stream and, optionally, its communicator.
  void setCudaStream(void* stream);
  void adoptNcclComm(void* comm);
  // sf_set_store: the host's store (struct already size-checked) for every
  // rendezvous of this context. SF_ERR_INVALID_STATE once the store is in use.
  void setStore(const sf_store& store, const char* prefix);

  // ---- Buckets and buffers (the reducer's, checked here) --------------------
  void buildBuckets() { reducer_.build(); }
  void* gradientData(int64_t id);
  void* parameterData(int64_t id);
  // A window call (serialized with the others): waits for a synchronization
  // another thread runs, then zeroes.
  void zeroGradients();
  void shardRange(int64_t id, int64_t* offset, int64_t* count);
  int64_t gradientBucket(int64_t id);
  void bucketInfo(int64_t index, int64_t* bytes, int64_t* grads, sf_dtype* dtype) const;
  // sf_bucket_state / sf_window_state (Since 0.5): the reducer's cycles,
  // asked (the window is the clock's current pass).
  int32_t bucketState(int64_t index) const;
  int32_t windowState() const { return reducer_.windowState(clock_.pass()); }

  // ---- Windows (the clock's state; what they allow to be communicated) ------
  void beginAccumulation();
  void endAccumulation();
  bool inAccumulation() const { return clock_.inWindow(); }
  // Windows begun so far; readable from any thread. Counted before the window
  // state flips, so a reader that sees inAccumulation() true also sees its count.
  int64_t windowsBegun() const { return clock_.windowsBegun(); }
  // For the shim (plugin/api/sfsync_internal.h) and the warnings.
  int64_t windowsEnded() const { return clock_.windowsEnded(); }
  // sf_begin_accumulation calls refused inside a window (a forgotten end),
  // and the window that was open at the latest of them.
  int64_t refusedBegins() const { return clock_.refusedBegins(); }
  int64_t refusedBeginWindow() const { return clock_.refusedBeginWindow(); }
  // sf_restore_windows: a resumed run continues the saved run's window count
  // (the clock's restore). SF_ERR_INVALID_ARGUMENT for a negative count,
  // SF_ERR_INVALID_STATE once a window call or synchronization used the clock.
  void restoreWindows(int64_t windowsCompleted);
  // sf_count_window: a window the host reduced itself ended; the clock
  // counts it as synchronized. SF_ERR_INVALID_STATE inside a window or with
  // registered gradients (their windows are sf_synchronize's to count).
  void countHostWindow();
  // Something acts on this context's windows besides its registered
  // gradients (the shim for the default context, a host that asks
  // sf_in_accumulation): its windows are not "windows that affect nothing".
  void markFollowed() const { followed_.store(true, std::memory_order_relaxed); }

  // ---- Weighted windows (SF_REDUCE_WEIGHTED) --------------------------------
  // sf_add_window_weight / sf_add_window_sums: the values checked here, the
  // timing and the mode by the reducer. sf_get_window_totals.
  void addWindowWeight(double weight);
  void addWindowSums(const double* values, int32_t count);
  void windowTotals(double* weight, double* sums, int32_t count) const;

  // ---- Synchronization: reductions, waits, gathers --------------------------
  void gradReady(int64_t id);
  // Serialized with the other window calls. A call that finds another
  // thread's synchronize under way (it read the count of ended
  // synchronizations before it waited for the lock, and the count moved
  // while it waited) does not synchronize again: it returns, or rethrows,
  // the outcome of that synchronization, so a window is synchronized once
  // however many threads ask. A call made after another returned is a
  // synchronization of its own.
  void synchronize();
  // synchronize() calls entered and not yet returned (those waiting for the
  // lock included): a test waits on it to make two calls overlap.
  int synchronizeCallers() const { return syncCallers_.load(std::memory_order_acquire); }
  void synchronizeStart();
  void waitBucket(int64_t bucket);
  void startGather(int64_t bucket);
  void waitGather(int64_t bucket);
  void gatherParameters();
  // sf_gather_gradients (SF_ERR_INVALID_STATE inside a window).
  void gatherGradients();

  // ---- Control collectives between windows ---------------------------------
  // sf_connect: admission (Rendezvous), the control backend's connect, then a
  // re-check of the claims combined across ranks by one small collective.
  void connect();
  // sf_broadcast of host memory from `root`; checks that every rank passed
  // the same size and root (one 32-byte collective) before moving data.
  void broadcast(void* data, uint64_t bytes, int32_t root);
  void allreduceFloat64(double* values, int64_t count);
  // sf_digest_gradients: chained digest of the host gradients' bytes.
  uint64_t digestGradients();
  // sf_check_replicas: allgather of digests (a max-reduction of one slot per
  // rank), SF_ERR_MISMATCH naming the ranks that differ from rank 0.
  void checkReplicas(uint64_t digest);

  sf_stats stats() const;

 private:
  // The one place that decides which backend serves a device's memory
  // (made on first use through the BackendMaker, counted, handed the host's
  // stream; backend = gloo refuses CUDA, backend = nccl host memory at its
  // first collective), and which device's backend carries the control
  // collectives.
  Backend& backendFor(sf_device device);
  sf_device controlDevice() const;
  Backend* madeBackend(sf_device device);  // nullptr until backendFor made it
  // The backend for control collectives: backendFor(controlDevice()).
  Backend& controlBackend() { return backendFor(controlDevice()); }
  void checkId(int64_t id) const;
  // gradReady outside a window: the clock's pass and `id` to the reducer.
  void markReady(int64_t id);
  // SF_ERR_INVALID_STATE inside a window or while buckets are in flight.
  void checkIdle(const char* what) const;
  // synchronize() with windowMutex_ held; the window it synchronized (or
  // tried) in *window.
  void synchronizeLocked(int64_t* window);
  // trace_ set: the nth grad-ready call of the window, or of those outside
  // a window since the last synchronization (the clock's count).
  void tracePass(bool inWindow, int64_t nth);

  std::unique_ptr<Tracer> trace_;  // SF_TRACE; first: outlives the backends' threads
  std::mutex traceMutex_;
  double windowStartUs_ = -1;  // trace: the window's begin, -1 outside
  double passStartUs_ = 0;     // trace: the current pass's first grad-ready
  std::mutex backendsMutex_;
  BackendMaker makeBackend_;
  WireCount wire_;  // every backend's collectives (CountingBackend); before backends_
  std::map<sf_device, std::unique_ptr<Backend>> backends_;
  void* cudaStream_ = nullptr;  // the host's cudaStream_t
  Reducer reducer_;  // after backends_: destroyed first, while backends live

  // The windows and the number each synchronization checks across ranks.
  WindowClock clock_;
  // The window calls, one at a time (see "Threads" above).
  std::mutex windowMutex_;
  // synchronize() calls that ended (succeeded or failed), written under
  // windowMutex_, and the outcome of the last (under windowMutex_): what a
  // call that waited for it returns.
  std::atomic<int64_t> syncsEnded_{0};
  struct SyncOutcome {
    sf_status status = SF_OK;
    std::string message;
    int64_t window = 0;
  };
  SyncOutcome lastSync_;
  std::atomic<int> syncCallers_{0};
  // What the misuse warnings need besides the clock.
  mutable std::atomic<bool> followed_{false};
  std::atomic<bool> saidAffectsNothing_{false};
  std::atomic<int64_t> syncNs_{0};         // read by sf_get_stats from any thread
  ReducerCounters atLastSync_;  // for the INFO line of each window

  std::shared_ptr<Rendezvous> rendezvous_;  // shared with the backends
  std::mutex connectMutex_;
  bool connected_ = false;
};

}  // namespace sfsync
