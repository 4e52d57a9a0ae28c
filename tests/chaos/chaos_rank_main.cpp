// sfsync-chaos-rank: runs one chaos session's rank(s) and prints one
// "CHAOS rank=..." line per rank. Started by sfsync-chaos.
//
//   sfsync-chaos-rank PLAN                     this process is rank $RANK (env rendezvous)
//   sfsync-chaos-rank PLAN --threads URL       every rank, as threads, on rendezvous URL
//
// Descriptors and threads are counted before the first sfsync call and after
// teardown (waiting up to a second for threads that are still exiting).

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "tests/chaos/chaos_rank.h"

namespace {

void settle(long fds, long tasks, long& fdAfter, long& tasksAfter) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  do {
    fdAfter = sfchaos::countFds();
    tasksAfter = sfchaos::countTasks();
    if (fdAfter <= fds && tasksAfter <= tasks) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < until);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && !(argc == 4 && std::string(argv[2]) == "--threads")) {
    std::fprintf(stderr, "usage: sfsync-chaos-rank PLAN [--threads RENDEZVOUS]\n");
    return 4;
  }
  sfchaos::Plan plan;
  try {
    plan = sfchaos::decode(argv[1]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sfsync-chaos-rank: %s\n", e.what());
    return 4;
  }
  const long fds = sfchaos::countFds(), tasks = sfchaos::countTasks();
  std::vector<sfchaos::Outcome> outs;
  if (argc == 2) {
    const char* r = std::getenv("RANK");
    outs.push_back(sfchaos::runRank(plan, r ? std::atoi(r) : 0, sfchaos::Mode::kProcess, ""));
  } else {
    outs.resize(size_t(plan.world));
    std::vector<std::thread> threads;
    for (int r = 0; r < plan.world; ++r) {
      threads.emplace_back([&, r] { outs[size_t(r)] = sfchaos::runRank(plan, r, sfchaos::Mode::kThread, argv[3]); });
    }
    for (auto& t : threads) t.join();
  }
  long fdAfter = -1, tasksAfter = -1;
  settle(fds, tasks, fdAfter, tasksAfter);
  for (auto& o : outs) {
    o.fdBefore = fds;
    o.tasksBefore = tasks;
    o.fdAfter = fdAfter;
    o.tasksAfter = tasksAfter;
    std::printf("%s\n", sfchaos::formatOutcome(o).c_str());
  }
  std::fflush(stdout);
  return 0;
}
