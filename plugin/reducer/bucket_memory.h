#pragma once
// BucketMemory: where the gradients and parameters of a built reducer live.
// Responsible for each bucket's shard layout (with the reserved elements per
// segment its owner asks for), the flat buffers of plugin-owned gradients
// and parameters (one per device, laid out bucket by bucket in packing
// order), the staging buffers of buckets that need one, the views (every
// gradient's and parameter's address, every bucket's storage) and the copies
// between host-owned gradients and staging. Not responsible for what the
// reserved elements hold (the window check), when anything is copied, or any
// collective (the reducer).
//
// A bucket is zero copy when its storage is a slice of its device's flat
// buffer: every gradient of it plugin-owned and none cut by a reserved tail.
// Otherwise it is staged: a buffer of its own, the gradients copied in
// before its reduction and back after, run by run around the reserved tails.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/core/dtype.h"
#include "plugin/reducer/bucket_plan.h"
#include "plugin/reducer/shard_plan.h"
#include "sfsync.h"

namespace sfsync {

// One registered gradient (and, sharded, its parameter), as the reducer
// keeps it: what the host registered, then where the build put it.
struct Gradient {
  void* data;  // host pointer, or the view into the flat buffer once built
  int64_t numel;
  sf_dtype dtype;
  sf_device device;
  std::string name;
  bool owned;  // storage in the flat buffer
  int64_t bucket = -1;
  int64_t offset = 0;  // logical elements from the start of the bucket (shard_plan.h)
  bool ready = false;  // reported since the last synchronization (the reducer's)
  bool scaled = false;  // multiplied by its bucket's ready scale since then (Reducer::readyScaleOf)
  void* param = nullptr;    // sharded: the parameter (host pointer, or a view into flat parameters)
  bool hasParam = false;
  bool paramOwned = false;  // storage in the flat parameter buffer
  int64_t bytes() const { return numel * int64_t(dtypeSize(dtype)); }
};

// One bucket's memory once built.
struct BucketBuffers {
  const PlannedBucket* plan = nullptr;
  ShardLayout layout;        // segments, reserved tails, the gradients' offsets
  char* storage = nullptr;   // what its collectives work on: a flat view (zero copy) or staging
  bool staged = false;       // storage is a staging buffer of its own
  int64_t numel = 0;         // gradient elements (without padding or reserved tails)
  char* params = nullptr;    // sharded: the bucket's slice of the flat parameter buffer
  // The reserved tail of segment `segment` (layout.reservedElems elements).
  char* reservedTail(int64_t segment) const {
    return storage + size_t(segment * layout.segmentElems + layout.shardElems) *
                         dtypeSize(plan->dtype);
  }
};

class BucketMemory {
 public:
  // Host memory, or the memory of the backend that reduces a device.
  using MemoryFor = std::function<MemoryOps&(sf_device)>;
  explicit BucketMemory(MemoryFor memoryFor) : memoryFor_(std::move(memoryFor)) {}
  ~BucketMemory() { release(); }
  BucketMemory(const BucketMemory&) = delete;
  BucketMemory& operator=(const BucketMemory&) = delete;

  // Lays out `plan`'s buckets (bucket i reserving reserve[i] elements per
  // segment), sets every gradient's bucket, offset and views, and allocates.
  // SF_ERR_OUT_OF_MEMORY (naming the buffer and the first gradient) when a
  // size passes 2^63 or an allocation fails; then nothing stays allocated.
  void build(std::vector<Gradient>& grads, const std::vector<PlannedBucket>& plan,
             const std::vector<int64_t>& reserve, int64_t world, sf_shard_layout shard);
  // Every buffer back to its device (the backends must still live). Never throws.
  void release() noexcept;

  size_t size() const { return buckets_.size(); }
  BucketBuffers& operator[](size_t i) { return buckets_[i]; }
  const BucketBuffers& operator[](size_t i) const { return buckets_[i]; }
  MemoryOps& memoryFor(sf_device device) { return memoryFor_(device); }

  // Copies of one gradient of bucket `b` between its own memory and the
  // bucket's staging, run by run around the reserved tails. `range`
  // (relative to the gradient; count -1: all of it) limits the copy.
  void toStaging(const BucketBuffers& b, const Gradient& g, ShardRange range = {0, -1});
  void fromStaging(const BucketBuffers& b, Gradient& g, ShardRange range);

 private:
  bool needsStaging(const BucketBuffers& b, const std::vector<Gradient>& grads) const;
  char* allocate(sf_device device, int64_t bytes);

  MemoryFor memoryFor_;
  std::vector<BucketBuffers> buckets_;
  std::map<sf_device, char*> flat_;        // plugin-owned gradients, bucket by bucket, per device
  std::map<sf_device, char*> flatParams_;  // sharded: every bucket's parameters, per device
};

}  // namespace sfsync
