// The Boost.Test module of the shim's decision logic (shim/policy/):
// reduce_probe_tests, pass_tracker_tests, shim_policy_tests. One case runs
// alone with e.g. --run_test=pass_tracker_tests/learns_across_ddp_bucket_rebuild.
#define BOOST_TEST_MODULE sfsync_shim_tests
#include <boost/test/unit_test.hpp>
