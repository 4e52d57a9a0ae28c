// The reducer itself: the pass, the order in which buckets start (the one
// place that picks the collective), the waits, and failure. Registration and
// the build are in reducer_build.cpp, the gathers in reducer_gather.cpp,
// memory in bucket_memory.cpp, the window check in window_check.cpp.

#include "plugin/reducer/reducer.h"


#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/core/options.h"
#include "plugin/reducer/layout_check.h"

namespace sfsync {

Reducer::Reducer(const sf_options& opts)
    : opts_(opts),
      capChosen_(opts.bucket_cap_mb != kDefaultBucketCapMb),
      memory_([this](sf_device d) -> MemoryOps& { return backendOf(d); }) {}

Reducer::~Reducer() {
  quiesce();  // collectives in flight read and write our buffers
  // The backends outlive the reducer (Context declares them first).
  memory_.release();
}

Backend& Reducer::backendOf(sf_device device) {
  Backend* backend = deviceBackends_[size_t(device)];
  if (!backend) fail(SF_ERR_INTERNAL, "no backend was handed for device " + std::to_string(device));
  return *backend;
}

// ---- Reductions: the pass, the order, the waits -----------------------------

void Reducer::enterPassLocked(int64_t pass) {
  // Every cycle enters a pass with the others: the first one says where all are.
  if (cycles_.empty() || cycles_.front().pass() == pass) return;
  // A new pass: the previous window's reductions are no longer this
  // window's (a wait or gather now refers to the new one).
  for (auto& c : cycles_) c.enterPass(pass);
}

bool Reducer::reducedIn(int64_t pass) const {
  for (const auto& c : cycles_) {
    if (!c.reducedIn(pass)) return false;
  }
  return !cycles_.empty();
}

bool Reducer::beginPass(int64_t pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (nextToStart_ > 0) return false;  // inFlight()
  // A window begins after a pass reported gradients ready without
  // synchronizing them: they go on accumulating unscaled (x * W undoes the
  // exact x / W of readyScaleOf), and are scaled at their next report.
  // (Only then a loop: a begin is one per micro-batch for some hosts.)
  if (reportsScaled_) {
    for (auto& g : grads_) {
      if (!g.scaled) continue;
      scaleInPlace(g.data, g.numel, g.dtype, 1.0 / readyScale_[size_t(g.bucket)]);
      g.scaled = false;
    }
    reportsScaled_ = false;
  }
  enterPassLocked(pass);
  return true;
}

double Reducer::readyScaleOf(size_t i) const {
  const int64_t w = opts_.world_size;
  if (opts_.reduce_op != SF_REDUCE_AVERAGE || w < 2 || (w & (w - 1)) != 0) return 1.0;
  if (sharded() || memory_[i].staged) return 1.0;  // the scale is on the shard / the staging
  return backends_[i]->scalesInAPass(plan_[i].dtype) ? 1.0 / double(w) : 1.0;
}

void Reducer::scaleOnce(Gradient& g, double factor) {
  if (factor == 1.0 || g.scaled) return;
  scaleInPlace(g.data, g.numel, g.dtype, factor);
  g.scaled = true;
}

bool Reducer::inFlight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return nextToStart_ > 0;
}

int32_t Reducer::bucketState(int64_t bucket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const BucketCycle& c = cycles_[size_t(bucket)];
  switch (c.state()) {
    case BucketState::kIdle: return SF_BUCKET_IDLE;
    case BucketState::kFilling: return SF_BUCKET_FILLING;
    case BucketState::kReducing: return SF_BUCKET_REDUCING;
    case BucketState::kReduced: return SF_BUCKET_REDUCED;
    // One state inside (the gather's end changes nothing the cycle checks),
    // two for the host: whether it still has to wait.
    case BucketState::kGathering: return c.inFlight() ? SF_BUCKET_GATHERING : SF_BUCKET_GATHERED;
    case BucketState::kGatheringGradients: return SF_BUCKET_GATHERING_GRADIENTS;
  }
  fail(SF_ERR_INTERNAL, "bucket " + std::to_string(bucket) + " is in no known state");
}

