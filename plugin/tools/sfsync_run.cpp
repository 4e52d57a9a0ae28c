// sfsync-run: start N local ranks of a command with the torchrun variables
// set, prefix their output with the rank, and return the first failure.
//
//   sfsync-run -n 2 -- ./trainer --windows 5
//
// Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR and MASTER_PORT (a free port unless given), and SF_AUTH_TOKEN:
// a fresh random job token per launch (unless SF_AUTH_TOKEN or
// SF_AUTH_TOKEN_FILE is already set), so that rank 0's env:// store admits
// only these ranks. When a rank exits
// with a non-zero status or a signal, the others get SIGTERM (SIGKILL after a
// grace period) and sfsync-run exits with that first status (128 + signal).
//
//   sfsync-run --discover          (alone, or under mpirun / srun / sfsync-run)
//
// prints what sfsync discovers in this process's environment, from the
// library itself (sf_discover_launcher, the code behind sf_options_init): launcher, rank, world,
// local rank and meeting point, or the error sf_options_init / sf_create
// would give; exit status 0, or 2 for an error.

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/random.h>
#include <cerrno>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <cxxopts.hpp>

#include "plugin/core/env.h"
#include "plugin/launch/free_port.h"
#include "sfsync.h"

namespace {

volatile sig_atomic_t gSignal = 0;
void onSignal(int sig) { gSignal = sig; }

// MASTER_PORT, with MASTER_PORT + 1 free as well (the Python samples put
// torch.distributed there beside sfsync's env:// store).
int freePort() {
  const int port = sfsync::freeLoopbackPortPair();
  if (port < 0) {
    std::perror("sfsync-run: cannot find a free port");
    std::exit(2);
  }
  return port;
}

// 32 random bytes from the kernel, as hex: this launch's job token.
std::string randomToken() {
  unsigned char b[32];
  size_t got = 0;
  while (got < sizeof b) {
    ssize_t n = ::getrandom(b + got, sizeof b - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::perror("sfsync-run: getrandom");
      std::exit(2);
    }
    got += size_t(n);
  }
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : b) {
    out += hex[c >> 4];
    out += hex[c & 15];
  }
  return out;
}

bool envSet(const char* name) { return sfsync::envValue(name) != nullptr; }

// One child's output stream: bytes are cut into lines and prefixed.
struct Stream {
  int fd;
  int rank;
  FILE* out;
  std::string pending;
};

void emit(Stream& s, bool prefix, bool flushPartial) {
  size_t nl;
  while ((nl = s.pending.find('\n')) != std::string::npos || (flushPartial && !s.pending.empty())) {
    const size_t n = nl == std::string::npos ? s.pending.size() : nl + 1;
    if (prefix) std::fprintf(s.out, "[rank %d] ", s.rank);
    std::fwrite(s.pending.data(), 1, n, s.out);
    if (nl == std::string::npos) std::fputc('\n', s.out);
    s.pending.erase(0, n);
  }
  std::fflush(s.out);
}

