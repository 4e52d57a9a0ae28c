#pragma once
// The reducer: owns the gradient list, the bucket plan, the flat buffer and
// the per-bucket readiness. It starts bucket collectives in bucket order
// (early when grad-ready completes a bucket, the rest at synchronize), waits
// for them, and verifies once that every rank registered the same layout.
// It knows nothing of windows but their number, which the Context passes in
// and the reducer checks across ranks inside one bucket's collective (no
// extra collective); the Context decides when it may communicate.
//
// Two modes behind the same buckets (since 0.3): all-reduce (every rank
// receives every reduced gradient) and sharded (each bucket reduce-scattered,
// each rank owning one segment, parameters all-gathered after the host's
// step). Both share one picture of a bucket (shard_plan.h: the unsharded
// layout is one segment); start() is the one place that picks the collective.
// Sharded contexts also own the parameters' buffers (a flat parameter buffer
// laid out as the logical bucket layout, host-owned parameters copied in and
// out of it around a gather).

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/core/dtype.h"
#include "plugin/core/tracer.h"
#include "plugin/reducer/bucket_plan.h"
#include "plugin/reducer/shard_plan.h"
#include "sfsync.h"

namespace sfsync {

// The largest total size of a context's gradients (4 EiB): every size sum
// of the layout (flat buffers with their alignment, buckets, staging) then
// fits in int64_t and size_t with room to spare.
constexpr int64_t kMaxTotalBytes = int64_t(1) << 62;

struct ReducerCounters {
  int64_t collectives = 0;
  int64_t earlyLaunches = 0;
  int64_t bytesReduced = 0;
  int64_t reduceScatters = 0;  // since 0.3: of the collectives
  int64_t allGathers = 0;
  int64_t bytesGathered = 0;
};

class Reducer {
 public:
  // Returns the backend for a device (created on first use by the caller).
  using BackendFor = std::function<Backend&(sf_device)>;

  Reducer(const sf_options& opts, BackendFor backendFor);
  ~Reducer();

  // Registration; SF_ERR_INVALID_ARGUMENT when the total size of the
  // registered gradients would pass kMaxTotalBytes (names the gradient).
  int64_t addGradient(void* hostData, int64_t numel, sf_dtype dtype, sf_device device,
                      const char* name);
  void setCaps(double capMb, double firstCapMb);
  // Once true, plan() and the gradients' addresses never change.
  bool built() const { return built_.load(std::memory_order_acquire); }
  // Every implicitly building call (build, gradientData, zero, markReady,
  // synchronize) builds under the lock: concurrent first use is safe.
  void build();
  void* gradientData(int64_t id);
  void zero();

  int64_t gradientCount() const;
  int64_t gradientBytes() const;
  const std::vector<PlannedBucket>& plan() const { return plan_; }  // after built()

  // Outside a window: mark `id` ready, start complete buckets in order.
  // `window` is the caller's window number (see checkWindow).
  void markReady(int64_t id, int64_t window);
  // Start every bucket not yet started, wait for all, scatter results; then
  // SF_ERR_MISMATCH on every rank if the ranks' window numbers differ.
  void synchronize(int64_t window);
  bool inFlight() const;
  // ---- Since 0.3: sharded windows and per-bucket completion -------------
  // Until built(); SF_ERR_INVALID_STATE after.
  void setShardLayout(sf_shard_layout layout);
  sf_shard_layout shardLayout() const { return shard_; }
  // The parameter of gradient `id` (hostData NULL: plugin-owned). The caller
  // has checked id; checks the layout, the state and the match.
  void addParameter(int64_t id, void* hostData, int64_t numel, sf_dtype dtype, sf_device device);
  void* parameterData(int64_t id);
  ShardRange shardRange(int64_t id);
  int64_t gradientBucket(int64_t id);
  int64_t bucketCount();
  // A new window begins (sf_begin_accumulation): false (and nothing
  // changed) while collectives started by markReady are in flight, else the
  // last window's reductions stop counting as this window's. One lock, as
  // inFlight(). markReady and the synchronizations open a pass themselves.
  bool beginPass();
  // Start every bucket not yet started (sf_synchronize_start).
  void synchronizeStart(int64_t window);
  // Wait for one bucket's reduction and put its results in place.
  void waitBucket(int64_t bucket);
  // Parameter gathers; bucket -1: all (forward order: the last bucket first).
  void startGather(int64_t bucket);
  void waitGather(int64_t bucket);
  // ---- Since 0.4 ----------------------------------------------------------
  // sf_gather_gradients: once every bucket's reduction of the current window
  // is in place and before any parameter gather of it started, all-gather
  // each bucket's gradient segments (bucket order, blocking) so that every
  // rank holds the whole reduced gradients. Unsharded or world size 1: the
  // same state checks, then nothing to do. A repeat in the same window is free.
  void gatherGradients();

  // Wait for whatever is in flight, swallowing errors; false if the reducer
  // has failed (its peers may be gone). Never throws.
  bool quiesce() noexcept;
  ReducerCounters counters() const;
  // SF_TRACE: launches and finishes go to the host track (nullptr: none).
  void setTracer(Tracer* trace) { trace_ = trace; }

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

