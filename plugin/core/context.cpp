#include "plugin/core/context.h"

#include <chrono>
#include <sstream>

#include "plugin/backend/gloo_backend.h"
#include "plugin/backend/local_backend.h"
#include "plugin/backend/nccl/nccl_backend.h"
#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/core/options.h"

namespace sfsync {

namespace {
sf_options clamped(sf_options o) {
  o.timeout_ms = clampTimeoutMs(o.timeout_ms);
  return o;
}
}  // namespace

Context::Context(const sf_options& opts)
    : opts_(clamped(opts)),
      reducer_(opts_, [this](sf_device d) -> Backend& { return backendFor(d); }) {
  logSetRank(opts_.rank);
  SF_LOG(kInfo, "context", "rank " << opts_.rank << " of " << opts_.world_size << ", backend "
                                    << opts_.backend << ", rendezvous '" << opts_.rendezvous
                                    << "', timeout_ms " << opts_.timeout_ms);
}

Context::~Context() {
  // Wait for our own collectives, then meet the peers once so that no rank
  // tears its connections down while another still reads from them. A failed
  // context has no peers left to meet.
  if (reducer_.quiesce()) {
    // A backend that failed to come up (no GPU, wrong backend) leaves an empty slot.
    for (auto& kv : backends_) {
      if (kv.second) kv.second->barrierQuietly();
    }
  }
}

Backend& Context::backendFor(sf_device device) {
  std::lock_guard<std::mutex> lock(backendsMutex_);
  auto& slot = backends_[device];
  if (slot) return *slot;
  if (device == SF_DEVICE_HOST) {
    if (opts_.backend == SF_BACKEND_NCCL) {
      fail(SF_ERR_UNSUPPORTED,
           "backend = nccl cannot reduce host-memory gradients; use gloo or auto");
    }
    if (opts_.world_size == 1) {
      slot = std::make_unique<LocalBackend>();
    } else {
      slot = std::make_unique<GlooBackend>(opts_);
    }
  } else {
    if (opts_.backend == SF_BACKEND_GLOO) {
      fail(SF_ERR_UNSUPPORTED,
           "backend = gloo cannot reduce CUDA gradients; use nccl or auto");
    }
    auto nccl = std::make_unique<NcclBackend>(opts_);  // SF_ERR_UNSUPPORTED without CUDA/NCCL/GPU
    nccl->setHostStream(cudaStream_);
    nccl_ = nccl.get();
    slot = std::move(nccl);
  }
  return *slot;
}

void Context::setCudaStream(void* stream) {
  if (reducer_.inFlight()) {
    fail(SF_ERR_INVALID_STATE, "bucket collectives started by sf_grad_ready are in flight; change "
                               "the stream after sf_synchronize");
  }
  std::lock_guard<std::mutex> lock(backendsMutex_);
  cudaStream_ = stream;
  if (nccl_) nccl_->setHostStream(stream);
}

void Context::adoptNcclComm(void* comm) {
  if (!comm) fail(SF_ERR_INVALID_ARGUMENT, "comm is NULL");
  backendFor(SF_DEVICE_CUDA);
  nccl_->adopt(comm);
}

void Context::setBucketCapMb(double mb) {
  validateCap(mb, "bucket_cap_mb");
  reducer_.setCaps(mb, opts_.first_bucket_cap_mb);
  opts_.bucket_cap_mb = mb;
}

void Context::setFirstBucketCapMb(double mb) {
  validateCap(mb, "first_bucket_cap_mb");
  reducer_.setCaps(opts_.bucket_cap_mb, mb);
  opts_.first_bucket_cap_mb = mb;
}

int64_t Context::registerGradient(void* data, int64_t numel, sf_dtype dtype, sf_device device,
                                  const char* name) {
  std::ostringstream s;
  if (numel <= 0) {
    s << "numel = " << numel << " must be positive";
  } else if (!dtypeValid(dtype)) {
    s << "dtype = " << dtype << " is not an sf_dtype (0 float32, 1 float64, 2 float16, 3 bfloat16)";
  } else if (device != SF_DEVICE_HOST && device != SF_DEVICE_CUDA) {
    s << "device = " << device << " is not an sf_device (0 host, 1 cuda)";
  } else if (numel > (int64_t(1) << 58) / int64_t(dtypeSize(dtype))) {
    s << "numel = " << numel << " is too large";
  } else {
    if (device == SF_DEVICE_CUDA) {
      backendFor(device);  // SF_ERR_UNSUPPORTED now, not at the first synchronization
      if (data) nccl_->checkDeviceMemory(data, size_t(numel) * dtypeSize(dtype));
    }
    const int64_t id = reducer_.addGradient(data, numel, dtype, device, name);
    gradientCount_.store(id + 1, std::memory_order_relaxed);
    return id;
  }
  fail(SF_ERR_INVALID_ARGUMENT, s.str());
}

void Context::checkId(int64_t id) const {
  const int64_t n = gradientCount_.load(std::memory_order_relaxed);
  if (id < 0 || id >= n) {
    fail(SF_ERR_INVALID_ARGUMENT, "id = " + std::to_string(id) + " is not a registered gradient "
                                  "(ids are 0.." + std::to_string(n - 1) + ")");
  }
}

void* Context::gradientData(int64_t id) {
  checkId(id);
  return reducer_.gradientData(id);
}

void Context::beginAccumulation() {
  if (inWindow_.load(std::memory_order_relaxed)) {
    fail(SF_ERR_INVALID_STATE,
         "already inside an accumulation window (sf_begin_accumulation twice without "
         "sf_end_accumulation)");
  }
  if (reducer_.inFlight()) {
    fail(SF_ERR_INVALID_STATE,
         "bucket collectives started by sf_grad_ready are still in flight; call sf_synchronize "
         "before starting a new window");
  }
  // A begin opens a window, except one that follows an end with no
  // synchronization between in a host that reports gradients (then no pass
  // ran outside the windows: it brackets its micro-batches one by one, and
  // consecutive windows are one). A host that reports nothing cannot be told
  // apart from one that skipped an sf_synchronize: each begin counts.
  if (begunSinceSync_.load(std::memory_order_relaxed) == 0 ||
      !hostReportsReady_.load(std::memory_order_relaxed)) {
    begunSinceSync_.fetch_add(1, std::memory_order_relaxed);
  }
  readyInWindow_.store(0, std::memory_order_relaxed);
  windowsBegun_.fetch_add(1, std::memory_order_release);
  inWindow_.store(true, std::memory_order_release);
}

void Context::endAccumulation() {
  if (!inWindow_.load(std::memory_order_relaxed)) {
    fail(SF_ERR_INVALID_STATE, "not inside an accumulation window (sf_end_accumulation without "
                               "sf_begin_accumulation)");
  }
  const int64_t n = gradientCount_.load(std::memory_order_relaxed);
  if (n > 0) {
    deferredPasses_.fetch_add(readyInWindow_.load(std::memory_order_relaxed) / n,
                              std::memory_order_relaxed);
  }
  inWindow_.store(false, std::memory_order_release);
}

int64_t Context::currentWindow() const {
  // The window a synchronization now would complete: windows begun since the
  // last one; else an implicit window of one micro-batch (no begin), unless
  // the host reports gradients and reported none since: then this is an
  // extra synchronization and claims the previous window's number again.
  const int64_t last = windowNumber_.load(std::memory_order_relaxed);
  const int64_t begun = begunSinceSync_.load(std::memory_order_relaxed);
  if (begun > 0) return last + begun;
  if (hostReportsReady_.load(std::memory_order_relaxed) &&
      readyOutsideSinceSync_.load(std::memory_order_relaxed) == 0) {
    return last;
  }
  return last + 1;
}

void Context::gradReady(int64_t id) {
  checkId(id);
  if (!hostReportsReady_.load(std::memory_order_relaxed)) {
    hostReportsReady_.store(true, std::memory_order_relaxed);
  }
  if (inWindow_.load(std::memory_order_acquire)) {
    // Inside a window nothing is communicated: count and return.
    readyInWindow_.fetch_add(1, std::memory_order_relaxed);
    deferredReadyCalls_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  readyOutsideSinceSync_.fetch_add(1, std::memory_order_relaxed);
  reducer_.markReady(id, currentWindow());
}

void Context::synchronize() {
  if (inWindow_.load(std::memory_order_acquire)) {
    fail(SF_ERR_INVALID_STATE,
         "sf_synchronize inside an accumulation window: the optimizer would step on unreduced "
         "gradients; call sf_end_accumulation first");
  }
  const auto t0 = std::chrono::steady_clock::now();
  const ReducerCounters before = reducer_.counters();
  const int64_t window = currentWindow();
  reducer_.synchronize(window);
  windowNumber_.store(window, std::memory_order_relaxed);
  begunSinceSync_.store(0, std::memory_order_relaxed);
  readyOutsideSinceSync_.store(0, std::memory_order_relaxed);
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - t0)
                         .count();
  syncNs_.fetch_add(ns, std::memory_order_relaxed);
  windowsCompleted_.fetch_add(1, std::memory_order_relaxed);
  if (logEnabled(LogLevel::kInfo)) {
    const ReducerCounters after = reducer_.counters();
    SF_LOG(kInfo, "window", "window " << window << " synchronized: "
                                      << after.collectives - before.collectives
                                      << " bucket collectives ("
                                      << after.earlyLaunches - before.earlyLaunches
                                      << " started by sf_grad_ready), "
                                      << after.bytesReduced - before.bytesReduced << " bytes, "
                                      << ns / 1000 << " us");
  }
}

sf_stats Context::stats() const {
  sf_stats s{};
  s.struct_size = sizeof s;
  s.windows_begun = windowsBegun_.load(std::memory_order_relaxed);
  s.windows_completed = windowsCompleted_.load(std::memory_order_relaxed);
  s.deferred_passes = deferredPasses_.load(std::memory_order_relaxed);
  s.deferred_ready_calls = deferredReadyCalls_.load(std::memory_order_relaxed);
  const ReducerCounters c = reducer_.counters();
  s.collectives_issued = c.collectives;
  s.early_launches = c.earlyLaunches;
  s.bytes_reduced = c.bytesReduced;
  s.gradient_count = reducer_.gradientCount();
  s.gradient_bytes = reducer_.gradientBytes();
  s.sync_ns_total = syncNs_.load(std::memory_order_relaxed);
  if (reducer_.built()) {
    const auto& plan = reducer_.plan();
    s.bucket_count = int64_t(plan.size());
    s.smallest_bucket_bytes = plan.empty() ? 0 : plan.front().bytes;
    for (const auto& b : plan) {
      if (b.bytes > s.largest_bucket_bytes) s.largest_bucket_bytes = b.bytes;
      if (b.bytes < s.smallest_bucket_bytes) s.smallest_bucket_bytes = b.bytes;
    }
  }
  return s;
}

void Context::bucketInfo(int64_t index, int64_t* bytes, int64_t* grads, sf_dtype* dtype) const {
  if (!reducer_.built()) {
    fail(SF_ERR_INVALID_STATE, "the buckets are not built yet (sf_build_buckets)");
  }
  const auto& plan = reducer_.plan();
  if (index < 0 || index >= int64_t(plan.size())) {
    fail(SF_ERR_INVALID_ARGUMENT, "index = " + std::to_string(index) + " is not a bucket (0.." +
                                      std::to_string(int64_t(plan.size()) - 1) + ")");
  }
  const PlannedBucket& b = plan[size_t(index)];
  if (bytes) *bytes = b.bytes;
  if (grads) *grads = int64_t(b.grads.size());
  if (dtype) *dtype = b.dtype;
}

}  // namespace sfsync
