// sfsync-chaos: a randomized soak. Runs M sessions of 2-4 ranks (real
// processes, or threads of one process in the fast mode), each with one fault
// drawn at random (see chaos_plan.h), and judges each with one oracle:
// every surviving rank either completes with weights equal to the
// single-process reference, or fails with the status the fault calls for
// within timeout_ms + slack; no crash, no hang, no descriptor or thread left
// after teardown, no byte written outside the host's buffers.
//
//   sfsync-chaos --sessions 200 --mode mixed --seed 7
//   sfsync-chaos --replay 'seed=...,world=...' --mode process   (one session, verbose)
//
// Prints a table per fault kind and exits 1 on any session that is not passed.

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <cxxopts.hpp>

#include "plugin/launch/free_port.h"
#ifdef SF_CHAOS_STORE_PROTOCOL
#include "plugin/rendezvous/store_protocol.h"
#endif
#include "sfsync.h"
#include "tests/chaos/chaos_plan.h"
#include "tests/chaos/chaos_rank.h"

namespace {

using Clock = std::chrono::steady_clock;
using sfchaos::Fault;

// SIGINT/SIGTERM: start no new session, print the table, stop redis-server.
volatile std::sig_atomic_t gStop = 0;
void onStop(int) { gStop = 1; }
using sfchaos::Plan;
using sfchaos::Point;

enum Verdict { kPassed = 0, kWrong, kCrashed, kHung, kSlow, kLeak, kCorrupt, kVerdicts };
const char* const kVerdictNames[] = {"passed", "wrong", "crashed", "hung", "slow", "leak", "corrupt"};

struct Config {
  std::string rankProgram;
  std::vector<std::string> rendezvous;  // for process mode: env, file, redis
  std::string mode = "mixed";
  int64_t minTimeoutMs = 800, maxTimeoutMs = 2000, slackMs = 2000;
  int minWorld = 2, maxWorld = 4;
  std::set<int> faults;
  int redisPort = -1;
  bool verbose = false;
  bool stacks = false;  // gdb the hung processes
  std::string standin;  // directory of the NCCL/CUDA stand-ins: device sessions drawn too
  double ncclShare = 0.25;  // of the sessions, with the stand-ins
};

double msSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// ---- drawing a plan --------------------------------------------------------

Plan drawPlan(std::mt19937_64& rng, const Config& cfg, bool threads) {
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Plan p;
  p.seed = rng();
  p.world = uni(cfg.minWorld, cfg.maxWorld);
  const int windows = uni(2, 4);
  p.micro.clear();
  for (int w = 0; w < windows; ++w) p.micro.push_back(uni(1, 4));
  p.blocks = uni(1, 8);
  p.rows = uni(1, 16);
  p.in = uni(1, 24);
  p.batch = uni(1, 4);
  // Caps from "every gradient its own bucket" to "one bucket".
  static const double kCaps[] = {1e-6, 64.0 / 1048576, 512.0 / 1048576, 2048.0 / 1048576, 25};
  p.capMb = kCaps[uni(0, 4)];
  p.firstCapMb = kCaps[uni(0, 4)];
  p.flat = uni(0, 1) == 1;
  p.gradReady = uni(0, 3) != 0;
  p.reduceOp = uni(0, 1);
  p.timeoutMs = std::uniform_int_distribution<int64_t>(cfg.minTimeoutMs, cfg.maxTimeoutMs)(rng);
  std::vector<int> faults(cfg.faults.begin(), cfg.faults.end());
  if (threads) faults.erase(std::remove(faults.begin(), faults.end(), int(Fault::kStranger)), faults.end());
  p.fault = faults.empty() ? Fault::kNone : Fault(faults[size_t(uni(0, int(faults.size()) - 1))]);
  p.target = uni(0, p.world - 1);
  p.atWindow = uni(0, windows - 1);
  p.point = Point(uni(0, threads ? int(Point::kRandomCall) : int(Point::kTimer)));
  p.delayMs = uni(0, int(p.timeoutMs) * 3 / 2);
  p.callIndex = uni(0, 40);
  p.layout = sfchaos::LayoutDiff(uni(0, int(sfchaos::LayoutDiff::kNum) - 1));
  if ((p.fault == Fault::kKill || p.fault == Fault::kStop) && p.point == Point::kMidBucket) p.gradReady = true;
  if (!cfg.standin.empty() && std::uniform_real_distribution<double>(0, 1)(rng) < cfg.ncclShare) {
    p.cuda = true;
    p.flat = true;
  }
  if ((p.fault == Fault::kKill || p.fault == Fault::kStop) && p.point == Point::kTimer) {
    p.delayMs = uni(0, 1500);
  }
  // Out of step: not in the last window, so that a later synchronization exists to notice.
  // What the library can tell apart (windows of different lengths stay
  // legal): an extra synchronization is one with no grad-ready report since
  // the last, so the host must report; a skipped one either leaves reported
  // buckets in flight (the next zero/begin fails on that rank) or, without
  // reports, shows as two windows begun before one synchronization.
  if (p.fault == Fault::kExtraSync || p.fault == Fault::kMissingSync) p.atWindow = uni(0, windows - 2);
  if (p.fault == Fault::kExtraSync) p.gradReady = true;
  if (p.fault == Fault::kMissingSync && !p.gradReady) {
    p.micro[size_t(p.atWindow)] = std::max(2, p.micro[size_t(p.atWindow)]);
    p.micro[size_t(p.atWindow) + 1] = std::max(2, p.micro[size_t(p.atWindow) + 1]);
  }
  return p;
}

// ---- running a session -----------------------------------------------------

struct Child {
  pid_t pid = -1;
  std::string log;
  int exitCode = -1, signal = 0;
  bool killedByUs = false, hung = false;
  std::string output;
  std::string stacks;  // of a hung process: the sfsync frames of each waiting thread
};

// The sfsync and Gloo frames of every thread of a hung process (gdb), so that
// a hang report says where it waits.
std::string stacksOf(pid_t pid) {
  const std::string cmd = "timeout 30 gdb -batch -p " + std::to_string(pid) +
                          " -ex 'thread apply all bt 14' 2>/dev/null | grep -E '^Thread|sfsync::|gloo::' | "
                          "sed -E 's/ \\(.*\\) at / at /; s/^#[0-9]+ +(0x[0-9a-f]+ in )?/    /' | head -60";
  std::string out;
  if (FILE* f = ::popen(cmd.c_str(), "r")) {
    char buf[512];
    while (std::fgets(buf, sizeof buf, f)) out += buf;
    ::pclose(f);
  }
  return out;
}

pid_t spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            const std::string& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    if (fd > 2) ::close(fd);
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SF_RENDEZVOUS",
                          "SF_AUTH_TOKEN", "SF_AUTH_TOKEN_FILE",
                          "SF_TIMEOUT_MS", "SF_BUCKET_CAP_MB", "SF_FIRST_BUCKET_CAP_MB", "SF_REDUCE"}) {
      ::unsetenv(v);
    }
    for (const auto& kv : env) ::setenv(kv.first.c_str(), kv.second.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::perror("exec");
    ::_exit(127);
  }
  return pid;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

