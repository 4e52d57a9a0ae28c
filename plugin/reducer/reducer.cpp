#include "plugin/reducer/reducer.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/core/options.h"

namespace sfsync {

namespace {
constexpr size_t kAlign = 64;
size_t alignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

std::string describe(int64_t signature) {
  // Inverse of the signature packing in verifyLayout.
  std::ostringstream s;
  s << (signature >> 4) << " x " << dtypeName(sf_dtype((signature >> 1) & 7)) << " on "
    << deviceName(sf_device(signature & 1));
  return s.str();
}
}  // namespace

Reducer::Reducer(const sf_options& opts, BackendFor backendFor)
    : opts_(opts),
      backendFor_(std::move(backendFor)),
      capMb_(opts.bucket_cap_mb),
      firstCapMb_(opts.first_bucket_cap_mb) {}

Reducer::~Reducer() {
  quiesce();  // collectives in flight read and write our buffers
  releaseMemory();
}

void Reducer::releaseMemory() noexcept {
  // The backends outlive the reducer (Context declares them first).
  for (auto& b : buckets_) {
    if (b.staged) memoryFor(b.plan->device).deallocate(b.storage);
  }
  buckets_.clear();
  for (auto& kv : flat_) memoryFor(kv.first).deallocate(kv.second);
  flat_.clear();
}

bool Reducer::bucketNeedsStaging(const PlannedBucket& plan) const {
  for (int64_t id : plan.grads) {
    if (!grads_[size_t(id)].owned) return true;
  }
  return false;
}

MemoryOps& Reducer::memoryFor(sf_device device) {
  return device == SF_DEVICE_HOST ? MemoryOps::host() : backendFor_(device);
}

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
  for (auto& b : buckets_) {
    if (!b.work) continue;
    try {
      b.work->wait();
    } catch (...) {
      ok = false;
    }
    b.work.reset();
  }
  nextToStart_ = 0;
  return ok;
}

int64_t Reducer::addGradient(void* hostData, int64_t numel, sf_dtype dtype, sf_device device,
                             const char* name) {
  if (built_) {
    fail(SF_ERR_INVALID_STATE,
         "the buckets are already built (by sf_build_buckets, sf_gradient_data, sf_grad_ready or "
         "sf_synchronize); register every gradient before that");
  }
  const int64_t id = int64_t(grads_.size());
  std::string label = name && *name ? name : "#" + std::to_string(id);
  grads_.push_back(Gradient{hostData, numel, dtype, device, label, hostData == nullptr});
  return id;
}

void Reducer::setCaps(double capMb, double firstCapMb) {
  if (built_) {
    fail(SF_ERR_INVALID_STATE, "the buckets are already built; bucket caps can only change before");
  }
  capMb_ = capMb;
  firstCapMb_ = firstCapMb;
}

int64_t Reducer::gradientBytes() const {
  int64_t total = 0;
  for (const auto& g : grads_) total += g.bytes();
  return total;
}

