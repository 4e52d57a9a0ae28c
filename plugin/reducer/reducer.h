#pragma once
// The reducer: owns the gradient list and the bucket plan, and drives the
// buckets through their cycle (bucket_state.h). It starts bucket collectives
// in bucket order (early when grad-ready completes a bucket, the rest at
// synchronize), waits for them, gathers, and has every rank's layout checked
// once before the first collective (layout_check.h). It keeps no count of
// passes or windows: every call of a window is handed its pass (pass_ref.h:
// the number, whether it is open, and the window number that the window
// check, window_check.h, compares across ranks inside one bucket's
// collective), and each BucketCycle records the pass its state belongs to.
// The Context decides when it may communicate. Its rooms: bucket memory
// (bucket_memory.h: layout, allocation, staging, views), the window check,
// and the reducer itself (reducer.cpp: registration, the build, ordering,
// waits; reducer_gather.cpp: the gathers).
//
// Two modes behind the same buckets (since 0.3): all-reduce (every rank
// receives every reduced gradient) and sharded (each bucket reduce-scattered,
// each rank owning one segment, parameters all-gathered after the host's
// step). Both share one picture of a bucket (shard_plan.h: the unsharded
// layout is one segment); start() is the one place that picks the collective.
// Setup, then plan: the reducer holds the options its build reads (the one
// copy of the caps and the shard layout, which change only through its
// setters until the build) and each device's backend, handed with the
// device's first gradient by the Context, which resolved it. The build turns
// them and the registrations into the plan (bucket plan, memory with its
// shard layouts, window check, totals, cycles, each bucket's backend), and
// everything is frozen from then on. The reducer never calls up: every call
// is handed what it needs (its pass, its backends).
//
// Sharded contexts also own the parameters' buffers (a flat parameter buffer
// laid out as the logical bucket layout, host-owned parameters copied in and
// out of it around a gather).

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/core/dtype.h"
#include "plugin/core/tracer.h"
#include "plugin/reducer/bucket_memory.h"
#include "plugin/reducer/bucket_plan.h"
#include "plugin/reducer/bucket_state.h"
#include "plugin/reducer/pass_ref.h"
#include "plugin/reducer/shard_plan.h"
#include "plugin/reducer/window_check.h"
#include "plugin/reducer/window_totals.h"
#include "sfsync.h"

namespace sfsync {

// The largest total size of a context's gradients (4 EiB): every size sum
// of the layout (flat buffers with their alignment, buckets, staging) then
// fits in int64_t and size_t with room to spare.
constexpr int64_t kMaxTotalBytes = int64_t(1) << 62;

// The name under which a host registers its used-parameter mask as a
// gradient (the Python binding's find_unused_parameters): its bytes count
// as sf_stats.wire_mask_bytes, not as gradients. Nothing else differs.
constexpr const char* kMaskName = "sfsync.used";

struct ReducerCounters {
  int64_t collectives = 0;
  int64_t earlyLaunches = 0;
  int64_t bytesReduced = 0;
  int64_t reduceScatters = 0;  // of the collectives
  int64_t allGathers = 0;
  int64_t bytesGathered = 0;
};

class Reducer {
 public:
  // `opts`: copied; the caps and the shard layout change only through the
  // setters below, before the build. A bucket_cap_mb other than the default
  // (kDefaultBucketCapMb) counts as chosen, as does setBucketCapMb.
  explicit Reducer(const sf_options& opts);
  ~Reducer();

  // ---- Registration and the build (reducer_build.cpp) ---------------------
  // SF_ERR_INVALID_ARGUMENT when the total size of the registered gradients
  // would pass kMaxTotalBytes (names the gradient). `backend`: the transport
  // and memory of `device`, resolved by the caller (the same one for every
  // gradient of a device); it must outlive the reducer.
  int64_t addGradient(void* hostData, int64_t numel, sf_dtype dtype, sf_device device,
                      const char* name, Backend& backend);
  // The parameter of gradient `id` (hostData NULL: plugin-owned). The caller
  // has checked id; checks the layout, the state and the match.
  void addParameter(int64_t id, void* hostData, int64_t numel, sf_dtype dtype, sf_device device);
  // The options the build reads, before it (values checked by the caller);
  // SF_ERR_INVALID_STATE once the buckets are built. setBucketCapMb chooses
  // the cap (the sharded default below no longer applies).
  void setBucketCapMb(double mb);
  void setFirstBucketCapMb(double mb);
  void setShardLayout(sf_shard_layout layout);
  // The options as the build reads them (the one copy: caps and shard layout
  // as set). The build settles the bucket cap of a sharded context whose cap
  // was never chosen (shardedDefaultCapMb of the registered gradients'
  // bytes, core/options.h): from then on bucket_cap_mb is that effective
  // cap; before, the default as set.
  const sf_options& options() const { return opts_; }
  // Once true, plan() and the gradients' addresses never change.
  bool built() const { return built_.load(std::memory_order_acquire); }
  // Every implicitly building call (build, gradientData, zero, markReady,
  // synchronize, ...) builds under the lock: concurrent first use is safe.
  void build();

