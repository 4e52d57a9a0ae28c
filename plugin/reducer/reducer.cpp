// The reducer itself: registration, the build as a sequence of its rooms'
// steps, the order in which buckets start, the waits, and failure. The
// gathers are in reducer_gather.cpp; memory in bucket_memory.cpp; the window
// check in window_check.cpp.

#include "plugin/reducer/reducer.h"

#include <sstream>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/core/options.h"
#include "plugin/reducer/layout_check.h"

namespace sfsync {

Reducer::Reducer(const sf_options& opts, BackendFor backendFor)
    : opts_(opts),
      backendFor_(std::move(backendFor)),
      capMb_(opts.bucket_cap_mb),
      firstCapMb_(opts.first_bucket_cap_mb),
      shard_(opts.shard_layout),
      memory_([this](sf_device d) -> MemoryOps& { return memoryFor(d); }) {}

Reducer::~Reducer() {
  quiesce();  // collectives in flight read and write our buffers
  // The backends outlive the reducer (Context declares them first).
  memory_.release();
}

MemoryOps& Reducer::memoryFor(sf_device device) {
  return device == SF_DEVICE_HOST ? MemoryOps::host() : backendFor_(device);
}

// ---- Registration -----------------------------------------------------------

int64_t Reducer::addGradient(void* hostData, int64_t numel, sf_dtype dtype, sf_device device,
                             const char* name) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (built()) {
    fail(SF_ERR_INVALID_STATE,
         "the buckets are already built (by sf_build_buckets, sf_gradient_data, sf_grad_ready or "
         "sf_synchronize); register every gradient before that");
  }
  const int64_t id = int64_t(grads_.size());
  std::string label = name && *name ? name : "#" + std::to_string(id);
  // numel * size <= 2^58 (checked by the Context), so the product cannot wrap;
  // the sum is kept below kMaxTotalBytes so that no layout sum can.
  const int64_t bytes = numel * int64_t(dtypeSize(dtype));
  if (bytes > kMaxTotalBytes - totalBytes_) {
    std::ostringstream m;
    m << "gradient " << id << " ('" << label << "'): numel = " << numel << " x "
      << dtypeName(dtype) << " (" << bytes << " bytes) brings the registered gradients past "
      << kMaxTotalBytes << " bytes (2^62) in total (" << totalBytes_ << " bytes before it)";
    fail(SF_ERR_INVALID_ARGUMENT, m.str());
  }
  grads_.push_back(Gradient{hostData, numel, dtype, device, label, hostData == nullptr});
  totalBytes_ += bytes;
  return id;
}

void Reducer::addParameter(int64_t id, void* hostData, int64_t numel, sf_dtype dtype,
                           sf_device device) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireSharded("sf_register_parameter");
  if (built()) {
    fail(SF_ERR_INVALID_STATE, "the buckets are already built; register every parameter before "
                               "that");
  }
  Gradient& g = grads_[size_t(id)];
  std::ostringstream m;
  if (g.hasParam) {
    m << "id = " << id << ": gradient '" << g.name << "' already has a parameter";
  } else if (numel != g.numel) {
    m << "numel = " << numel << " differs from gradient " << id << " ('" << g.name
      << "'), which has numel = " << g.numel;
  } else if (dtype != g.dtype) {
    m << "dtype = " << dtype << " (" << (dtypeValid(dtype) ? dtypeName(dtype) : "not an sf_dtype")
      << ") differs from gradient " << id << " ('" << g.name << "'), which is "
      << dtypeName(g.dtype);
  } else if (device != g.device) {
    m << "device = " << device << " differs from gradient " << id << " ('" << g.name
      << "'), which is on " << deviceName(g.device) << " (" << g.device << ")";
  } else {
    g.hasParam = true;
    g.paramOwned = hostData == nullptr;
    g.param = hostData;
    return;
  }
  fail(SF_ERR_INVALID_ARGUMENT, m.str());
}

void Reducer::setCaps(double capMb, double firstCapMb) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (built()) {
    fail(SF_ERR_INVALID_STATE, "the buckets are already built; bucket caps can only change before");
  }
  capMb_ = capMb;
  firstCapMb_ = firstCapMb;
}

void Reducer::setShardLayout(sf_shard_layout layout) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (built()) {
    fail(SF_ERR_INVALID_STATE, "the buckets are already built; the shard layout can only change "
                               "before (sf_build_buckets, sf_gradient_data, sf_shard_range, ...)");
  }
  shard_ = layout;
}

void Reducer::requireSharded(const char* what) const {
  if (sharded()) return;
  fail(SF_ERR_INVALID_STATE, std::string(what) + " needs a sharded context, but shard_layout = "
                                 "none (set SF_SHARD, sf_options.shard_layout or "
                                 "sf_set_shard_layout to flat or parameter before the buckets "
                                 "are built)");
}

