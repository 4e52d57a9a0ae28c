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
      firstCapMb_(opts.first_bucket_cap_mb),
      shard_(opts.shard_layout) {}

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
  for (auto& kv : flatParams_) memoryFor(kv.first).deallocate(kv.second);
  flatParams_.clear();
}

bool Reducer::bucketNeedsStaging(const PlannedBucket& plan) const {
  // A host-owned gradient, or a plugin-owned one that a control slot would
  // cut in two (the flat sharded layout's window-check bucket).
  const ShardLayout& layout = buckets_[size_t(&plan - plan_.data())].layout;
  for (int64_t id : plan.grads) {
    const Gradient& g = grads_[size_t(id)];
    if (!g.owned || !layout.contiguous(g.offset, g.numel)) return true;
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
    for (std::unique_ptr<Work>* w : {&b.work, &b.gather, &b.gradientGather}) {
      if (!*w) continue;
      try {
        (*w)->wait();
      } catch (...) {
        ok = false;
      }
      w->reset();
    }
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
  if (sharded()) {
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
  std::vector<GradSpec> specs;
  for (const auto& g : grads_) specs.push_back({g.numel, g.dtype, g.device});
  plan_ = planBuckets(specs, capBytes(capMb_), capBytes(firstCapMb_));

  // The window check rides in one bucket of the layout's most exact dtype
  // (which sets the modulus): a host bucket if one is that exact, else a
  // device bucket (its two values go through a small pinned copy); the last
  // such bucket (every rank plans the same buckets from the same layout,
  // which verifyLayout checks before the first collective).
  controlBucket_ = -1;
  controlModulus_ = 0;
  if (opts_.world_size > 1) {
    // Whether bucket i carries the check better than bucket c: the more
    // exact dtype (a 16-bit host bucket must not shrink a float32 device
    // layout's modulus); among equals a host bucket; in the flat sharded
    // layout, which stages its window-check bucket (the control slots cut
    // gradients), the smaller; else the later. Device buckets only unsharded
    // (NCCL's reduce-scatter scales every element it receives).
    auto better = [&](size_t i, size_t c) {
      const int ei = exactBits(plan_[i].dtype), ec = exactBits(plan_[c].dtype);
      if (ei != ec) return ei > ec;
      const bool hi = plan_[i].device == SF_DEVICE_HOST, hc = plan_[c].device == SF_DEVICE_HOST;
      if (hi != hc) return hi;
      if (shard_ == SF_SHARD_FLAT && plan_[i].bytes != plan_[c].bytes) {
        return plan_[i].bytes < plan_[c].bytes;
      }
      return true;
    };
    for (size_t i = 0; i < plan_.size(); ++i) {
      if (plan_[i].device != SF_DEVICE_HOST && shard_ != SF_SHARD_NONE) continue;
      if (controlBucket_ < 0 || better(i, size_t(controlBucket_))) controlBucket_ = int64_t(i);
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
  // Each bucket's shard layout (one segment when unsharded: shard_plan.h).
  buckets_.clear();
  buckets_.resize(plan_.size());
  std::vector<int64_t> rankLoad;  // parameter layout: elements per rank, bucket after bucket
  for (size_t i = 0; i < plan_.size(); ++i) {
    std::vector<int64_t> numels;
    for (int64_t id : plan_[i].grads) numels.push_back(grads_[size_t(id)].numel);
    buckets_[i].layout = planShards(numels, int64_t(dtypeSize(plan_[i].dtype)), opts_.world_size,
                                    shard_, int64_t(i) == controlBucket_, &rankLoad);
    for (size_t j = 0; j < plan_[i].grads.size(); ++j) {
      Gradient& g = grads_[size_t(plan_[i].grads[j])];
      g.bucket = int64_t(i);
      g.offset = buckets_[i].layout.offsets[j];
    }
  }
  std::map<sf_device, int64_t> flatBytes, paramBytes;
  std::vector<int64_t> bucketOffset(plan_.size()), paramOffset(plan_.size());
  std::vector<int64_t> allocBytes(plan_.size());  // gradients + padding + control elements
  for (size_t i = 0; i < plan_.size(); ++i) {
    int64_t& deviceBytes = flatBytes[plan_[i].device];
    bucketOffset[i] = deviceBytes;
    const int64_t esize = int64_t(dtypeSize(plan_[i].dtype));
    // The padding of a sharded layout is below 64 bytes per rank (flat) or
    // the groups' imbalance (parameter): within the 2^62 total's headroom.
    const int64_t layoutBytes = buckets_[i].layout.gradientElems() * esize;
    const int64_t control = layoutBytes - plan_[i].bytes;
    if (sharded()) {
      int64_t& p = paramBytes[plan_[i].device];
      paramOffset[i] = p;
      p += (buckets_[i].layout.parameterElems() * esize + int64_t(kAlign) - 1) / int64_t(kAlign) *
           int64_t(kAlign);
    }
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
    for (const auto& kv : paramBytes) {
      try {
        flatParams_[kv.first] = static_cast<char*>(memoryFor(kv.first).allocate(size_t(kv.second)));
      } catch (const Error& e) {
        if (e.status() != SF_ERR_OUT_OF_MEMORY) throw;
        fail(SF_ERR_OUT_OF_MEMORY, "cannot allocate the flat parameter buffer of " +
                                       std::to_string(kv.second) + " bytes on " +
                                       deviceName(kv.first) + ": " + e.what());
      }
    }
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
      // A staged bucket's own gradients keep the logical layout (contiguous);
      // a zero-copy one's sit where the collective reads them.
      const int64_t at = b.staged ? g.offset : b.layout.physical(g.offset);
      if (g.owned) g.data = flat_[g.device] + bucketOffset[i] + size_t(at) * dtypeSize(g.dtype);
    }
    if (!b.staged) b.storage = flat_[plan_[i].device] + bucketOffset[i];  // zero copy
    if (sharded()) {
      b.params = flatParams_[plan_[i].device] + paramOffset[i];
      for (int64_t id : plan_[i].grads) {
        Gradient& g = grads_[size_t(id)];
        if (g.paramOwned) g.param = b.params + size_t(g.offset) * dtypeSize(g.dtype);
      }
    }
    b.pending = int64_t(plan_[i].grads.size());
  }
  built_.store(true, std::memory_order_release);

  SF_LOG(kInfo, "reducer", "bucket plan: " << plan_.size() << " buckets for " << grads_.size()
                                           << " gradients (" << totalBytes_ << " bytes), cap "
                                           << capBytes(capMb_) << " bytes, first cap "
                                           << capBytes(firstCapMb_) << " bytes; "
                                           << (sharded() ? (shard_ == SF_SHARD_FLAT
                                                                ? "sharded (flat); "
                                                                : "sharded (parameter); ")
                                                         : "")
                                           << "window check "
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
  openPassLocked();
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

void Reducer::copyToStaging(const Bucket& b, const Gradient& g, ShardRange range) {
  // Run by run: a run never crosses a segment's end (its control slot).
  MemoryOps& memory = memoryFor(b.plan->device);
  const size_t esize = dtypeSize(g.dtype);
  const int64_t u = b.layout.shardElems;
  const int64_t end = range.count < 0 ? g.numel : range.offset + range.count;
  for (int64_t done = range.offset; done < end;) {
    const int64_t l = g.offset + done;
    const int64_t run = std::min(end - done, u - l % u);
    memory.copy(b.storage + size_t(b.layout.physical(l)) * esize,
                static_cast<const char*>(g.data) + size_t(done) * esize, size_t(run) * esize);
    done += run;
  }
}

void Reducer::copyFromStaging(const Bucket& b, Gradient& g, ShardRange range) {
  MemoryOps& memory = memoryFor(b.plan->device);
  const size_t esize = dtypeSize(g.dtype);
  const int64_t u = b.layout.shardElems;
  for (int64_t done = range.offset; done < range.offset + range.count;) {
    const int64_t l = g.offset + done;
    const int64_t run = std::min(range.offset + range.count - done, u - l % u);
    memory.copy(static_cast<char*>(g.data) + size_t(done) * esize,
                b.storage + size_t(b.layout.physical(l)) * esize, size_t(run) * esize);
    done += run;
  }
}

void Reducer::start(Bucket& b, bool early) {
  Backend& backend = backendFor_(b.plan->device);
  if (!verified_) verifyLayout(backend);
  const sf_dtype dtype = b.plan->dtype;
  const size_t esize = dtypeSize(dtype);
  // The previous window's gather of this bucket ends first (the host may
  // not have waited for it; its parameters must be whole before this
  // window's state replaces it).
  if (b.gather) waitGatherLocked(b);
  b.reduced = false;
  b.gatherStarted = false;
  if (b.staged) {
    try {
      for (int64_t id : b.plan->grads) copyToStaging(b, grads_[size_t(id)]);
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
                                     (early ? "true" : "false") + ",\"collective\":\"" +
                                     (sharded() ? "reduce_scatter" : "all_reduce") + "\"");
  }
  const ShardLayout& layout = b.layout;
  if (b.control) {
    // The control elements must be summed exactly: the backend scales only
    // the gradients (on its lanes, piece by piece, off the caller's path);
    // the modulus fits the dtype they travel in (a 16-bit wire included).
    // Sharded: after every rank's segment, so that each rank checks its own.
    spec.scaledElems = layout.shardElems;
    const int64_t x = window_ % controlModulus_;
    char values[16];
    storeValue(values, dtype, double(x));
    storeValue(values + esize, dtype, double(x * x));
    for (int64_t k = 0; k < layout.world; ++k) {
      char* slot = b.storage + size_t(k * layout.segmentElems + layout.shardElems) * esize;
      try {
        memoryFor(b.plan->device).writeControl(slot, values, 2 * esize);
      } catch (const Error& e) {
        failWith(e.status(), e.what());
      }
    }
    controlWindow_ = window_;
  }
  // The one place where the mode picks the collective (as Megatron's
  // _ParamAndGradBucketGroup): each rank receives its segment, or everything.
  try {
    if (sharded()) {
      spec.segmentUsed = layout.used;
      b.work = backend.startReduceScatter(b.storage, layout.segmentElems, dtype, spec);
    } else {
      b.work = backend.startAllreduce(b.storage, layout.gradientElems(), dtype, spec);
    }
  } catch (const Error& e) {
    failWith(e.status(), e.what());
  }
  ++counters_.collectives;
  if (sharded()) ++counters_.reduceScatters;
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
  // This rank's own segment's slot (the only one a reduce-scatter sums here).
  const char* slot = b.storage + size_t(ownSegment(b) * b.layout.segmentElems +
                                        b.layout.shardElems) * esize;
  char values[16];
  try {
    memoryFor(b.plan->device).readControl(values, slot, 2 * esize);
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
                                 opts_.reduce_op,
                                 int64_t(shard_)};
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
                                        "first_bucket_cap_mb", "reduce ops", "shard layouts"};
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
  startAllLocked(window);
  for (auto& b : buckets_) {
    if (!b.reduced) waitBucketLocked(b);
  }
  if (controlBucket_ >= 0) checkWindow();
  for (auto& g : grads_) g.ready = false;
  for (auto& b : buckets_) b.pending = int64_t(b.plan->grads.size());
  nextToStart_ = 0;
  passOpen_ = false;  // the results stay this window's until the next pass opens
}

// ---- Since 0.3: sharded windows and per-bucket completion -----------------

void Reducer::openPassLocked() {
  if (passOpen_) return;
  // A new pass: the previous window's reductions are no longer this
  // window's (a wait or gather now refers to the new one).
  for (auto& b : buckets_) b.reduced = false;
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

void* Reducer::parameterData(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireSharded("sf_parameter_data");
  buildLocked();  // every gradient has a parameter once built
  return grads_[size_t(id)].param;
}

ShardRange Reducer::shardRange(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  buildLocked();
  const Gradient& g = grads_[size_t(id)];
  const Bucket& b = buckets_[size_t(g.bucket)];
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
  return int64_t(buckets_.size());
}

void Reducer::checkBucketIndex(int64_t bucket, const char* what) const {
  if (bucket >= 0 && bucket < int64_t(buckets_.size())) return;
  fail(SF_ERR_INVALID_ARGUMENT, std::string(what) + ": bucket = " + std::to_string(bucket) +
                                    " is not a bucket (0.." +
                                    std::to_string(int64_t(buckets_.size()) - 1) + ")");
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
  while (nextToStart_ < buckets_.size()) {
    start(buckets_[nextToStart_], false);
    ++nextToStart_;
  }
}

void Reducer::waitBucketLocked(Bucket& b) {
  const int64_t index = int64_t(&b - buckets_.data());
  try {
    b.work->wait();
  } catch (const Error& e) {
    b.work.reset();
    failWith(e.status(), e.what());
  }
  b.work.reset();
  if (b.staged) {
    // Sharded: only this rank's part holds reduced values; copy that back.
    try {
      for (int64_t id : b.plan->grads) {
        Gradient& g = grads_[size_t(id)];
        copyFromStaging(b, g, ownedRange(b.layout, g.offset, g.numel, ownSegment(b)));
      }
    } catch (const Error& e) {
      failWith(e.status(), e.what());
    }
  }
  b.reduced = true;
  if (++reducedInPass_ == int64_t(buckets_.size())) completePass_ = pass_;
  if (trace_) trace_->instant(0, "finish", "\"bucket\":" + std::to_string(index));
}

void Reducer::waitBucket(int64_t bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  buildLocked();
  checkBucketIndex(bucket, "sf_wait_bucket");
  Bucket& b = buckets_[size_t(bucket)];
  if (b.reduced && !b.work) return;  // waiting twice is free
  if (!b.work) {
    fail(SF_ERR_INVALID_STATE, "sf_wait_bucket: bucket " + std::to_string(bucket) +
                                   " was not started in this window (start it with "
                                   "sf_synchronize_start, or let sf_grad_ready complete it)");
  }
  waitBucketLocked(b);
}

void Reducer::startGatherLocked(Bucket& b) {
  const sf_dtype dtype = b.plan->dtype;
  const size_t esize = dtypeSize(dtype);
  const int64_t index = int64_t(&b - buckets_.data());
  MemoryOps& memory = memoryFor(b.plan->device);
  try {
    // Host-owned parameters: this rank's stepped part into the bucket.
    for (int64_t id : b.plan->grads) {
      const Gradient& g = grads_[size_t(id)];
      if (g.paramOwned) continue;
      const ShardRange r = ownedRange(b.layout, g.offset, g.numel, ownSegment(b));
      if (r.count == 0) continue;
      memory.copy(b.params + size_t(g.offset + r.offset) * esize,
                  static_cast<const char*>(g.param) + size_t(r.offset) * esize,
                  size_t(r.count) * esize);
    }
    ReduceSpec spec;
    spec.bucket = index;
    spec.trace = trace_;
    spec.segmentUsed = b.layout.used;
    b.gather = backendFor_(b.plan->device).startAllgather(b.params, b.layout.shardElems, dtype, spec);
  } catch (const Error& e) {
    failWith(e.status(), e.what());
  }
  b.gatherStarted = true;
  ++counters_.allGathers;
  counters_.bytesGathered += b.plan->bytes;
  if (trace_) {
    trace_->instant(0, "gather", "\"bucket\":" + std::to_string(index) + ",\"bytes\":" +
                                     std::to_string(b.plan->bytes));
  }
}

void Reducer::waitGatherLocked(Bucket& b) {
  if (!b.gather) return;  // waited already
  try {
    b.gather->wait();
  } catch (const Error& e) {
    b.gather.reset();
    failWith(e.status(), e.what());
  }
  b.gather.reset();
  const size_t esize = dtypeSize(b.plan->dtype);
  MemoryOps& memory = memoryFor(b.plan->device);
  try {
    for (int64_t id : b.plan->grads) {
      Gradient& g = grads_[size_t(id)];
      if (g.paramOwned) continue;
      memory.copy(g.param, b.params + size_t(g.offset) * esize, size_t(g.bytes()));
    }
  } catch (const Error& e) {
    failWith(e.status(), e.what());
  }
  if (trace_) {
    trace_->instant(0, "gathered", "\"bucket\":" + std::to_string(&b - buckets_.data()));
  }
}

void Reducer::startGather(int64_t bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireSharded("sf_start_gather");
  throwIfFailed();
  buildLocked();
  if (bucket != -1) checkBucketIndex(bucket, "sf_start_gather");
  // Every bucket asked for is checked before any starts: a refused call
  // starts nothing, on every rank alike.
  auto check = [&](int64_t i) {
    const Bucket& b = buckets_[size_t(i)];
    if (b.plan->device != SF_DEVICE_HOST && passOpen_ && nextToStart_ < buckets_.size()) {
      // NCCL matches collectives by issue order on one communicator: a
      // gather may not come between reductions that ranks start at
      // different points (grad-ready hooks).
      fail(SF_ERR_INVALID_STATE,
           "sf_start_gather: bucket " + std::to_string(i) +
               " is on a CUDA device and bucket " + std::to_string(nextToStart_) +
               "'s reduction has not started yet: start gathers of CUDA buckets after every "
               "bucket's reduction started (sf_synchronize_start or sf_synchronize)");
    }
    if (!b.reduced) {
      fail(SF_ERR_INVALID_STATE,
           "sf_start_gather: bucket " + std::to_string(i) +
               " has not completed its reduction of this window (gathering before "
               "synchronization: call sf_synchronize or sf_wait_bucket, then step, then gather)");
    }
  };
  if (bucket >= 0) {
    check(bucket);
    if (buckets_[size_t(bucket)].gatherStarted) {
      fail(SF_ERR_INVALID_STATE, "sf_start_gather: bucket " + std::to_string(bucket) +
                                     "'s gather was already started in this window");
    }
    startGatherLocked(buckets_[size_t(bucket)]);
    return;
  }
  for (int64_t i = int64_t(buckets_.size()) - 1; i >= 0; --i) {
    if (!buckets_[size_t(i)].gatherStarted) check(i);
  }
  for (int64_t i = int64_t(buckets_.size()) - 1; i >= 0; --i) {  // forward order
    if (!buckets_[size_t(i)].gatherStarted) startGatherLocked(buckets_[size_t(i)]);
  }
}

void Reducer::waitGather(int64_t bucket) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireSharded("sf_wait_gather");
  throwIfFailed();
  buildLocked();
  if (bucket == -1) {
    for (int64_t i = int64_t(buckets_.size()) - 1; i >= 0; --i) {
      if (buckets_[size_t(i)].gatherStarted) waitGatherLocked(buckets_[size_t(i)]);
    }
    return;
  }
  checkBucketIndex(bucket, "sf_wait_gather");
  Bucket& b = buckets_[size_t(bucket)];
  if (!b.gatherStarted) {
    fail(SF_ERR_INVALID_STATE, "sf_wait_gather: bucket " + std::to_string(bucket) +
                                   "'s gather was never started in this window (sf_start_gather)");
  }
  waitGatherLocked(b);
}

// ---- Since 0.4: whole gradients after a sharded window --------------------

void Reducer::gatherGradients() {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  // The state first, alike in every mode, so that a host that calls at the
  // wrong point learns it in an unsharded context too.
  const char* const kAfter = " (call sf_synchronize, or sf_synchronize_start and sf_wait_bucket "
                             "for every bucket, and then sf_gather_gradients)";
  if (!built() || pass_ == 0) {
    fail(SF_ERR_INVALID_STATE, std::string("sf_gather_gradients before synchronization: no "
                                           "window's gradients have been reduced yet") + kAfter);
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket& b = buckets_[i];
    if (b.reduced) continue;
    std::ostringstream m;
    if (completePass_ > 0) {
      // The last reduced window's gradients are no longer the ones in place.
      m << "sf_gather_gradients after the next window began (sf_begin_accumulation, "
           "sf_grad_ready or sf_synchronize_start since the last synchronization): bucket "
        << i << (b.work ? " is reducing" : " is not reduced yet")
        << " in the new window; gather a window's gradients between its synchronization and "
           "the next window";
    } else {
      m << "sf_gather_gradients before the window's reductions are complete: bucket " << i
        << (b.work ? " is still reducing (started, not waited for)"
                   : "'s reduction has not started in this window")
        << kAfter;
    }
    fail(SF_ERR_INVALID_STATE, m.str());
  }
  if (gradientsGatheredPass_ == completePass_) return;  // whole already: free
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (!buckets_[i].gatherStarted) continue;
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
    gradientsGatheredPass_ = completePass_;
    return;
  }
  // One all-gather per bucket, in bucket order on every rank, over the
  // storage the reduce-scatter used (segments of shardElems + control
  // elements; only each segment's used elements are gradients: padding and
  // the window-check slots are no gradient's). A staged bucket first takes
  // this rank's own ranges as the host holds them now (as a zero-copy bucket
  // reads them in place), and afterwards gives every gradient back whole.
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    try {
      if (b.staged) {
        for (int64_t id : b.plan->grads) {
          const Gradient& g = grads_[size_t(id)];
          const ShardRange r = ownedRange(b.layout, g.offset, g.numel, ownSegment(b));
          if (r.count > 0) copyToStaging(b, g, r);
        }
      }
      ReduceSpec spec;
      spec.bucket = int64_t(i);
      spec.trace = trace_;
      spec.segmentUsed = b.layout.used;
      b.gradientGather = backendFor_(b.plan->device)
                             .startAllgather(b.storage, b.layout.segmentElems, b.plan->dtype, spec);
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
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    try {
      b.gradientGather->wait();
      b.gradientGather.reset();
      if (b.staged) {
        for (int64_t id : b.plan->grads) {
          Gradient& g = grads_[size_t(id)];
          copyFromStaging(b, g, ShardRange{0, g.numel});
        }
      }
    } catch (const Error& e) {
      b.gradientGather.reset();
      failWith(e.status(), e.what());
    }
  }
  gradientsGatheredPass_ = completePass_;
  SF_LOG(kTrace, "reducer", "gradients of window " << window_ << " gathered ("
                                                   << buckets_.size() << " all-gathers)");
}

}  // namespace sfsync
