#pragma once
// Ring reduce-scatter and ring all-gather over Gloo unbound buffers: the two
// halves of a ring all-reduce, each moving every segment but one once per
// rank, so that together they cost exactly one ring all-reduce of the bytes
// they move. Segments may carry different amounts (a parameter-aligned
// bucket's groups): only each segment's spans travel, never its padding.
// Each step posts its receives before its sends (gloo_ring.cpp's Note).
// Blocking; run on a backend worker thread. Not responsible for lanes or
// tracing; of the scaling, only the reduce-scatter's owner's (its factor).

#include <chrono>
#include <cstdint>
#include <vector>

#include "sfsync.h"

namespace gloo {
class Context;
}

namespace sfsync {

// A byte range inside one segment.
struct RingSpan {
  int64_t offsetBytes;
  int64_t bytes;
};

// The Gloo contexts a ring sends on and receives on: the same one, or at
// two ranks one per direction (gloo_backend.cpp's [Note: a mesh per
// direction]). Both have this rank's rank and the same size.
struct RingLinks {
  gloo::Context& send;
  gloo::Context& recv;
};

// One piece of a segmented buffer: world_size segments of `strideBytes`
// each start at `base`; in segment k the piece is spans[k] (at most two
// ranges, in order; possibly none). Every rank builds the same spans.
struct RingPiece {
  char* base;
  int64_t strideBytes;
  sf_dtype dtype;
  std::vector<std::vector<RingSpan>> spans;  // one list per segment
};

// The piece of elements [begin, begin + count) of every segment, less what
// is padding: in segment k, elements [used[k], dataEnd) (`used` empty: no
// padding; elements from dataEnd to the segment's end, the window-check slot,
// travel). Adjacent ranges are merged.
RingPiece slicePiece(char* base, int64_t segmentElems, sf_dtype dtype, int world, int64_t begin,
                     int64_t count, const std::vector<int64_t>& used, int64_t dataEnd);

// The chunk a reduce-scatter receives at a time (two of them are its
// scratch): kRingChunkBytes, or more for a segment over kRingMaxChunks of
// them (the slots of a step have room for that many), in whole elements.
constexpr int64_t kRingChunkBytes = 512 * 1024;
constexpr int64_t kRingMaxChunks = 64;
int64_t ringChunkBytes(int64_t largestSegmentBytes, size_t elemBytes);

// Afterwards this rank's piece of segment `rank` holds the sum over ranks,
// times `factor` for its elements below `scaledEnd` (an element index in
// the segment; -1: every element): each chunk is scaled as its last sum is
// taken, while it is in cache, rather than in a pass over the shard
// afterwards (the same bits: the sum rounded, then the product). Only the
// piece's spans are scaled, never its padding.
// `scratch` (grown to two chunks, ringChunkBytes) receives the neighbour's
// partial sums; `tag`
// is the same on every rank and unique among collectives in flight.
// Returns the bytes this rank sent. Throws what Gloo throws (the caller maps
// it), or sfsync::Error(SF_ERR_TIMEOUT) when a wait is aborted.
int64_t ringReduceScatter(const RingLinks& links, const RingPiece& piece, uint32_t tag,
                          std::chrono::milliseconds timeout, std::vector<char>& scratch,
                          double factor = 1.0, int64_t scaledEnd = -1);

// Afterwards every segment's piece holds what its rank held.
int64_t ringAllgather(const RingLinks& links, const RingPiece& piece, uint32_t tag,
                      std::chrono::milliseconds timeout);

// A float32 piece of `count` elements all-reduced over a 16-bit wire
// (`wire`: SF_DTYPE_BFLOAT16 or SF_DTYPE_FLOAT16), as one ring all-reduce's
// bytes at 16 bits: a ring reduce-scatter over world_size segments in which
// each rank adds its own float32 value (times `prescale` for the first
// `scaled` elements) to the 16-bit partial sum it receives and rounds once,
// then a ring all-gather of the 16-bit sums, widened into `data` (times
// `postscale` for the first `scaled` elements). A rank's own value is thus
// never rounded on its own: world_size roundings per element, not the
// 2 world_size - 1 of a ring over values rounded first, and every rank ends
// with the same bits. `scratch` is grown to whole segments (`count` 16-bit
// values rounded up to a multiple of world_size). Returns
// the bytes this rank sent; throws as ringReduceScatter.
int64_t ringAllreduce16(const RingLinks& links, float* data, int64_t count, int64_t scaled,
                        sf_dtype wire, float prescale, float postscale, uint32_t tag,
                        std::chrono::milliseconds timeout, std::vector<uint16_t>& scratch);

}  // namespace sfsync
