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

// What the kernel counted for each rank of a launched trainer run: the
// bytes passed to write/writev (wchar, sockets included) from
// /proc/<pid>/io. Each rank runs under a shell that prints the line
// "IO rank=R rchar=... wchar=..." after the trainer ended: the shell's
// counters then hold its reaped child's (the kernel adds a reaped child's
// I/O to its parent's, kernel/exit.c), and the shell itself writes nothing
// before. Gloo's TCP pairs send with writev; their receives do not reach
// rchar (measured: 0 bytes per window), so only sends are counted.
struct KernelIo {
  int64_t wchar = 0;
};

std::vector<KernelIo> trainerIo(int world, int windows, const std::vector<std::string>& args) {
  std::vector<std::string> cmd = {SF_LAUNCHER, "-n", std::to_string(world), "--", "/bin/sh", "-c",
                                  "\"$@\"; rc=$?; echo \"IO rank=$RANK\" $(sed 's/: /=/' /proc/$$/io); exit $rc",
                                  "sh", SF_TRAINER, "--windows", std::to_string(windows), "--quiet"};
  cmd.insert(cmd.end(), args.begin(), args.end());
  const ProcessResult res = runProcess(cmd, {}, 120);
  BOOST_TEST_REQUIRE(res.exitCode == 0, res.output);
  std::vector<KernelIo> io(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const std::string prefix = "IO rank=" + std::to_string(r);
    const std::string w = field(res.output, prefix, "wchar");
    BOOST_TEST_REQUIRE(!w.empty(), res.output);
    io[size_t(r)] = {std::stoll(w)};
  }
  return io;
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

BOOST_AUTO_TEST_CASE(kernel_counted_bytes_per_window_are_one_all_reduce_gloo_processes) {
  // An oracle the product does not supply: the bytes each rank's process
  // wrote to its sockets per window, as the kernel counts them, against
  // the gradient bytes G computed here from the model's shape.
  // Per window = (run of 5 windows - run of 1 window) / 4: the difference
  // removes all that does not scale with windows (loading libraries, the
  // env:// store, Gloo's connections, the layout check, the RESULT line,
  // teardown), so what remains is what the windows cost.
  // Bounds per rank per window, N ranks, float32 on the wire:
  //   >= G: every element of a rank's gradient must leave it at least once
  //         (rules out "sent nothing" and "sent part of it");
  //   <= 1.3 * 2 (N - 1) / N * G: a bandwidth-optimal all-reduce (ring)
  //         sends 2 (N - 1) / N * G per rank (G for 2 ranks), plus 30 % for
  //         framing. One more all-reduce of the bucket per window is 2x.
  const int blocks = 8, rows = 64, in = 256;
  const int64_t gradBytes = int64_t(blocks * rows * in + rows * blocks) * 4;
  const std::vector<std::string> model = {"--blocks", std::to_string(blocks), "--rows",
                                          std::to_string(rows), "--in", std::to_string(in),
                                          "--micro", "2", "--batch", "1"};
  struct Case {
    int world;
    std::vector<std::string> caps;
  };
  const std::vector<Case> cases = {{2, {}}, {4, {}}, {2, {"--cap-mb", "0.25", "--first-cap-mb", "0.1"}}};
  for (const auto& c : cases) {
    BOOST_TEST_CONTEXT("world " << c.world << (c.caps.empty() ? ", one bucket" : ", 3 buckets")) {
      std::vector<std::string> args = model;
      args.insert(args.end(), c.caps.begin(), c.caps.end());
      const auto one = trainerIo(c.world, 1, args);
      const auto five = trainerIo(c.world, 5, args);
      const double upper = 1.3 * 2.0 * (c.world - 1) / c.world * double(gradBytes);
      for (int r = 0; r < c.world; ++r) {
        const double sent = double(five[size_t(r)].wchar - one[size_t(r)].wchar) / 4;
        BOOST_TEST_MESSAGE("rank " << r << ": sent " << sent << " bytes per window; G = " << gradBytes
                                   << ", bounds [" << gradBytes << ", " << upper << "]");
        BOOST_TEST(sent >= double(gradBytes), "rank " << r << " sent " << sent << " bytes per window");
        BOOST_TEST(sent <= upper, "rank " << r << " sent " << sent << " bytes per window");
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
