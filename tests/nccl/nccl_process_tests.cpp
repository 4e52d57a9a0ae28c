// Ranks as real processes with CUDA gradients: the C program nccl_rank.c,
// started N times on the CUDA and NCCL stand-ins, meeting through file://
// (the NCCL unique id travels through Gloo's FileStore; the collectives
// through the stand-in's shared memory).

#include <boost/test/unit_test.hpp>

#include <map>
#include <string>
#include <vector>

#include "tests/support/processes.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

std::vector<ProcessResult> runRanks(int world, std::map<std::string, std::string> env) {
  env["SF_RENDEZVOUS"] = "file:///tmp/" + uniqueName("sfsync-nccl-proc");
  env["LD_LIBRARY_PATH"] = SF_STANDIN_LIB_DIR;
  std::vector<std::vector<std::string>> argv(size_t(world), std::vector<std::string>{SF_NCCL_RANK});
  return runProcesses(argv, env, 120);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(nccl_process_tests)

BOOST_AUTO_TEST_CASE(processes2_and_4_parity_and_counts) {
  for (int world : {2, 4}) {
    const auto results = runRanks(world, {{"SF_TIMEOUT_MS", "60000"}});
    for (int r = 0; r < world; ++r) {
      const ProcessResult& p = results[size_t(r)];
      BOOST_TEST(p.exitCode == 0, "world " << world << " rank " << r << ":\n" << p.output);
      const std::string prefix = "RESULT rank=" + std::to_string(r);
      BOOST_TEST(field(p.output, prefix, "ok") == "1", p.output);
      const int buckets = std::stoi("0" + field(p.output, prefix, "buckets"));
      BOOST_TEST(buckets >= 3, p.output);
      // 3 windows: one collective per bucket each, all launched by grad-ready.
      BOOST_TEST(field(p.output, prefix, "collectives") == std::to_string(3 * buckets), p.output);
      BOOST_TEST(field(p.output, prefix, "early") == std::to_string(3 * buckets), p.output);
    }
  }
}

BOOST_AUTO_TEST_CASE(processes2_peer_gone_is_an_error_not_a_hang) {
  // Rank 1 exits before window 1; rank 0's collective can never complete.
  std::map<std::string, std::string> env = {{"SF_TIMEOUT_MS", "2000"}};
  env["SF_RENDEZVOUS"] = "file:///tmp/" + uniqueName("sfsync-nccl-gone");
  env["LD_LIBRARY_PATH"] = SF_STANDIN_LIB_DIR;
  const std::vector<std::vector<std::string>> argv = {{SF_NCCL_RANK}, {"/bin/sh", "-c", "SF_TEST_STOP_AFTER_WINDOW=1 exec " SF_NCCL_RANK}};
  const auto results = runProcesses(argv, env, 60);
  BOOST_TEST(results[1].exitCode == 0, results[1].output);
  BOOST_TEST(!results[0].timedOut, results[0].output);
  BOOST_TEST(results[0].exitCode == 3, results[0].output);
  BOOST_TEST(field(results[0].output, "RESULT rank=0", "status") == "5", results[0].output);  // SF_ERR_TIMEOUT
  BOOST_TEST(results[0].output.find("the communicator was aborted") != std::string::npos, results[0].output);
}

BOOST_AUTO_TEST_SUITE_END()