int32_t Reducer::windowState(const PassRef& pass) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!built()) return 0;
  // Started and not synchronized (synchronize() resets nextToStart_); a
  // failure drains the buckets, and the open pass stays unsynchronized.
  const bool synchronizing = nextToStart_ > 0 || (failedStatus_ != SF_OK && pass.open);
  int32_t flags = synchronizing ? SF_WINDOW_SYNCHRONIZING : 0;
  bool whole = !cycles_.empty();
  for (const auto& c : cycles_) {
    // Unsharded every rank received every reduced gradient; sharded only
    // sf_gather_gradients makes them whole (bucket_state.h).
    if (!(sharded() ? c.gradientsWholeIn(pass.number) : c.reducedIn(pass.number))) whole = false;
  }
  if (whole) flags |= SF_WINDOW_GRADIENTS_WHOLE;
  return flags;
}

bool Reducer::markReady(int64_t id, const PassRef& pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  if (pass.number <= synchronizedPass_) return false;  // closed since the caller read it
  buildLocked();
  Gradient& g = grads_[size_t(id)];
  if (g.ready) {
    fail(SF_ERR_INVALID_STATE, "gradient " + std::to_string(id) + " ('" + g.name +
                                   "') was already reported ready since the last sf_synchronize");
  }
  enterPassLocked(pass.number);
  g.ready = true;
  if (readyScale_[size_t(g.bucket)] != 1.0) {
    scaleOnce(g, readyScale_[size_t(g.bucket)]);
    reportsScaled_ = true;
  }
  cycles_[size_t(g.bucket)].gradientReported();
  startReadyBuckets(true, pass);
  return true;
}

void Reducer::startReadyBuckets(bool early, const PassRef& pass) {
  while (nextToStart_ < cycles_.size() && cycles_[nextToStart_].complete()) {
    start(nextToStart_, early, pass);
    ++nextToStart_;
  }
}

void Reducer::synchronizeStart(const PassRef& pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  startAllLocked(pass);
}

void Reducer::startAllLocked(const PassRef& pass) {
  throwIfFailed();
  buildLocked();
  enterPassLocked(pass.number);
  while (nextToStart_ < cycles_.size()) {
    start(nextToStart_, false, pass);
    ++nextToStart_;
  }
}

