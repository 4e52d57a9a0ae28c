#include "plugin/core/options.h"

#include <algorithm>
#include <cstddef>
#include <cmath>
#include <cstring>
#include <sstream>

#include "plugin/core/error.h"

namespace sfsync {

// The version-1 layouts, frozen (see kOptionsV1Size): a change here breaks
// every binary built against 0.1.
static_assert(kOptionsV1Size == 320 && sizeof(sf_options) >= kOptionsV1Size, "sf_options v1");
static_assert(offsetof(sf_options, struct_size) == 0, "sf_options v1");
static_assert(offsetof(sf_options, rank) == 8, "sf_options v1");
static_assert(offsetof(sf_options, world_size) == 12, "sf_options v1");
static_assert(offsetof(sf_options, local_rank) == 16, "sf_options v1");
static_assert(offsetof(sf_options, backend) == 20, "sf_options v1");
static_assert(offsetof(sf_options, reduce_op) == 24, "sf_options v1");
static_assert(offsetof(sf_options, reserved0) == 28, "sf_options v1");
static_assert(offsetof(sf_options, prescale) == 32, "sf_options v1");
static_assert(offsetof(sf_options, bucket_cap_mb) == 40, "sf_options v1");
static_assert(offsetof(sf_options, first_bucket_cap_mb) == 48, "sf_options v1");
static_assert(offsetof(sf_options, timeout_ms) == 56, "sf_options v1");
static_assert(offsetof(sf_options, rendezvous) == 64 && SF_RENDEZVOUS_MAX == 256, "sf_options v1");
static_assert(kStatsV1Size == 112 && sizeof(sf_stats) >= kStatsV1Size, "sf_stats v1");
static_assert(offsetof(sf_stats, struct_size) == 0, "sf_stats v1");
static_assert(offsetof(sf_stats, windows_begun) == 8, "sf_stats v1");
static_assert(offsetof(sf_stats, windows_completed) == 16, "sf_stats v1");
static_assert(offsetof(sf_stats, deferred_passes) == 24, "sf_stats v1");
static_assert(offsetof(sf_stats, deferred_ready_calls) == 32, "sf_stats v1");
static_assert(offsetof(sf_stats, collectives_issued) == 40, "sf_stats v1");
static_assert(offsetof(sf_stats, early_launches) == 48, "sf_stats v1");
static_assert(offsetof(sf_stats, bytes_reduced) == 56, "sf_stats v1");
static_assert(offsetof(sf_stats, bucket_count) == 64, "sf_stats v1");
static_assert(offsetof(sf_stats, largest_bucket_bytes) == 72, "sf_stats v1");
static_assert(offsetof(sf_stats, smallest_bucket_bytes) == 80, "sf_stats v1");
static_assert(offsetof(sf_stats, gradient_count) == 88, "sf_stats v1");
static_assert(offsetof(sf_stats, gradient_bytes) == 96, "sf_stats v1");
static_assert(offsetof(sf_stats, sync_ns_total) == 104, "sf_stats v1");
// Fields appended since (0.2, 0.3): their offsets are frozen as well.
static_assert(offsetof(sf_options, max_inflight) == 320, "sf_options 0.2");
static_assert(offsetof(sf_options, wire_dtype) == 324, "sf_options 0.2");
static_assert(offsetof(sf_options, shard_layout) == 328, "sf_options 0.3");
static_assert(offsetof(sf_options, reserved1) == 332, "sf_options 0.3");
static_assert(sizeof(sf_options) == 336, "sf_options 0.3");
static_assert(offsetof(sf_stats, reduce_scatters) == 112, "sf_stats 0.3");
static_assert(offsetof(sf_stats, all_gathers) == 120, "sf_stats 0.3");
static_assert(offsetof(sf_stats, bytes_gathered) == 128, "sf_stats 0.3");
static_assert(offsetof(sf_stats, wire_allreduces) == 136, "sf_stats 0.5");
static_assert(offsetof(sf_stats, wire_controls) == 168, "sf_stats 0.5");
static_assert(offsetof(sf_stats, wire_bytes) == 176, "sf_stats 0.5");
static_assert(offsetof(sf_stats, wire_host_bytes) == 224, "sf_stats 0.5");
static_assert(sizeof(sf_stats) == 232, "sf_stats 0.5");
static_assert(sizeof(sf_launch_info) == kLaunchInfoV1Size, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, struct_size) == 0, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, rank) == 8, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, world_size) == 12, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, local_rank) == 16, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, truncated) == 20, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, launcher) == 24, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, rank_vars) == 40, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, rendezvous) == 1064, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, meeting) == 1320, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, error) == 2344, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, unmet) == 3368, "sf_launch_info 0.4");

void setDefaultOptions(sf_options& o) {
  std::memset(&o, 0, sizeof o);
  o.struct_size = sizeof o;
  o.rank = 0;
  o.world_size = 1;
  o.local_rank = 0;
  o.backend = SF_BACKEND_AUTO;
  o.reduce_op = SF_REDUCE_AVERAGE;
  o.prescale = 1.0;
  o.bucket_cap_mb = kDefaultBucketCapMb;
  o.first_bucket_cap_mb = kDefaultFirstBucketCapMb;
  o.timeout_ms = kDefaultTimeoutMs;
  o.max_inflight = kDefaultMaxInflight;
  o.wire_dtype = SF_DTYPE_FLOAT32;
  o.shard_layout = SF_SHARD_NONE;
}

void validateCap(double mb, const char* what) {
  if (!(mb > 0) || !std::isfinite(mb)) {
    std::ostringstream s;
    s << what << " = " << mb << " is invalid: it must be a positive, finite number of MiB";
    fail(SF_ERR_INVALID_ARGUMENT, s.str());
  }
  if (mb * 1048576.0 > 9.0e18) {
    std::ostringstream s;
    s << what << " = " << mb << " MiB is too large";
    fail(SF_ERR_INVALID_ARGUMENT, s.str());
  }
}

int64_t capBytes(double mb) {
  int64_t b = int64_t(mb * 1048576.0);
  return b < 1 ? 1 : b;
}

double shardedDefaultCapMb(int64_t gradientBytes) {
  // The same double arithmetic as the Python binding's 0.4 rule (bytes / 8 /
  // 2^20, every step exact below 2^53 bytes): the same buckets as before.
  const double mb = double(gradientBytes) / kShardedBuckets / 1048576.0;
  return std::min(kDefaultBucketCapMb, std::max(1.0, mb));
}

}  // namespace sfsync
