#pragma once
// The reducer: owns the gradient list, the bucket plan, the flat buffer and
// the per-bucket readiness. It starts bucket collectives in bucket order
// (early when grad-ready completes a bucket, the rest at synchronize), waits
// for them, and verifies once that every rank registered the same layout.
// It knows nothing of windows: the Context decides when it may communicate.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/core/dtype.h"
#include "plugin/reducer/bucket_plan.h"
#include "sfsync.h"

namespace sfsync {

struct ReducerCounters {
  int64_t collectives = 0;
  int64_t earlyLaunches = 0;
  int64_t bytesReduced = 0;
};

class Reducer {
 public:
  // Returns the backend for a device (created on first use by the caller).
  using BackendFor = std::function<Backend&(sf_device)>;

  Reducer(const sf_options& opts, BackendFor backendFor);
  ~Reducer();

  int64_t addGradient(void* hostData, int64_t numel, sf_dtype dtype, sf_device device,
                      const char* name);
  void setCaps(double capMb, double firstCapMb);
  bool built() const { return built_; }
  void build();
  void* gradientData(int64_t id);
  void zero();

  int64_t gradientCount() const { return int64_t(grads_.size()); }
  int64_t gradientBytes() const;
  const std::vector<PlannedBucket>& plan() const { return plan_; }

  // Outside a window: mark `id` ready, start complete buckets in order.
  void markReady(int64_t id);
  // Start every bucket not yet started, wait for all, scatter results.
  void synchronize();
  bool inFlight() const;
  // Wait for whatever is in flight, swallowing errors; false if the reducer
  // has failed (its peers may be gone). Never throws.
  bool quiesce() noexcept;
  ReducerCounters counters() const;

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
    int64_t offset = 0;  // elements from the start of the bucket
    bool ready = false;
    int64_t bytes() const { return numel * int64_t(dtypeSize(dtype)); }
  };

  struct Bucket {
    const PlannedBucket* plan;
    char* storage = nullptr;          // flat_ view (zero copy) or staging
    bool staged = false;              // storage is a staging buffer (some gradient is host-owned)
    int64_t numel = 0;
    int64_t pending = 0;              // gradients not yet ready this pass
    std::unique_ptr<Work> work;       // set while in flight
  };

  void startReadyBuckets(bool early);  // mutex_ held
  void start(Bucket& b, bool early);   // mutex_ held
  void verifyLayout(Backend& backend);
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
  std::vector<PlannedBucket> plan_;
  std::vector<Bucket> buckets_;
  std::map<sf_device, char*> flat_;  // plugin-owned gradients, bucket by bucket, per device
  bool built_ = false;
  bool verified_ = false;

  mutable std::mutex mutex_;
  size_t nextToStart_ = 0;
  ReducerCounters counters_;
  sf_status failedStatus_ = SF_OK;
  std::string failedMessage_;
};

}  // namespace sfsync
