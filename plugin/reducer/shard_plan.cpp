#include "plugin/reducer/shard_plan.h"

#include <algorithm>

namespace sfsync {

namespace {

int64_t roundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Greedy: the number of contiguous groups of at most `cap` elements.
int64_t groupsFor(const std::vector<int64_t>& numels, int64_t cap) {
  int64_t groups = 1, fill = 0;
  for (int64_t n : numels) {
    if (fill + n > cap) {
      ++groups;
      fill = 0;
    }
    fill += n;
  }
  return groups;
}

}  // namespace

ShardLayout planShards(const std::vector<int64_t>& numels, int64_t elemBytes, int64_t world,
                       sf_shard_layout layout, bool control) {
  ShardLayout s;
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  if (layout == SF_SHARD_NONE || world <= 1) {
    // One segment; at world size 1 a sharded layout is the same (rank 0 owns all).
    s.world = 1;
    s.shardElems = total;
    s.controlElems = control ? 2 : 0;
    if (layout != SF_SHARD_NONE) {
      const int64_t align = std::max<int64_t>(1, 64 / elemBytes);
      s.shardElems = roundUp(total, align);
      s.controlElems = control ? align : 0;
    }
    s.segmentElems = s.shardElems + s.controlElems;
    int64_t at = 0;
    for (size_t i = 0; i < numels.size(); ++i) {
      s.offsets.push_back(at);
      at += numels[i];
    }
    return s;
  }
  const int64_t align = std::max<int64_t>(1, 64 / elemBytes);
  s.world = world;
  s.controlElems = control ? align : 0;
  s.offsets.resize(numels.size());
  if (layout == SF_SHARD_FLAT) {
    s.shardElems = roundUp(std::max<int64_t>(1, (total + world - 1) / world), align);
    int64_t at = 0;
    for (size_t i = 0; i < numels.size(); ++i) {
      s.offsets[i] = at;
      at += numels[i];
    }
  } else {
    // The smallest cap with at most W groups: binary search between the
    // largest gradient and the total (groupsFor falls as the cap grows).
    int64_t lo = 1, hi = std::max<int64_t>(total, 1);
    for (int64_t n : numels) lo = std::max(lo, n);
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (groupsFor(numels, mid) <= world) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const int64_t cap = lo;
    s.shardElems = roundUp(cap, align);
    int64_t group = 0, fill = 0;
    for (size_t i = 0; i < numels.size(); ++i) {
      if (fill + numels[i] > cap) {
        ++group;
        fill = 0;
      }
      s.offsets[i] = group * s.shardElems + fill;
      fill += numels[i];
    }
  }
  s.segmentElems = s.shardElems + s.controlElems;
  return s;
}

ShardRange ownedRange(const ShardLayout& layout, int64_t offset, int64_t numel, int64_t rank) {
  if (layout.world <= 1) return {0, numel};
  const int64_t begin = std::max(offset, rank * layout.shardElems);
  const int64_t end = std::min(offset + numel, (rank + 1) * layout.shardElems);
  if (end <= begin) return {0, 0};
  return {begin - offset, end - begin};
}

}  // namespace sfsync
