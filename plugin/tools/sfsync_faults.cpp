// sfsync-faults: the rendezvous hang/fault matrix, run R rounds. For each
// case it prints the statuses seen and the worst time to error against
// timeout_ms, and exits non-zero if a round ended with another status or
// later than timeout_ms + slack.
//
//   sfsync-faults --rounds 50 --timeout-ms 1000
//
// Cases (real sockets, real Gloo, real processes where the case is about a
// process; a Redis that is silent is a socket that never answers):
//   silent-store     a socket on MASTER_PORT that accepts and never answers
//   stopped-rank0    rank 0's store in a SIGSTOPped child process
//   silent-redis     redis:// at a silent socket
//   refused-redis    redis:// where nothing listens
//   passive-dead     Gloo: this rank listens, the peer's address is dead
//   active-dead      Gloo: this rank connects to a dead address
//   active-wedged    Gloo: the peer's listening queue is full (stopped peer)
//   missing-rank     a rank that never arrives
//   memory-reuse     a memory:// name reused while its first job lives
//   two-claimants    two processes claim rank 1 of an env:// job
//   wrong-token      a client with another job's token

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <cxxopts.hpp>
#include <gloo/transport/tcp/address.h>

#include "plugin/backend/gloo_backend.h"
#include "plugin/tools/silent_listener.h"
#include "plugin/core/error.h"
#include "plugin/launch/launch_options.h"
#include "plugin/rendezvous/memory_store.h"
#include "plugin/rendezvous/redis_store.h"
#include "plugin/rendezvous/tcp_store.h"
#include "plugin/launch/free_port.h"

using namespace sfsync;
using std::chrono::milliseconds;

namespace {

using Listener = SilentListener;  // accepts into its queue, never answers

std::vector<char> glooAddress(const char* ip, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  ::inet_pton(AF_INET, ip, &a.sin_addr);
  return gloo::transport::tcp::Address(reinterpret_cast<sockaddr*>(&a), sizeof a).bytes();
}

sf_options rankOptions(int rank, int world, const std::string& url, int64_t timeoutMs) {
  sf_options o;
  optionsFromEnvironment(o);
  o.rank = rank;
  o.world_size = world;
  o.timeout_ms = timeoutMs;
  o.backend = SF_BACKEND_GLOO;
  std::snprintf(o.rendezvous, sizeof o.rendezvous, "%s", url.c_str());
  return o;
}

int unique = 0;
std::string uniqueName(const char* tag) {
  return std::string(tag) + "-" + std::to_string(::getpid()) + "-" + std::to_string(unique++);
}

struct Result {
  sf_status status = SF_OK;
  std::string message;
};

// Runs body, timing from `t0` to the error.
Result run(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return {e.status(), e.what()};
  } catch (const std::exception& e) {
    return {SF_ERR_INTERNAL, e.what()};
  }
  return {SF_OK, ""};
}

struct Case {
  const char* name;
  std::set<sf_status> expected;
  // Returns the outcome; sets *start to when the wait began (after set-up).
  std::function<Result(int64_t timeoutMs, std::chrono::steady_clock::time_point* start)> body;
};

const char* statusName(sf_status s) {
  switch (s) {
    case SF_OK: return "OK";
    case SF_ERR_MISMATCH: return "MISMATCH";
    case SF_ERR_BACKEND: return "BACKEND";
    case SF_ERR_TIMEOUT: return "TIMEOUT";
    case SF_ERR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case SF_ERR_INTERNAL: return "INTERNAL";
    default: return "OTHER";
  }
}

