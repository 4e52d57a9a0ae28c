#pragma once
// Ring reduce-scatter and ring all-gather over Gloo unbound buffers: the two
// halves of a ring all-reduce, each moving (W-1)/W of the buffer per rank, so
// that together they cost exactly one ring all-reduce. Blocking; run on a
// backend worker thread. Not responsible for lanes, scaling or tracing.

#include <chrono>
#include <cstdint>
#include <vector>

#include "sfsync.h"

namespace gloo {
class Context;
}

namespace sfsync {

// One piece of a segmented buffer: world_size segments of `strideBytes`
// each start at `base`; the piece is `bytes` bytes at `offsetBytes` inside
// every segment (a whole segment: offset 0, bytes = stride).
struct RingPiece {
  char* base;
  int64_t strideBytes;
  int64_t offsetBytes;
  int64_t bytes;
  sf_dtype dtype;
};

// Afterwards this rank's piece of segment `rank` holds the sum over ranks.
// `scratch` (grown as needed) receives the neighbour's partial sums; `tag`
// is the same on every rank and unique among collectives in flight.
// Returns the bytes this rank sent. Throws what Gloo throws (the caller maps
// it), or sfsync::Error(SF_ERR_TIMEOUT) when a wait is aborted.
int64_t ringReduceScatter(gloo::Context& context, const RingPiece& piece, uint32_t tag,
                          std::chrono::milliseconds timeout, std::vector<char>& scratch);

// Afterwards every segment's piece holds what its rank held.
int64_t ringAllgather(gloo::Context& context, const RingPiece& piece, uint32_t tag,
                      std::chrono::milliseconds timeout);

}  // namespace sfsync