// ---- The build --------------------------------------------------------------

void Reducer::build() {
  std::lock_guard<std::mutex> lock(mutex_);
  buildLocked();
}

void Reducer::buildLocked() {
  if (built()) return;
  if (grads_.empty()) fail(SF_ERR_INVALID_STATE, "no gradient is registered");
  checkParameters();
  std::vector<GradSpec> specs;
  for (const auto& g : grads_) specs.push_back({g.numel, g.dtype, g.device});
  plan_ = planBuckets(specs, capBytes(capMb_), capBytes(firstCapMb_));
  check_.choose(plan_, opts_.world_size, shard_, opts_.wire_dtype);
  memory_.build(grads_, plan_, check_.reserve(plan_.size()), opts_.world_size, shard_);
  cycles_.clear();
  for (size_t i = 0; i < plan_.size(); ++i) cycles_.emplace_back(int64_t(i), int64_t(plan_[i].grads.size()));
  gradientGathers_.clear();
  gradientGathers_.resize(plan_.size());
  built_.store(true, std::memory_order_release);
  logPlan();
}

void Reducer::checkParameters() const {
  if (!sharded()) return;
  for (size_t id = 0; id < grads_.size(); ++id) {
    if (grads_[id].hasParam) continue;
    fail(SF_ERR_INVALID_STATE,
         "gradient " + std::to_string(id) + " ('" + grads_[id].name +
             "') has no parameter: in a sharded context (shard_layout = " +
             std::string(shard_ == SF_SHARD_FLAT ? "flat" : "parameter") +
             ") register every gradient's parameter (sf_register_parameter) before the "
             "buckets are built");
  }
}

void Reducer::logPlan() const {
  SF_LOG(kInfo, "reducer", "bucket plan: " << plan_.size() << " buckets for " << grads_.size()
                                           << " gradients (" << totalBytes_ << " bytes), cap "
                                           << capBytes(capMb_) << " bytes, first cap "
                                           << capBytes(firstCapMb_) << " bytes; "
                                           << (sharded() ? (shard_ == SF_SHARD_FLAT
                                                                ? "sharded (flat); "
                                                                : "sharded (parameter); ")
                                                         : "")
                                           << "window check "
                                           << (check_.carrier() >= 0
                                                   ? "in bucket " + std::to_string(check_.carrier()) +
                                                         " modulo " + std::to_string(check_.modulus())
                                                   : std::string("off")));
  if (!logEnabled(LogLevel::kInfo)) return;
  for (size_t i = 0; i < plan_.size(); ++i) {
    SF_LOG(kInfo, "reducer", "bucket " << i << ": " << plan_[i].bytes << " bytes, "
                                       << plan_[i].grads.size() << " gradients ("
                                       << grads_[size_t(plan_[i].grads.front())].name << " .. "
                                       << grads_[size_t(plan_[i].grads.back())].name << "), "
                                       << dtypeName(plan_[i].dtype) << " on "
                                       << deviceName(plan_[i].device)
                                       << (memory_[i].staged ? ", staged" : ", zero copy"));
  }
}

// ---- Buffers and their description ------------------------------------------

void* Reducer::gradientData(int64_t id) {
  if (!built()) {
    std::lock_guard<std::mutex> lock(mutex_);
    buildLocked();
  }
  return grads_[size_t(id)].data;  // fixed once built
}

void* Reducer::parameterData(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireSharded("sf_parameter_data");
  buildLocked();  // every gradient has a parameter once built
  return grads_[size_t(id)].param;
}

void Reducer::zero() {
  std::lock_guard<std::mutex> lock(mutex_);
  buildLocked();
  if (nextToStart_ > 0) {
    fail(SF_ERR_INVALID_STATE, "a synchronization is in flight; call sf_synchronize first");
  }
  for (auto& g : grads_) memoryFor(g.device).zero(g.data, size_t(g.bytes()));
}

int64_t Reducer::gradientCount() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return int64_t(grads_.size());
}

int64_t Reducer::gradientBytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return totalBytes_;
}

ShardRange Reducer::shardRange(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  buildLocked();
  const Gradient& g = grads_[size_t(id)];
  const BucketBuffers& b = memory_[size_t(g.bucket)];
  return ownedRange(b.layout, g.offset, g.numel, ownSegment(b));
}

int64_t Reducer::gradientBucket(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  buildLocked();
  return grads_[size_t(id)].bucket;
}

int64_t Reducer::bucketCount() {
  std::lock_guard<std::mutex> lock(mutex_);
  buildLocked();
  return int64_t(plan_.size());
}