#ifdef SF_CHAOS_STORE_PROTOCOL
// A stranger that speaks the store's protocol without the job's token: it
// answers the hello with a made-up proof, then claims a rank, overwrites a
// rank's key and reads one. Returns true if the store admitted it (any 'K'
// after the hello): with SF_AUTH_TOKEN set it must refuse.
bool protocolStranger(int fd, std::mt19937_64& rng) {
  namespace sp = sfsync::store_protocol;
  timeval tv{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sp::FrameParser parser(1 << 20);
  auto next = [&](sp::Message& m) {
    for (;;) {
      const auto r = parser.next(m);
      if (r == sp::FrameParser::Result::kMessage) return true;
      if (r == sp::FrameParser::Result::kError) return false;
      char buf[4096];
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return false;
      parser.feed(buf, size_t(n));
    }
  };
  auto junk = [&](size_t n) {
    std::string b(n, 0);
    for (char& c : b) c = char(rng());
    return b;
  };
  sp::Message hello;
  if (!next(hello) || hello.type != 'H') return false;
  std::string out = sp::encode('A', {junk(sp::kNonceBytes), junk(sp::kMacBytes)}) +
                    sp::encode('C', {"1"}) + sp::encode('S', {"sfsync/1", "evil"}) +
                    sp::encode('G', {"sfsync/0"});
  (void)!::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
  sp::Message reply;
  while (next(reply)) {
    if (reply.type == 'K') return true;
  }
  return false;
}
#endif

// A stranger on the env:// store: connects after a while and sends garbage,
// holds the connection silently, connects and leaves many times, or (with a
// job token set) speaks the protocol without the token.
void stranger(int port, uint64_t seed, bool speaks, std::atomic<bool>& stop, std::atomic<bool>& admitted) {
  std::mt19937_64 rng(seed);
  std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 400));
  const int how = speaks ? 3 : int(rng() % 3);
  std::vector<int> fds;
  for (int i = 0; i < (how == 2 ? 50 : 1) && !stop; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
#ifdef SF_CHAOS_STORE_PROTOCOL
    if (how == 3 && protocolStranger(fd, rng)) admitted = true;
#endif
    if (how == 0) {
      std::vector<char> junk(size_t(1 + rng() % 256));
      for (char& c : junk) c = char(rng());
      (void)!::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    }
    if (how == 2) {
      ::close(fd);
    } else {
      fds.push_back(fd);
    }
  }
  while (!stop) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  for (int fd : fds) ::close(fd);
}

