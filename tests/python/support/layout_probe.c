/* Prints the C layout of sf_options, sf_stats, sf_store and sf_launch_info and the header's constants
 * as JSON, for test_binding.py to compare with the ctypes mirrors. */
#include <stddef.h>
#include <stdio.h>

#include "sfsync.h"

#define FIELD(T, f) printf("%s\"%s\": [%zu, %zu]", first ? "" : ", ", #f, offsetof(T, f), \
                           sizeof(((T*)0)->f)), first = 0

int main(void) {
  int first = 1;
  printf("{\"sf_options\": {\"size\": %zu, \"fields\": {", sizeof(sf_options));
  FIELD(sf_options, struct_size);
  FIELD(sf_options, rank);
  FIELD(sf_options, world_size);
  FIELD(sf_options, local_rank);
  FIELD(sf_options, backend);
  FIELD(sf_options, reduce_op);
  FIELD(sf_options, reserved0);
  FIELD(sf_options, prescale);
  FIELD(sf_options, bucket_cap_mb);
  FIELD(sf_options, first_bucket_cap_mb);
  FIELD(sf_options, timeout_ms);
  FIELD(sf_options, rendezvous);
  FIELD(sf_options, max_inflight);
  FIELD(sf_options, wire_dtype);
  FIELD(sf_options, shard_layout);
  FIELD(sf_options, reserved1);
  first = 1;
  printf("}}, \"sf_stats\": {\"size\": %zu, \"fields\": {", sizeof(sf_stats));
  FIELD(sf_stats, struct_size);
  FIELD(sf_stats, windows_begun);
  FIELD(sf_stats, windows_completed);
  FIELD(sf_stats, deferred_passes);
  FIELD(sf_stats, deferred_ready_calls);
  FIELD(sf_stats, collectives_issued);
  FIELD(sf_stats, early_launches);
  FIELD(sf_stats, bytes_reduced);
  FIELD(sf_stats, bucket_count);
  FIELD(sf_stats, largest_bucket_bytes);
  FIELD(sf_stats, smallest_bucket_bytes);
  FIELD(sf_stats, gradient_count);
  FIELD(sf_stats, gradient_bytes);
  FIELD(sf_stats, sync_ns_total);
  FIELD(sf_stats, reduce_scatters);
  FIELD(sf_stats, all_gathers);
  FIELD(sf_stats, bytes_gathered);
  FIELD(sf_stats, wire_allreduces);
  FIELD(sf_stats, wire_reduce_scatters);
  FIELD(sf_stats, wire_all_gathers);
  FIELD(sf_stats, wire_broadcasts);
  FIELD(sf_stats, wire_controls);
  FIELD(sf_stats, wire_bytes);
  FIELD(sf_stats, wire_gradient_bytes);
  FIELD(sf_stats, wire_parameter_bytes);
  FIELD(sf_stats, wire_mask_bytes);
  FIELD(sf_stats, wire_check_bytes);
  FIELD(sf_stats, wire_weight_bytes);
  FIELD(sf_stats, wire_host_bytes);
  first = 1;
  printf("}}, \"sf_store\": {\"size\": %zu, \"fields\": {", sizeof(sf_store));
  FIELD(sf_store, struct_size);
  FIELD(sf_store, user);
  FIELD(sf_store, set);
  FIELD(sf_store, get);
  first = 1;
  printf("}}, \"sf_launch_info\": {\"size\": %zu, \"fields\": {", sizeof(sf_launch_info));
  FIELD(sf_launch_info, struct_size);
  FIELD(sf_launch_info, rank);
  FIELD(sf_launch_info, world_size);
  FIELD(sf_launch_info, local_rank);
  FIELD(sf_launch_info, truncated);
  FIELD(sf_launch_info, launcher);
  FIELD(sf_launch_info, rank_vars);
  FIELD(sf_launch_info, rendezvous);
  FIELD(sf_launch_info, meeting);
  FIELD(sf_launch_info, error);
  FIELD(sf_launch_info, unmet);
  printf("}}, \"SF_ABI_VERSION\": %d, \"SF_VERSION_NUMBER\": %d}\n", SF_ABI_VERSION,
         SF_VERSION_NUMBER);
  return 0;
}
