// BucketMemory (bucket_memory.h): layout sums, allocation, views and staging
// copies; no collective and no window check here.

#include "plugin/reducer/bucket_memory.h"

#include <algorithm>

#include "plugin/core/error.h"

namespace sfsync {

namespace {
constexpr int64_t kAlign = 64;
int64_t alignUp(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
}  // namespace

void BucketMemory::release() noexcept {
  for (auto& b : buckets_) {
    if (b.staged) memoryFor_(b.plan->device).deallocate(b.storage);
  }
  buckets_.clear();
  for (auto& kv : flat_) memoryFor_(kv.first).deallocate(kv.second);
  flat_.clear();
  for (auto& kv : flatParams_) memoryFor_(kv.first).deallocate(kv.second);
  flatParams_.clear();
}

bool BucketMemory::needsStaging(const BucketBuffers& b, const std::vector<Gradient>& grads) const {
  // A host-owned gradient, or a plugin-owned one that a reserved tail would
  // cut in two (the flat sharded layout's window-check bucket).
  for (int64_t id : b.plan->grads) {
    const Gradient& g = grads[size_t(id)];
    if (!g.owned || !b.layout.contiguous(g.offset, g.numel)) return true;
  }
  return false;
}

char* BucketMemory::allocate(sf_device device, int64_t bytes) {
  return static_cast<char*>(memoryFor_(device).allocate(size_t(bytes)));
}

void BucketMemory::build(std::vector<Gradient>& grads, const std::vector<PlannedBucket>& plan,
                         const std::vector<int64_t>& reserve, int64_t world,
                         sf_shard_layout shard) {
  const bool sharded = shard != SF_SHARD_NONE;
  // Each bucket's shard layout (one segment when unsharded: shard_plan.h).
  buckets_.clear();
  buckets_.resize(plan.size());
  std::vector<int64_t> rankLoad;  // parameter layout: elements per rank, bucket after bucket
  for (size_t i = 0; i < plan.size(); ++i) {
    BucketBuffers& b = buckets_[i];
    b.plan = &plan[i];
    std::vector<int64_t> numels;
    for (int64_t id : plan[i].grads) numels.push_back(grads[size_t(id)].numel);
    b.layout = planShards(numels, int64_t(dtypeSize(plan[i].dtype)), world, shard, reserve[i],
                          &rankLoad);
    for (size_t j = 0; j < plan[i].grads.size(); ++j) {
      Gradient& g = grads[size_t(plan[i].grads[j])];
      g.bucket = int64_t(i);
      g.offset = b.layout.offsets[j];
    }
  }
  // Plugin-owned gradients are laid out bucket by bucket in packing order,
  // so a bucket made only of them is one contiguous slice of its device's
  // flat buffer. Every sum is checked (the reducer's 2^62 total makes a wrap
  // impossible; the check keeps it so if that limit changes).
  std::map<sf_device, int64_t> flatBytes, paramBytes;
  std::vector<int64_t> bucketOffset(plan.size()), paramOffset(plan.size());
  std::vector<int64_t> allocBytes(plan.size());  // gradients + padding + reserved tails
  for (size_t i = 0; i < plan.size(); ++i) {
    int64_t& deviceBytes = flatBytes[plan[i].device];
    bucketOffset[i] = deviceBytes;
    const int64_t esize = int64_t(dtypeSize(plan[i].dtype));
    // The padding of a sharded layout is below 64 bytes per rank (flat) or
    // the groups' imbalance (parameter): within the 2^62 total's headroom.
    const int64_t extra = buckets_[i].layout.gradientElems() * esize - plan[i].bytes;
    if (sharded) {
      int64_t& p = paramBytes[plan[i].device];
      paramOffset[i] = p;
      p += alignUp(buckets_[i].layout.parameterElems() * esize);
    }
    int64_t end = 0;
    if (__builtin_add_overflow(plan[i].bytes, extra, &allocBytes[i]) ||
        __builtin_add_overflow(deviceBytes, allocBytes[i], &end) ||
        __builtin_add_overflow(end, kAlign - 1, &end)) {
      const Gradient& g = grads[size_t(plan[i].grads.front())];
      fail(SF_ERR_OUT_OF_MEMORY, "the gradients do not fit in memory: bucket " + std::to_string(i) +
                                     " (gradient " + std::to_string(plan[i].grads.front()) +
                                     ", '" + g.name + "') would end past 2^63 bytes");
    }
    deviceBytes = end / kAlign * kAlign;
  }
  // Device memory comes from the device's backend (created here if needed,
  // which may fail: no GPU). On any failure nothing stays allocated.
  try {
    for (const auto& kv : paramBytes) {
      try {
        flatParams_[kv.first] = allocate(kv.first, kv.second);
      } catch (const Error& e) {
        if (e.status() != SF_ERR_OUT_OF_MEMORY) throw;
        fail(SF_ERR_OUT_OF_MEMORY, "cannot allocate the flat parameter buffer of " +
                                       std::to_string(kv.second) + " bytes on " +
                                       deviceName(kv.first) + ": " + e.what());
      }
    }
    for (const auto& g : grads) {
      if (g.owned && !flat_.count(g.device)) {
        const int64_t bytes = flatBytes[g.device];
        try {
          flat_[g.device] = allocate(g.device, bytes);
        } catch (const Error& e) {
          if (e.status() != SF_ERR_OUT_OF_MEMORY) throw;
          fail(SF_ERR_OUT_OF_MEMORY, "cannot allocate the flat buffer of " + std::to_string(bytes) +
                                         " bytes for the plugin-owned gradients on " +
                                         deviceName(g.device) + " (the first is '" + g.name +
                                         "'): " + e.what());
        }
      }
    }
    for (size_t i = 0; i < plan.size(); ++i) {
      if (!needsStaging(buckets_[i], grads)) continue;
      buckets_[i].storage = allocate(plan[i].device, allocBytes[i]);
      buckets_[i].staged = true;
    }
  } catch (...) {
    release();
    throw;
  }

  // The views.
  for (size_t i = 0; i < plan.size(); ++i) {
    BucketBuffers& b = buckets_[i];
    for (int64_t id : plan[i].grads) {
      Gradient& g = grads[size_t(id)];
      b.numel += g.numel;
      // A staged bucket's own gradients keep the logical layout (contiguous);
      // a zero-copy one's sit where the collective reads them.
      const int64_t at = b.staged ? g.offset : b.layout.physical(g.offset);
      if (g.owned) g.data = flat_[g.device] + bucketOffset[i] + size_t(at) * dtypeSize(g.dtype);
    }
    if (!b.staged) b.storage = flat_[plan[i].device] + bucketOffset[i];  // zero copy
    if (sharded) {
      b.params = flatParams_[plan[i].device] + paramOffset[i];
      for (int64_t id : plan[i].grads) {
        Gradient& g = grads[size_t(id)];
        if (g.paramOwned) g.param = b.params + size_t(g.offset) * dtypeSize(g.dtype);
      }
    }
  }
}

void BucketMemory::toStaging(const BucketBuffers& b, const Gradient& g, ShardRange range) {
  // Run by run: a run never crosses a segment's end (its reserved tail).
  MemoryOps& memory = memoryFor_(b.plan->device);
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

void BucketMemory::fromStaging(const BucketBuffers& b, Gradient& g, ShardRange range) {
  MemoryOps& memory = memoryFor_(b.plan->device);
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

}  // namespace sfsync
