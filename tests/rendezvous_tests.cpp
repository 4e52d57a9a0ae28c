// Every rendezvous form gets ranks together: file:// (Gloo's FileStore),
// env:// (the TCP store on MASTER_ADDR:MASTER_PORT), redis:// (a real
// redis-server started by the test) and memory:// (used everywhere else).

#include <boost/test/unit_test.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "tests/support/processes.h"
#include "tests/support/toy_training.h"

using namespace sftest;

namespace {
Scenario small() {
  Scenario sc;
  sc.micro = {2, 3};
  sc.capMb = kSmallCapMb;
  sc.firstCapMb = kSmallFirstCapMb;
  return sc;
}

// redis-server on a free port for the life of the fixture.
struct RedisServer {
  pid_t pid = -1;
  int port = freePort();
  RedisServer() {
    pid = ::fork();
    if (pid == 0) {
      const std::string p = std::to_string(port);
      ::execlp("redis-server", "redis-server", "--port", p.c_str(), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--loglevel", "warning", (char*)nullptr);
      ::_exit(127);
    }
    // Ready when it answers PING.
    for (int i = 0; i < 100; ++i) {
      auto r = runProcess({"redis-cli", "-p", std::to_string(port), "ping"}, {}, 5);
      if (r.output.find("PONG") != std::string::npos) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ~RedisServer() {
    if (pid > 0) {
      ::kill(pid, SIGTERM);
      ::waitpid(pid, nullptr, 0);
    }
  }
};
}  // namespace

BOOST_AUTO_TEST_SUITE(rendezvous_tests)

BOOST_AUTO_TEST_CASE(file_store_two_ranks_gloo_threads) {
  const std::string dir = "/tmp/" + uniqueName("sfsync-file");
  const Scenario sc = small();
  checkRuns(sc, trainThreads(sc, "file://" + dir), 4);
  std::system(("rm -rf " + dir).c_str());
}

BOOST_AUTO_TEST_CASE(env_tcp_store_two_ranks_gloo_threads) {
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(freePort()).c_str(), 1);
  const Scenario sc = small();
  checkRuns(sc, trainThreads(sc, "env://"), 4);
  ::unsetenv("MASTER_ADDR");
  ::unsetenv("MASTER_PORT");
}

BOOST_AUTO_TEST_CASE(redis_store_two_ranks_gloo_threads) {
  RedisServer redis;
  const Scenario sc = small();
  const std::string url =
      "redis://127.0.0.1:" + std::to_string(redis.port) + "/" + uniqueName("job");
  checkRuns(sc, trainThreads(sc, url), 4);
}

BOOST_AUTO_TEST_CASE(unknown_scheme_is_rejected_at_create) {
  sf_options o = rankOptions(0, 2, "udp://127.0.0.1:1");
  sf_context* c = nullptr;
  BOOST_TEST(sf_create(&o, &c) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("'udp://127.0.0.1:1'") != std::string::npos);
}

BOOST_AUTO_TEST_SUITE_END()
