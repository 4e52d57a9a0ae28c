// Rendezvous faults with ranks as real processes (the C trainer): a
// SIGSTOPped rank 0, a peer stopped while the job meets, two processes that
// claim the same rank. Every surviving rank ends with an error within
// timeout_ms + slack, never a hang.

#include <boost/test/unit_test.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "tests/support/bounded.h"
#include "tests/support/processes.h"

using namespace sftest;

namespace {

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Starts the trainer as one rank in the background.
pid_t spawnRank(int rank, int world, int port, int64_t timeoutMs, const std::string& windows) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    ::setenv("SF_TIMEOUT_MS", std::to_string(timeoutMs).c_str(), 1);
    int devnull = ::open("/dev/null", O_WRONLY);
    ::dup2(devnull, 1);
    ::dup2(devnull, 2);
    // Many long windows: still running when the test stops a peer.
    ::execl(SF_TRAINER, SF_TRAINER, "--windows", windows.c_str(), "--micro", "4", "--batch", "64",
            "--quiet", (char*)nullptr);
    ::_exit(127);
  }
  return pid;
}

bool portAccepts(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

void killAndReap(pid_t pid) {
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

std::vector<std::string> asRank(int rank, int world) {
  return {"env", "RANK=" + std::to_string(rank), "LOCAL_RANK=" + std::to_string(rank),
          "WORLD_SIZE=" + std::to_string(world), SF_TRAINER, "--windows", "2", "--quiet"};
}

}  // namespace

BOOST_AUTO_TEST_SUITE(store_process_tests)

BOOST_AUTO_TEST_CASE(sigstopped_rank0_times_out_the_others_gloo_processes) {
  const int port = freePort();
  const pid_t rank0 = spawnRank(0, 2, port, 60000, "1");
  bool up = false;
  for (int i = 0; i < 200 && !up; ++i) {
    up = portAccepts(port);
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  BOOST_TEST_REQUIRE(up, "rank 0 never listened");
  ::kill(rank0, SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  const ProcessResult r1 = runProcess({SF_TRAINER, "--windows", "1"},
                                      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                       {"MASTER_PORT", std::to_string(port)}, {"SF_TIMEOUT_MS", "2000"}},
                                      30);
  const double seconds = since(t0);
  killAndReap(rank0);
  BOOST_TEST(!r1.timedOut, "rank 1 hung on a stopped rank 0");
  BOOST_TEST(r1.exitCode == 3, r1.output);
  BOOST_TEST(r1.output.find("timed out") != std::string::npos, r1.output);
  BOOST_TEST(r1.output.find("127.0.0.1:" + std::to_string(port)) != std::string::npos, r1.output);
  BOOST_TEST(seconds <= 2.0 + kSlackSeconds + kStartSeconds, "error after " << seconds << " s");
}

BOOST_AUTO_TEST_CASE(peer_stopped_while_the_job_meets_gloo_processes) {
  // Rank 1 is stopped at some point of its set-up or first windows (store,
  // pair connect or collective, whichever it reached): rank 0 ends within
  // the timeout after the stop, whatever the stage.
  for (int delayMs : {30, 150}) {
    BOOST_TEST_CONTEXT("rank 1 stopped after " << delayMs << " ms") {
      const int port = freePort();
      const auto start = std::chrono::steady_clock::now();
      const pid_t rank0 = spawnRank(0, 2, port, 2000, "256");
      const pid_t rank1 = spawnRank(1, 2, port, 2000, "256");
      std::this_thread::sleep_for(std::chrono::milliseconds(delayMs));
      ::kill(rank1, SIGSTOP);
      const auto stopped = std::chrono::steady_clock::now();
      int status = 0;
      bool done = false;
      while (!done && since(stopped) < 30) {
        done = ::waitpid(rank0, &status, WNOHANG) == rank0;
        if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      const double seconds = since(stopped);
      if (!done) killAndReap(rank0);
      killAndReap(rank1);
      BOOST_TEST(done, "rank 0 hung on a stopped peer");
      BOOST_TEST((WIFEXITED(status) && WEXITSTATUS(status) == 3), "rank 0 status " << status);
      // From the stop, or from the start if rank 0 was still loading.
      BOOST_TEST(std::min(seconds, since(start)) <= 2.0 + kSlackSeconds + kStartSeconds,
                 "rank 0 failed " << seconds << " s after the stop");
    }
  }
}

BOOST_AUTO_TEST_CASE(two_claimants_for_a_rank_fail_every_rank_gloo_processes) {
  // World 3: rank 0 and two processes that both say RANK=1 start together;
  // rank 2 starts only once they have ended, so the job cannot have met
  // before both claims (an event, not a sleep). Rank 0 and both claimants
  // fail with SF_ERR_MISMATCH naming rank 1, long before the timeout (also
  // the claimant already connecting its pairs: the store pushes the
  // verdict). Rank 2 then finds the job gone (rank 0 exited with its store)
  // and fails too, within its timeout.
  const int64_t timeoutMs = 6000;
  const std::map<std::string, std::string> env = {{"MASTER_ADDR", "127.0.0.1"},
                                                  {"MASTER_PORT", std::to_string(freePort())},
                                                  {"SF_TIMEOUT_MS", std::to_string(timeoutMs)}};
  auto t0 = std::chrono::steady_clock::now();
  auto res = runProcesses({asRank(0, 3), asRank(1, 3), asRank(1, 3)}, env, 60, false);
  const double claimsSeconds = since(t0);
  for (size_t i = 0; i < 3; ++i) {
    BOOST_TEST_CONTEXT("process " << i) {
      BOOST_TEST(!res[i].timedOut);
      BOOST_TEST(res[i].exitCode == 3, res[i].output);
      BOOST_TEST(res[i].output.find("ranks disagree") != std::string::npos, res[i].output);
      BOOST_TEST(res[i].output.find("rank 1 was claimed") != std::string::npos, res[i].output);
      BOOST_TEST(res[i].output.find("timed out") == std::string::npos, res[i].output);
    }
  }
  // The verdict does not wait for the timeout.
  BOOST_TEST(claimsSeconds < timeoutMs / 1000.0, "took " << claimsSeconds << " s");
  t0 = std::chrono::steady_clock::now();
  const ProcessResult late = runProcesses({asRank(2, 3)}, env, 60, false)[0];
  BOOST_TEST(!late.timedOut);
  BOOST_TEST(late.exitCode == 3, late.output);
  expectWithin(since(t0), timeoutMs / 1000.0 + kStartSeconds, "rank 2's error");
}

BOOST_AUTO_TEST_CASE(launcher_gives_its_ranks_a_fresh_job_token) {
  auto tokens = [] {
    const ProcessResult r = runProcess({SF_LAUNCHER, "-n", "2", "--no-prefix", "--", "sh", "-c",
                                        "echo TOKEN rank=$RANK token=$SF_AUTH_TOKEN"},
                                       {}, 30);
    BOOST_TEST(r.exitCode == 0, r.output);
    return std::make_pair(field(r.output, "TOKEN rank=0", "token"), field(r.output, "TOKEN rank=1", "token"));
  };
  const auto first = tokens(), second = tokens();
  BOOST_TEST(first.first.size() == 64u, first.first);
  BOOST_TEST(first.first == first.second);    // one token per job
  BOOST_TEST(first.first != second.first);    // a new one per launch
  // A token the user set is kept.
  const ProcessResult own = runProcess({SF_LAUNCHER, "-n", "1", "--no-prefix", "--", "sh", "-c",
                                        "echo TOKEN rank=$RANK token=$SF_AUTH_TOKEN"},
                                       {{"SF_AUTH_TOKEN", "mine"}}, 30);
  BOOST_TEST(field(own.output, "TOKEN rank=0", "token") == "mine", own.output);
}

BOOST_AUTO_TEST_SUITE_END()