// --discover: one line from the library's sf_discover_launcher (the code
// sf_options_init runs), the line sfsync.launch.describe() prints in Python.
int printDiscovery() {
  sf_launch_info l;
  if (sf_discover_launcher(&l, sizeof l, nullptr) != SF_OK) {
    std::fprintf(stderr, "sfsync-run: %s\n", sf_last_error());
    return 2;
  }
  std::printf("sfsync-run: launcher=%s rank=%d world=%d local_rank=%d", l.launcher, l.rank,
              l.world_size, l.local_rank);
  const char* error = l.error[0] ? l.error : l.unmet;
  if (error[0]) {
    std::printf(" ERROR: %s\n", error);
    return 2;
  }
  std::printf(" rendezvous=%s (%s)\n", l.rendezvous[0] ? l.rendezvous : "none",
              l.meeting[0] ? l.meeting : "a world of one meets nobody");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  cxxopts::Options options("sfsync-run", "Start N local ranks of a command with the torchrun "
                                         "environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)");
  options.custom_help("-n N [options]");
  options.positional_help("-- COMMAND [ARGS...]");
  options.add_options()
      ("n,nproc", "number of ranks to start", cxxopts::value<int>())
      ("master-addr", "MASTER_ADDR given to the ranks", cxxopts::value<std::string>()->default_value("127.0.0.1"))
      ("master-port", "MASTER_PORT (default: a free port)", cxxopts::value<int>())
      ("grace", "seconds between SIGTERM and SIGKILL for the other ranks after a failure", cxxopts::value<double>()->default_value("5"))
      ("no-prefix", "do not prefix output lines with the rank")
      ("discover", "print the launcher, rank, world, local rank and meeting point sfsync finds in this environment, and exit")
      ("h,help", "print this help");
  // The command after "--" is taken verbatim (cxxopts would split its
  // arguments at commas); only what comes before it is parsed.
  std::vector<std::string> command;
  int ownArgs = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--") == 0) {
      ownArgs = i;
      command.assign(argv + i + 1, argv + argc);
      break;
    }
  }
  cxxopts::ParseResult args;
  try {
    args = options.parse(ownArgs, argv);
  } catch (const std::exception& e) {
    std::cerr << "sfsync-run: " << e.what() << "\n" << options.help() << std::endl;
    return 2;
  }
  if (args.count("help")) {
    std::cout << options.help() << std::endl;
    return 0;
  }
  if (args.count("discover")) return printDiscovery();
  if (command.empty()) command = args.unmatched();  // "sfsync-run -n 2 cmd" without "--"
  if (!args.count("n") || command.empty()) {
    std::cerr << "sfsync-run: -n N and a command are required\n" << options.help() << std::endl;
    return 2;
  }
  const int n = args["n"].as<int>();
  if (n < 1 || n > 1024) {
    std::cerr << "sfsync-run: -n " << n << " is not in [1, 1024]" << std::endl;
    return 2;
  }
  const std::string addr = args["master-addr"].as<std::string>();
  const int port = args.count("master-port") ? args["master-port"].as<int>() : freePort();
  const double grace = args["grace"].as<double>();
  const bool prefix = !args.count("no-prefix");
  const std::string token =
      envSet("SF_AUTH_TOKEN") || envSet("SF_AUTH_TOKEN_FILE") ? "" : randomToken();

  struct sigaction sa{};
  sa.sa_handler = onSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  std::vector<pid_t> pids(size_t(n), -1);
  std::vector<Stream> streams;
  for (int r = 0; r < n; ++r) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      std::perror("sfsync-run: pipe");
      return 2;
    }
    pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("sfsync-run: fork");
      return 2;
    }
    if (pid == 0) {
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("GROUP_RANK", "0", 1);
      ::setenv("MASTER_ADDR", addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (!token.empty()) ::setenv("SF_AUTH_TOKEN", token.c_str(), 1);
      std::vector<char*> cargv;
      for (const auto& a : command) cargv.push_back(const_cast<char*>(a.c_str()));
      cargv.push_back(nullptr);
      ::execvp(cargv[0], cargv.data());
      std::fprintf(stderr, "sfsync-run: cannot run '%s': %s\n", cargv[0], std::strerror(errno));
      ::_exit(127);
    }
    pids[size_t(r)] = pid;
    ::close(out[1]);
    ::close(err[1]);
    streams.push_back({out[0], r, stdout, {}});
    streams.push_back({err[0], r, stderr, {}});
  }

  int firstFailure = 0;
  int running = n;
  bool terminating = false;
  auto killDeadline = std::chrono::steady_clock::time_point::max();
  auto terminateOthers = [&](int sig) {
    for (pid_t p : pids) {
      if (p > 0) ::kill(p, sig);
    }
  };

  while (running > 0 || !streams.empty()) {
    if (gSignal && !terminating) {
      terminating = true;
      if (!firstFailure) firstFailure = 128 + gSignal;
      terminateOthers(SIGTERM);
      killDeadline = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(int64_t(grace * 1000));
    }
    if (terminating && std::chrono::steady_clock::now() > killDeadline) {
      terminateOthers(SIGKILL);
      killDeadline = std::chrono::steady_clock::time_point::max();
    }
    std::vector<pollfd> fds;
    for (const auto& s : streams) fds.push_back({s.fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), 50);
    for (size_t i = fds.size(); i-- > 0;) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[65536];
      ssize_t got = ::read(fds[i].fd, buf, sizeof buf);
      if (got > 0) {
        streams[i].pending.append(buf, size_t(got));
        emit(streams[i], prefix, false);
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        emit(streams[i], prefix, true);
        ::close(streams[i].fd);
        streams.erase(streams.begin() + long(i));
      }
    }
    int status;
    pid_t done;
    while (running > 0 && (done = ::waitpid(-1, &status, WNOHANG)) > 0) {
      for (auto& p : pids) {
        if (p != done) continue;
        p = -1;
        --running;
        const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (code != 0 && !firstFailure) {
          firstFailure = code;
          std::fprintf(stderr, "sfsync-run: a rank exited with status %d; stopping the others\n",
                       code);
          terminating = true;
          terminateOthers(SIGTERM);
          killDeadline = std::chrono::steady_clock::now() +
                         std::chrono::milliseconds(int64_t(grace * 1000));
        }
      }
    }
  }
  return firstFailure;
}