void Reducer::checkBucketIndex(int64_t bucket, const char* what) const {
  if (bucket >= 0 && bucket < int64_t(plan_.size())) return;
  fail(SF_ERR_INVALID_ARGUMENT, std::string(what) + ": bucket = " + std::to_string(bucket) +
                                    " is not a bucket (0.." +
                                    std::to_string(int64_t(plan_.size()) - 1) + ")");
}

// ---- Reductions: the pass, the order, the waits -----------------------------

void Reducer::openPassLocked() {
  if (passOpen_) return;
  // A new pass: the previous window's reductions are no longer this
  // window's (a wait or gather now refers to the new one).
  for (auto& c : cycles_) c.newWindow();
  passOpen_ = true;
  ++pass_;
  reducedInPass_ = 0;
}

bool Reducer::beginPass() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (nextToStart_ > 0) return false;  // inFlight()
  openPassLocked();
  return true;
}

bool Reducer::inFlight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return nextToStart_ > 0;
}

void Reducer::markReady(int64_t id, int64_t window) {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  buildLocked();
  Gradient& g = grads_[size_t(id)];
  if (g.ready) {
    fail(SF_ERR_INVALID_STATE, "gradient " + std::to_string(id) + " ('" + g.name +
                                   "') was already reported ready since the last sf_synchronize");
  }
  openPassLocked();
  g.ready = true;
  cycles_[size_t(g.bucket)].gradientReported();
  window_ = window;
  startReadyBuckets(true);
}

void Reducer::startReadyBuckets(bool early) {
  while (nextToStart_ < cycles_.size() && cycles_[nextToStart_].complete()) {
    start(nextToStart_, early);
    ++nextToStart_;
  }
}

void Reducer::synchronizeStart(int64_t window) {
  std::lock_guard<std::mutex> lock(mutex_);
  startAllLocked(window);
}

void Reducer::startAllLocked(int64_t window) {
  throwIfFailed();
  buildLocked();
  openPassLocked();
  window_ = window;
  while (nextToStart_ < cycles_.size()) {
    start(nextToStart_, false);
    ++nextToStart_;
  }
}

void Reducer::start(size_t i, bool early) {
  const BucketBuffers& b = memory_[i];
  Backend& backend = backendFor_(b.plan->device);
  if (!verified_) {
    try {
      backend.connect();
      checkLayoutAcrossRanks(backend, grads_,
                             {int64_t(plan_.size()), capBytes(capMb_), capBytes(firstCapMb_),
                              opts_.reduce_op, int64_t(shard_)});
    } catch (const Error& e) {
      failWith(e.status(), e.what());
    }
    verified_ = true;
  }
  // The previous window's gather of this bucket ends first (the host may
  // not have waited for it; its parameters must be whole before this
  // window's state replaces it).
  if (cycles_[i].inFlight()) waitGatherLocked(i);
  if (b.staged) {
    try {
      for (int64_t id : b.plan->grads) memory_.toStaging(b, grads_[size_t(id)]);
    } catch (const Error& e) {
      failWith(e.status(), e.what());
    }
  }
  ReduceSpec spec = reduceSpec();
  spec.bucket = int64_t(i);
  spec.trace = trace_;
  if (trace_) {
    trace_->instant(0, "launch", "\"bucket\":" + std::to_string(spec.bucket) + ",\"bytes\":" +
                                     std::to_string(b.plan->bytes) + ",\"early\":" +
                                     (early ? "true" : "false") + ",\"collective\":\"" +
                                     (sharded() ? "reduce_scatter" : "all_reduce") + "\"");
  }
  // The scales apply to the data, not to the reserved tail after it.
  if (b.layout.reservedElems > 0) spec.scaledElems = b.layout.shardElems;
  if (check_.carries(i)) {
    try {
      check_.encode(b, memoryFor(b.plan->device), window_);
    } catch (const Error& e) {
      failWith(e.status(), e.what());
    }
  }
  // The one place where the mode picks the collective (as Megatron's
  // _ParamAndGradBucketGroup): each rank receives its segment, or everything.
  std::unique_ptr<Work> work;
  try {
    if (sharded()) {
      spec.segmentUsed = b.layout.used;
      work = backend.startReduceScatter(b.storage, b.layout.segmentElems, b.plan->dtype, spec);
    } else {
      work = backend.startAllreduce(b.storage, b.layout.gradientElems(), b.plan->dtype, spec);
    }
  } catch (const Error& e) {
    failWith(e.status(), e.what());
  }
  cycles_[i].startReduction(std::move(work));
  ++counters_.collectives;
  if (sharded()) ++counters_.reduceScatters;
  counters_.bytesReduced += b.plan->bytes;
  if (early) ++counters_.earlyLaunches;
  SF_LOG(kTrace, "reducer", "window " << window_ << ": bucket " << i << " started ("
                                      << b.plan->bytes << " bytes, "
                                      << (early ? "by sf_grad_ready" : "by sf_synchronize")
                                      << (check_.carries(i) ? ", carries the window check" : "")
                                      << ")");
}

