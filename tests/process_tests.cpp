// Ranks as real processes: the C trainer (samples/c) started by the
// launcher, or directly with the torchrun variables. Checks counts and parity
// from its RESULT lines, and that peers that die or disagree produce errors
// on the survivors, never a hang.

#include <boost/test/unit_test.hpp>

#include <signal.h>

#include <chrono>
#include <string>

#include "plugin/reducer/bucket_plan.h"
#include "tests/support/bounded.h"
#include "tests/support/processes.h"

using namespace sftest;

namespace {

// The trainer's default model: 6 blocks of 16 x 32 floats, a 96-float bias.
int64_t expectedBuckets(double capMb, double firstCapMb) {
  std::vector<sfsync::GradSpec> g(6, {16 * 32, SF_DTYPE_FLOAT32, SF_DEVICE_HOST});
  g.push_back({96, SF_DTYPE_FLOAT32, SF_DEVICE_HOST});
  return int64_t(sfsync::planBuckets(g, int64_t(capMb * 1048576), int64_t(firstCapMb * 1048576)).size());
}

std::vector<std::string> trainer(std::vector<std::string> args) {
  args.insert(args.begin(), SF_TRAINER);
  return args;
}

std::map<std::string, std::string> rendezvousEnv(int64_t timeoutMs) {
  return {{"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(freePort())},
          {"SF_TIMEOUT_MS", std::to_string(timeoutMs)}};
}

}  // namespace

BOOST_AUTO_TEST_SUITE(process_tests)

BOOST_AUTO_TEST_CASE(launcher_c_trainer_gloo_processes_world_2_and_4) {
  const int windows = 3;
  for (int world : {2, 4}) {
    for (bool many : {false, true}) {
      for (int n : {1, 2, 4, 8}) {
        BOOST_TEST_CONTEXT("world " << world << (many ? ", many buckets" : ", one bucket") << ", N = " << n) {
          std::vector<std::string> cmd = {SF_LAUNCHER, "-n", std::to_string(world), "--", SF_TRAINER,
                                          "--windows", std::to_string(windows), "--micro", std::to_string(n), "--quiet"};
          double cap = 25, first = 1;
          if (many) {
            cap = 0.004;
            first = 0.002;
            for (std::string a : {"--cap-mb", "0.004", "--first-cap-mb", "0.002", "--host-buffers"}) cmd.push_back(a);
          }
          const int64_t buckets = expectedBuckets(cap, first);
          BOOST_TEST((many ? buckets > 2 : buckets == 1));
          const ProcessResult res = runProcess(cmd, {}, 120);
          BOOST_TEST_REQUIRE(res.exitCode == 0, res.output);
          for (int r = 0; r < world; ++r) {
            const std::string prefix = "RESULT rank=" + std::to_string(r);
            BOOST_TEST(field(res.output, prefix, "buckets") == std::to_string(buckets));
            BOOST_TEST(field(res.output, prefix, "collectives") == std::to_string(buckets * windows));
            BOOST_TEST(field(res.output, prefix, "windows") == std::to_string(windows));
            BOOST_TEST(field(res.output, prefix, "deferred_passes") == std::to_string(windows * (n - 1)));
            const std::string diff = field(res.output, prefix, "max_abs_diff");
            BOOST_TEST_REQUIRE(!diff.empty(), res.output);
            BOOST_TEST(std::stod(diff) <= 1e-5);
          }
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(launcher_returns_the_first_failure) {
  const ProcessResult res = runProcess({SF_LAUNCHER, "-n", "2", "--", "sh", "-c", "exit $((RANK + 5))"}, {}, 30);
  BOOST_TEST((res.exitCode == 5 || res.exitCode == 6));
  const ProcessResult missing = runProcess({SF_LAUNCHER, "-n", "2", "--", "/nonexistent/binary"}, {}, 30);
  BOOST_TEST(missing.exitCode == 127);
  const ProcessResult usage = runProcess({SF_LAUNCHER, "--", "true"}, {}, 30);
  BOOST_TEST(usage.exitCode == 2);
  BOOST_TEST(usage.output.find("-n N") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(peer_killed_mid_window_gloo_processes) {
  const auto t0 = std::chrono::steady_clock::now();
  auto res = runProcesses({trainer({"--windows", "5", "--micro", "3", "--die-at-window", "2"}),
                           trainer({"--windows", "5", "--micro", "3", "--die-at-window", "2"})},
                          rendezvousEnv(10000), 90);
  BOOST_TEST(res[1].signal == SIGKILL);
  BOOST_TEST(!res[0].timedOut, "the survivor hung");
  BOOST_TEST(res[0].exitCode == 3, res[0].output);
  BOOST_TEST(res[0].output.find("sf_synchronize") != std::string::npos, res[0].output);
  BOOST_TEST((res[0].output.find("transport failed") != std::string::npos ||
              res[0].output.find("timed out") != std::string::npos),
             res[0].output);
  // Measured from outside: the start of both processes, then the timeout.
  expectWithin(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
               10.0 + kStartSeconds, "the survivor's error");
}

BOOST_AUTO_TEST_CASE(mismatched_layouts_gloo_processes) {
  auto res = runProcesses({trainer({"--blocks", "6"}), trainer({"--blocks", "5"})}, rendezvousEnv(20000), 90);
  for (int r = 0; r < 2; ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST(!res[size_t(r)].timedOut);
      BOOST_TEST(res[size_t(r)].exitCode == 3, res[size_t(r)].output);
      BOOST_TEST(res[size_t(r)].output.find("different gradient layouts") != std::string::npos,
                 res[size_t(r)].output);
    }
  }
}

BOOST_AUTO_TEST_CASE(a_rank_that_never_arrives_gloo_processes) {
  auto env = rendezvousEnv(1500);
  env["WORLD_SIZE"] = "2";
  env["RANK"] = "0";
  const auto t0 = std::chrono::steady_clock::now();
  const ProcessResult res = runProcess(trainer({"--windows", "1"}), env, 60);
  expectWithin(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
               1.5 + kStartSeconds, "rank 0's timeout");
  BOOST_TEST(!res.timedOut);
  BOOST_TEST(res.exitCode == 3, res.output);
  BOOST_TEST(res.output.find("timed out") != std::string::npos, res.output);
}

BOOST_AUTO_TEST_CASE(file_rendezvous_gloo_processes) {
  auto env = rendezvousEnv(20000);
  env["SF_RENDEZVOUS"] = "file:///tmp/sfsync-proc-" + std::to_string(::getpid());
  auto res = runProcesses({trainer({"--quiet"}), trainer({"--quiet"})}, env, 90);
  for (const auto& r : res) BOOST_TEST(r.exitCode == 0, r.output);
  std::system(("rm -rf /tmp/sfsync-proc-" + std::to_string(::getpid())).c_str());
}

BOOST_AUTO_TEST_SUITE_END()