void Reducer::start(size_t i, bool early, const PassRef& pass) {
  const BucketBuffers& b = memory_[i];
  Backend& backend = *backends_[i];  // resolved at the build
  if (!verified_) {
    try {
      backend.connect();
      checkLayoutAcrossRanks(backend, grads_,
                             {int64_t(plan_.size()), capBytes(opts_.bucket_cap_mb),
                              capBytes(opts_.first_bucket_cap_mb), opts_.reduce_op,
                              int64_t(opts_.shard_layout)},
                             pass.window);
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
  if (readyScale_[i] != 1.0) {
    // Scaled as reported ready; the ones never reported (started by
    // sf_synchronize) here. The collective is a plain sum.
    for (int64_t id : b.plan->grads) scaleOnce(grads_[size_t(id)], readyScale_[i]);
    spec.prescale = spec.postscale = 1.0;
  }
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
  spec.maskElems = maskElems_[i];  // for the wire counts
  if (totals_.weighted()) {
    // Weighted: the window's weight and sums freeze as bucket 0 starts.
    totals_.describe(i, spec);
    try {
      totals_.encode(i, b, backend);
    } catch (const Error& e) {
      failWith(e.status(), e.what());
    }
  }
  if (check_.carries(i)) {
    try {
      check_.encode(b, backend, pass.window);
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
  SF_LOG(kTrace, "reducer", "window " << pass.window << ": bucket " << i << " started ("
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

void Reducer::waitBucketLocked(size_t i, const PassRef& pass) {
  BucketCycle& c = cycles_[i];
  const BucketBuffers& b = memory_[i];
  try {
    c.reduction().wait();
    if (totals_.weighted()) scaleByWeightLocked(i);
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
  c.reductionDone(pass.number);
  if (totals_.weighted() && reducedIn(pass.number)) {
    // The pass is complete: the window's totals from bucket 0's own
    // segment; the next window's weight and sums start at 0.
    try {
      const BucketBuffers& first = memory_[0];
      totals_.collect(first, ownSegment(first), *backends_[0]);
    } catch (const Error& e) {
      failWith(e.status(), e.what());
    }
  }
  if (trace_) trace_->instant(0, "finish", "\"bucket\":" + std::to_string(i));
}

void Reducer::scaleByWeightLocked(size_t i) {
  // The backend summed; the weight is decoded here, once (window_totals.h),
  // and the backend scales this rank's data (its segment, sharded).
  const BucketBuffers& b = memory_[i];
  Backend& backend = *backends_[i];
  const int64_t own = ownSegment(b);
  const double factor = totals_.scaleOf(i, b, own, backend);
  if (factor == 1.0 || b.layout.shardElems == 0) return;
  char* data = b.storage + size_t(own * b.layout.segmentElems) * dtypeSize(b.plan->dtype);
  backend.startScale(data, b.layout.shardElems, b.plan->dtype, factor)->wait();
}

void Reducer::waitBucket(int64_t bucket, const PassRef& pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  buildLocked();
  checkBucketIndex(bucket, "sf_wait_bucket");
  const BucketCycle& c = cycles_[size_t(bucket)];
  if (c.reducedIn(pass.number)) return;  // waiting twice is free
  if (c.state() != BucketState::kReducing) {
    fail(SF_ERR_INVALID_STATE, "sf_wait_bucket: bucket " + std::to_string(bucket) +
                                   " was not started in this window (start it with "
                                   "sf_synchronize_start, or let sf_grad_ready complete it)");
  }
  waitBucketLocked(size_t(bucket), pass);
}

bool Reducer::synchronize(const PassRef& pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  startAllLocked(pass);
  for (size_t i = 0; i < cycles_.size(); ++i) {
    if (!cycles_[i].reducedIn(pass.number)) waitBucketLocked(i, pass);
  }
  if (check_.carrier() >= 0) {
    const BucketBuffers& b = memory_[size_t(check_.carrier())];
    Backend& backend = *backends_[size_t(check_.carrier())];
    try {
      check_.verify(b, ownSegment(b), backend, backend, opts_.world_size);
    } catch (const Error& e) {
      failWith(e.status(), e.what());
    }
  }
  for (auto& g : grads_) g.ready = g.scaled = false;
  reportsScaled_ = false;
  for (auto& c : cycles_) c.reportsCleared();
  nextToStart_ = 0;  // the results stay this pass's until the next one opens
  synchronizedPass_ = pass.number;
  return totals_.weighted() && totals_.hasTotals() && totals_.totals().weight == 0.0;
}

// ---- Weighted windows ---------------------------------------------------------

void Reducer::addWindowWeight(double weight, const PassRef& pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireWindowOpenLocked(pass);
  totals_.addWeight(weight);
}

void Reducer::addWindowSums(const double* values, int count, const PassRef& pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireWindowOpenLocked(pass);
  totals_.addSums(values, count);
}

void Reducer::requireWindowOpenLocked(const PassRef& pass) const {
  if (opts_.reduce_op != SF_REDUCE_WEIGHTED) {
    fail(SF_ERR_INVALID_STATE, std::string("this context's reduce_op is ") +
                                   std::to_string(opts_.reduce_op) +
                                   ", not SF_REDUCE_WEIGHTED (3): a weight would divide nothing "
                                   "(set reduce_op = SF_REDUCE_WEIGHTED, or SF_REDUCE=weighted)");
  }
  if (nextToStart_ > 0) {
    fail(SF_ERR_INVALID_STATE,
         "bucket 0 of window " + std::to_string(pass.window) +
             " has started reducing, carrying the window's weight and sums as they were; "
             "this value was not added (add each micro-batch's weight before its backward, "
             "and before sf_synchronize)");
  }
}

bool Reducer::windowTotals(WindowTotals::Totals& out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!totals_.hasTotals()) return false;
  out = totals_.totals();
  return true;
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
