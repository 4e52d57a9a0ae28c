// The reducer's registration (gradients, parameters, caps, shard layout),
// its build as a short sequence of its rooms' steps (plan, window-check
// carrier, memory, bucket cycles), and the description of its buffers.

#include <sstream>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/core/options.h"
#include "plugin/reducer/reducer.h"

namespace sfsync {

// ---- Registration -----------------------------------------------------------

int64_t Reducer::addGradient(void* hostData, int64_t numel, sf_dtype dtype, sf_device device,
                             const char* name, Backend& backend) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (built()) {
    fail(SF_ERR_INVALID_STATE,
         "the buckets are already built (by sf_build_buckets, sf_gradient_data, sf_grad_ready or "
         "sf_synchronize); register every gradient before that");
  }
  Backend*& deviceBackend = deviceBackends_[size_t(device)];
  if (deviceBackend && deviceBackend != &backend) {
    fail(SF_ERR_INTERNAL, "gradients of device " + std::to_string(device) +
                              " were handed two different backends");
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
  deviceBackend = &backend;
  totalBytes_ += bytes;
  registered_.store(id + 1, std::memory_order_release);
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

void Reducer::requireNotBuilt(const std::string& what) const {
  if (built()) fail(SF_ERR_INVALID_STATE, "the buckets are already built; " + what);
}

void Reducer::setBucketCapMb(double mb) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireNotBuilt("bucket caps can only change before");
  opts_.bucket_cap_mb = mb;
  capChosen_ = true;
}

void Reducer::setFirstBucketCapMb(double mb) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireNotBuilt("bucket caps can only change before");
  opts_.first_bucket_cap_mb = mb;
}

void Reducer::setShardLayout(sf_shard_layout layout) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireNotBuilt("the shard layout can only change before (sf_build_buckets, "
                  "sf_gradient_data, sf_shard_range, ...)");
  opts_.shard_layout = layout;
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
  // Sharded, with no cap chosen: about kShardedBuckets buckets (the one
  // place the rule is applied; the options then report the effective cap).
  if (sharded() && !capChosen_) opts_.bucket_cap_mb = shardedDefaultCapMb(totalBytes_);
  std::vector<GradSpec> specs;
  for (const auto& g : grads_) specs.push_back({g.numel, g.dtype, g.device});
  plan_ = planBuckets(specs, capBytes(opts_.bucket_cap_mb), capBytes(opts_.first_bucket_cap_mb));
  backends_.clear();  // each bucket's backend, resolved once
  for (const PlannedBucket& p : plan_) backends_.push_back(&backendOf(p.device));
  check_.choose(plan_, opts_.world_size, opts_.shard_layout, opts_.wire_dtype);
  // Each tail: the window check's elements, then the weighted window's limbs.
  std::vector<int64_t> reserve = check_.reserve(plan_.size());
  totals_.plan(plan_, opts_.world_size, opts_.wire_dtype, opts_.reduce_op == SF_REDUCE_WEIGHTED,
               reserve);
  const std::vector<int64_t> limbs = totals_.reserve(plan_.size());
  for (size_t i = 0; i < reserve.size(); ++i) reserve[i] += limbs[i];
  memory_.build(grads_, plan_, reserve, opts_.world_size, opts_.shard_layout);
  cycles_.clear();
  maskElems_.assign(plan_.size(), 0);
  readyScale_.clear();
  for (size_t i = 0; i < plan_.size(); ++i) readyScale_.push_back(readyScaleOf(i));
  for (size_t i = 0; i < plan_.size(); ++i) {
    cycles_.emplace_back(int64_t(i), int64_t(plan_[i].grads.size()));
    for (int64_t id : plan_[i].grads) {
      if (grads_[size_t(id)].name == kMaskName) maskElems_[i] += grads_[size_t(id)].numel;
    }
  }
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
             std::string(opts_.shard_layout == SF_SHARD_FLAT ? "flat" : "parameter") +
             ") register every gradient's parameter (sf_register_parameter) before the "
             "buckets are built");
  }
}

void Reducer::logPlan() const {
  SF_LOG(kInfo, "reducer", "bucket plan: " << plan_.size() << " buckets for " << grads_.size()
                                           << " gradients (" << totalBytes_ << " bytes), cap "
                                           << capBytes(opts_.bucket_cap_mb) << " bytes, first cap "
                                           << capBytes(opts_.first_bucket_cap_mb) << " bytes; "
                                           << (sharded() ? (opts_.shard_layout == SF_SHARD_FLAT
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
  for (auto& g : grads_) backendOf(g.device).zero(g.data, size_t(g.bytes()));
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

}  // namespace sfsync
