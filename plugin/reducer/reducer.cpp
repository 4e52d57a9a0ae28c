#include "plugin/reducer/reducer.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/core/options.h"

namespace sfsync {

namespace {
constexpr size_t kAlign = 64;

// Bits of an integer a dtype holds exactly (2^m and every integer below).
int exactBits(sf_dtype dtype) {
  switch (dtype) {
    case SF_DTYPE_FLOAT64: return 53;
    case SF_DTYPE_FLOAT32: return 24;
    case SF_DTYPE_FLOAT16: return 11;
    default: return 8;  // bfloat16
  }
}

// The window check's modulus p for `world` ranks: the largest p (at most
// 2^20) with world * (p - 1)^2 <= 2^m, so that both control sums, of
// x = w mod p and of x^2, are exact integers in the dtype whatever the order
// of the additions. p < 2 means no check (bfloat16 with more than 256 ranks).
int64_t controlModulus(sf_dtype dtype, int64_t world) {
  using U = unsigned __int128;
  const U limit = U(1) << exactBits(dtype);
  auto fits = [&](int64_t q) { return U(world) * U(q) * U(q) <= limit; };  // q = p - 1
  int64_t q = int64_t(std::sqrt(std::ldexp(1.0, exactBits(dtype)) / double(world)));
  while (q > 0 && !fits(q)) --q;
  while (fits(q + 1)) ++q;
  const int64_t kMaxModulus = int64_t(1) << 20;
  return q + 1 > kMaxModulus ? kMaxModulus : q + 1;
}

void storeValue(char* p, sf_dtype dtype, double v) {
  switch (dtype) {
    case SF_DTYPE_FLOAT64: std::memcpy(p, &v, sizeof v); break;
    case SF_DTYPE_FLOAT32: { const float f = float(v); std::memcpy(p, &f, sizeof f); break; }
    case SF_DTYPE_FLOAT16: { const uint16_t h = floatToHalf(float(v)); std::memcpy(p, &h, 2); break; }
    default: { const uint16_t h = floatToBf16(float(v)); std::memcpy(p, &h, 2); break; }
  }
}

double loadValue(const char* p, sf_dtype dtype) {
  switch (dtype) {
    case SF_DTYPE_FLOAT64: { double v; std::memcpy(&v, p, sizeof v); return v; }
    case SF_DTYPE_FLOAT32: { float f; std::memcpy(&f, p, sizeof f); return f; }
    case SF_DTYPE_FLOAT16: { uint16_t h; std::memcpy(&h, p, 2); return halfToFloat(h); }
    default: { uint16_t h; std::memcpy(&h, p, 2); return bf16ToFloat(h); }
  }
}

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

void Reducer::setCaps(double capMb, double firstCapMb) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (built()) {
    fail(SF_ERR_INVALID_STATE, "the buckets are already built; bucket caps can only change before");
  }
  capMb_ = capMb;
  firstCapMb_ = firstCapMb;
}

int64_t Reducer::gradientCount() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return int64_t(grads_.size());
}

int64_t Reducer::gradientBytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return totalBytes_;
}

void Reducer::build() {
  std::lock_guard<std::mutex> lock(mutex_);
  buildLocked();
}

