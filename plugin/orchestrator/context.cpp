// The Context: its backends, registration and validation, the window calls
// (asking its WindowClock) and the synchronizations they allow, the stats.
// The control collectives between windows are in context_control.cpp.

#include "plugin/orchestrator/context.h"

#include <chrono>
#include <cmath>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/core/options.h"
#include "plugin/core/strict.h"

namespace sfsync {

namespace {
sf_options clamped(sf_options o) {
  o.timeout_ms = clampTimeoutMs(o.timeout_ms);
  return o;
}
}  // namespace

Context::Context(const sf_options& opts, BackendMaker makeBackend)
    : trace_(Tracer::fromEnvironment(opts.rank, opts.world_size)),
      reducer_(clamped(opts)),  // the one copy of the options (context.h)
      rendezvous_(std::make_shared<Rendezvous>(reducer_.options())) {
  if (!makeBackend) fail(SF_ERR_INTERNAL, "a Context needs a BackendMaker");
  makeBackend_ = std::move(makeBackend);
  reducer_.setTracer(trace_.get());
  const sf_options& o = options();
  logSetRank(o.rank);
  SF_LOG(kInfo, "context", "rank " << o.rank << " of " << o.world_size << ", backend "
                                    << o.backend << ", rendezvous '" << o.rendezvous
                                    << "', timeout_ms " << o.timeout_ms);
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

namespace {
// What serves host memory when backend = nccl: registering a host gradient
// succeeds (as it always has), and its first collective is refused.
class RefusedBackend final : public Backend {
 public:
  explicit RefusedBackend(std::string why) : why_(std::move(why)) {}
  const char* name() const override { return "refused"; }
  void connect() override { fail(SF_ERR_UNSUPPORTED, why_); }
  std::unique_ptr<Work> startAllreduce(void*, int64_t, sf_dtype, ReduceSpec) override {
    fail(SF_ERR_UNSUPPORTED, why_);
  }
  void allreduceMaxInt64(int64_t*, int64_t) override { fail(SF_ERR_UNSUPPORTED, why_); }
  void barrierQuietly() noexcept override {}
  void broadcast(void*, size_t, int) override { fail(SF_ERR_UNSUPPORTED, why_); }

 private:
  std::string why_;
};
}  // namespace

sf_device Context::controlDevice() const {
  return options().backend == SF_BACKEND_NCCL ? SF_DEVICE_CUDA : SF_DEVICE_HOST;
}

Backend& Context::backendFor(sf_device device) {
  std::lock_guard<std::mutex> lock(backendsMutex_);
  auto& slot = backends_[device];
  if (slot) return *slot;
  if (device == SF_DEVICE_HOST && options().backend == SF_BACKEND_NCCL) {
    slot = std::make_unique<RefusedBackend>(
        "backend = nccl cannot reduce host-memory gradients; use gloo or auto");
    return *slot;
  }
  if (device == SF_DEVICE_CUDA && options().backend == SF_BACKEND_GLOO) {
    fail(SF_ERR_UNSUPPORTED, "backend = gloo cannot reduce CUDA gradients; use nccl or auto");
  }
  auto made = makeBackend_(device, options(), rendezvous_);  // SF_ERR_UNSUPPORTED: no CUDA/NCCL/GPU
  if (!made) fail(SF_ERR_INTERNAL, "the BackendMaker made no backend for device " + std::to_string(device));
  made->setHostStream(cudaStream_);
  // Every collective is counted where it is handed over (sf_stats.wire_*).
  slot = std::make_unique<CountingBackend>(std::move(made), wire_, options().world_size);
  return *slot;
}

Backend* Context::madeBackend(sf_device device) {
  std::lock_guard<std::mutex> lock(backendsMutex_);
  auto it = backends_.find(device);
  return it == backends_.end() ? nullptr : it->second.get();
}

void Context::setCudaStream(void* stream) {
  if (reducer_.inFlight()) {
    fail(SF_ERR_INVALID_STATE, "bucket collectives started by sf_grad_ready are in flight; change "
                               "the stream after sf_synchronize");
  }
  std::lock_guard<std::mutex> lock(backendsMutex_);
  cudaStream_ = stream;
  for (auto& kv : backends_) {
    if (kv.second) kv.second->setHostStream(stream);
  }
}

void Context::adoptNcclComm(void* comm) {
  if (!comm) fail(SF_ERR_INVALID_ARGUMENT, "comm is NULL");
  backendFor(SF_DEVICE_CUDA).adopt(comm);
}

void Context::setBucketCapMb(double mb) {
  validateCap(mb, "bucket_cap_mb");
  reducer_.setBucketCapMb(mb);
}

void Context::setFirstBucketCapMb(double mb) {
  validateCap(mb, "first_bucket_cap_mb");
  reducer_.setFirstBucketCapMb(mb);
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
    // Resolved here, once per device, and handed down with the gradient. A
    // CUDA gradient: SF_ERR_UNSUPPORTED now, not at the first synchronization.
    Backend& backend = backendFor(device);
    if (device == SF_DEVICE_CUDA && data) {
      backend.checkDeviceMemory(data, size_t(numel) * dtypeSize(dtype));
    }
    return reducer_.addGradient(data, numel, dtype, device, name, backend);
  }
  fail(SF_ERR_INVALID_ARGUMENT, s.str());
}

void Context::checkId(int64_t id) const {
  const int64_t n = reducer_.gradientCount();
  if (id < 0 || id >= n) {
    fail(SF_ERR_INVALID_ARGUMENT, "id = " + std::to_string(id) + " is not a registered gradient "
                                  "(ids are 0.." + std::to_string(n - 1) + ")");
  }
}

void* Context::gradientData(int64_t id) {
  checkId(id);
  return reducer_.gradientData(id);
}

void Context::zeroGradients() {
  std::lock_guard<std::mutex> lock(windowMutex_);
  reducer_.zero();
}

void Context::beginAccumulation() {
  std::lock_guard<std::mutex> lock(windowMutex_);  // a window call (context.h, "Threads")
  if (clock_.inWindow()) {
    // Said at the call: a host that ignores the status (ctypes does) would
    // otherwise keep window K open, and under the shim train on local gradients.
    const int64_t k = clock_.refuseBegin();
    SF_LOG(kWarn, "window",
           "sf_begin_accumulation inside window " << k
               << " refused (SF_ERR_INVALID_STATE): window " << k
               << " was never ended (a forgotten sf_end_accumulation?); it stays open, so "
                  "nothing is synchronized until sf_end_accumulation"
               << (strictMode() ? " (SF_STRICT=1: under the shim, the next gradient all-reduce fails)"
                                : ""));
    fail(SF_ERR_INVALID_STATE,
         "already inside an accumulation window (sf_begin_accumulation twice without "
         "sf_end_accumulation)");
  }
  // One reducer lock: the in-flight check and the new pass (the last
  // window's reductions are not this one's).
  if (!reducer_.beginPass(clock_.nextPass())) {
    fail(SF_ERR_INVALID_STATE,
         "bucket collectives started by sf_grad_ready are still in flight; call sf_synchronize "
         "before starting a new window");
  }
  if (trace_) windowStartUs_ = Tracer::nowUs();
  clock_.begin();  // the numbering rules live there
}

void Context::endAccumulation() {
  std::lock_guard<std::mutex> lock(windowMutex_);  // a window call (context.h, "Threads")
  if (!clock_.inWindow()) {
    fail(SF_ERR_INVALID_STATE, "not inside an accumulation window (sf_end_accumulation without "
                               "sf_begin_accumulation)");
  }
  const int64_t n = reducer_.gradientCount();
  clock_.end(n);
  if (n == 0 && !followed_.load(std::memory_order_relaxed)) {
    // Nothing registered, nothing interposed, nobody asked: the window changed nothing.
    const int64_t k = clock_.windowsBegun();
    const bool strict = strictMode();
    if (!saidAffectsNothing_.exchange(true)) {
      SF_LOG(kWarn, "window",
             "window " << k << " ended, but these windows affect nothing: no gradient is "
                       "registered with this context, no interposer follows it (for the default "
                       "context: LD_PRELOAD=libsfsync_shim.so) and nothing asked "
                       "sf_in_accumulation; a host that all-reduces itself (PyTorch DDP) still "
                       "does so every micro-batch"
                    << (strict ? " (SF_STRICT=1: sf_end_accumulation fails)" : ""));
    }
    if (strict) {
      fail(SF_ERR_INVALID_STATE,
           "window " + std::to_string(k) +
               " affected nothing (no gradient registered, no interposer, SF_STRICT=1); the "
               "window is ended");
    }
  }
}

void Context::restoreWindows(int64_t windowsCompleted) {
  std::lock_guard<std::mutex> lock(windowMutex_);  // a window call (context.h, "Threads")
  if (windowsCompleted < 0) {
    fail(SF_ERR_INVALID_ARGUMENT,
         "windows_completed = " + std::to_string(windowsCompleted) +
             " is negative; pass the saved run's sf_stats.windows_completed (0 or more)");
  }
  if (!clock_.restore(windowsCompleted)) {
    fail(SF_ERR_INVALID_STATE,
         "too late to restore windows_completed = " + std::to_string(windowsCompleted) +
             ": this context already began a window or synchronized (windows begun " +
             std::to_string(clock_.windowsBegun()) + ", completed " +
             std::to_string(clock_.windowsCompleted()) +
             "); call sf_restore_windows right after sf_create, before training resumes "
             "(before the first sf_begin_accumulation, sf_grad_ready or sf_synchronize)");
  }
  SF_LOG(kInfo, "window", "restored " << windowsCompleted << " completed windows: the next "
                          "window is number " << windowsCompleted + 1);
}

void Context::countHostWindow() {
  std::lock_guard<std::mutex> lock(windowMutex_);  // a window call (context.h, "Threads")
  if (clock_.inWindow()) {
    fail(SF_ERR_INVALID_STATE,
         "sf_count_window inside an accumulation window (window " + std::to_string(clock_.current()) +
             "): its last pass is still to come; call sf_end_accumulation first");
  }
  const int64_t registered = gradientsRegistered();
  if (registered > 0) {
    fail(SF_ERR_INVALID_STATE,
         "sf_count_window on a context with " + std::to_string(registered) +
             " registered gradients: sf_synchronize reduces and counts their windows; "
             "sf_count_window is for a host that reduces its windows with its own collectives");
  }
  const PassRef pass = clock_.claim();
  clock_.passSynchronized(pass);
  SF_LOG(kTrace, "window", "window " << pass.window << " reduced by the host: counted ("
                           << clock_.windowsCompleted() << " completed)");
}

void Context::gradReady(int64_t id) {
  checkId(id);
  int64_t nth = 0;
  if (!clock_.gradReady(&nth)) {
    // Inside a window nothing is communicated: counted, done.
    if (trace_) tracePass(true, nth);
    return;
  }
  markReady(id);
  if (trace_) tracePass(false, nth);
}

// Out of line: the window's path above stays a few instructions.
[[gnu::noinline]] void Context::markReady(int64_t id) {
  // The clock's pass, handed down. Refused if a synchronization closed it
  // after the clock answered: asked again once the clock closed it too
  // (pass_ref.h; a synchronization closes it right after the reducer's).
  while (!reducer_.markReady(id, clock_.openPass())) std::this_thread::yield();
}

void Context::tracePass(bool inWindow, int64_t nth) {
  // A pass (of the trace: one backward) is as many grad-ready calls as there
  // are gradients: the clock counts them, the nth starts or ends one.
  const int64_t gradients = reducer_.gradientCount();
  std::lock_guard<std::mutex> lock(traceMutex_);
  const double now = Tracer::nowUs();
  if ((nth - 1) % gradients == 0) passStartUs_ = now;
  if (nth % gradients != 0) return;
  trace_->span(0, "pass", passStartUs_, now,
               std::string("\"in_window\":") + (inWindow ? "true" : "false"));
}

void Context::synchronize() {
  // Read before waiting for the lock, then counted as a caller (the order a
  // test that waits on synchronizeCallers() relies on): a synchronization
  // that ends while this call waits ran at the same time as this call.
  const int64_t endedBefore = syncsEnded_.load(std::memory_order_acquire);
  syncCallers_.fetch_add(1, std::memory_order_release);
  struct Leave {
    std::atomic<int>& callers;
    ~Leave() { callers.fetch_sub(1, std::memory_order_release); }
  } leave{syncCallers_};
  std::lock_guard<std::mutex> lock(windowMutex_);
  if (syncsEnded_.load(std::memory_order_relaxed) != endedBefore) {
    // Two threads asked for the same window: it is synchronized once, and
    // this call answers as that synchronization did. A second round of
    // collectives here would pair with the peers' next window.
    const SyncOutcome& o = lastSync_;
    SF_LOG(kInfo, "window", "sf_synchronize waited for window "
                                << o.window << "'s synchronization by another thread (status "
                                << o.status << "): not synchronized again");
    if (o.status != SF_OK) {
      throw Error(o.status, "another thread's sf_synchronize of this context ran while this call "
                            "waited, and this call returns its outcome (window " +
                                std::to_string(o.window) + " is not synchronized again): " +
                                o.message);
    }
    return;
  }
  SyncOutcome outcome;
  outcome.window = clock_.current();  // the open window's, if refused inside it
  struct Record {  // the outcome and the count, also when the synchronization throws
    Context& c;
    SyncOutcome& o;
    ~Record() {
      c.lastSync_ = std::move(o);
      c.syncsEnded_.fetch_add(1, std::memory_order_release);
    }
  } record{*this, outcome};
  try {
    synchronizeLocked(&outcome.window);
  } catch (const Error& e) {
    outcome.status = e.status();
    outcome.message = e.what();
    throw;
  } catch (const std::bad_alloc&) {
    outcome.status = SF_ERR_OUT_OF_MEMORY;
    outcome.message = "out of memory";
    throw;
  } catch (...) {
    outcome.status = SF_ERR_INTERNAL;
    outcome.message = "an unexpected failure (the first call's sf_last_error() says which)";
    throw;
  }
}

void Context::synchronizeLocked(int64_t* windowOut) {
  if (clock_.inWindow()) {
    fail(SF_ERR_INVALID_STATE,
         "sf_synchronize inside an accumulation window: the optimizer would step on unreduced "
         "gradients; call sf_end_accumulation first");
  }
  const auto t0 = std::chrono::steady_clock::now();
  const PassRef pass = clock_.claim();
  const int64_t window = pass.window;
  *windowOut = window;
  const double t0Us = trace_ ? Tracer::nowUs() : 0;
  bool weightless = false;
  try {
    weightless = reducer_.synchronize(pass);
    clock_.passSynchronized(pass);  // it succeeded: the pass closes
  } catch (const Error& e) {
    if (trace_) {
      trace_->span(0, "synchronize", t0Us, Tracer::nowUs(),
                   "\"window\":" + std::to_string(window) + ",\"failed\":true");
    }
    throw;
  }
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - t0)
                         .count();
  syncNs_.fetch_add(ns, std::memory_order_relaxed);
  if (trace_) {
    const double end = Tracer::nowUs();
    const std::string args = "\"window\":" + std::to_string(window);
    trace_->span(0, "synchronize", t0Us, end, args);
    if (windowStartUs_ >= 0) trace_->span(0, "window", windowStartUs_, end, args);
    windowStartUs_ = -1;
  }
  // This window's collectives: since the previous synchronization (hooks
  // may have started them before this call).
  const ReducerCounters after = reducer_.counters();
  if (logEnabled(LogLevel::kInfo)) {
    SF_LOG(kInfo, "window", "window " << window << " synchronized: "
                                      << after.collectives - atLastSync_.collectives
                                      << " bucket collectives ("
                                      << after.earlyLaunches - atLastSync_.earlyLaunches
                                      << " started by sf_grad_ready), "
                                      << after.bytesReduced - atLastSync_.bytesReduced
                                      << " bytes, " << ns / 1000 << " us in sf_synchronize");
  }
  atLastSync_ = after;
  if (weightless) {
    // Every rank decoded the same global weight: every rank says so, and
    // the context stays usable (the window is counted; nothing was divided).
    fail(SF_ERR_INVALID_STATE,
         "window " + std::to_string(window) +
             ": the global window weight is 0 (no rank added a weight with "
             "sf_add_window_weight, or every weight was 0): the gradients were left as the plain "
             "sums, not divided; skip this optimizer step");
  }
}

