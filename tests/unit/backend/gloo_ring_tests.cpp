// The Gloo ring reduce-scatter (plugin/backend/gloo_ring.cpp) through two
// GlooBackends as threads of this process (memory:// store): exact sums
// across chunk boundaries, the owner's scaling taken chunk by chunk with
// the bits of a separate pass, and a receive scratch of two chunks per lane
// instead of a whole segment per lane (0.3 kept each lane's largest piece
// allocated: about one shard per lane, measured 8 MB on bench/torch2_bench's
// MLP at 2 ranks).

#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "plugin/backend/gloo_backend.h"
#include "plugin/backend/gloo_ring.h"
#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/launch/launch_options.h"
#include "plugin/rendezvous/memory_store.h"
#include "tests/support/thread_ranks.h"

using namespace sfsync;

namespace {

sf_options ringOptions(int rank, int world, const std::string& url) {
  sf_options o;
  optionsFromEnvironment(o);
  o.rank = rank;
  o.world_size = world;
  o.timeout_ms = 30000;
  std::strncpy(o.rendezvous, url.c_str(), SF_RENDEZVOUS_MAX - 1);
  o.backend = SF_BACKEND_GLOO;
  return o;
}

// What one rank saw: its own segment after the reduce-scatter (float64 for
// comparison), the scratch its lanes hold, or the error.
struct RankResult {
  std::vector<double> own;
  size_t scratch = 0;
  std::string error;
};

void storeValue(char* p, sf_dtype dtype, double v) {
  if (dtype == SF_DTYPE_FLOAT32) {
    const float f = float(v);
    std::memcpy(p, &f, sizeof f);
  } else if (dtype == SF_DTYPE_FLOAT64) {
    std::memcpy(p, &v, sizeof v);
  } else {
    const uint16_t b = floatToBf16(float(v));
    std::memcpy(p, &b, sizeof b);
  }
}

double loadValue(const char* p, sf_dtype dtype) {
  if (dtype == SF_DTYPE_FLOAT32) {
    float f;
    std::memcpy(&f, p, sizeof f);
    return f;
  }
  if (dtype == SF_DTYPE_FLOAT64) {
    double d;
    std::memcpy(&d, p, sizeof d);
    return d;
  }
  uint16_t b;
  std::memcpy(&b, p, sizeof b);
  return bf16ToFloat(b);
}

// Rank r's value of element k of segment s (small integers: exact in every dtype).
double valueOf(int r, int64_t s, int64_t k) { return double((r + 1) * ((k + 3 * s) % 13)); }

std::vector<RankResult> reduceScatter(int world, int64_t segmentElems, sf_dtype dtype,
                                      int repeats, const ReduceSpec& spec = ReduceSpec{}) {
  const std::string name = sftest::uniqueName("ring");
  auto store = MemoryStore::named(name);  // held while the ranks use it
  return sftest::runThreadRanks<RankResult>(world, [&](int r) {
    RankResult out;
    try {
      GlooBackend backend(ringOptions(r, world, "memory://" + name));
      backend.connect();
      const size_t esize = dtypeSize(dtype);
      std::vector<char> buf(size_t(segmentElems * world) * esize);
      for (int rep = 0; rep < repeats; ++rep) {
        for (int64_t s = 0; s < world; ++s) {
          for (int64_t k = 0; k < segmentElems; ++k) {
            storeValue(buf.data() + size_t(s * segmentElems + k) * esize, dtype, valueOf(r, s, k));
          }
        }
        backend.startReduceScatter(buf.data(), segmentElems, dtype, spec)->wait();
      }
      out.scratch = backend.ringScratchBytes();
      for (int64_t k = 0; k < segmentElems; ++k) {
        out.own.push_back(loadValue(buf.data() + size_t(r * segmentElems + k) * esize, dtype));
      }
    } catch (const std::exception& e) {
      out.error = e.what();
    }
    return out;
  });
}

// The sums times `factor` below element `scaledEnd` of each segment, in
// `dtype`'s bits: the sum stored (exact: small integers), then scaled by
// scaleInPlace, as a separate pass over the shard would.
void expectScaledSums(const std::vector<RankResult>& results, int world, int64_t segmentElems,
                      sf_dtype dtype, double factor, int64_t scaledEnd) {
  const size_t esize = dtypeSize(dtype);
  for (int r = 0; r < world; ++r) {
    const RankResult& got = results[size_t(r)];
    BOOST_TEST_REQUIRE(got.error.empty(), "rank " << r << ": " << got.error);
    BOOST_REQUIRE_EQUAL(got.own.size(), size_t(segmentElems));
    int64_t wrong = 0, first = -1;
    for (int64_t k = 0; k < segmentElems; ++k) {
      double sum = 0;
      for (int q = 0; q < world; ++q) sum += valueOf(q, r, k);
      std::vector<char> one(esize);
      storeValue(one.data(), dtype, sum);
      if (k < scaledEnd) scaleInPlace(one.data(), 1, dtype, factor);
      if (got.own[size_t(k)] != loadValue(one.data(), dtype)) {
        if (first < 0) first = k;
        ++wrong;
      }
    }
    BOOST_TEST(wrong == 0, "rank " << r << ": " << wrong << " wrong, the first at " << first
                                    << " (scaled below " << scaledEnd << ")");
  }
}

// The plain sums (exact in every dtype: small integers).
void expectSums(const std::vector<RankResult>& results, int world, int64_t segmentElems) {
  expectScaledSums(results, world, segmentElems, SF_DTYPE_FLOAT64, 1.0, 0);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(gloo_ring_tests)

BOOST_AUTO_TEST_CASE(chunk_is_half_a_mebibyte_up_to_64_chunks_then_a_64th) {
  BOOST_TEST(ringChunkBytes(12 << 20, 4) == kRingChunkBytes);
  BOOST_TEST(ringChunkBytes(32 << 20, 4) == kRingChunkBytes);
  BOOST_TEST(ringChunkBytes(100 << 20, 4) == (100 << 20) / 64);  // 1.5625 MiB, whole floats
  BOOST_TEST(ringChunkBytes((100 << 20) + 6, 2) % 2 == 0);
  BOOST_TEST(ringChunkBytes(1000, 4) == 1000);  // a small segment: one chunk of itself
  BOOST_TEST(ringChunkBytes(2, 2) == 2);
}

BOOST_AUTO_TEST_CASE(large_segments_sum_exactly_through_a_two_chunk_scratch) {
  // 3 Mi floats + 5 per segment (12 MiB: 24 chunks and a short last one).
  const int64_t elems = (3 << 20) + 5;
  const auto results = reduceScatter(2, elems, SF_DTYPE_FLOAT32, 2);
  expectSums(results, 2, elems);
  for (int r = 0; r < 2; ++r) {
    // Two chunks per lane (at most 8 lanes), never a segment's 12 MiB per lane.
    const size_t scratch = results[size_t(r)].scratch;
    BOOST_TEST(scratch > 0u);
    BOOST_TEST(scratch % size_t(2 * kRingChunkBytes) == 0u, "rank " << r << ": " << scratch);
    BOOST_TEST(scratch <= size_t(8 * 2 * kRingChunkBytes), "rank " << r << ": " << scratch);
  }
}

BOOST_AUTO_TEST_CASE(three_ranks_sixteen_bit_and_float64_across_chunk_edges) {
  // Segments just past one and two chunks, in 2- and 8-byte elements.
  expectSums(reduceScatter(3, kRingChunkBytes / 2 + 1, SF_DTYPE_BFLOAT16, 1), 3,
             kRingChunkBytes / 2 + 1);
  expectSums(reduceScatter(3, 2 * kRingChunkBytes / 8 + 3, SF_DTYPE_FLOAT64, 1), 3,
             2 * kRingChunkBytes / 8 + 3);
}

BOOST_AUTO_TEST_CASE(own_sums_are_scaled_below_the_reserved_tail_as_their_chunk_arrives) {
  // The ring scales each chunk of this rank's segment as its last sum is
  // taken; the bits must equal a pass scaling the finished sums, at 1, 2 and
  // 3 ranks (1: no ring), the scaled end inside the second chunk, and past
  // it only the sums (the reserved tail, e.g. a window check).
  for (const sf_dtype dtype : {SF_DTYPE_FLOAT32, SF_DTYPE_BFLOAT16}) {
    for (const int world : {1, 2, 3}) {
      const int64_t esize = int64_t(dtypeSize(dtype));
      const int64_t elems = 2 * kRingChunkBytes / esize + 7;
      const int64_t scaledEnd = kRingChunkBytes / esize + 11;
      ReduceSpec spec;
      spec.prescale = 1.0 / 3.0;  // the product of both scales, as the reduce-scatter takes them
      spec.postscale = 1.0 / world;
      spec.scaledElems = scaledEnd;
      BOOST_TEST_CONTEXT(dtypeName(dtype) << ", " << world << " ranks") {
        expectScaledSums(reduceScatter(world, elems, dtype, 1, spec), world, elems, dtype,
                         spec.prescale * spec.postscale, scaledEnd);
      }
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
