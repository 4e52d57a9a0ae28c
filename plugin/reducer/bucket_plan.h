#pragma once
// Bucket planning: which gradients travel together. Pure function of the
// gradient list and the caps; no memory, no communication.
//
// Rules (as PyTorch DDP's compute_bucket_assignment_by_size, with a strict cap):
//  - gradients are taken in reverse registration order (the last layers'
//    gradients are ready first in a backward pass);
//  - one dtype and device per bucket: each (dtype, device) group fills its
//    own open bucket;
//  - a group's first bucket holds at most first_cap bytes, later ones
//    bucket_cap bytes; a gradient is never split, so one larger than the cap
//    gets a bucket of its own;
//  - buckets are ordered by the position of their last gradient in the walk:
//    the order in which a backward pass completes them, so launching in
//    bucket order never makes a complete bucket wait for an incomplete one.

#include <cstdint>
#include <vector>

#include "sfsync.h"

namespace sfsync {

struct GradSpec {
  int64_t numel;
  sf_dtype dtype;
  sf_device device;
};

struct PlannedBucket {
  sf_dtype dtype;
  sf_device device;
  std::vector<int64_t> grads;  // gradient ids in the order they are packed
  int64_t bytes = 0;
};

std::vector<PlannedBucket> planBuckets(const std::vector<GradSpec>& grads, int64_t capBytes,
                                       int64_t firstCapBytes);

}  // namespace sfsync