namespace {
// A weight or window sum: finite, below the codec's magnitude, and (a weight) not negative.
void checkWindowValue(const std::string& name, double v, bool weight) {
  if (!std::isfinite(v) || (weight && v < 0) || std::fabs(v) >= LimbCodec::kMaxMagnitude) {
    std::ostringstream m;
    m.precision(17);
    m << name << " = " << v << " is "
      << (!std::isfinite(v) ? "not finite"
                            : (weight && v < 0) ? "negative" : "2^52 or more in magnitude")
      << (weight ? "; a window weight is a finite count or sum of weights, 0 <= weight < 2^52"
                 : "; a window sum must be finite with |value| < 2^52");
    fail(SF_ERR_INVALID_ARGUMENT, m.str());
  }
}
}  // namespace

void Context::addWindowWeight(double weight) {
  checkWindowValue("weight", weight, true);
  reducer_.addWindowWeight(weight, clock_.pass());
}

void Context::addWindowSums(const double* values, int32_t count) {
  if (count < 1 || count > SF_WINDOW_SUMS) {
    fail(SF_ERR_INVALID_ARGUMENT, "count = " + std::to_string(count) +
                                      " is not between 1 and SF_WINDOW_SUMS (" +
                                      std::to_string(SF_WINDOW_SUMS) + ")");
  }
  if (values == nullptr) fail(SF_ERR_INVALID_ARGUMENT, "values is NULL");
  for (int32_t k = 0; k < count; ++k) {
    checkWindowValue("values[" + std::to_string(k) + "]", values[k], false);
  }
  reducer_.addWindowSums(values, count, clock_.pass());
}

