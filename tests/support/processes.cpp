#include "tests/support/processes.h"

#include "plugin/launch/free_port.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

namespace sftest {

std::vector<ProcessResult> runProcesses(const std::vector<std::vector<std::string>>& argv,
                                        const std::map<std::string, std::string>& env,
                                        double timeoutSeconds, bool setRankVariables) {
  const int world = int(argv.size());
  std::vector<pid_t> pids(argv.size(), -1);
  std::vector<std::string> logs(argv.size());
  for (int r = 0; r < world; ++r) {
    char path[] = "/tmp/sfsync-test-XXXXXX";
    int fd = ::mkstemp(path);
    logs[size_t(r)] = path;
    pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      for (const auto& kv : env) ::setenv(kv.first.c_str(), kv.second.c_str(), 1);
      if (setRankVariables) {
        ::setenv("RANK", std::to_string(r).c_str(), 1);
        ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
        ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      }
      std::vector<char*> args;
      for (const auto& a : argv[size_t(r)]) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      std::perror("exec");
      ::_exit(127);
    }
    ::close(fd);
    pids[size_t(r)] = pid;
  }
  std::vector<ProcessResult> results(argv.size());
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(timeoutSeconds * 1000));
  int running = world;
  while (running > 0) {
    bool progressed = false;
    for (int r = 0; r < world; ++r) {
      if (pids[size_t(r)] < 0) continue;
      int status = 0;
      if (::waitpid(pids[size_t(r)], &status, WNOHANG) == pids[size_t(r)]) {
        ProcessResult& res = results[size_t(r)];
        if (WIFEXITED(status)) res.exitCode = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) res.signal = WTERMSIG(status);
        pids[size_t(r)] = -1;
        --running;
        progressed = true;
      }
    }
    if (running > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < world; ++r) {
        if (pids[size_t(r)] < 0) continue;
        ::kill(pids[size_t(r)], SIGKILL);
        ::waitpid(pids[size_t(r)], nullptr, 0);
        results[size_t(r)].timedOut = true;
        results[size_t(r)].signal = SIGKILL;
        pids[size_t(r)] = -1;
      }
      running = 0;
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int r = 0; r < world; ++r) {
    std::ifstream in(logs[size_t(r)]);
    std::stringstream ss;
    ss << in.rdbuf();
    results[size_t(r)].output = ss.str();
    std::remove(logs[size_t(r)].c_str());
  }
  return results;
}

ProcessResult runProcess(const std::vector<std::string>& argv,
                         const std::map<std::string, std::string>& env, double timeoutSeconds) {
  return runProcesses({argv}, env, timeoutSeconds, false).front();
}

int freePort() { return sfsync::freeLoopbackPort(); }

std::string field(const std::string& text, const std::string& prefix, const std::string& key) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t at = line.find(prefix);
    if (at == std::string::npos) continue;
    std::istringstream words(line.substr(at));
    std::string word;
    while (words >> word) {
      if (word.compare(0, key.size() + 1, key + "=") == 0) return word.substr(key.size() + 1);
    }
    return "";
  }
  return "";
}

}  // namespace sftest
