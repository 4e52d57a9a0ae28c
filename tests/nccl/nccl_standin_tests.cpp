// The NCCL stand-in's ncclReduce (tests/standin, README "NCCL API covered"),
// called directly, ranks as threads: a group of reduces with roots 0..n-1
// on one stream per rank (the NCCL module's reduce-scatter of uneven
// segments) runs without deadlock, writes each root's buffer only, exactly;
// a pairing that differs in root fails every rank; an invalid root fails at
// once. No sfsync: the stand-in alone.

#include <boost/test/unit_test.hpp>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tests/nccl/nccl_support.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

constexpr int64_t kSegment = 8;

// Element i of segment k on rank r before the reduces: exact small floats.
float input(int r, int64_t k, int64_t i) { return float((r + 1) * 100 + k * 10 + i); }

struct RankRun {
  ncclResult_t enqueued = ncclSuccess;  // the group's
  ncclResult_t async = ncclSuccess;     // ncclCommGetAsyncError after the stream ran
  std::string lastError;
  std::vector<float> data;              // the rank's segments afterwards
};

// Each rank: `world` segments of kSegment floats, one ncclGroupStart/End
// around an in-place ncclReduce per root with a non-zero count (roots[k]:
// the root the rank names for segment k), then the stream drained.
RankRun groupedReduces(int rank, int world, const ncclUniqueId& id, const std::vector<int64_t>& used,
                       const std::vector<int>& roots, ncclRedOp_t op) {
  RankRun out;
  cudaSetDevice(rank);
  ncclComm_t comm = nullptr;
  if (ncclCommInitRank(&comm, world, id, rank) != ncclSuccess) {
    out.enqueued = ncclSystemError;
    return out;
  }
  cudaStream_t s = nullptr;
  cudaStreamCreate(&s);
  out.data.resize(size_t(world * kSegment));
  for (int64_t k = 0; k < world; ++k) {
    for (int64_t i = 0; i < kSegment; ++i) out.data[size_t(k * kSegment + i)] = input(rank, k, i);
  }
  ncclResult_t r = ncclGroupStart();
  for (int k = 0; r == ncclSuccess && k < world; ++k) {
    float* seg = out.data.data() + k * kSegment;
    if (used[size_t(k)] > 0) r = ncclReduce(seg, seg, size_t(used[size_t(k)]), ncclFloat32, op, roots[size_t(k)], comm, s);
  }
  const ncclResult_t end = ncclGroupEnd();
  out.enqueued = r == ncclSuccess ? end : r;
  drain(s);
  ncclCommGetAsyncError(comm, &out.async);
  if (out.async != ncclSuccess) out.lastError = ncclGetLastError(comm);
  cudaStreamDestroy(s);
  ncclCommDestroy(comm);
  return out;
}

ncclUniqueId newId() {
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  return id;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(nccl_standin_tests)

BOOST_AUTO_TEST_CASE(threads3_grouped_reduces_write_each_root_only) {
  const int world = 3;
  const std::vector<int64_t> used = {5, 0, 8};  // segment 1 is empty: skipped
  const std::vector<int> roots = {0, 1, 2};
  const ncclUniqueId id = newId();
  const int64_t calls0 = sfStandinNcclCounter("ncclReduce"), elems0 = sfStandinNcclCounter("ncclReduce_elems");
  auto runs = runThreadRanks<RankRun>(world, [&](int r) {
    return groupedReduces(r, world, id, used, roots, ncclSum);
  });
  for (int r = 0; r < world; ++r) {
    const RankRun& x = runs[size_t(r)];
    BOOST_REQUIRE_MESSAGE(x.enqueued == ncclSuccess && x.async == ncclSuccess, "rank " << r << ": " << x.lastError);
    for (int64_t k = 0; k < world; ++k) {
      for (int64_t i = 0; i < kSegment; ++i) {
        float want = input(r, k, i);  // other roots' segments and padding: as they were
        if (k == r && i < used[size_t(k)]) {
          want = 0;
          for (int q = 0; q < world; ++q) want += input(q, k, i);
        }
        BOOST_TEST(x.data[size_t(k * kSegment + i)] == want, "rank " << r << " segment " << k << "[" << i << "]");
      }
    }
  }
  BOOST_TEST(sfStandinNcclCounter("ncclReduce") - calls0 == world * 2);
  BOOST_TEST(sfStandinNcclCounter("ncclReduce_elems") - elems0 == world * (5 + 8));
}

BOOST_AUTO_TEST_CASE(threads2_reduces_paired_with_another_root_fail_every_rank) {
  const int world = 2;
  const ncclUniqueId id = newId();
  const int64_t mismatches = sfStandinNcclCounter("mismatches");
  auto runs = runThreadRanks<RankRun>(world, [&](int r) {
    // Rank 1 names itself root of segment 0: the pairing differs.
    return groupedReduces(r, world, id, {4, 0}, {r, 0}, ncclSum);
  });
  for (int r = 0; r < world; ++r) {
    const RankRun& x = runs[size_t(r)];
    BOOST_TEST(x.enqueued == ncclSuccess);
    BOOST_TEST(x.async == ncclInvalidUsage, "rank " << r);
    BOOST_TEST(x.lastError.find("ncclReduce #1 (4 x float32, sum, root") != std::string::npos, x.lastError);
    for (int64_t i = 0; i < 4; ++i) BOOST_TEST(x.data[size_t(i)] == input(r, 0, i));  // not combined
  }
  BOOST_TEST(sfStandinNcclCounter("mismatches") > mismatches);
}

BOOST_AUTO_TEST_CASE(reduce_with_an_invalid_root_fails_at_once) {
  ncclComm_t comm = nullptr;
  BOOST_REQUIRE(ncclCommInitRank(&comm, 1, newId(), 0) == ncclSuccess);
  float x[4] = {1, 2, 3, 4};
  const int64_t calls = sfStandinNcclCounter("ncclReduce");
  BOOST_TEST(ncclReduce(x, x, 4, ncclFloat32, ncclSum, 1, comm, nullptr) == ncclInvalidArgument);
  BOOST_TEST(ncclReduce(x, x, 4, ncclFloat32, ncclSum, -1, comm, nullptr) == ncclInvalidArgument);
  BOOST_TEST(sfStandinNcclCounter("ncclReduce") == calls);
  BOOST_TEST(ncclCommDestroy(comm) == ncclSuccess);
}

BOOST_AUTO_TEST_SUITE_END()
