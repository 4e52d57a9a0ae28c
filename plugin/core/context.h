#pragma once
// A context: one data-parallel group. Responsible for the window state
// machine (what may be communicated when), argument validation and the
// stats; delegates gradients and buckets to the Reducer and transport to the
// backends. Not responsible for how bytes move.

#include <atomic>
#include <map>
#include <memory>
#include <mutex>

#include "plugin/backend/backend.h"
#include "plugin/reducer/reducer.h"
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

  sf_options opts_;
  std::mutex backendsMutex_;
  std::map<sf_device, std::unique_ptr<Backend>> backends_;
  NcclBackend* nccl_ = nullptr;  // backends_[SF_DEVICE_CUDA] once created
  void* cudaStream_ = nullptr;   // the host's cudaStream_t
  Reducer reducer_;  // after backends_: destroyed first, while backends live

  std::atomic<bool> inWindow_{false};
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
};

}  // namespace sfsync