 private:
  struct Gradient {
    void* data;  // host pointer, or the view into flat_ once built
    int64_t numel;
    sf_dtype dtype;
    sf_device device;
    std::string name;
    bool owned;  // storage in flat_
    int64_t bucket = -1;
    int64_t offset = 0;  // logical elements from the start of the bucket (shard_plan.h)
    bool ready = false;
    void* param = nullptr;    // sharded: the parameter (host pointer or view into flatParams_)
    bool hasParam = false;
    bool paramOwned = false;  // storage in flatParams_
    int64_t bytes() const { return numel * int64_t(dtypeSize(dtype)); }
  };

  struct Bucket {
    const PlannedBucket* plan;
    char* storage = nullptr;          // flat_ view (zero copy) or staging
    bool staged = false;              // storage is a staging buffer (some gradient is host-owned)
    bool control = false;             // carries the two window-check elements after the gradients
    int64_t numel = 0;                // gradient elements (without the control elements)
    int64_t pending = 0;              // gradients not yet ready this pass
    std::unique_ptr<Work> work;       // set while in flight
    ShardLayout layout;               // segments, control slots, the gradients' offsets
    char* params = nullptr;           // sharded: the bucket's slice of flatParams_
    bool reduced = false;             // this window's reduction waited for and in place
    bool gatherStarted = false;       // this window's gather started
    std::unique_ptr<Work> gather;     // set while the gather is in flight
    std::unique_ptr<Work> gradientGather;  // sf_gather_gradients, inside that call only
  };

  void buildLocked();                  // mutex_ held
  bool sharded() const { return shard_ != SF_SHARD_NONE; }
  int64_t ownSegment(const Bucket& b) const { return b.layout.world > 1 ? opts_.rank : 0; }
  void waitBucketLocked(Bucket& b);    // wait, copy back, mark reduced
  void openPassLocked();
  void startGatherLocked(Bucket& b);
  void waitGatherLocked(Bucket& b);
  void checkBucketIndex(int64_t bucket, const char* what) const;
  void requireSharded(const char* what) const;
  // Staging copies of one gradient, run by run around the control slots.
  // `range` (relative to the gradient; count -1: all of it) limits the copy.
  void copyToStaging(const Bucket& b, const Gradient& g, ShardRange range = {0, -1});
  void copyFromStaging(const Bucket& b, Gradient& g, ShardRange range);
  void startReadyBuckets(bool early);  // mutex_ held
  // Opens the pass if needed and starts every bucket not yet started; mutex_ held.
  void startAllLocked(int64_t window);
  void start(Bucket& b, bool early);   // mutex_ held
  void verifyLayout(Backend& backend);
  // After every bucket of a pass completed: compares the window numbers the
  // control elements carried; on a difference learns the exact numbers with
  // one small collective (failure path only) and fails with SF_ERR_MISMATCH.
  void checkWindow();
  ReduceSpec reduceSpec() const;  // from the options, for every bucket
  bool drainLocked() noexcept;  // wait for all work, mutex_ held; false if any failed
  // Records the first failure (every later synchronize repeats it), drains, throws.
  [[noreturn]] void failWith(sf_status status, const std::string& message);
  void throwIfFailed() const;
  // Host memory, or the memory of the backend that reduces `device`.
  MemoryOps& memoryFor(sf_device device);
  bool bucketNeedsStaging(const PlannedBucket& plan) const;
  void releaseMemory() noexcept;  // flat and staging buffers, back to their devices

  const sf_options opts_;
  BackendFor backendFor_;
  double capMb_, firstCapMb_;
  std::vector<Gradient> grads_;
  int64_t totalBytes_ = 0;  // of grads_, at most kMaxTotalBytes
  std::vector<PlannedBucket> plan_;
  std::vector<Bucket> buckets_;
  std::map<sf_device, char*> flat_;  // plugin-owned gradients, bucket by bucket, per device
  std::map<sf_device, char*> flatParams_;  // sharded: every bucket's parameters, per device
  sf_shard_layout shard_;
  std::atomic<bool> built_{false};
  bool verified_ = false;

  // The window check (world size > 1; a bucket of the most exact dtype, a host one if
  // any is that exact, else a device one): index of the
  // bucket carrying (w mod p, (w mod p)^2), the modulus p, and the window
  // number of the pass in flight.
  int64_t controlBucket_ = -1;
  int64_t controlModulus_ = 0;
  int64_t window_ = 0;
  int64_t controlWindow_ = 0;  // the window number the control bucket carried

  mutable std::mutex mutex_;
  size_t nextToStart_ = 0;
  bool passOpen_ = false;  // a pass (window) started since the last synchronize
  // Passes opened so far, the last one whose buckets were all reduced, and
  // the last one whose gradients sf_gather_gradients made whole (0: none).
  int64_t pass_ = 0;
  int64_t reducedInPass_ = 0;  // buckets of pass_ reduced
  int64_t completePass_ = 0;
  int64_t gradientsGatheredPass_ = 0;
  ReducerCounters counters_;
  sf_status failedStatus_ = SF_OK;
  std::string failedMessage_;
  Tracer* trace_ = nullptr;
};

}  // namespace sfsync
