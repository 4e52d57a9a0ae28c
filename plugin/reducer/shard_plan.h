#pragma once
// Shard planning: where each gradient of a bucket lies in the bucket's
// buffers and which part of it each rank owns. Pure function of one planned
// bucket, the gradients' sizes, the world size and the layout; no memory, no
// communication. The unsharded (all-reduce) layout is the same description
// with one segment, so the reducer has one picture for both modes.
//
// Coordinates. A bucket has W segments of `shardElems` (U) elements in its
// logical layout: rank r owns logical elements [r*U, (r+1)*U). The parameter
// buffer of a bucket is exactly the logical layout (W*U elements; a gather
// moves segment r from rank r to every rank). The gradient buffer may
// reserve `reservedElems` elements after every segment for its owner's use
// (the reducer's window check; the layout knows only their count): its
// segments are `segmentElems` (S = U + reservedElems) long, and logical
// element l sits at physical (l / U) * S + l % U (with nothing reserved the
// two coincide). The reserved tail of segment r starts at physical r*S + U.
//
// Rules:
//  - SF_SHARD_NONE: one segment (W = 1 in this picture) holding the
//    gradients contiguous, U = their sum, the `reserve` elements asked for
//    directly after them: every rank owns everything.
//  - sharded layouts: U is a multiple of the elements in 64 bytes (so every
//    segment of both buffers starts 64-byte aligned when the bucket does),
//    and a reserved tail, when one is asked for, is rounded up to a multiple
//    of 64 bytes;
//  - SF_SHARD_FLAT: the gradients contiguous from logical 0, U the smallest
//    aligned size with W*U >= their sum (the padding at the end);
//  - SF_SHARD_PARAMETER: the gradients, in bucket order, cut into W
//    contiguous groups whose largest is as small as possible (balanced by
//    bytes: one dtype per bucket), U the aligned size of the largest group;
//    trailing groups may be empty. Which rank holds which group balances the
//    ranks across buckets: with `rankLoad` (elements per rank so far, carried
//    from bucket to bucket), the largest group goes to the least loaded rank,
//    and so on (ties: the lower rank); without it, group r to rank r.
//
// `used[r]`: the elements at the start of segment r that hold gradients; the
// rest of the segment up to U is padding, which stays zero and off the wire
// (the collectives move used[r] elements of segment r, plus its reserved
// tail), so a padded bucket costs its gradients' bytes, not W * U.

#include <cstdint>
#include <vector>

#include "sfsync.h"

namespace sfsync {

struct ShardLayout {
  int64_t world = 1;         // segments (1 for SF_SHARD_NONE)
  int64_t shardElems = 0;    // U
  int64_t reservedElems = 0;  // at the end of every segment of the gradient buffer
  int64_t segmentElems = 0;   // S = U + reservedElems
  std::vector<int64_t> offsets;  // logical offset of each gradient, in bucket order
  std::vector<int64_t> used;     // per segment: leading elements holding gradients

  int64_t gradientElems() const { return world * segmentElems; }  // gradient buffer
  int64_t parameterElems() const { return world * shardElems; }   // parameter buffer
  int64_t physical(int64_t logical) const {
    return reservedElems == 0 ? logical
                             : (logical / shardElems) * segmentElems + logical % shardElems;
  }
  // Whether [offset, offset + numel) is contiguous in the gradient buffer.
  bool contiguous(int64_t offset, int64_t numel) const {
    return reservedElems == 0 || offset / shardElems == (offset + numel - 1) / shardElems;
  }
};

// Elements [offset, offset + count) of a gradient owned by a rank; count 0: none.
struct ShardRange {
  int64_t offset = 0;
  int64_t count = 0;
};

// `numels`: the bucket's gradients' sizes, in bucket order. `reserve`:
// elements to reserve at the end of every segment (0: none; sharded layouts
// round it up to 64 bytes). `elemBytes`: the dtype's size.
// `rankLoad` (SF_SHARD_PARAMETER only; may be null): see above; resized to
// `world` when smaller, and this bucket's groups added to it.
ShardLayout planShards(const std::vector<int64_t>& numels, int64_t elemBytes, int64_t world,
                       sf_shard_layout layout, int64_t reserve,
                       std::vector<int64_t>* rankLoad = nullptr);

// The part of the gradient at logical `offset` with `numel` elements that
// `rank` owns (rank < layout.world; always the whole gradient for NONE).
ShardRange ownedRange(const ShardLayout& layout, int64_t offset, int64_t numel, int64_t rank);

}  // namespace sfsync