void Context::windowTotals(double* weight, double* sums, int32_t count) const {
  if (count < 0) {
    fail(SF_ERR_INVALID_ARGUMENT,
         "count = " + std::to_string(count) + " is negative");
  }
  if (count > 0 && sums == nullptr) {
    fail(SF_ERR_INVALID_ARGUMENT, "sums is NULL with count = " +
                                      std::to_string(count));
  }
  WindowTotals::Totals t;
  if (!reducer_.windowTotals(t)) {
    fail(SF_ERR_INVALID_STATE,
         std::string("no weighted window has completed yet") +
             (options().reduce_op == SF_REDUCE_WEIGHTED
                  ? ""
                  : " (this context's reduce_op is not SF_REDUCE_WEIGHTED: it has none)"));
  }
  if (weight) *weight = t.weight;
  for (int32_t k = 0; k < count && k < SF_WINDOW_SUMS; ++k) sums[k] = t.sums[size_t(k)];
}

sf_stats Context::stats() const {
  sf_stats s{};
  s.struct_size = sizeof s;
  s.windows_begun = clock_.windowsBegun();
  s.windows_completed = clock_.windowsCompleted();
  s.deferred_passes = clock_.deferredPasses();
  s.deferred_ready_calls = clock_.deferredReadyCalls();
  const ReducerCounters c = reducer_.counters();
  s.collectives_issued = c.collectives;
  s.early_launches = c.earlyLaunches;
  s.bytes_reduced = c.bytesReduced;
  s.gradient_count = reducer_.gradientCount();
  s.gradient_bytes = reducer_.gradientBytes();
  s.sync_ns_total = syncNs_.load(std::memory_order_relaxed);
  s.reduce_scatters = c.reduceScatters;
  s.all_gathers = c.allGathers;
  s.bytes_gathered = c.bytesGathered;
  const WireCounts w = wire_.counts();
  s.wire_allreduces = w.allreduces;
  s.wire_reduce_scatters = w.reduceScatters;
  s.wire_all_gathers = w.allGathers;
  s.wire_broadcasts = w.broadcasts;
  s.wire_controls = w.controls;
  s.wire_bytes = w.bytes;
  s.wire_gradient_bytes = w.gradientBytes;
  s.wire_parameter_bytes = w.parameterBytes;
  s.wire_mask_bytes = w.maskBytes;
  s.wire_check_bytes = w.checkBytes;
  s.wire_weight_bytes = w.weightBytes;
  s.wire_host_bytes = w.hostBytes;
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

// The buckets are built and `index` is one of them (sf_bucket_info, sf_bucket_state).
static void checkBucket(const Reducer& reducer, int64_t index) {
  if (!reducer.built()) {
    fail(SF_ERR_INVALID_STATE, "the buckets are not built yet (sf_build_buckets)");
  }
  const int64_t n = int64_t(reducer.plan().size());
  if (index < 0 || index >= n) {
    fail(SF_ERR_INVALID_ARGUMENT, "index = " + std::to_string(index) + " is not a bucket (0.." +
                                      std::to_string(n - 1) + ")");
  }
}

void Context::bucketInfo(int64_t index, int64_t* bytes, int64_t* grads, sf_dtype* dtype) const {
  checkBucket(reducer_, index);
  const PlannedBucket& b = reducer_.plan()[size_t(index)];
  if (bytes) *bytes = b.bytes;
  if (grads) *grads = int64_t(b.grads.size());
  if (dtype) *dtype = b.dtype;
}

int32_t Context::bucketState(int64_t index) const {
  checkBucket(reducer_, index);
  return reducer_.bucketState(index);
}

// ---- Sharded windows, per-bucket completion, gathers ------------------------

void Context::setShardLayout(sf_shard_layout layout) {
  if (layout < SF_SHARD_NONE || layout > SF_SHARD_PARAMETER) {
    fail(SF_ERR_INVALID_ARGUMENT, "layout = " + std::to_string(layout) +
                                      " is not an sf_shard_layout (0 none, 1 flat, 2 parameter)");
  }
  reducer_.setShardLayout(layout);
}

void Context::registerParameter(int64_t id, void* data, int64_t numel, sf_dtype dtype,
                                sf_device device) {
  checkId(id);
  if (device == SF_DEVICE_CUDA && data) {
    Backend* cuda = madeBackend(SF_DEVICE_CUDA);
    if (cuda) {
      cuda->checkDeviceMemory(data, size_t(std::max<int64_t>(numel, 0)) *
                                        (dtypeValid(dtype) ? dtypeSize(dtype) : 1));
    }
  }
  reducer_.addParameter(id, data, numel, dtype, device);
}

void* Context::parameterData(int64_t id) {
  checkId(id);
  return reducer_.parameterData(id);
}

void Context::shardRange(int64_t id, int64_t* offset, int64_t* count) {
  checkId(id);
  const ShardRange r = reducer_.shardRange(id);
  if (offset) *offset = r.offset;
  if (count) *count = r.count;
}

int64_t Context::gradientBucket(int64_t id) {
  checkId(id);
  return reducer_.gradientBucket(id);
}

void Context::synchronizeStart() {
  std::lock_guard<std::mutex> lock(windowMutex_);  // a window call (context.h, "Threads")
  if (clock_.inWindow()) {
    fail(SF_ERR_INVALID_STATE,
         "sf_synchronize_start inside an accumulation window: the optimizer would step on "
         "unreduced gradients; call sf_end_accumulation first");
  }
  reducer_.synchronizeStart(clock_.claim());
}

void Context::waitBucket(int64_t bucket) { reducer_.waitBucket(bucket, clock_.pass()); }

void Context::startGather(int64_t bucket) {
  if (bucket < -1) {
    fail(SF_ERR_INVALID_ARGUMENT, "bucket = " + std::to_string(bucket) +
                                      " is not a bucket (0..count-1, or -1 for all)");
  }
  reducer_.startGather(bucket, clock_.pass());
}

void Context::waitGather(int64_t bucket) {
  if (bucket < -1) {
    fail(SF_ERR_INVALID_ARGUMENT, "bucket = " + std::to_string(bucket) +
                                      " is not a bucket (0..count-1, or -1 for all)");
  }
  reducer_.waitGather(bucket);
}

void Context::gatherParameters() {
  reducer_.startGather(-1, clock_.pass());
  reducer_.waitGather(-1);
}

void Context::gatherGradients() {
  std::lock_guard<std::mutex> lock(windowMutex_);  // a window call (context.h, "Threads")
  if (clock_.inWindow()) {
    fail(SF_ERR_INVALID_STATE,
         "sf_gather_gradients inside an accumulation window: the window's gradients are not "
         "reduced yet (call sf_end_accumulation, then sf_synchronize, then sf_gather_gradients)");
  }
  reducer_.gatherGradients(clock_.pass());
}

}  // namespace sfsync