ReduceSpec Reducer::reduceSpec() const {
  ReduceSpec spec;
  if (opts_.reduce_op == SF_REDUCE_AVERAGE) spec.postscale = 1.0 / opts_.world_size;
  if (opts_.reduce_op == SF_REDUCE_PRESCALED_SUM) spec.prescale = opts_.prescale;
  return spec;
}

void Reducer::waitBucketLocked(size_t i) {
  BucketCycle& c = cycles_[i];
  const BucketBuffers& b = memory_[i];
  try {
    c.reduction().wait();
  } catch (const Error& e) {
    c.abandon();
    failWith(e.status(), e.what());
  }
  if (b.staged) {
    // Sharded: only this rank's part holds reduced values; copy that back.
    try {
      for (int64_t id : b.plan->grads) {
        Gradient& g = grads_[size_t(id)];
        memory_.fromStaging(b, g, ownedRange(b.layout, g.offset, g.numel, ownSegment(b)));
      }
    } catch (const Error& e) {
      c.abandon();
      failWith(e.status(), e.what());
    }
  }
  c.reductionDone(pass_);
  if (++reducedInPass_ == int64_t(cycles_.size())) completePass_ = pass_;
  if (trace_) trace_->instant(0, "finish", "\"bucket\":" + std::to_string(i));
}

void Reducer::waitBucket(int64_t bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  buildLocked();
  checkBucketIndex(bucket, "sf_wait_bucket");
  const BucketCycle& c = cycles_[size_t(bucket)];
  if (c.reducedIn(pass_)) return;  // waiting twice is free
  if (c.state() != BucketState::kReducing) {
    fail(SF_ERR_INVALID_STATE, "sf_wait_bucket: bucket " + std::to_string(bucket) +
                                   " was not started in this window (start it with "
                                   "sf_synchronize_start, or let sf_grad_ready complete it)");
  }
  waitBucketLocked(size_t(bucket));
}

void Reducer::synchronize(int64_t window) {
  std::lock_guard<std::mutex> lock(mutex_);
  startAllLocked(window);
  for (size_t i = 0; i < cycles_.size(); ++i) {
    if (!cycles_[i].reducedIn(pass_)) waitBucketLocked(i);
  }
  if (check_.carrier() >= 0) {
    const BucketBuffers& b = memory_[size_t(check_.carrier())];
    try {
      check_.verify(b, ownSegment(b), memoryFor(b.plan->device), backendFor_(b.plan->device),
                    opts_.world_size);
    } catch (const Error& e) {
      failWith(e.status(), e.what());
    }
  }
  for (auto& g : grads_) g.ready = false;
  for (auto& c : cycles_) c.reportsCleared();
  nextToStart_ = 0;
  passOpen_ = false;  // the results stay this window's until the next pass opens
}

// ---- Failure and teardown ---------------------------------------------------

bool Reducer::quiesce() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!drainLocked() && failedStatus_ == SF_OK) {
    failedStatus_ = SF_ERR_BACKEND;
    failedMessage_ = "a collective failed while the context was torn down";
  }
  return failedStatus_ == SF_OK;
}

bool Reducer::drainLocked() noexcept {
  bool ok = true;
  auto waitQuietly = [&](Work* w) {
    if (!w) return;
    try {
      w->wait();
    } catch (...) {
      ok = false;
    }
  };
  for (size_t i = 0; i < cycles_.size(); ++i) {
    waitQuietly(cycles_[i].inFlight());
    cycles_[i].abandon();
    waitQuietly(gradientGathers_[i].get());
    gradientGathers_[i].reset();
  }
  nextToStart_ = 0;
  return ok;
}

void Reducer::throwIfFailed() const {
  if (failedStatus_ != SF_OK) {
    throw Error(failedStatus_, "the context failed earlier and cannot synchronize again: " +
                                   failedMessage_);
  }
}

void Reducer::failWith(sf_status status, const std::string& message) {
  drainLocked();  // nothing may keep writing into our buffers after this
  if (failedStatus_ == SF_OK) {
    failedStatus_ = status;
    failedMessage_ = message;
  }
  SF_LOG(kWarn, "reducer", message);
  throw Error(status, message);
}

ReducerCounters Reducer::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

}  // namespace sfsync
