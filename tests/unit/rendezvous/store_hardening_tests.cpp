// Rendezvous under faults, ranks as threads: every wait ends within
// timeout_ms + kSlack with SF_ERR_TIMEOUT / SF_ERR_BACKEND / SF_ERR_MISMATCH
// and a message that names what it waited for; the env:// store survives
// strangers (garbage, floods, fd exhaustion) and admits only the job; a
// client with the job token trusts only a store that proves it knows it.
// Each case was seen to fail (hang, wrong status, leak or >5x timeout) on
// the 0.1 code before the fix.

#include <boost/test/unit_test.hpp>

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include <gloo/transport/tcp/address.h>

#include "plugin/backend/gloo_backend.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/launch/launch_options.h"
#include "plugin/rendezvous/job_token.h"
#include "plugin/rendezvous/memory_store.h"
#include "plugin/rendezvous/store_factory.h"
#include "plugin/rendezvous/store_protocol.h"
#include "plugin/rendezvous/tcp_store.h"
#include "plugin/tools/silent_listener.h"
#include "tests/support/bounded.h"
#include "tests/support/processes.h"
#include "tests/support/thread_ranks.h"

using namespace sfsync;
using std::chrono::milliseconds;

namespace {

using sftest::expectBounded;
using Outcome = sftest::Bounded;

// Runs f on its own thread (tests/support/bounded.h); a thrown sfsync::Error
// becomes its status and message.
Outcome bounded(std::function<void()> f, double limitSeconds) {
  return sftest::boundedRun(
      [f](Outcome& o) {
        try {
          f();
        } catch (const Error& e) {
          o.status = e.status();
          o.message = e.what();
        } catch (const std::exception& e) {
          o.status = SF_ERR_INTERNAL;  // what the C boundary would return
          o.message = e.what();
        }
      },
      limitSeconds);
}

// A TCP listener that never accepts nor answers: a wedged rank 0, a
// squatter on the port, a silent Redis.
using sfsync::SilentListener;

int connectTo(int port, const char* ip = "127.0.0.1") {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  ::inet_pton(AF_INET, ip, &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int countEntries(const char* dir) {
  int n = 0;
  if (DIR* d = ::opendir(dir)) {
    while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}
int openFds() { return countEntries("/proc/self/fd"); }
int threadCount() { return countEntries("/proc/self/task"); }

long rssKiB() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

// Polls cond for up to `seconds`.
bool eventually(const std::function<bool()>& cond, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return cond();
}

std::vector<char> bytes(const std::string& s) { return {s.begin(), s.end()}; }

// Sets an environment variable for the life of the object.
struct ScopedEnv {
  std::string name;
  ScopedEnv(const std::string& n, const std::string& v) : name(n) { ::setenv(n.c_str(), v.c_str(), 1); }
  ~ScopedEnv() { ::unsetenv(name.c_str()); }
};

sf_options gloo2(int rank, const std::string& url, int64_t timeoutMs) {
  sf_options o;
  optionsFromEnvironment(o);
  o.rank = rank;
  o.world_size = 2;
  o.timeout_ms = timeoutMs;
  std::strncpy(o.rendezvous, url.c_str(), SF_RENDEZVOUS_MAX - 1);
  o.backend = SF_BACKEND_GLOO;
  return o;
}

// The key Gloo's full mesh reads for `rank` (world 2): one pair address.
std::vector<char> glooAddressBlob(const char* ip, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  ::inet_pton(AF_INET, ip, &a.sin_addr);
  return gloo::transport::tcp::Address(reinterpret_cast<sockaddr*>(&a), sizeof a).bytes();
}

// A store server on 127.0.0.1:port that reads its job token from `var`.
std::unique_ptr<TcpStore> serverWithToken(const char* var, const std::string& value, int port) {
  ScopedEnv token(var, value);
  return std::make_unique<TcpStore>("127.0.0.1", port, true, milliseconds(3000));
}

// A client with the environment as it is now, reading rank 0's key.
Outcome clientReadsRank0(int port) {
  return bounded(
      [&] {
        TcpStore client("127.0.0.1", port, false, milliseconds(1000));
        client.get("sfsync/0");
      },
      10);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(store_hardening_tests)

// ---- Bounded waits ----------------------------------------------------------

BOOST_AUTO_TEST_CASE(silent_store_times_out_naming_host_and_port) {
  SilentListener silent;
  const Outcome o = bounded(
      [&] {
        TcpStore client("127.0.0.1", silent.port, false, milliseconds(800));
        client.get("sfsync/0");
      },
      10);
  expectBounded(o, 0.8, {SF_ERR_TIMEOUT});
  BOOST_TEST(o.message.find("127.0.0.1:" + std::to_string(silent.port)) != std::string::npos,
             o.message);
}

BOOST_AUTO_TEST_CASE(silent_redis_times_out) {
  SilentListener silent;
  sf_options o = gloo2(1, "redis://127.0.0.1:" + std::to_string(silent.port) + "/job", 800);
  const Outcome out = bounded([&] { openStore(o)->get("sfsync/0"); }, 10);
  expectBounded(out, 0.8, {SF_ERR_TIMEOUT});
  BOOST_TEST(out.message.find("127.0.0.1:" + std::to_string(silent.port)) != std::string::npos,
             out.message);
}

BOOST_AUTO_TEST_CASE(refused_redis_is_a_backend_error) {
  const int port = sftest::freePort();
  sf_options o = gloo2(1, "redis://127.0.0.1:" + std::to_string(port) + "/job", 800);
  const Outcome out = bounded([&] { openStore(o)->get("sfsync/0"); }, 10);
  expectBounded(out, 0.8, {SF_ERR_BACKEND});
  BOOST_TEST(out.message.find("127.0.0.1:" + std::to_string(port)) != std::string::npos,
             out.message);
}

BOOST_AUTO_TEST_CASE(dead_peer_address_passive_side_gloo_thread) {
  // Rank 1's address sorts above rank 0's (127.0.0.2 > 127.0.0.1): rank 0 is
  // Gloo's listening side and waits for a peer that never connects. 0.1
  // failed after 5 x timeout.
  const std::string name = sftest::uniqueName("passive");
  auto store = MemoryStore::named(name);
  store->set("sfsync/1", glooAddressBlob("127.0.0.2", sftest::freePort()));
  const sf_options o = gloo2(0, "memory://" + name, 1000);
  const Outcome out = bounded([&] { GlooBackend(o).connect(); }, 30);
  expectBounded(out, 1.0, {SF_ERR_TIMEOUT});
  BOOST_TEST(out.message.find("rank 1") != std::string::npos, out.message);
  BOOST_TEST(out.message.find("127.0.0.2") != std::string::npos, out.message);
}

BOOST_AUTO_TEST_CASE(dead_peer_address_active_side_gloo_thread) {
  // This rank on 127.0.0.2 connects to rank 1 on 127.0.0.1: nothing listens
  // there, the connection is refused at once.
  ScopedEnv host("SF_GLOO_HOSTNAME", "127.0.0.2");
  const std::string name = sftest::uniqueName("active");
  auto store = MemoryStore::named(name);  // held: the registry keeps stores only while used
  store->set("sfsync/1", glooAddressBlob("127.0.0.1", sftest::freePort()));
  const sf_options o = gloo2(0, "memory://" + name, 1000);
  const Outcome out = bounded([&] { GlooBackend(o).connect(); }, 30);
  expectBounded(out, 1.0, {SF_ERR_BACKEND, SF_ERR_TIMEOUT});
  BOOST_TEST(out.message.find("rank 1") != std::string::npos, out.message);
}

BOOST_AUTO_TEST_CASE(stopped_peer_during_connect_active_side_gloo_thread) {
  // Rank 1 is wedged: its listening socket's queue is full and nobody
  // accepts, so this rank's connect gets no answer. 0.1: 5 x timeout.
  ScopedEnv host("SF_GLOO_HOSTNAME", "127.0.0.2");
  SilentListener wedged("127.0.0.1", 0);
  wedged.fillBacklog(4);
  const std::string name = sftest::uniqueName("wedged");
  auto store = MemoryStore::named(name);
  store->set("sfsync/1", glooAddressBlob("127.0.0.1", wedged.port));
  const sf_options o = gloo2(0, "memory://" + name, 1000);
  const Outcome out = bounded([&] { GlooBackend(o).connect(); }, 30);
  expectBounded(out, 1.0, {SF_ERR_TIMEOUT, SF_ERR_BACKEND});
  BOOST_TEST(out.message.find("rank 1") != std::string::npos, out.message);
}

BOOST_AUTO_TEST_CASE(late_rank_joins_and_missing_rank_times_out_gloo_threads) {
  const std::string name = sftest::uniqueName("late");
  // Rank 1 arrives 1 s late, well within the timeout: both connect. Each
  // rank keeps its pairs open until the other connected too: a rank that
  // tore down as soon as its own side was up closed the peer's pair while
  // that peer's connect was still reading (a race of the test, "Connection
  // closed by peer", seen under load, not the behaviour under test).
  std::atomic<int> connected{0};
  auto late = sftest::runThreadRanks<Outcome>(2, [&](int r) {
    if (r == 1) std::this_thread::sleep_for(milliseconds(1000));
    const sf_options o = gloo2(r, "memory://" + name, 5000);
    return bounded([&] {
      GlooBackend backend(o);
      backend.connect();
      ++connected;
      if (!eventually([&] { return connected.load() == 2; }, 20))
        throw Error(SF_ERR_TIMEOUT, "the peer did not connect within 20 s");
    }, 30);
  });
  for (const auto& o : late) BOOST_TEST(o.status == SF_OK, o.message);
  // Rank 1 never arrives: rank 0 times out naming the key it waited for.
  const sf_options o = gloo2(0, "memory://" + sftest::uniqueName("missing"), 800);
  const Outcome out = bounded([&] { GlooBackend(o).connect(); }, 30);
  expectBounded(out, 0.8, {SF_ERR_TIMEOUT});
  BOOST_TEST(out.message.find("sfsync/1") != std::string::npos, out.message);
}

BOOST_AUTO_TEST_CASE(memory_name_reused_while_first_job_lives_fails_fast) {
  // 0.1: the second job read the first job's addresses and failed after
  // 5 x timeout (20 s for 4 s).
  const std::string url = "memory://" + sftest::uniqueName("reuse");
  std::vector<std::unique_ptr<GlooBackend>> first(2);
  auto firstJob = sftest::runThreadRanks<Outcome>(2, [&](int r) {
    first[size_t(r)] = std::make_unique<GlooBackend>(gloo2(r, url, 5000));
    return bounded([&] { first[size_t(r)]->connect(); }, 30);
  });
  for (const auto& o : firstJob) BOOST_TEST_REQUIRE(o.status == SF_OK, o.message);
  auto second = sftest::runThreadRanks<Outcome>(2, [&](int r) {
    const sf_options o = gloo2(r, url, 1500);
    return bounded([&] { GlooBackend(o).connect(); }, 30);
  });
  for (const auto& o : second) {
    expectBounded(o, 1.5, {SF_ERR_MISMATCH, SF_ERR_TIMEOUT});
    BOOST_TEST(o.message.find(url) != std::string::npos, o.message);
  }
}

BOOST_AUTO_TEST_CASE(file_store_missing_rank_times_out_and_reused_directory_is_a_mismatch) {
  const std::string dir = "/tmp/" + sftest::uniqueName("sfsync-filestore");
  const std::string url = "file://" + dir;
  // Each job's rank 0 listens on an address of its own: a key holding the
  // very bytes being written is a repeated write, not another job's (the
  // store accepts it), and by chance the second job's port can be the one
  // the first had just freed, which made this test fail once in CI.
  auto connectFrom = [&](const char* host, int64_t timeoutMs) {
    ScopedEnv env("SF_GLOO_HOSTNAME", host);
    return bounded([&] { GlooBackend(gloo2(0, url, timeoutMs)).connect(); }, 30);
  };
  // Rank 1 never arrives: bounded, naming the key and the directory.
  const Outcome missing = connectFrom("127.0.0.1", 800);
  expectBounded(missing, 0.8, {SF_ERR_TIMEOUT});
  BOOST_TEST(missing.message.find("sfsync%2f1") == std::string::npos);
  BOOST_TEST(missing.message.find("'sfsync/1'") != std::string::npos, missing.message);
  BOOST_TEST(missing.message.find(dir) != std::string::npos, missing.message);
  // A second job in the same directory meets the first job's keys: written
  // once, so a fast SF_ERR_MISMATCH instead of connecting to stale addresses.
  const Outcome reused = connectFrom("127.0.0.2", 5000);
  BOOST_TEST(reused.finished);
  BOOST_TEST(reused.status == SF_ERR_MISMATCH, reused.message);
  BOOST_TEST(reused.seconds < 2.0, reused.seconds);
  std::system(("rm -rf " + dir).c_str());
}

// ---- A store that survives strangers ------------------------------------------

BOOST_AUTO_TEST_CASE(no_fd_or_thread_kept_per_closed_or_garbage_connection) {
  const int port = sftest::freePort();
  TcpStore server("127.0.0.1", port, true, milliseconds(5000));
  const int fds0 = openFds(), threads0 = threadCount();
  for (int i = 0; i < 40; ++i) {
    int fd = connectTo(port);
    BOOST_TEST_REQUIRE(fd >= 0);
    if (i % 2) {
      const char garbage[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n\xff\xff\xff\xff";
      (void)!::send(fd, garbage, sizeof garbage, MSG_NOSIGNAL);
    }
    ::close(fd);
  }
  BOOST_TEST(eventually([&] { return openFds() <= fds0; }, 5),
             "fds before " << fds0 << ", after " << openFds());
  // Idle strangers that stay connected: no thread each.
  std::vector<int> idle;
  for (int i = 0; i < 40; ++i) idle.push_back(connectTo(port));
  std::this_thread::sleep_for(milliseconds(300));
  BOOST_TEST(threadCount() <= threads0 + 2, "threads before " << threads0 << ", with 40 idle clients "
                                                              << threadCount());
  for (int fd : idle) ::close(fd);
  // The store still serves the job.
  TcpStore client("127.0.0.1", port, false, milliseconds(3000));
  client.set("k", bytes("v"));
  BOOST_TEST(std::string(server.get("k").data(), 1) == "v");
}

BOOST_AUTO_TEST_CASE(oversize_values_are_rejected_without_growing_memory) {
  const int port = sftest::freePort();
  TcpStore server("127.0.0.1", port, true, milliseconds(5000));
  TcpStore client("127.0.0.1", port, false, milliseconds(5000));
  std::vector<char> big(16u << 20, 'x');
  const long rss0 = rssKiB();  // with the 16 MiB value itself already counted
  for (int i = 0; i < 8; ++i) {
    const Outcome o = bounded([&] { client.set("big" + std::to_string(i), big); }, 30);
    BOOST_TEST(o.finished);
    BOOST_TEST(o.status == SF_ERR_INVALID_ARGUMENT, o.message);
  }
  const long grown = rssKiB() - rss0;  // 0.1 kept 8 x 16 MiB (+129 MiB)
  BOOST_TEST_MESSAGE("RSS grew by " << grown << " KiB over 8 rejected 16 MiB values");
  BOOST_TEST(grown < 8 * 1024, "RSS grew by " << grown << " KiB");
  client.set("small", bytes("ok"));
  BOOST_TEST(server.get("small").size() == 2u);
}

// The child's half of store_survives_fd_exhaustion: runs only when the
// test below starts this binary again with SF_TEST_EMFILE_CHILD=1 (a fresh
// process: setrlimit is per process, and fork without exec is unsafe under
// the sanitizers).
BOOST_AUTO_TEST_CASE(fd_exhaustion_child) {
  if (!std::getenv("SF_TEST_EMFILE_CHILD")) return;
  const int port = std::atoi(std::getenv("SF_TEST_EMFILE_CHILD"));
  int rc = 1;
  try {
    TcpStore server("127.0.0.1", port, true, milliseconds(3000));
    // The strangers' sockets exist before the limit drops, so that only the
    // server runs out: it can accept 4 of them, the other 36 wait in its
    // queue while accept fails with EMFILE.
    std::vector<int> strangers;
    for (int i = 0; i < 40; ++i) strangers.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    rlimit lim{};
    ::getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = rlim_t(openFds() + 4);
    ::setrlimit(RLIMIT_NOFILE, &lim);
    for (int fd : strangers) {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(uint16_t(port));
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      (void)::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
    std::this_thread::sleep_for(milliseconds(300));
    for (int fd : strangers) ::close(fd);
    std::this_thread::sleep_for(milliseconds(300));
    TcpStore client("127.0.0.1", port, false, milliseconds(3000));
    client.set("k", bytes("v"));
    rc = client.get("k").size() == 1 ? 0 : 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child: %s\n", e.what());
    rc = 3;
  }
  std::fflush(stderr);
  ::_exit(rc);
}

BOOST_AUTO_TEST_CASE(store_survives_fd_exhaustion_process) {
  // In a child: the server runs out of fds on accept, the strangers go
  // away, and the job's client is still served. 0.1's accept thread died on
  // EMFILE and the client then hung.
  if (std::getenv("SF_TEST_EMFILE_CHILD")) return;
  const std::string self = boost::unit_test::framework::master_test_suite().argv[0];
  const sftest::ProcessResult r = sftest::runProcess(
      {self, "--run_test=store_hardening_tests/fd_exhaustion_child", "--log_level=nothing"},
      {{"SF_TEST_EMFILE_CHILD", std::to_string(sftest::freePort())}, {"SF_DEBUG", "WARN"}}, 20);
  BOOST_TEST(!r.timedOut, "the child hung: the store stopped serving after EMFILE");
  BOOST_TEST(r.exitCode == 0, r.output);
  BOOST_TEST(r.output.find("no file descriptor left") != std::string::npos, r.output);
}

// ---- Only the job gets in -------------------------------------------------------

BOOST_AUTO_TEST_CASE(client_without_the_token_is_refused) {
  const int port = sftest::freePort();
  auto server = serverWithToken("SF_AUTH_TOKEN", "job-secret-1", port);
  server->set("sfsync/0", bytes("rank 0's address"));
  const Outcome o = clientReadsRank0(port);
  BOOST_TEST(o.finished);
  BOOST_TEST(o.status == SF_ERR_BACKEND, o.message);
  BOOST_TEST(o.message.find("SF_AUTH_TOKEN") != std::string::npos, o.message);
}

BOOST_AUTO_TEST_CASE(client_with_a_wrong_token_is_refused) {
  const int port = sftest::freePort();
  auto server = serverWithToken("SF_AUTH_TOKEN", "job-secret-2", port);
  server->set("sfsync/0", bytes("rank 0's address"));
  ScopedEnv wrong("SF_AUTH_TOKEN", "guessed");
  const Outcome o = clientReadsRank0(port);
  BOOST_TEST(o.finished);
  BOOST_TEST(o.status == SF_ERR_BACKEND, o.message);
  BOOST_TEST(o.message.find("authentication") != std::string::npos, o.message);
}

BOOST_AUTO_TEST_CASE(token_from_a_file_admits_the_job_and_a_bad_file_is_named) {
  const std::string path = "/tmp/" + sftest::uniqueName("token");
  {
    std::ofstream f(path);
    f << "file-secret\n";  // the trailing newline is not part of the token
  }
  const int port = sftest::freePort();
  auto server = serverWithToken("SF_AUTH_TOKEN_FILE", path, port);
  {
    ScopedEnv token("SF_AUTH_TOKEN", "file-secret");
    const Outcome ok = bounded(
        [&] {
          TcpStore rank1("127.0.0.1", port, false, milliseconds(3000));
          rank1.set("k", bytes("v"));
        },
        10);
    BOOST_TEST(ok.status == SF_OK, ok.message);
  }
  ::unlink(path.c_str());
  ScopedEnv missing("SF_AUTH_TOKEN_FILE", path);
  const Outcome bad = bounded([&] { TcpStore("127.0.0.1", port, false, milliseconds(1000)); }, 10);
  BOOST_TEST(bad.status == SF_ERR_INVALID_ARGUMENT, bad.message);
  BOOST_TEST(bad.message.find(path) != std::string::npos, bad.message);
}

BOOST_AUTO_TEST_CASE(rank_key_cannot_be_overwritten) {
  const int port = sftest::freePort();
  TcpStore server("127.0.0.1", port, true, milliseconds(3000));
  TcpStore rank1("127.0.0.1", port, false, milliseconds(3000));
  TcpStore stranger("127.0.0.1", port, false, milliseconds(3000));
  rank1.set("sfsync/1", bytes("10.0.0.1:1234"));
  const Outcome o = bounded([&] { stranger.set("sfsync/1", bytes("6.6.6.6:666")); }, 10);
  BOOST_TEST(o.status == SF_ERR_MISMATCH, o.message);
  BOOST_TEST(o.message.find("sfsync/1") != std::string::npos, o.message);
  const auto v = server.get("sfsync/1");
  BOOST_TEST(std::string(v.begin(), v.end()) == "10.0.0.1:1234");
}

BOOST_AUTO_TEST_CASE(open_store_warns_once_and_each_rejected_client_is_logged) {
  const std::string logPath = "/tmp/" + sftest::uniqueName("store-log");
  {
    ScopedEnv level("SF_DEBUG", "WARN"), file("SF_DEBUG_FILE", logPath);
    logReconfigure();
    const int port = sftest::freePort();
    {
      // No token, a non-loopback address: one warning that the store is open.
      TcpStore server("0.0.0.0", port, true, milliseconds(3000));
      for (int i = 0; i < 3; ++i) {
        int fd = connectTo(port);
        const char garbage[] = "\x05\x00\x00\x00Zjunk";
        (void)!::send(fd, garbage, sizeof garbage - 1, MSG_NOSIGNAL);
        char b[256];
        while (::recv(fd, b, sizeof b, 0) > 0) {
        }
        ::close(fd);
      }
    }
    {
      ScopedEnv token("SF_AUTH_TOKEN", "secret");
      TcpStore server("0.0.0.0", sftest::freePort(), true, milliseconds(3000));  // no warning
    }
  }
  logReconfigure();
  std::ifstream f(logPath);
  std::string line;
  int open = 0, rejected = 0;
  while (std::getline(f, line)) {
    open += line.find("WARN store") != std::string::npos && line.find("is open") != std::string::npos;
    rejected += line.find("WARN store") != std::string::npos && line.find("rejected client 127.0.0.1:") != std::string::npos;
  }
  ::unlink(logPath.c_str());
  BOOST_TEST(open == 1);
  BOOST_TEST(rejected == 3);
}

BOOST_AUTO_TEST_CASE(stranger_speaking_the_protocol_without_token_reads_nothing) {
  // A raw client that skips authentication and asks for a key is answered
  // with an error and disconnected; it never sees a value.
  const int port = sftest::freePort();
  ScopedEnv token("SF_AUTH_TOKEN", "job-secret-3");
  TcpStore server("127.0.0.1", port, true, milliseconds(3000));
  server.set("sfsync/0", bytes("SECRET-ADDRESS"));
  int fd = connectTo(port);
  // Body: 'G', a 4-byte length 8, "sfsync/0" (13 bytes).
  const std::string frame = std::string("\x0d\x00\x00\x00G\x08\x00\x00\x00", 9) + "sfsync/0";
  (void)!::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
  std::string seen;
  char b[4096];
  ssize_t n;
  timeval tv{3, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  while ((n = ::recv(fd, b, sizeof b, 0)) > 0) seen.append(b, size_t(n));
  ::close(fd);
  BOOST_TEST(n == 0, "the store did not close the connection");
  BOOST_TEST(seen.find("SECRET-ADDRESS") == std::string::npos);
  BOOST_TEST(seen.find("authenticate first") != std::string::npos);
}

BOOST_AUTO_TEST_SUITE_END()

// ---- The client refuses a store that does not know the job token -----------------

namespace {

namespace sp = sfsync::store_protocol;

// A stand-in for whatever answers on MASTER_PORT when rank 0's store is not
// there: it accepts one connection and either sends `garbage` as is, or
// speaks the handshake (store_protocol.h) without knowing the job's token:
// its hello says whether it checks tokens (`claimsAuth`), and its answer to
// the client's proof is answer(client nonce, client mac, its own nonce).
// After that it acknowledges every request with a value, as a store that
// accepted the client would; requests() counts them (and, for a garbage
// sender, the client's proof): what a client that trusted it told it.
class Impostor {
 public:
  using Answer = std::function<std::string(const std::string&, const std::string&, const std::string&)>;
  Impostor(bool claimsAuth, Answer answer, std::string garbage = "")
      : claimsAuth_(claimsAuth), answer_(std::move(answer)), garbage_(std::move(garbage)) {
    thread_ = std::thread([this] { serve(); });
  }
  ~Impostor() {
    stop_ = true;
    thread_.join();
  }
  int port() const { return listener_.port; }
  int requests() const { return requests_; }

 private:
  void serve() {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    pollfd p{listener_.fd, POLLIN, 0};
    while (!stop_ && std::chrono::steady_clock::now() < end && ::poll(&p, 1, 50) == 0) {
    }
    if (stop_ || !(p.revents & POLLIN)) return;
    const int fd = ::accept(listener_.fd, nullptr, nullptr);
    if (fd < 0) return;
    const std::string nonce(sp::kNonceBytes, 'n');
    send(fd, garbage_.empty() ? sp::encode('H', {sp::kVersion, nonce, claimsAuth_ ? "1" : "0", "4096"})
                              : garbage_);
    sp::FrameParser parser(1 << 16);
    bool authenticated = false;
    while (!stop_ && std::chrono::steady_clock::now() < end) {
      pollfd q{fd, POLLIN, 0};
      if (::poll(&q, 1, 50) <= 0) continue;
      char b[4096];
      const ssize_t n = ::recv(fd, b, sizeof b, 0);
      if (n <= 0) break;
      parser.feed(b, size_t(n));
      sp::Message m;
      while (parser.next(m) == sp::FrameParser::Result::kMessage) {
        if (!authenticated && answer_ && m.type == 'A' && m.fields.size() == 2) {
          send(fd, sp::encode('K', {answer_(m.fields[0], m.fields[1], nonce)}));
          authenticated = true;
        } else {
          ++requests_;
          send(fd, sp::encode('K', {"10.6.6.6:666"}));
        }
      }
    }
    ::close(fd);
  }
  static void send(int fd, const std::string& s) { (void)!::send(fd, s.data(), s.size(), MSG_NOSIGNAL); }

  SilentListener listener_;  // bound before the thread starts: port() is valid at once
  const bool claimsAuth_;
  const Answer answer_;
  const std::string garbage_;
  std::atomic<bool> stop_{false};
  std::atomic<int> requests_{0};
  std::thread thread_;
};

// The server's side of the proof (tcp_store.cpp's role string), for `key`.
std::string serverProof(const std::string& key, const std::string& clientNonce,
                        const std::string& serverNonce) {
  return proof(key, "sfsync-store server", clientNonce, serverNonce);
}

// A rank with the job token reading rank 0's key from the store on `port`.
Outcome tokenClientReads(int port) {
  ScopedEnv token("SF_AUTH_TOKEN", "the-job-token");
  return clientReadsRank0(port);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(store_hardening_tests)

BOOST_AUTO_TEST_CASE(client_with_the_token_refuses_a_real_store_without_one) {
  const int port = sftest::freePort();
  TcpStore open("127.0.0.1", port, true, milliseconds(3000));  // rank 0 started without the token
  open.set("sfsync/0", bytes("rank 0's address"));
  const Outcome o = tokenClientReads(port);
  expectBounded(o, 1.0, {SF_ERR_BACKEND});
  BOOST_TEST(o.message.find("does not check the job token") != std::string::npos, o.message);
}

BOOST_AUTO_TEST_CASE(client_with_the_token_refuses_impostors_and_tells_them_nothing) {
  // Each impostor would hand the client a forged rank 0 address if the
  // client trusted it; the client must fail the handshake and send no request.
  struct Case {
    const char* what;
    bool claimsAuth;
    Impostor::Answer answer;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"an open store (no token check)", false, [](auto&, auto&, auto&) { return std::string(); },
       "does not check the job token"},
      {"a store with another token", true,
       [](auto& cn, auto&, auto& sn) { return serverProof("another-job-token", cn, sn); },
       "does not know the job token"},
      {"a store that accepts anyone (no proof)", true, [](auto&, auto&, auto&) { return std::string(); },
       "does not know the job token"},
      {"a store that sends 32 random bytes", true,
       [](auto&, auto&, auto&) { return randomBytes(sp::kMacBytes); }, "does not know the job token"},
      {"a store that reflects the client's own proof", true,
       [](auto&, auto& mac, auto&) { return mac; }, "does not know the job token"},
  };
  for (const auto& c : cases) {
    BOOST_TEST_CONTEXT(c.what) {
      Impostor impostor(c.claimsAuth, c.answer);
      const Outcome o = tokenClientReads(impostor.port());
      expectBounded(o, 1.0, {SF_ERR_BACKEND});
      BOOST_TEST(o.message.find(c.says) != std::string::npos, o.message);
      BOOST_TEST(impostor.requests() == 0, "the client sent " << impostor.requests() << " requests");
    }
  }
  // The harness itself: an impostor that does know the token is trusted
  // (so the refusals above are the client's checks, not a broken stand-in).
  Impostor knows(true, [](auto& cn, auto&, auto& sn) { return serverProof("the-job-token", cn, sn); });
  const Outcome ok = tokenClientReads(knows.port());
  BOOST_TEST(ok.status == SF_OK, ok.message);
  BOOST_TEST(knows.requests() >= 1);
}

BOOST_AUTO_TEST_CASE(client_refuses_a_stranger_that_answers_garbage) {
  struct Case {
    const char* what;
    std::string bytes;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"an HTTP server", "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
       "does not speak the sfsync store protocol"},
      {"another protocol version",
       sp::encode('H', {"sfsync-store-0", std::string(sp::kNonceBytes, 'n'), "1", "4096"}),
       "does not speak version"},
      {"a short hello", sp::encode('H', {sp::kVersion}), "does not speak version"},
  };
  for (const auto& c : cases) {
    BOOST_TEST_CONTEXT(c.what) {
      Impostor stranger(true, nullptr, c.bytes);
      const Outcome o = tokenClientReads(stranger.port());
      expectBounded(o, 1.0, {SF_ERR_BACKEND});
      BOOST_TEST(o.message.find(c.says) != std::string::npos, o.message);
      BOOST_TEST(stranger.requests() == 0);
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