void Reducer::build() {
  if (built_) return;
  if (grads_.empty()) fail(SF_ERR_INVALID_STATE, "no gradient is registered");
  std::vector<GradSpec> specs;
  for (const auto& g : grads_) specs.push_back({g.numel, g.dtype, g.device});
  plan_ = planBuckets(specs, capBytes(capMb_), capBytes(firstCapMb_));

  // Lay plugin-owned gradients out bucket by bucket in packing order, so a
  // bucket made only of them is one contiguous slice of its device's flat_.
  std::map<sf_device, size_t> flatBytes;
  std::vector<size_t> bucketOffset(plan_.size());
  for (size_t i = 0; i < plan_.size(); ++i) {
    size_t& deviceBytes = flatBytes[plan_[i].device];
    bucketOffset[i] = deviceBytes;
    int64_t elems = 0;
    for (int64_t id : plan_[i].grads) {
      Gradient& g = grads_[size_t(id)];
      g.bucket = int64_t(i);
      g.offset = elems;
      elems += g.numel;
    }
    deviceBytes = alignUp(deviceBytes + size_t(plan_[i].bytes));
  }
  // Device memory comes from the device's backend (created here if needed,
  // which may fail: no GPU). On any failure nothing stays allocated.
  try {
    for (const auto& g : grads_) {
      if (g.owned && !flat_.count(g.device)) {
        flat_[g.device] = static_cast<char*>(memoryFor(g.device).allocate(flatBytes[g.device]));
      }
    }
    buckets_.resize(plan_.size());
    for (size_t i = 0; i < plan_.size(); ++i) {
      buckets_[i].plan = &plan_[i];
      if (!bucketNeedsStaging(plan_[i])) continue;
      buckets_[i].storage = static_cast<char*>(memoryFor(plan_[i].device).allocate(size_t(plan_[i].bytes)));
      buckets_[i].staged = true;
    }
  } catch (...) {
    releaseMemory();
    throw;
  }

  for (size_t i = 0; i < plan_.size(); ++i) {
    Bucket& b = buckets_[i];
    for (int64_t id : plan_[i].grads) {
      Gradient& g = grads_[size_t(id)];
      b.numel += g.numel;
      if (g.owned) g.data = flat_[g.device] + bucketOffset[i] + size_t(g.offset) * dtypeSize(g.dtype);
    }
    if (!b.staged) b.storage = flat_[plan_[i].device] + bucketOffset[i];  // zero copy
    b.pending = int64_t(plan_[i].grads.size());
  }
  built_ = true;
}

void* Reducer::gradientData(int64_t id) {
  build();
  return grads_[size_t(id)].data;
}

void Reducer::zero() {
  build();
  if (inFlight()) {
    fail(SF_ERR_INVALID_STATE, "a synchronization is in flight; call sf_synchronize first");
  }
  for (auto& g : grads_) memoryFor(g.device).zero(g.data, size_t(g.bytes()));
}

bool Reducer::inFlight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return nextToStart_ > 0;
}

ReducerCounters Reducer::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
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
  throw Error(status, message);
}

void Reducer::markReady(int64_t id) {
  build();
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  Gradient& g = grads_[size_t(id)];
  if (g.ready) {
    fail(SF_ERR_INVALID_STATE, "gradient " + std::to_string(id) + " ('" + g.name +
                                   "') was already reported ready since the last sf_synchronize");
  }
  g.ready = true;
  --buckets_[size_t(g.bucket)].pending;
  startReadyBuckets(true);
}

void Reducer::startReadyBuckets(bool early) {
  while (nextToStart_ < buckets_.size() && buckets_[nextToStart_].pending == 0) {
    start(buckets_[nextToStart_], early);
    ++nextToStart_;
  }
}

void Reducer::start(Bucket& b, bool early) {
  Backend& backend = backendFor_(b.plan->device);
  if (!verified_) verifyLayout(backend);
  if (b.staged) {
    MemoryOps& memory = memoryFor(b.plan->device);
    try {
      for (int64_t id : b.plan->grads) {
        const Gradient& g = grads_[size_t(id)];
        memory.copy(b.storage + size_t(g.offset) * dtypeSize(g.dtype), g.data, size_t(g.bytes()));
      }
    } catch (const Error& e) {
      failWith(e.status(), e.what());
    }
  }
  ReduceSpec spec;
  if (opts_.reduce_op == SF_REDUCE_AVERAGE) spec.postscale = 1.0 / opts_.world_size;
  if (opts_.reduce_op == SF_REDUCE_PRESCALED_SUM) spec.prescale = opts_.prescale;
  spec.bucket = int64_t(&b - buckets_.data());
  spec.trace = trace_;
  if (trace_) {
    trace_->instant(0, "launch", "\"bucket\":" + std::to_string(spec.bucket) + ",\"bytes\":" +
                                     std::to_string(b.plan->bytes) + ",\"early\":" +
                                     (early ? "true" : "false"));
  }
  try {
    b.work = backend.startAllreduce(b.storage, b.numel, b.plan->dtype, spec);
  } catch (const Error& e) {
    failWith(e.status(), e.what());
  }
  ++counters_.collectives;
  counters_.bytesReduced += b.plan->bytes;
  if (early) ++counters_.earlyLaunches;
}