struct SessionResult {
  Verdict verdict = kPassed;
  std::string detail;
  double worstErrMs = 0;
  double seconds = 0;
};

struct Judge {
  const Plan& plan;
  const Config& cfg;
  SessionResult res;

  // Keeps the most severe verdict: crashed, hung, corrupt, wrong, slow, leak.
  void flag(Verdict v, const std::string& why) {
    static const int kSeverity[kVerdicts] = {0, 3, 6, 5, 2, 1, 4};
    if (kSeverity[v] > kSeverity[res.verdict]) {
      res.verdict = v;
      res.detail = why;
    }
  }

  bool mustComplete() const {
    switch (plan.fault) {
      case Fault::kNone:
      case Fault::kGarbage:
      case Fault::kStranger:
        return true;
      case Fault::kLate:
        return plan.delayMs < plan.timeoutMs / 2;
      default:
        return false;
    }
  }
  bool mustFail() const {
    return plan.fault == Fault::kLayout || plan.fault == Fault::kExtraSync || plan.fault == Fault::kMissingSync;
  }

  void rank(const sfchaos::Outcome& o, bool processMode) {
    const std::string who = "rank " + std::to_string(o.rank) + ": ";
    const double tol = plan.reduceOp == SF_REDUCE_SUM ? 1e-4 : 1e-5;
    if (o.faulted) return;  // thread-mode kill/stop target
    if (!o.guardsOk) flag(kCorrupt, who + "bytes around a host gradient buffer changed");
    if (!o.garbage.empty()) flag(kWrong, who + "garbage call " + o.garbage);
    (void)processMode;
    if (o.fdAfter > o.fdBefore) {
      flag(kLeak, who + "descriptors " + std::to_string(o.fdBefore) + " -> " + std::to_string(o.fdAfter));
    }
    // The CUDA runtime (here its stand-in) keeps its threads until exit.
    if (o.tasksAfter > o.tasksBefore && !plan.cuda) {
      flag(kLeak, who + "threads " + std::to_string(o.tasksBefore) + " -> " + std::to_string(o.tasksAfter));
    }
    if (o.completed) {
      if (!(o.maxDiff <= tol)) {
        flag(kWrong, who + "completed with weights " + std::to_string(o.maxDiff) + " from the reference");
      } else if (mustFail()) {
        flag(kWrong, who + "completed although the fault must fail every rank");
      }
      return;
    }
    const std::string st = sf_status_string(o.status);
    const std::string failed = who + o.call + " -> " + st + " after " + std::to_string(int(o.errMs)) +
                               " ms: " + o.error.substr(0, 300);
    if (mustComplete()) return flag(kWrong, failed);
    std::set<int> allowed;
    if (plan.fault == Fault::kMissingSync && plan.gradReady) {
      // The skipper finds its buckets in flight; the others lose it.
      allowed = o.rank == plan.target ? std::set<int>{SF_ERR_INVALID_STATE}
                                      : std::set<int>{SF_ERR_MISMATCH, SF_ERR_BACKEND, SF_ERR_TIMEOUT};
    } else if (mustFail()) {
      allowed = {SF_ERR_MISMATCH};
    } else {
      allowed = {SF_ERR_TIMEOUT, SF_ERR_BACKEND};
    }
    if (!allowed.count(o.status)) return flag(kWrong, failed);
    res.worstErrMs = std::max(res.worstErrMs, o.errMs);
    if (o.errMs > double(plan.timeoutMs + cfg.slackMs)) flag(kSlow, failed);
  }
};