void Reducer::buildLocked() {
  if (built()) return;
  if (grads_.empty()) fail(SF_ERR_INVALID_STATE, "no gradient is registered");
  std::vector<GradSpec> specs;
  for (const auto& g : grads_) specs.push_back({g.numel, g.dtype, g.device});
  plan_ = planBuckets(specs, capBytes(capMb_), capBytes(firstCapMb_));

  // The window check rides in one bucket: a host bucket if there is one,
  // else a device bucket (its two values go through a small pinned copy);
  // the most exact dtype, the last such bucket (every rank plans the same
  // buckets from the same layout, which verifyLayout checks before the
  // first collective).
  controlBucket_ = -1;
  controlModulus_ = 0;
  if (opts_.world_size > 1) {
    int best = 0;
    for (sf_device device : {SF_DEVICE_HOST, SF_DEVICE_CUDA}) {
      for (size_t i = 0; i < plan_.size(); ++i) {
        if (plan_[i].device != device || exactBits(plan_[i].dtype) < best) continue;
        best = exactBits(plan_[i].dtype);
        controlBucket_ = int64_t(i);
      }
      if (controlBucket_ >= 0) break;
    }
    if (controlBucket_ >= 0) {
      // A float32 bucket on a 16-bit wire carries its values as that type.
      sf_dtype carried = plan_[size_t(controlBucket_)].dtype;
      if (carried == SF_DTYPE_FLOAT32 && (opts_.wire_dtype == SF_DTYPE_BFLOAT16 ||
                                          opts_.wire_dtype == SF_DTYPE_FLOAT16)) {
        carried = opts_.wire_dtype;
      }
      controlModulus_ = controlModulus(carried, opts_.world_size);
      if (controlModulus_ < 2) controlBucket_ = -1;
    }
  }

  // Lay plugin-owned gradients out bucket by bucket in packing order, so a
  // bucket made only of them is one contiguous slice of its device's flat_.
  // Every sum is checked (kMaxTotalBytes makes a wrap impossible; the check
  // keeps it so if that limit changes).
  std::map<sf_device, int64_t> flatBytes;
  std::vector<int64_t> bucketOffset(plan_.size());
  std::vector<int64_t> allocBytes(plan_.size());  // gradients + control elements
  for (size_t i = 0; i < plan_.size(); ++i) {
    int64_t& deviceBytes = flatBytes[plan_[i].device];
    bucketOffset[i] = deviceBytes;
    int64_t elems = 0;
    for (int64_t id : plan_[i].grads) {
      Gradient& g = grads_[size_t(id)];
      g.bucket = int64_t(i);
      g.offset = elems;
      elems += g.numel;
    }
    const int64_t control = int64_t(i) == controlBucket_ ? 2 * int64_t(dtypeSize(plan_[i].dtype)) : 0;
    int64_t end = 0;
    if (__builtin_add_overflow(plan_[i].bytes, control, &allocBytes[i]) ||
        __builtin_add_overflow(deviceBytes, allocBytes[i], &end) ||
        __builtin_add_overflow(end, int64_t(kAlign - 1), &end)) {
      const Gradient& g = grads_[size_t(plan_[i].grads.front())];
      fail(SF_ERR_OUT_OF_MEMORY, "the gradients do not fit in memory: bucket " + std::to_string(i) +
                                     " (gradient " + std::to_string(plan_[i].grads.front()) +
                                     ", '" + g.name + "') would end past 2^63 bytes");
    }
    deviceBytes = end / int64_t(kAlign) * int64_t(kAlign);
  }
  // Device memory comes from the device's backend (created here if needed,
  // which may fail: no GPU). On any failure nothing stays allocated.
  try {
    for (const auto& g : grads_) {
      if (g.owned && !flat_.count(g.device)) {
        const int64_t bytes = flatBytes[g.device];
        try {
          flat_[g.device] = static_cast<char*>(memoryFor(g.device).allocate(size_t(bytes)));
        } catch (const Error& e) {
          if (e.status() != SF_ERR_OUT_OF_MEMORY) throw;
          fail(SF_ERR_OUT_OF_MEMORY, "cannot allocate the flat buffer of " + std::to_string(bytes) +
                                         " bytes for the plugin-owned gradients on " +
                                         deviceName(g.device) + " (the first is '" + g.name +
                                         "'): " + e.what());
        }
      }
    }
    buckets_.resize(plan_.size());
    for (size_t i = 0; i < plan_.size(); ++i) {
      buckets_[i].plan = &plan_[i];
      buckets_[i].control = int64_t(i) == controlBucket_;
      if (!bucketNeedsStaging(plan_[i])) continue;
      buckets_[i].storage = static_cast<char*>(memoryFor(plan_[i].device).allocate(size_t(allocBytes[i])));
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
  built_.store(true, std::memory_order_release);

  SF_LOG(kInfo, "reducer", "bucket plan: " << plan_.size() << " buckets for " << grads_.size()
                                           << " gradients (" << totalBytes_ << " bytes), cap "
                                           << capBytes(capMb_) << " bytes, first cap "
                                           << capBytes(firstCapMb_) << " bytes; window check "
                                           << (controlBucket_ >= 0
                                                   ? "in bucket " + std::to_string(controlBucket_) +
                                                         " modulo " + std::to_string(controlModulus_)
                                                   : std::string("off")));
  if (logEnabled(LogLevel::kInfo)) {
    for (size_t i = 0; i < plan_.size(); ++i) {
      SF_LOG(kInfo, "reducer", "bucket " << i << ": " << plan_[i].bytes << " bytes, "
                                         << plan_[i].grads.size() << " gradients ("
                                         << grads_[size_t(plan_[i].grads.front())].name << " .. "
                                         << grads_[size_t(plan_[i].grads.back())].name << "), "
                                         << dtypeName(plan_[i].dtype) << " on "
                                         << deviceName(plan_[i].device)
                                         << (buckets_[i].staged ? ", staged" : ", zero copy"));
    }
  }
}

void* Reducer::gradientData(int64_t id) {
  if (!built()) {
    std::lock_guard<std::mutex> lock(mutex_);
    buildLocked();
  }
  return grads_[size_t(id)].data;  // fixed once built
}

void Reducer::zero() {
  std::lock_guard<std::mutex> lock(mutex_);
  buildLocked();
  if (nextToStart_ > 0) {
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
  SF_LOG(kWarn, "reducer", message);
  throw Error(status, message);
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
  g.ready = true;
  --buckets_[size_t(g.bucket)].pending;
  window_ = window;
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
  const sf_dtype dtype = b.plan->dtype;
  const size_t esize = dtypeSize(dtype);
  if (b.staged) {
    MemoryOps& memory = memoryFor(b.plan->device);
    try {
      for (int64_t id : b.plan->grads) {
        const Gradient& g = grads_[size_t(id)];
        memory.copy(b.storage + size_t(g.offset) * esize, g.data, size_t(g.bytes()));
      }
    } catch (const Error& e) {
      failWith(e.status(), e.what());
    }
  }
  ReduceSpec spec = reduceSpec();
  spec.bucket = int64_t(&b - buckets_.data());
  spec.trace = trace_;
  if (trace_) {
    trace_->instant(0, "launch", "\"bucket\":" + std::to_string(spec.bucket) + ",\"bytes\":" +
                                     std::to_string(b.plan->bytes) + ",\"early\":" +
                                     (early ? "true" : "false"));
  }
  int64_t numel = b.numel;
  if (b.control) {
    // The control elements must be summed exactly: the backend scales only
    // the gradients (on its lanes, piece by piece, off the caller's path);
    // the modulus fits the dtype they travel in (a 16-bit wire included).
    spec.scaledElems = b.numel;
    const int64_t x = window_ % controlModulus_;
    char values[16];
    storeValue(values, dtype, double(x));
    storeValue(values + esize, dtype, double(x * x));
    try {
      memoryFor(b.plan->device).writeControl(b.storage + size_t(b.numel) * esize, values, 2 * esize);
    } catch (const Error& e) {
      failWith(e.status(), e.what());
    }
    controlWindow_ = window_;
    numel += 2;
  }
  try {
    b.work = backend.startAllreduce(b.storage, numel, dtype, spec);
  } catch (const Error& e) {
    failWith(e.status(), e.what());
  }
  ++counters_.collectives;
  counters_.bytesReduced += b.plan->bytes;
  if (early) ++counters_.earlyLaunches;
  SF_LOG(kTrace, "reducer", "window " << window_ << ": bucket " << (&b - buckets_.data())
                                      << " started (" << b.plan->bytes << " bytes, "
                                      << (early ? "by sf_grad_ready" : "by sf_synchronize")
                                      << (b.control ? ", carries the window check" : "") << ")");
}

ReduceSpec Reducer::reduceSpec() const {
  ReduceSpec spec;
  if (opts_.reduce_op == SF_REDUCE_AVERAGE) spec.postscale = 1.0 / opts_.world_size;
  if (opts_.reduce_op == SF_REDUCE_PRESCALED_SUM) spec.prescale = opts_.prescale;
  return spec;
}

void Reducer::checkWindow() {
  const Bucket& b = buckets_[size_t(controlBucket_)];
  const sf_dtype dtype = b.plan->dtype;
  const size_t esize = dtypeSize(dtype);
  char values[16];
  try {
    memoryFor(b.plan->device).readControl(values, b.storage + size_t(b.numel) * esize, 2 * esize);
  } catch (const Error& e) {
    failWith(e.status(), e.what());
  }
  const double sum = loadValue(values, dtype);
  const double sumSquares = loadValue(values + esize, dtype);
  const int64_t w = controlWindow_, x = w % controlModulus_, world = opts_.world_size;
  // world * x^2 <= 2^53: exact in int64 and double. A rank's check passes iff
  // both sums are world times its own values, i.e. iff every rank sent the
  // same x (zero variance): either every rank sees a difference or none does.
  if (sum == double(world * x) && sumSquares == double(world * x * x)) return;
  // Failure path only: one small collective for the exact numbers.
  int64_t v[2] = {w, -w};
  try {
    backendFor_(b.plan->device).allreduceMaxInt64(v, 2);
  } catch (const Error& e) {
    failWith(e.status(), std::string("ranks are out of step (their window numbers differ) and "
                                     "gathering the numbers failed: ") + e.what());
  }
  std::ostringstream m;
  m << "ranks are out of step: this rank is synchronizing window " << w
    << ", the ranks' window numbers range from " << -v[1] << " to " << v[0]
    << " (a rank skipped or added an sf_synchronize, or began more windows than the others)";
  failWith(SF_ERR_MISMATCH, m.str());
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

void Reducer::synchronize(int64_t window) {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  buildLocked();
  window_ = window;
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
  if (controlBucket_ >= 0) checkWindow();
  for (auto& g : grads_) g.ready = false;
  for (auto& b : buckets_) b.pending = int64_t(b.plan->grads.size());
  nextToStart_ = 0;
}

}  // namespace sfsync