std::vector<Case> cases(const std::string& self) {
  using TP = std::chrono::steady_clock::time_point;
  auto now = [] { return std::chrono::steady_clock::now(); };
  std::vector<Case> c;
  c.push_back({"silent-store", {SF_ERR_TIMEOUT}, [=](int64_t t, TP* s) {
                 Listener silent;
                 *s = now();
                 return run([&] { TcpStore("127.0.0.1", silent.port, false, milliseconds(t), 1, 2).get("0"); });
               }});
  c.push_back({"stopped-rank0", {SF_ERR_TIMEOUT}, [=](int64_t t, TP* s) {
                 const int port = freeLoopbackPort();
                 pid_t pid = ::fork();
                 if (pid == 0) {
                   ::execl(self.c_str(), self.c_str(), "--serve", std::to_string(port).c_str(), (char*)nullptr);
                   ::_exit(127);
                 }
                 // Wait until rank 0 serves, then stop it.
                 for (int i = 0; i < 400; ++i) {
                   int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                   sockaddr_in a{};
                   a.sin_family = AF_INET;
                   a.sin_port = htons(uint16_t(port));
                   a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
                   const bool up = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
                   ::close(fd);
                   if (up) break;
                   std::this_thread::sleep_for(milliseconds(10));
                 }
                 ::kill(pid, SIGSTOP);
                 *s = now();
                 Result r = run([&] { TcpStore("127.0.0.1", port, false, milliseconds(t), 1, 2).get("0"); });
                 ::kill(pid, SIGKILL);
                 ::waitpid(pid, nullptr, 0);
                 return r;
               }});
  c.push_back({"silent-redis", {SF_ERR_TIMEOUT}, [=](int64_t t, TP* s) {
                 Listener silent;
                 *s = now();
                 return run([&] { RedisStore("127.0.0.1", silent.port, milliseconds(t)).get("k"); });
               }});
  c.push_back({"refused-redis", {SF_ERR_BACKEND}, [=](int64_t t, TP* s) {
                 const int port = freeLoopbackPort();
                 *s = now();
                 return run([&] { RedisStore("127.0.0.1", port, milliseconds(t)).get("k"); });
               }});
  c.push_back({"passive-dead", {SF_ERR_TIMEOUT}, [=](int64_t t, TP* s) {
                 const std::string name = uniqueName("passive");
                 auto store = MemoryStore::named(name);
                 store->set("sfsync/1", glooAddress("127.0.0.2", freeLoopbackPort()));
                 *s = now();
                 return run([&] { GlooBackend(rankOptions(0, 2, "memory://" + name, t)).connect(); });
               }});
  c.push_back({"active-dead", {SF_ERR_BACKEND}, [=](int64_t t, TP* s) {
                 ::setenv("SF_GLOO_HOSTNAME", "127.0.0.2", 1);
                 const std::string name = uniqueName("active");
                 auto store = MemoryStore::named(name);
                 store->set("sfsync/1", glooAddress("127.0.0.1", freeLoopbackPort()));
                 *s = now();
                 Result r = run([&] { GlooBackend(rankOptions(0, 2, "memory://" + name, t)).connect(); });
                 ::unsetenv("SF_GLOO_HOSTNAME");
                 return r;
               }});
  c.push_back({"active-wedged", {SF_ERR_TIMEOUT}, [=](int64_t t, TP* s) {
                 ::setenv("SF_GLOO_HOSTNAME", "127.0.0.2", 1);
                 Listener wedged("127.0.0.1", 0);
                 wedged.fillBacklog(4);
                 const std::string name = uniqueName("wedged");
                 auto store = MemoryStore::named(name);
                 store->set("sfsync/1", glooAddress("127.0.0.1", wedged.port));
                 *s = now();
                 Result r = run([&] { GlooBackend(rankOptions(0, 2, "memory://" + name, t)).connect(); });
                 ::unsetenv("SF_GLOO_HOSTNAME");
                 return r;
               }});
  c.push_back({"missing-rank", {SF_ERR_TIMEOUT}, [=](int64_t t, TP* s) {
                 *s = now();
                 return run([&] { GlooBackend(rankOptions(0, 2, "memory://" + uniqueName("missing"), t)).connect(); });
               }});
  c.push_back({"memory-reuse", {SF_ERR_MISMATCH}, [=](int64_t t, TP* s) {
                 const std::string url = "memory://" + uniqueName("reuse");
                 GlooBackend a(rankOptions(0, 2, url, t)), b(rankOptions(1, 2, url, t));
                 std::thread other([&] { b.connect(); });
                 a.connect();
                 other.join();
                 *s = now();
                 return run([&] { GlooBackend(rankOptions(0, 2, url, t)).connect(); });
               }});
  c.push_back({"two-claimants", {SF_ERR_MISMATCH}, [=](int64_t t, TP* s) {
                 const int port = freeLoopbackPort();
                 TcpStore rank0("127.0.0.1", port, true, milliseconds(t), 0, 2);
                 TcpStore first("127.0.0.1", port, false, milliseconds(t), 1, 2);
                 *s = now();
                 Result second = run([&] { TcpStore("127.0.0.1", port, false, milliseconds(t), 1, 2); });
                 Result waiting = run([&] { first.get("0"); });  // the first claimant learns it too
                 if (waiting.status != second.status) return waiting;
                 return second;
               }});
  c.push_back({"wrong-token", {SF_ERR_BACKEND}, [=](int64_t t, TP* s) {
                 const int port = freeLoopbackPort();
                 ::setenv("SF_AUTH_TOKEN", "the-job", 1);
                 TcpStore rank0("127.0.0.1", port, true, milliseconds(t), 0, 2);
                 ::setenv("SF_AUTH_TOKEN", "a-guess", 1);
                 *s = now();
                 Result r = run([&] { TcpStore("127.0.0.1", port, false, milliseconds(t), 1, 2); });
                 ::unsetenv("SF_AUTH_TOKEN");
                 return r;
               }});
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  cxxopts::Options options("sfsync-faults", "Run the rendezvous fault matrix and report the worst time to error");
  options.add_options()
      ("rounds", "rounds per case", cxxopts::value<int>()->default_value("5"))
      ("timeout-ms", "timeout_ms of every wait", cxxopts::value<int64_t>()->default_value("1000"))
      ("slack-ms", "allowed time past timeout_ms (docs/reliability.md)", cxxopts::value<int64_t>()->default_value("2000"))
      ("cases", "only these cases (comma-separated)", cxxopts::value<std::vector<std::string>>())
      ("serve", "internal: serve an env:// store on this port until killed", cxxopts::value<int>())
      ("h,help", "print this help");
  cxxopts::ParseResult args;
  try {
    args = options.parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "sfsync-faults: " << e.what() << "\n" << options.help() << std::endl;
    return 2;
  }
  if (args.count("help")) {
    std::cout << options.help() << std::endl;
    return 0;
  }
  if (args.count("serve")) {
    TcpStore server("127.0.0.1", args["serve"].as<int>(), true, milliseconds(60000), 0, 2);
    for (;;) ::pause();
  }
  ::setenv("SF_DEBUG", "NONE", 0);  // the rejected-client lines are expected here
  const int rounds = args["rounds"].as<int>();
  const int64_t timeoutMs = args["timeout-ms"].as<int64_t>();
  const double limit = double(timeoutMs + args["slack-ms"].as<int64_t>()) / 1000.0;
  if (rounds < 1 || timeoutMs < 1) {
    std::cerr << "sfsync-faults: --rounds and --timeout-ms must be positive" << std::endl;
    return 2;
  }
  std::set<std::string> only;
  if (args.count("cases")) {
    for (const auto& c : args["cases"].as<std::vector<std::string>>()) only.insert(c);
  }
  signal(SIGPIPE, SIG_IGN);
  bool ok = true;
  std::printf("%-14s %6s %-9s %-26s %9s %9s %10s %8s\n", "case", "rounds", "expect", "seen", "worst_s",
              "mean_s", "timeout_s", "worst/to");
  for (const Case& c : cases(argv[0])) {
    if (!only.empty() && !only.count(c.name)) continue;
    std::map<sf_status, int> seen;
    double worst = 0, sum = 0;
    std::string sample, unexpected;
    for (int r = 0; r < rounds; ++r) {
      auto start = std::chrono::steady_clock::now();
      const Result res = c.body(timeoutMs, &start);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      seen[res.status]++;
      worst = std::max(worst, s);
      sum += s;
      if (sample.empty()) sample = res.message;
      if (!c.expected.count(res.status) && unexpected.empty()) unexpected = res.message;
    }
    std::string seenText, expectText;
    for (auto& [st, n] : seen) seenText += std::string(seenText.empty() ? "" : ",") + statusName(st) + "x" + std::to_string(n);
    for (sf_status st : c.expected) expectText += std::string(expectText.empty() ? "" : ",") + statusName(st);
    const bool caseOk = unexpected.empty() && worst <= limit;
    ok = ok && caseOk;
    std::printf("%-14s %6d %-9s %-26s %9.3f %9.3f %10.3f %8.2f%s\n", c.name, rounds, expectText.c_str(),
                seenText.c_str(), worst, sum / rounds, timeoutMs / 1000.0, worst / (timeoutMs / 1000.0),
                caseOk ? "" : "  FAIL");
    std::printf("    e.g. %s\n", (unexpected.empty() ? sample : unexpected).substr(0, 220).c_str());
    std::fflush(stdout);
  }
  std::printf("%s: every case ended with its expected status within timeout + %.1f s slack\n",
              ok ? "PASS" : "FAIL", limit - timeoutMs / 1000.0);
  return ok ? 0 : 1;
}
