#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <numeric>

#include "plugin/reducer/shard_plan.h"

using namespace sfsync;

namespace {

// Every rank's ranges of every gradient: disjoint, in rank order, covering
// the gradient exactly; each inside the rank's segment.
void checkPartition(const ShardLayout& s, const std::vector<int64_t>& numels) {
  for (size_t i = 0; i < numels.size(); ++i) {
    int64_t covered = 0;
    for (int64_t r = 0; r < s.world; ++r) {
      const ShardRange o = ownedRange(s, s.offsets[i], numels[i], r);
      if (o.count == 0) continue;
      BOOST_TEST(o.offset == covered);  // contiguous, in rank order
      covered += o.count;
      const int64_t begin = s.offsets[i] + o.offset;
      BOOST_TEST(begin >= r * s.shardElems);
      BOOST_TEST(begin + o.count <= (r + 1) * s.shardElems);
    }
    BOOST_TEST(covered == numels[i]);
  }
}

void checkAligned(const ShardLayout& s, int64_t elemBytes) {
  BOOST_TEST((s.shardElems * elemBytes) % 64 == 0);
  BOOST_TEST((s.segmentElems * elemBytes) % 64 == 0);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(shard_plan_tests)

BOOST_AUTO_TEST_CASE(unsharded_is_one_segment_with_the_control_after_the_gradients) {
  const ShardLayout s = planShards({10, 20, 30}, 4, 4, SF_SHARD_NONE, 2);
  BOOST_TEST(s.world == 1);
  BOOST_TEST(s.shardElems == 60);
  BOOST_TEST(s.reservedElems == 2);
  BOOST_TEST(s.gradientElems() == 62);
  BOOST_TEST(s.offsets == (std::vector<int64_t>{0, 10, 30}), boost::test_tools::per_element());
  BOOST_TEST(ownedRange(s, 10, 20, 0).count == 20);
}

BOOST_AUTO_TEST_CASE(flat_pads_to_aligned_equal_segments_for_w_2_3_4) {
  // 1000 + 7 + 333 float32 = 1340 elements; W does not divide them.
  const std::vector<int64_t> n = {1000, 7, 333};
  const int64_t expectU[] = {0, 0, 672, 448, 336};  // ceil(1340 / W) rounded up to 16
  for (int64_t w : {2, 3, 4}) {
    BOOST_TEST_CONTEXT("W = " << w) {
      const ShardLayout s = planShards(n, 4, w, SF_SHARD_FLAT, 0);
      BOOST_TEST(s.world == w);
      BOOST_TEST(s.shardElems == expectU[w]);
      BOOST_TEST(s.reservedElems == 0);
      BOOST_TEST(s.offsets == (std::vector<int64_t>{0, 1000, 1007}), boost::test_tools::per_element());
      BOOST_TEST(s.parameterElems() >= 1340);
      BOOST_TEST(s.parameterElems() - 1340 < w * 16);  // padding below one 64-byte line per rank
      checkAligned(s, 4);
      checkPartition(s, n);
    }
  }
}

BOOST_AUTO_TEST_CASE(flat_gradient_straddles_ranks) {
  // W = 3, U = 448: gradient 0 (1000) spans ranks 0, 1 and 2.
  const ShardLayout s = planShards({1000, 7, 333}, 4, 3, SF_SHARD_FLAT, 0);
  const ShardRange r0 = ownedRange(s, 0, 1000, 0), r1 = ownedRange(s, 0, 1000, 1),
                   r2 = ownedRange(s, 0, 1000, 2);
  BOOST_TEST(r0.offset == 0);
  BOOST_TEST(r0.count == 448);
  BOOST_TEST(r1.offset == 448);
  BOOST_TEST(r1.count == 448);
  BOOST_TEST(r2.offset == 896);
  BOOST_TEST(r2.count == 104);
  // gradient 1 (7 elements at 1000) lies wholly in rank 2's segment.
  BOOST_TEST(ownedRange(s, 1000, 7, 1).count == 0);
  BOOST_TEST(ownedRange(s, 1000, 7, 2).count == 7);
}

BOOST_AUTO_TEST_CASE(flat_with_control_puts_a_64_byte_slot_after_every_segment) {
  const ShardLayout s = planShards({100, 50}, 8, 3, SF_SHARD_FLAT, 2);  // float64
  BOOST_TEST(s.shardElems == 56);    // ceil(150 / 3) = 50 -> 56 (8 per line)
  BOOST_TEST(s.reservedElems == 8);
  BOOST_TEST(s.segmentElems == 64);
  BOOST_TEST(s.gradientElems() == 192);
  BOOST_TEST(s.parameterElems() == 168);
  BOOST_TEST(s.physical(55) == 55);
  BOOST_TEST(s.physical(56) == 64);   // rank 1's first element after rank 0's slot
  BOOST_TEST(s.physical(149) == 64 * 2 + 149 - 112);
  BOOST_TEST(!s.contiguous(0, 100));  // gradient 0 crosses rank 0's slot
  BOOST_TEST(s.contiguous(100, 12));
  checkAligned(s, 8);
}

BOOST_AUTO_TEST_CASE(parameter_layout_keeps_gradients_whole_and_balances_by_bytes) {
  // bfloat16 (32 per line): 500 400 300 200 100 on W = 2, 3, 4.
  const std::vector<int64_t> n = {500, 400, 300, 200, 100};
  // The smallest largest contiguous group: W=2 [500 400] [300 200 100] = 900;
  // W=3 [500] [400] [300 200 100] = 600; W=4 [500] [400] [300] [200 100] = 500.
  const int64_t expectCap[] = {0, 0, 900, 600, 500};
  for (int64_t w : {2, 3, 4}) {
    BOOST_TEST_CONTEXT("W = " << w) {
      const ShardLayout s = planShards(n, 2, w, SF_SHARD_PARAMETER, 0);
      BOOST_TEST(s.shardElems == (expectCap[w] + 31) / 32 * 32);
      checkAligned(s, 2);
      checkPartition(s, n);
      int64_t previousOwner = 0;
      for (size_t i = 0; i < n.size(); ++i) {
        int owners = 0;
        for (int64_t r = 0; r < w; ++r) {
          const ShardRange o = ownedRange(s, s.offsets[i], n[i], r);
          if (o.count == 0) continue;
          ++owners;
          BOOST_TEST(o.count == n[i]);  // whole
          BOOST_TEST(r >= previousOwner);  // groups in bucket order
          previousOwner = r;
        }
        BOOST_TEST(owners == 1);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(parameter_layout_optimum_matches_brute_force) {
  // Every cut of 6 gradients into at most 3 contiguous groups.
  const std::vector<int64_t> n = {37, 5, 90, 12, 64, 33};
  int64_t best = INT64_MAX;
  for (size_t a = 0; a <= n.size(); ++a) {
    for (size_t b = a; b <= n.size(); ++b) {
      const int64_t g1 = std::accumulate(n.begin(), n.begin() + long(a), int64_t(0));
      const int64_t g2 = std::accumulate(n.begin() + long(a), n.begin() + long(b), int64_t(0));
      const int64_t g3 = std::accumulate(n.begin() + long(b), n.end(), int64_t(0));
      best = std::min(best, std::max({g1, g2, g3}));
    }
  }
  const ShardLayout s = planShards(n, 8, 3, SF_SHARD_PARAMETER, 0);
  BOOST_TEST(best == 102);  // [37 5] [90 12] [64 33]
  BOOST_TEST(s.shardElems == (best + 7) / 8 * 8);
  checkPartition(s, n);
}

BOOST_AUTO_TEST_CASE(parameter_layout_with_fewer_gradients_than_ranks_leaves_ranks_empty) {
  const ShardLayout s = planShards({10, 20}, 4, 4, SF_SHARD_PARAMETER, 2);
  BOOST_TEST(s.shardElems == 32);
  BOOST_TEST(s.reservedElems == 16);
  int64_t owned[4] = {0, 0, 0, 0};
  for (int64_t r = 0; r < 4; ++r) {
    owned[r] = ownedRange(s, s.offsets[0], 10, r).count + ownedRange(s, s.offsets[1], 20, r).count;
  }
  BOOST_TEST(owned[0] + owned[1] + owned[2] + owned[3] == 30);
  BOOST_TEST((owned[2] == 0 && owned[3] == 0));
  // Whole gradients never cross a window-check slot: zero-copy views stay contiguous.
  BOOST_TEST(s.contiguous(s.offsets[0], 10));
  BOOST_TEST(s.contiguous(s.offsets[1], 20));
}

BOOST_AUTO_TEST_CASE(used_counts_are_each_segments_gradients) {
  // Flat: full segments, the last one short; parameter: each group's size.
  const ShardLayout f = planShards({100, 50}, 4, 3, SF_SHARD_FLAT, 2);
  BOOST_TEST(f.shardElems == 64);
  BOOST_TEST((f.used == std::vector<int64_t>{64, 64, 22}));
  const ShardLayout p = planShards({500, 400, 300, 200, 100}, 2, 3, SF_SHARD_PARAMETER, 0);
  BOOST_TEST((p.used == std::vector<int64_t>{500, 400, 600}));
  const ShardLayout none = planShards({10, 20}, 4, 4, SF_SHARD_NONE, 2);
  BOOST_TEST((none.used == std::vector<int64_t>{30}));
}

BOOST_AUTO_TEST_CASE(parameter_layout_balances_ranks_across_buckets) {
  // Buckets of one or two gradients each: without a load carried across
  // buckets rank 0 holds the first group of every bucket (here everything).
  const std::vector<std::vector<int64_t>> buckets = {
      {1000}, {900, 20}, {800}, {700}, {600, 600}, {500}, {400}, {300}, {10}};
  for (int64_t w : {2, 3, 4}) {
    BOOST_TEST_CONTEXT("W = " << w) {
      std::vector<int64_t> load, held(size_t(w), 0);
      int64_t total = 0, largest = 0;
      for (const auto& n : buckets) {
        const ShardLayout s = planShards(n, 4, w, SF_SHARD_PARAMETER, 0, &load);
        checkPartition(s, n);
        for (size_t i = 0; i < n.size(); ++i) {
          total += n[i];
          largest = std::max(largest, n[i]);
          for (int64_t r = 0; r < w; ++r) held[size_t(r)] += ownedRange(s, s.offsets[i], n[i], r).count;
        }
        int64_t inUse = 0;
        for (int64_t u : s.used) inUse += u;
        BOOST_TEST(inUse == std::accumulate(n.begin(), n.end(), int64_t(0)));
      }
      BOOST_TEST(held == load);  // the carried load is what each rank holds
      // The greedy bound: the average plus the largest group (here one gradient).
      for (int64_t h : held) BOOST_TEST(h <= total / w + largest);
      const int64_t most = *std::max_element(held.begin(), held.end());
      BOOST_TEST(most < total - 1000);  // not everything on one rank
    }
  }
}

BOOST_AUTO_TEST_CASE(world_size_one_owns_everything) {
  const ShardLayout s = planShards({3, 4}, 4, 1, SF_SHARD_FLAT, 0);
  BOOST_TEST(s.world == 1);
  BOOST_TEST(s.shardElems == 16);
  BOOST_TEST(ownedRange(s, 3, 4, 0).count == 4);
}

BOOST_AUTO_TEST_SUITE_END()
