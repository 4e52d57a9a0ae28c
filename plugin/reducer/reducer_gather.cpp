// The reducer's gathers (sharded contexts): the parameter gathers after the
// host's step (sf_start_gather / sf_wait_gather), and the gradient gather
// that makes every rank's reduced gradients whole (sf_gather_gradients).
// Their state checks come first, so that a refused call starts nothing, on
// every rank alike.

#include <sstream>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/reducer/reducer.h"

namespace sfsync {

void Reducer::startGatherLocked(size_t i) {
  const BucketBuffers& b = memory_[i];
  const sf_dtype dtype = b.plan->dtype;
  const size_t esize = dtypeSize(dtype);
  Backend& backend = *backends_[i];
  std::unique_ptr<Work> work;
  try {
    // Host-owned parameters: this rank's stepped part into the bucket.
    for (int64_t id : b.plan->grads) {
      const Gradient& g = grads_[size_t(id)];
      if (g.paramOwned) continue;
      const ShardRange r = ownedRange(b.layout, g.offset, g.numel, ownSegment(b));
      if (r.count == 0) continue;
      backend.copy(b.params + size_t(g.offset + r.offset) * esize,
                  static_cast<const char*>(g.param) + size_t(r.offset) * esize,
                  size_t(r.count) * esize);
    }
    ReduceSpec spec;
    spec.bucket = int64_t(i);
    spec.trace = trace_;
    spec.segmentUsed = b.layout.used;
    spec.payload = ReduceSpec::Payload::kParameters;
    work = backend.startAllgather(b.params, b.layout.shardElems, dtype, spec);
  } catch (const Error& e) {
    failWith(e.status(), e.what());
  }
  cycles_[i].startGather(std::move(work));
  ++counters_.allGathers;
  counters_.bytesGathered += b.plan->bytes;
  if (trace_) {
    trace_->instant(0, "gather", "\"bucket\":" + std::to_string(i) + ",\"bytes\":" +
                                     std::to_string(b.plan->bytes));
  }
}

void Reducer::waitGatherLocked(size_t i) {
  BucketCycle& c = cycles_[i];
  Work* gather = c.inFlight();
  if (!gather) return;  // waited already
  try {
    gather->wait();
  } catch (const Error& e) {
    c.gatherDone();
    failWith(e.status(), e.what());
  }
  c.gatherDone();
  const BucketBuffers& b = memory_[i];
  const size_t esize = dtypeSize(b.plan->dtype);
  MemoryOps& memory = *backends_[i];
  try {
    for (int64_t id : b.plan->grads) {
      Gradient& g = grads_[size_t(id)];
      if (g.paramOwned) continue;
      memory.copy(g.param, b.params + size_t(g.offset) * esize, size_t(g.bytes()));
    }
  } catch (const Error& e) {
    failWith(e.status(), e.what());
  }
  if (trace_) trace_->instant(0, "gathered", "\"bucket\":" + std::to_string(i));
}

void Reducer::startGather(int64_t bucket, const PassRef& pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireSharded("sf_start_gather");
  throwIfFailed();
  buildLocked();
  if (bucket != -1) checkBucketIndex(bucket, "sf_start_gather");
  // Every bucket asked for is checked before any starts: a refused call
  // starts nothing, on every rank alike.
  const int64_t n = int64_t(cycles_.size());
  auto check = [&](int64_t i) {
    if (plan_[size_t(i)].device != SF_DEVICE_HOST && pass.open && nextToStart_ < cycles_.size()) {
      // NCCL matches collectives by issue order on one communicator: a
      // gather may not come between reductions that ranks start at
      // different points (grad-ready hooks).
      fail(SF_ERR_INVALID_STATE,
           "sf_start_gather: bucket " + std::to_string(i) +
               " is on a CUDA device and bucket " + std::to_string(nextToStart_) +
               "'s reduction has not started yet: start gathers of CUDA buckets after every "
               "bucket's reduction started (sf_synchronize_start or sf_synchronize)");
    }
    if (!cycles_[size_t(i)].reducedIn(pass.number)) {
      fail(SF_ERR_INVALID_STATE,
           "sf_start_gather: bucket " + std::to_string(i) +
               " has not completed its reduction of this window (gathering before "
               "synchronization: call sf_synchronize or sf_wait_bucket, then step, then gather)");
    }
  };
  if (bucket >= 0) {
    check(bucket);
    if (cycles_[size_t(bucket)].gathering()) {
      fail(SF_ERR_INVALID_STATE, "sf_start_gather: bucket " + std::to_string(bucket) +
                                     "'s gather was already started in this window");
    }
    startGatherLocked(size_t(bucket));
    return;
  }
  for (int64_t i = n - 1; i >= 0; --i) {
    if (!cycles_[size_t(i)].gathering()) check(i);
  }
  for (int64_t i = n - 1; i >= 0; --i) {  // forward order
    if (!cycles_[size_t(i)].gathering()) startGatherLocked(size_t(i));
  }
}

void Reducer::waitGather(int64_t bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireSharded("sf_wait_gather");
  throwIfFailed();
  buildLocked();
  if (bucket == -1) {
    for (int64_t i = int64_t(cycles_.size()) - 1; i >= 0; --i) {
      if (cycles_[size_t(i)].gathering()) waitGatherLocked(size_t(i));
    }
    return;
  }
  checkBucketIndex(bucket, "sf_wait_gather");
  if (!cycles_[size_t(bucket)].gathering()) {
    fail(SF_ERR_INVALID_STATE, "sf_wait_gather: bucket " + std::to_string(bucket) +
                                   "'s gather was never started in this window (sf_start_gather)");
  }
  waitGatherLocked(size_t(bucket));
}

void Reducer::gatherGradients(const PassRef& pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  // The state first, alike in every mode, so that a host that calls at the
  // wrong point learns it in an unsharded context too.
  const char* const kAfter = " (call sf_synchronize, or sf_synchronize_start and sf_wait_bucket "
                             "for every bucket, and then sf_gather_gradients)";
  if (!built() || pass.number == 0) {
    fail(SF_ERR_INVALID_STATE, std::string("sf_gather_gradients before synchronization: no "
                                           "window's gradients have been reduced yet") + kAfter);
  }
  for (size_t i = 0; i < cycles_.size(); ++i) {
    const BucketCycle& c = cycles_[i];
    if (c.reducedIn(pass.number)) continue;
    const bool reducing = c.state() == BucketState::kReducing;
    std::ostringstream m;
    if (pass.number > 1) {
      // An earlier pass was synchronized (every pass before this one was,
      // each complete): its gradients are no longer the ones in place.
      m << "sf_gather_gradients after the next window began (sf_begin_accumulation, "
           "sf_grad_ready or sf_synchronize_start since the last synchronization): bucket "
        << i << (reducing ? " is reducing" : " is not reduced yet")
        << " in the new window; gather a window's gradients between its synchronization and "
           "the next window";
    } else {
      m << "sf_gather_gradients before the window's reductions are complete: bucket " << i
        << (reducing ? " is still reducing (started, not waited for)"
                     : "'s reduction has not started in this window")
        << kAfter;
    }
    fail(SF_ERR_INVALID_STATE, m.str());
  }
  if (cycles_.front().gradientsWholeIn(pass.number)) return;  // whole already: free
  for (size_t i = 0; i < cycles_.size(); ++i) {
    if (!cycles_[i].gathering()) continue;
    // Gradient and parameter gathers are one sequence of all-gathers,
    // matched by issue order: every rank must issue them in the same order.
    fail(SF_ERR_INVALID_STATE,
         "sf_gather_gradients after sf_start_gather (bucket " + std::to_string(i) +
             "'s parameter gather started in this window): gather the gradients first, then "
             "start the parameter gathers, in that order on every rank");
  }
  // Unsharded (every rank received everything) or one rank (its segment is
  // the bucket): whole already, no collective.
  if (!sharded() || opts_.world_size == 1) {
    for (auto& c : cycles_) c.gradientsMadeWhole(pass.number);
    return;
  }
  // One all-gather per bucket, in bucket order on every rank, over the
  // storage the reduce-scatter used (segments of shardElems + reserved
  // elements; only each segment's used elements are gradients: padding and
  // the reserved tails are no gradient's). A staged bucket first takes this
  // rank's own ranges as the host holds them now (as a zero-copy bucket
  // reads them in place), and afterwards gives every gradient back whole.
  for (size_t i = 0; i < cycles_.size(); ++i) {
    const BucketBuffers& b = memory_[i];
    try {
      if (b.staged) {
        for (int64_t id : b.plan->grads) {
          const Gradient& g = grads_[size_t(id)];
          const ShardRange r = ownedRange(b.layout, g.offset, g.numel, ownSegment(b));
          if (r.count > 0) memory_.toStaging(b, g, r);
        }
      }
      ReduceSpec spec;
      spec.bucket = int64_t(i);
      spec.trace = trace_;
      spec.segmentUsed = b.layout.used;
      spec.maskElems = maskElems_[i];  // for the wire counts
      Backend& backend = *backends_[i];
      cycles_[i].startGradientGather(
          backend.startAllgather(b.storage, b.layout.segmentElems, b.plan->dtype, spec));
    } catch (const Error& e) {
      failWith(e.status(), e.what());  // drains the gathers already started
    }
    ++counters_.allGathers;
    counters_.bytesGathered += b.plan->bytes;
    if (trace_) {
      trace_->instant(0, "gradient_gather", "\"bucket\":" + std::to_string(i) + ",\"bytes\":" +
                                                std::to_string(b.plan->bytes));
    }
  }
  for (size_t i = 0; i < cycles_.size(); ++i) {
    const BucketBuffers& b = memory_[i];
    try {
      cycles_[i].gradientGather().wait();
      cycles_[i].gradientGatherDone();
      if (b.staged) {
        for (int64_t id : b.plan->grads) {
          Gradient& g = grads_[size_t(id)];
          memory_.fromStaging(b, g, ShardRange{0, g.numel});
        }
      }
    } catch (const Error& e) {
      cycles_[i].abandon();  // its Work failed: released, not waited again
      failWith(e.status(), e.what());
    }
  }
  for (auto& c : cycles_) c.gradientsMadeWhole(pass.number);
  SF_LOG(kTrace, "reducer", "gradients of window " << pass.window << " gathered ("
                                                   << cycles_.size() << " all-gathers)");
}

}  // namespace sfsync
