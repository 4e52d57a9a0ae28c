#pragma once
// Ranks as real processes: fork + exec with an environment, output captured,
// bounded by a deadline (a test never hangs on a stuck child).

#include <map>
#include <string>
#include <vector>

namespace sftest {

struct ProcessResult {
  int exitCode = -1;  // valid when signal == 0
  int signal = 0;     // the terminating signal, if any
  bool timedOut = false;
  std::string output;  // stdout and stderr together
};

// Runs argv[rank] for each rank at once with `env` added to this process's
// environment plus RANK, WORLD_SIZE, LOCAL_RANK; waits for all, killing any
// still running after timeoutSeconds.
std::vector<ProcessResult> runProcesses(const std::vector<std::vector<std::string>>& argv,
                                        const std::map<std::string, std::string>& env,
                                        double timeoutSeconds, bool setRankVariables = true);

// One command, same rules.
ProcessResult runProcess(const std::vector<std::string>& argv,
                         const std::map<std::string, std::string>& env, double timeoutSeconds);

// A TCP port that was free a moment ago on 127.0.0.1.
int freePort();

// The value of `key=` in the first line of `text` that starts with `prefix`
// (e.g. "RESULT rank=0"); "" if absent.
std::string field(const std::string& text, const std::string& prefix, const std::string& key);

}  // namespace sftest
