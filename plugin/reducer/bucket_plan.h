#pragma once
// Bucket planning: which gradients travel together. Pure function of the
// gradient list and the caps; no memory, no communication.
//
// Rules (as PyTorch DDP's compute_bucket_assignment_by_size, with a strict cap):
//  - gradients are taken in reverse registration order (the last layers'
//    gradients are ready first in a backward pass);
//  - one dtype and device per bucket: each (dtype, device) group fills its
//    own open bucket;
//  - a group's first bucket closes once it holds first_cap bytes (DDP's
//    rule: so that it starts during the backward with real bytes in it, e.g.
//    a large last-layer weight, not only the few bytes before it); later ones
//    close once they hold bucket_cap bytes;
//  - no bucket takes a gradient that would carry it past bucket_cap (the
//    first: past max(bucket_cap, first_cap)); a gradient is never split, so
//    one larger than the cap gets a bucket of its own;
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