void Reducer::verifyLayout(Backend& backend) {
  // Every rank computes the same elementwise max of (x, -x) pairs, so every
  // rank sees the same disagreement and fails the same way: no rank is left
  // waiting in a collective the others never start.
  const int64_t g = int64_t(grads_.size());
  std::vector<int64_t> header = {g,
                                 int64_t(plan_.size()),
                                 capBytes(capMb_),
                                 capBytes(firstCapMb_),
                                 opts_.reduce_op};
  std::vector<int64_t> h;
  for (int64_t x : header) {
    h.push_back(x);
    h.push_back(-x);
  }
  try {
    backend.connect();
    backend.allreduceMaxInt64(h.data(), int64_t(h.size()));
  } catch (const Error& e) {
    failWith(e.status(), e.what());
  }
  const int64_t minG = -h[1];
  auto signature = [](const Gradient& x) {
    return (x.numel << 4) | (int64_t(x.dtype) << 1) | int64_t(x.device & 1);
  };
  std::vector<int64_t> s;
  for (int64_t i = 0; i < minG; ++i) s.push_back(signature(grads_[size_t(i)]));
  for (int64_t i = 0; i < minG; ++i) s.push_back(-s[size_t(i)]);
  try {
    if (minG > 0) backend.allreduceMaxInt64(s.data(), int64_t(s.size()));
  } catch (const Error& e) {
    failWith(e.status(), e.what());
  }
  for (int64_t i = 0; i < minG; ++i) {
    const int64_t hi = s[size_t(i)], lo = -s[size_t(minG + i)];
    if (hi != lo) {
      const Gradient& x = grads_[size_t(i)];
      failWith(SF_ERR_MISMATCH,
               "ranks registered different gradient layouts: the first difference is gradient " +
                   std::to_string(i) + " ('" + x.name + "'): this rank has " +
                   describe(signature(x)) + ", ranks range from " + describe(lo) + " to " +
                   describe(hi));
    }
  }
  static const char* const kFields[] = {"gradient counts", "bucket counts", "bucket_cap_mb",
                                        "first_bucket_cap_mb", "reduce ops"};
  for (size_t f = 0; f < header.size(); ++f) {
    const int64_t hi = h[2 * f], lo = -h[2 * f + 1];
    if (hi == lo) continue;
    std::ostringstream m;
    m << "ranks registered different gradient layouts: " << kFields[f] << " differ (from " << lo
      << " to " << hi << ", this rank " << header[f] << ")";
    if (f == 0) {
      m << "; the first difference is gradient " << minG;
      if (minG < g) m << " ('" << grads_[size_t(minG)].name << "')";
      m << ", missing on some ranks";
    }
    failWith(SF_ERR_MISMATCH, m.str());
  }
  verified_ = true;
}

void Reducer::synchronize() {
  build();
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  while (nextToStart_ < buckets_.size()) {
    start(buckets_[nextToStart_], false);
    ++nextToStart_;
  }
  for (auto& b : buckets_) {
    try {
      b.work->wait();
    } catch (const Error& e) {
      b.work.reset();
      failWith(e.status(), e.what());
    }
    b.work.reset();
    if (b.staged) {
      MemoryOps& memory = memoryFor(b.plan->device);
      try {
        for (int64_t id : b.plan->grads) {
          Gradient& g = grads_[size_t(id)];
          memory.copy(g.data, b.storage + size_t(g.offset) * dtypeSize(g.dtype), size_t(g.bytes()));
        }
      } catch (const Error& e) {
        failWith(e.status(), e.what());
      }
    }
    if (trace_) {
      trace_->instant(0, "finish", "\"bucket\":" + std::to_string(&b - buckets_.data()));
    }
  }
  for (auto& g : grads_) g.ready = false;
  for (auto& b : buckets_) b.pending = int64_t(b.plan->grads.size());
  nextToStart_ = 0;
}

}  // namespace sfsync