  // ---- Buffers and their description --------------------------------------
  void* gradientData(int64_t id);
  void* parameterData(int64_t id);
  void zero();
  // Gradients registered; lock-free (checkId on every grad-ready).
  int64_t gradientCount() const { return registered_.load(std::memory_order_acquire); }
  int64_t gradientBytes() const;
  const std::vector<PlannedBucket>& plan() const { return plan_; }  // after built()
  ShardRange shardRange(int64_t id);
  int64_t gradientBucket(int64_t id);
  int64_t bucketCount();
  // Gradient `id`'s storage (after build()) and size, for digests.
  struct GradientBytes {
    const void* data;
    int64_t bytes;
    sf_device device;
  };
  GradientBytes gradientBytesOf(int64_t id) const {
    const Gradient& g = grads_[size_t(id)];
    return {g.data, g.bytes(), g.device};
  }

  // ---- Reductions: ordering and waits (reducer.cpp) ------------------------
  // Each call is handed its pass (pass_ref.h); the window number of an open
  // pass is checked across ranks inside the window-check bucket's collective.
  // A new window begins (sf_begin_accumulation) in pass `pass`: false (and
  // nothing changed) while collectives started by markReady are in flight,
  // else the last pass's reductions stop counting as this one's. One lock,
  // as inFlight(). markReady and the synchronizations enter their pass
  // themselves.
  bool beginPass(int64_t pass);
  // Outside a window: mark `id` ready in `pass` (the clock's open pass, as
  // the Context read it), start complete buckets in order. False, changing
  // nothing, when `pass` was synchronized already (closed after the caller
  // read the clock): the caller asks the clock again (pass_ref.h).
  bool markReady(int64_t id, const PassRef& pass);
  // Start every bucket not yet started (sf_synchronize_start).
  void synchronizeStart(const PassRef& pass);
  // Wait for one bucket's reduction of `pass` and put its results in place.
  void waitBucket(int64_t bucket, const PassRef& pass);
  // Start every bucket not yet started, wait for all, scatter results; then
  // SF_ERR_MISMATCH on every rank if the ranks' window numbers differ.
  // Returning (not throwing) means `pass` is synchronized: the caller
  // closes it. Weighted windows: true when the window's global weight was 0
  // (its buckets were left as the plain sums).
  bool synchronize(const PassRef& pass);
  bool inFlight() const;

  // ---- States, as the host asks for them (Since 0.5) -------------------------
  // Each reads the cycles under the lock (a window call in progress is
  // waited for) and changes nothing: the cycles stay the one record.
  // sf_bucket_state: bucket `bucket`'s state as the ABI names it (SF_BUCKET_*;
  // a gathering bucket whose gather was waited for is SF_BUCKET_GATHERED).
  // After built(); the caller checked the index.
  int32_t bucketState(int64_t bucket) const;
  // sf_window_state: SF_WINDOW_* flags of pass `pass` (the clock's current
  // one); 0 before the build. A failed reducer stays synchronizing while
  // `pass` is open: no synchronization can complete it.
  int32_t windowState(const PassRef& pass) const;

  // ---- Weighted windows (window_totals.h) -----------------------------------
  // sf_add_window_weight / sf_add_window_sums (arguments checked by the
  // caller): SF_ERR_INVALID_STATE unless reduce_op is SF_REDUCE_WEIGHTED,
  // or once the first bucket of `pass` has started (naming it and the
  // window; nothing is added).
  void addWindowWeight(double weight, const PassRef& pass);
  void addWindowSums(const double* values, int count, const PassRef& pass);
  // The last completed weighted window's totals; false before one.
  bool windowTotals(WindowTotals::Totals& out) const;

  // ---- Gathers (reducer_gather.cpp) ----------------------------------------
  // Parameter gathers; bucket -1: all (forward order: the last bucket first).
  // Only buckets reduced in `pass` may start one.
  void startGather(int64_t bucket, const PassRef& pass);
  void waitGather(int64_t bucket);
  // sf_gather_gradients: once every bucket's reduction of the current window
  // is in place and before any parameter gather of it started, all-gather
  // each bucket's gradient segments (bucket order, blocking) so that every
  // rank holds the whole reduced gradients. Unsharded or world size 1: the
  // same state checks, then nothing to do. A repeat in the same pass is free.
  void gatherGradients(const PassRef& pass);

