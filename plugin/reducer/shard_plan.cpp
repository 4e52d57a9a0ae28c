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
                       sf_shard_layout layout, int64_t reserve, std::vector<int64_t>* rankLoad) {
  ShardLayout s;
  const int64_t align = std::max<int64_t>(1, 64 / elemBytes);
  std::vector<int64_t> packed;  // the gradients contiguous from 0 (unsharded, flat)
  int64_t total = 0;
  for (int64_t n : numels) {
    packed.push_back(total);
    total += n;
  }
  if (layout == SF_SHARD_NONE || world <= 1) {
    // One segment; at world size 1 a sharded layout is the same (rank 0 owns
    // all), aligned and with an aligned reserved tail as the sharded ones.
    const bool sharded = layout != SF_SHARD_NONE;
    s.world = 1;
    s.shardElems = sharded ? roundUp(total, align) : total;
    s.reservedElems =
        reserve > 0 && sharded ? roundUp(reserve, align) : std::max<int64_t>(reserve, 0);
    s.segmentElems = s.shardElems + s.reservedElems;
    s.offsets = packed;
    s.used = {total};
    return s;
  }
  s.world = world;
  s.reservedElems = reserve > 0 ? roundUp(reserve, align) : 0;
  s.used.assign(size_t(world), 0);
  if (layout == SF_SHARD_FLAT) {
    s.shardElems = roundUp(std::max<int64_t>(1, (total + world - 1) / world), align);
    s.offsets = packed;
    for (int64_t r = 0; r < world; ++r) {
      s.used[size_t(r)] = std::max<int64_t>(0, std::min(s.shardElems, total - r * s.shardElems));
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
    s.offsets.resize(numels.size());
    // The groups (first gradient of each, and sizes), as groupsFor cuts them.
    std::vector<size_t> groupOf(numels.size());
    std::vector<int64_t> groupElems(size_t(world), 0);
    size_t group = 0;
    for (size_t i = 0; i < numels.size(); ++i) {
      if (groupElems[group] + numels[i] > cap) ++group;
      groupOf[i] = group;
      groupElems[group] += numels[i];
    }
    // Group -> segment: identity, or the largest group to the least loaded rank.
    std::vector<int64_t> segmentOf(static_cast<size_t>(world));
    for (int64_t g = 0; g < world; ++g) segmentOf[size_t(g)] = g;
    if (rankLoad) {
      if (rankLoad->size() < size_t(world)) rankLoad->resize(size_t(world), 0);
      std::vector<int64_t> byLoad = segmentOf, bySize = segmentOf;
      std::stable_sort(byLoad.begin(), byLoad.end(), [&](int64_t a, int64_t b) {
        return (*rankLoad)[size_t(a)] < (*rankLoad)[size_t(b)];
      });
      std::stable_sort(bySize.begin(), bySize.end(), [&](int64_t a, int64_t b) {
        return groupElems[size_t(a)] > groupElems[size_t(b)];
      });
      for (size_t k = 0; k < size_t(world); ++k) {
        segmentOf[size_t(bySize[k])] = byLoad[k];
        (*rankLoad)[size_t(byLoad[k])] += groupElems[size_t(bySize[k])];
      }
    }
    std::vector<int64_t> fill(static_cast<size_t>(world), 0);
    for (size_t i = 0; i < numels.size(); ++i) {
      const size_t g = groupOf[i];
      s.offsets[i] = segmentOf[g] * s.shardElems + fill[g];
      fill[g] += numels[i];
    }
    for (int64_t g = 0; g < world; ++g) s.used[size_t(segmentOf[size_t(g)])] = groupElems[size_t(g)];
  }
  s.segmentElems = s.shardElems + s.reservedElems;
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
