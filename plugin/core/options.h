#pragma once
// The context options' ground floor: the frozen struct sizes, the defaults
// and the bucket-cap rules every layer shares. Owns no state. What the
// environment and the launchers add, and the validation of a whole struct
// (which names the launchers' variables), are one floor up:
// launch/launch_options.h.

#include <cstddef>
#include <cstdint>
#include <string>

#include "plugin/core/deadline.h"
#include "sfsync.h"

namespace sfsync {

// Sizes of the structs as first published (ABI version 1, sfsync 0.1/0.2).
// Frozen: fields are only ever appended, so a caller's struct_size is valid
// from these up; smaller values are rejected. options.cpp checks the v1
// layout field by field (static_assert + offsetof).
constexpr uint64_t kOptionsV1Size = 320;
constexpr uint64_t kStatsV1Size = 112;
// sf_launch_info as first published (0.4), frozen the same way.
constexpr uint64_t kLaunchInfoV1Size = 4392;

constexpr double kDefaultBucketCapMb = 25.0;
constexpr double kDefaultFirstBucketCapMb = 1.0;
constexpr int64_t kDefaultTimeoutMs = 300000;
constexpr int32_t kDefaultMaxInflight = 4;
constexpr int32_t kMaxInflightLimit = 16;

// Fills `opts` (full size) with the defaults above; reads no environment.
void setDefaultOptions(sf_options& opts);

// Throws SF_ERR_INVALID_ARGUMENT naming `what` and the value when `mb` is
// not a positive, finite number of MiB that fits in bytes.
void validateCap(double mb, const char* what);

// Bytes of a cap given in MiB.
int64_t capBytes(double mb);

// The bucket cap of a sharded context whose cap was never chosen (since
// 0.5; before, only the Python binding applied it): the registered
// gradients' bytes over kShardedBuckets, within [1, kDefaultBucketCapMb]
// MiB. The last bucket's reduce-scatter, step and gather lie between the
// last backward and the next forward, so a small one keeps that short, and
// the first reduce-scatters start early in the backward (25 MiB, DDP's cap,
// left bench/torch2_bench.py's transformer 3 buckets and the wire idle
// through most of the last backward).
constexpr int kShardedBuckets = 8;
double shardedDefaultCapMb(int64_t gradientBytes);

}  // namespace sfsync