  // ---- Failure, teardown, counters -----------------------------------------
  // Wait for whatever is in flight, swallowing errors; false if the reducer
  // has failed (its peers may be gone). Never throws.
  bool quiesce() noexcept;
  ReducerCounters counters() const;
  // SF_TRACE: launches and finishes go to the host track (nullptr: none).
  void setTracer(Tracer* trace) { trace_ = trace; }

 private:
  // Every private member function expects mutex_ held.
  void buildLocked();
  void checkParameters() const;  // sharded: every gradient has one
  void logPlan() const;
  bool sharded() const { return opts_.shard_layout != SF_SHARD_NONE; }
  int64_t ownSegment(const BucketBuffers& b) const { return b.layout.world > 1 ? opts_.rank : 0; }
  // The device's backend (its memory too), as handed with its gradients.
  Backend& backendOf(sf_device device);
  // Before the build, under the lock: SF_ERR_INVALID_STATE naming `what` after it.
  void requireNotBuilt(const std::string& what) const;
  void checkBucketIndex(int64_t bucket, const char* what) const;
  void requireSharded(const char* what) const;

  // Reductions.
  // Every cycle enters `pass` (the last pass's reductions stop being the
  // current ones); nothing if they are in it already (built, else nothing).
  void enterPassLocked(int64_t pass);
  void startReadyBuckets(bool early, const PassRef& pass);
  void startAllLocked(const PassRef& pass);  // enters the pass
  void start(size_t bucket, bool early, const PassRef& pass);
  ReduceSpec reduceSpec() const;  // from the options, for every bucket
  // Weighted windows: SF_ERR_INVALID_STATE unless a weight or sum may still
  // be added to the window (reduce_op weighted, bucket 0 not yet started).
  void requireWindowOpenLocked(const PassRef& pass) const;
  void waitBucketLocked(size_t bucket, const PassRef& pass);  // wait, copy back, mark reduced
  // Weighted, once bucket i's sum is done: its data times 1 / global weight.
  void scaleByWeightLocked(size_t bucket);
  // The factor bucket i's gradients are multiplied by as each is reported
  // ready (on memory the host just wrote, as DDP divides each gradient in
  // its hook), its collective then a plain sum; 1: the scales stay the
  // collective's (reduceSpec). Not 1 only where that changes no bit: an
  // average over a power-of-two world size (x / W is exact, so the sum of
  // the quotients is the quotient of the sum), unsharded, unstaged, on a
  // backend that would scale in a pass of its own (Backend::scalesInAPass).
  // Decided at the build.
  double readyScaleOf(size_t bucket) const;
  // Gradient g at factor `factor` (its bucket's ready scale), once per pass.
  static void scaleOnce(Gradient& g, double factor);
  bool reducedIn(int64_t pass) const;  // every bucket

  // Gathers.
  void startGatherLocked(size_t bucket);
  void waitGatherLocked(size_t bucket);

  // Failure: records the first (every later call repeats it), drains, throws.
  [[noreturn]] void failWith(sf_status status, const std::string& message);
  void throwIfFailed() const;
  bool drainLocked() noexcept;  // wait for all work; false if any failed

  sf_options opts_;  // caps and shard layout as set; frozen once built
  bool capChosen_;   // bucket_cap_mb was chosen (not the default): no sharded default
  // Each device's backend (indexed by sf_device), as addGradient was handed it.
  std::array<Backend*, 2> deviceBackends_{};
  std::vector<Gradient> grads_;
  std::atomic<int64_t> registered_{0};  // grads_.size(), published for lock-free readers
  int64_t totalBytes_ = 0;  // of grads_, at most kMaxTotalBytes

  // Built once (built_), under mutex_.
  std::vector<PlannedBucket> plan_;
  BucketMemory memory_;              // bucket i's buffers: memory_[i]
  std::vector<Backend*> backends_;   // bucket i's backend: backends_[i]
  std::vector<BucketCycle> cycles_;  // bucket i's state and its Work in flight: cycles_[i]
  WindowCheck check_;
  WindowTotals totals_;    // weighted windows: the weight and the window sums
  // Per bucket: elements of the used-parameter mask (kMaskName), for the
  // wire counts (ReduceSpec::maskElems).
  std::vector<int64_t> maskElems_;
  std::vector<double> readyScale_;  // bucket i's: readyScaleOf(i)
  bool reportsScaled_ = false;  // markReady scaled a gradient since the last synchronization
  std::atomic<bool> built_{false};
  bool verified_ = false;  // the layout check passed

  mutable std::mutex mutex_;
  size_t nextToStart_ = 0;  // buckets start in order: the next one
  int64_t synchronizedPass_ = 0;  // the last pass synchronize() completed
  ReducerCounters counters_;
  sf_status failedStatus_ = SF_OK;
  std::string failedMessage_;
  Tracer* trace_ = nullptr;
};

}  // namespace sfsync