std::string tempDir() {
  char dir[] = "/tmp/sfchaos-XXXXXX";
  if (!::mkdtemp(dir)) return "/tmp";
  return dir;
}

void removeTree(const std::string& dir) {
  const std::string cmd = "rm -rf '" + dir + "'";
  (void)!std::system(cmd.c_str());
}

SessionResult runSession(const Plan& plan, bool threads, const std::string& rdvKind, const Config& cfg) {
  const auto t0 = Clock::now();
  const std::string dir = tempDir();
  const std::string encoded = sfchaos::encode(plan);
  std::vector<Child> kids;
  std::map<std::string, std::string> env;
  int port = -1;
  bool speaks = false;  // the stranger speaks the store's protocol
  if (plan.cuda) {
    const char* old = std::getenv("LD_LIBRARY_PATH");
    env["LD_LIBRARY_PATH"] = cfg.standin + (old && *old ? std::string(":") + old : std::string());
    env["SF_STANDIN_DEVICES"] = "8";
  }
  if (threads) {
    kids.resize(1);
    kids[0].log = dir + "/threads.log";
    const std::string url = "memory://chaos-" + std::to_string(::getpid()) + "-" + std::to_string(plan.seed);
    kids[0].pid = spawn({cfg.rankProgram, encoded, "--threads", url}, env, kids[0].log);
  } else {
    env["WORLD_SIZE"] = std::to_string(plan.world);
    if (rdvKind == "env") {
#ifdef SF_CHAOS_STORE_PROTOCOL
      // Half the env:// sessions (every stranger session) with a job token.
      if (plan.fault == Fault::kStranger || plan.seed % 2 == 0) {
        env["SF_AUTH_TOKEN"] = "chaos-" + std::to_string(plan.seed * 2654435761u);
        speaks = plan.fault == Fault::kStranger && plan.seed % 4 < 2;
      }
#endif
      port = sfsync::freeLoopbackPort();
      env["SF_RENDEZVOUS"] = "env://";
      env["MASTER_ADDR"] = "127.0.0.1";
      env["MASTER_PORT"] = std::to_string(port);
    } else if (rdvKind == "file") {
      env["SF_RENDEZVOUS"] = "file://" + dir + "/store";
    } else {
      env["SF_RENDEZVOUS"] = "redis://127.0.0.1:" + std::to_string(cfg.redisPort) + "/chaos-" +
                             std::to_string(::getpid()) + "-" + std::to_string(plan.seed);
    }
    kids.resize(size_t(plan.world));
    for (int r = 0; r < plan.world; ++r) {
      env["RANK"] = env["LOCAL_RANK"] = std::to_string(r);
      kids[size_t(r)].log = dir + "/rank" + std::to_string(r) + ".log";
      kids[size_t(r)].pid = spawn({cfg.rankProgram, encoded}, env, kids[size_t(r)].log);
    }
  }
  std::atomic<bool> stopStranger{false}, admitted{false};
  std::thread strangerThread;
  if (plan.fault == Fault::kStranger && port > 0) {
    strangerThread = std::thread(stranger, port, plan.seed, speaks, std::ref(stopStranger), std::ref(admitted));
  }

  // Every wait a rank does ends within timeout + slack; a rank may wait at
  // most a few times (connect, collective, teardown) before it has failed.
  const double deadlineMs = 10000.0 + double(plan.delayMs) + 3.0 * double(plan.timeoutMs + cfg.slackMs);
  const bool faultStops = !threads && (plan.fault == Fault::kKill || plan.fault == Fault::kStop);
  for (;;) {
    bool othersDone = true, anyRunning = false;
    for (size_t i = 0; i < kids.size(); ++i) {
      Child& c = kids[i];
      if (c.pid < 0) continue;
      int status = 0;
      const pid_t got = ::waitpid(c.pid, &status, WNOHANG | WUNTRACED);
      if (got == c.pid && WIFSTOPPED(status)) {
        // Stopped (the fault): stays so until the others are done.
      } else if (got == c.pid) {
        if (WIFEXITED(status)) c.exitCode = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) c.signal = WTERMSIG(status);
        c.pid = -1;
        continue;
      }
      anyRunning = true;
      if (!(faultStops && int(i) == plan.target)) othersDone = false;
    }
    if (!anyRunning) break;
    const bool late = msSince(t0) > deadlineMs;
    if (othersDone || late) {
      for (size_t i = 0; i < kids.size(); ++i) {
        Child& c = kids[i];
        if (c.pid < 0) continue;
        c.hung = late && !(faultStops && int(i) == plan.target);
        if (c.hung && cfg.stacks) c.stacks = stacksOf(c.pid);
        ::kill(c.pid, SIGKILL);
        ::waitpid(c.pid, nullptr, 0);
        c.killedByUs = true;
        c.pid = -1;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stopStranger = true;
  if (strangerThread.joinable()) strangerThread.join();

  Judge judge{plan, cfg, {}};
  if (admitted) judge.flag(kWrong, "the env:// store admitted a stranger without the job token");
  for (size_t i = 0; i < kids.size(); ++i) {
    Child& c = kids[i];
    c.output = slurp(c.log);
    const bool target = !threads && int(i) == plan.target;
    const std::string who = threads ? "threads: " : "rank " + std::to_string(i) + ": ";
    if (c.hung) {
      judge.flag(kHung, who + "still running after " + std::to_string(int(deadlineMs)) + " ms");
      continue;
    }
    if (target && faultStops && (c.signal == SIGKILL || c.killedByUs)) continue;  // the fault itself
    if (c.signal != 0) {
      judge.flag(kCrashed, who + "died of signal " + std::to_string(c.signal) + " (" + strsignal(c.signal) + ")");
      continue;
    }
    std::istringstream lines(c.output);
    std::string line;
    int found = 0;
    while (std::getline(lines, line)) {
      sfchaos::Outcome o;
      if (!sfchaos::parseOutcome(line, o)) continue;
      ++found;
      judge.rank(o, !threads);
    }
    const int expected = threads ? plan.world : 1;
    if (c.exitCode != 0 || found != expected) {
      judge.flag(kCrashed, who + "exit code " + std::to_string(c.exitCode) + " with " + std::to_string(found) +
                               " result lines");
    }
  }
  SessionResult res = judge.res;
  res.seconds = msSince(t0) / 1000;
  if (res.verdict != kPassed || cfg.verbose) {
    std::ostringstream all;
    for (size_t i = 0; i < kids.size(); ++i) {
      all << "  --- " << (threads ? std::string("threads") : "rank " + std::to_string(i)) << " (exit "
          << kids[i].exitCode << ", signal " << kids[i].signal << ")\n";
      std::istringstream lines(kids[i].output);
      std::string line;
      int n = 0;
      while (std::getline(lines, line) && n++ < 30) all << "  " << line.substr(0, 400) << "\n";
      if (!kids[i].stacks.empty()) all << "  stacks:\n" << kids[i].stacks;
    }
    res.detail += "\n" + all.str();
  }
  removeTree(dir);
  return res;
}

struct Row {
  int sessions = 0;
  int count[kVerdicts] = {};
  double worstErrMs = 0, worstRatio = 0;
};

int startRedis(pid_t& pid) {
  const int port = sfsync::freeLoopbackPort();
  const std::string p = std::to_string(port);
  pid = spawn({"/usr/bin/redis-server", "--port", p, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"},
              {}, "/dev/null");
  for (int i = 0; i < 200; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    if (ok) return port;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  pid = -1;
  return -1;
}

std::string selfDir() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string s(buf, size_t(n));
  return s.substr(0, s.rfind('/'));
}

}  // namespace

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);
  ::signal(SIGINT, onStop);
  ::signal(SIGTERM, onStop);
  cxxopts::Options options("sfsync-chaos", "Randomized fault soak of sfsync sessions");
  options.add_options()
    ("sessions", "sessions to run", cxxopts::value<int>()->default_value("100"))
    ("seed", "random seed (0: from the clock)", cxxopts::value<uint64_t>()->default_value("0"))
    ("mode", "process | thread | mixed", cxxopts::value<std::string>()->default_value("mixed"))
    ("rendezvous", "process-mode stores: env,file,redis", cxxopts::value<std::string>()->default_value("env,file,redis"))
    ("faults", "fault kinds to draw (comma list, or all)", cxxopts::value<std::string>()->default_value("all"))
    ("min-timeout-ms", "smallest timeout_ms drawn", cxxopts::value<int64_t>()->default_value("800"))
    ("max-timeout-ms", "largest timeout_ms drawn", cxxopts::value<int64_t>()->default_value("2000"))
    ("slack-ms", "allowed time past timeout_ms for an error", cxxopts::value<int64_t>()->default_value("2000"))
    ("max-world", "largest world size", cxxopts::value<int>()->default_value("4"))
    ("budget-s", "start no session after this many seconds (0: no limit)", cxxopts::value<double>()->default_value("0"))
    ("rank-program", "the rank program", cxxopts::value<std::string>()->default_value(""))
    ("replay", "run this one plan (from a failure report)", cxxopts::value<std::string>()->default_value(""))
    ("replay-store", "rendezvous of the replayed session: env|file|redis|memory", cxxopts::value<std::string>()->default_value("env"))
    ("show", "failed sessions to print in full", cxxopts::value<int>()->default_value("5"))
    ("stacks", "print the stacks of hung ranks (gdb)")
    ("nccl-share", "share of the sessions on device gradients with --nccl-standin", cxxopts::value<double>()->default_value("0.25"))
    ("nccl-standin", "directory of the stand-in libnccl.so.2/libcudart.so.13: --nccl-share of the sessions use device gradients over NCCL", cxxopts::value<std::string>()->default_value(""))
    ("v,verbose", "print every session")
    ("h,help", "this help");
  cxxopts::ParseResult args;
  try {
    args = options.parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sfsync-chaos: %s\n", e.what());
    return 4;
  }
  if (args.count("help")) {
    std::printf("%s\n", options.help().c_str());
    return 0;
  }
  Config cfg;
  cfg.rankProgram = args["rank-program"].as<std::string>();
  if (cfg.rankProgram.empty()) cfg.rankProgram = selfDir() + "/sfsync-chaos-rank";
  cfg.mode = args["mode"].as<std::string>();
  cfg.minTimeoutMs = args["min-timeout-ms"].as<int64_t>();
  cfg.maxTimeoutMs = std::max(cfg.minTimeoutMs, args["max-timeout-ms"].as<int64_t>());
  cfg.slackMs = args["slack-ms"].as<int64_t>();
  cfg.maxWorld = std::max(2, args["max-world"].as<int>());
  cfg.verbose = args.count("verbose") > 0;
  cfg.stacks = args.count("stacks") > 0 && ::access("/usr/bin/gdb", X_OK) == 0;
  cfg.standin = args["nccl-standin"].as<std::string>();
  cfg.ncclShare = args["nccl-share"].as<double>();
  {
    std::istringstream in(args["rendezvous"].as<std::string>());
    std::string item;
    while (std::getline(in, item, ',')) cfg.rendezvous.push_back(item);
  }
  {
    const std::string f = args["faults"].as<std::string>();
    std::istringstream in(f);
    std::string item;
    while (std::getline(in, item, ',')) {
      for (int k = 0; k < int(Fault::kCount); ++k) {
        if (item == "all" || item == sfchaos::faultName(Fault(k))) cfg.faults.insert(k);
      }
    }
    if (cfg.faults.empty()) {
      std::fprintf(stderr, "sfsync-chaos: --faults '%s' names no fault kind\n", f.c_str());
      return 4;
    }
  }
  if (cfg.mode != "process" && cfg.mode != "thread" && cfg.mode != "mixed") {
    std::fprintf(stderr, "sfsync-chaos: --mode '%s' is not process, thread or mixed\n", cfg.mode.c_str());
    return 4;
  }
  pid_t redisPid = -1;
  bool wantRedis = false;
  for (const auto& r : cfg.rendezvous) wantRedis = wantRedis || r == "redis";
  if (wantRedis && cfg.mode != "thread") {
    if (::access("/usr/bin/redis-server", X_OK) == 0) cfg.redisPort = startRedis(redisPid);
    if (cfg.redisPort < 0) {
      const char* ci = std::getenv("CI");
      if (ci && std::string(ci) == "true") {  // CI must run every store the README promises
        std::fprintf(stderr, "sfsync-chaos: FAIL (CI=true): no redis-server (/usr/bin/redis-server): "
                             "the redis:// sessions cannot run\n");
        return 1;
      }
      std::fprintf(stderr, "sfsync-chaos: no redis-server: redis:// sessions left out\n");
      cfg.rendezvous.erase(std::remove(cfg.rendezvous.begin(), cfg.rendezvous.end(), "redis"), cfg.rendezvous.end());
    }
  }
  if (cfg.rendezvous.empty()) cfg.rendezvous.push_back("env");

  uint64_t seed = args["seed"].as<uint64_t>();
  if (seed == 0) seed = uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
  std::mt19937_64 rng(seed);
  const int sessions = args["sessions"].as<int>();
  const double budget = args["budget-s"].as<double>();
  int show = args["show"].as<int>();
  const std::string replay = args["replay"].as<std::string>();

  std::map<std::string, Row> table;
  Row total;
  const auto start = Clock::now();
  int ran = 0;
  std::printf("sfsync-chaos: seed %llu, %d sessions, mode %s, timeout %lld-%lld ms, slack %lld ms\n",
              (unsigned long long)seed, replay.empty() ? sessions : 1, cfg.mode.c_str(), (long long)cfg.minTimeoutMs,
              (long long)cfg.maxTimeoutMs, (long long)cfg.slackMs);
  std::fflush(stdout);
  for (int s = 0; s < (replay.empty() ? sessions : 1); ++s) {
    if (budget > 0 && msSince(start) / 1000 > budget) break;
    if (gStop) {
      std::printf("sfsync-chaos: stopped by a signal after %d sessions\n", ran);
      break;
    }
    bool threads = cfg.mode == "thread" || (cfg.mode == "mixed" && rng() % 2 == 0);
    Plan plan;
    std::string store;
    if (!replay.empty()) {
      try {
        plan = sfchaos::decode(replay);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "sfsync-chaos: --replay: %s\n", e.what());
        return 4;
      }
      store = args["replay-store"].as<std::string>();
      threads = store == "memory";
      cfg.verbose = true;
    } else {
      plan = drawPlan(rng, cfg, threads);
      store = threads ? "memory" : cfg.rendezvous[rng() % cfg.rendezvous.size()];
      if (plan.fault == Fault::kStranger && store != "env") store = "env";
    }
    const SessionResult res = runSession(plan, threads, store, cfg);
    ++ran;
    if (ran % 100 == 0 && replay.empty()) {
      std::printf("sfsync-chaos: %d sessions, %d passed, %.0f s\n", ran,
                  total.count[kPassed] + (res.verdict == kPassed ? 1 : 0), msSince(start) / 1000);
      std::fflush(stdout);
    }
    const std::string kind = plan.kind();
    for (Row* row : {&table[kind], &total}) {
      row->sessions++;
      row->count[res.verdict]++;
      row->worstErrMs = std::max(row->worstErrMs, res.worstErrMs);
      row->worstRatio = std::max(row->worstRatio, res.worstErrMs / double(plan.timeoutMs));
    }
    if (res.verdict != kPassed || cfg.verbose) {
      if (show-- > 0 || cfg.verbose) {
        std::printf("session %d: %s (%s, %s, %s): %s\n  replay: --replay '%s' --replay-store %s\n", s,
                    kVerdictNames[res.verdict], kind.c_str(), threads ? "threads" : "processes", store.c_str(),
                    res.detail.c_str(), sfchaos::encode(plan).c_str(), store.c_str());
      } else {
        std::printf("session %d: %s (%s, %s): %s\n", s, kVerdictNames[res.verdict], kind.c_str(), store.c_str(),
                    res.detail.substr(0, res.detail.find('\n')).c_str());
      }
      std::fflush(stdout);
    }
  }
  if (redisPid > 0) {
    ::kill(redisPid, SIGTERM);
    ::waitpid(redisPid, nullptr, 0);
  }

  std::printf("\n%-22s %8s %7s %6s %8s %5s %5s %5s %8s %13s %11s\n", "fault", "sessions", "passed", "wrong",
              "crashed", "hung", "slow", "leak", "corrupt", "worst_err_ms", "err/timeout");
  auto print = [](const std::string& name, const Row& r) {
    std::printf("%-22s %8d %7d %6d %8d %5d %5d %5d %8d %13.0f %11.2f\n", name.c_str(), r.sessions, r.count[kPassed],
                r.count[kWrong], r.count[kCrashed], r.count[kHung], r.count[kSlow], r.count[kLeak],
                r.count[kCorrupt], r.worstErrMs, r.worstRatio);
  };
  for (const auto& kv : table) print(kv.first, kv.second);
  print("TOTAL", total);
  std::printf("sfsync-chaos: %d sessions in %.0f s\n", ran, msSince(start) / 1000);
  return total.count[kPassed] == total.sessions ? 0 : 1;
}
