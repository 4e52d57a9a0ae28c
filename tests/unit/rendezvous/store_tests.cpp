#include <boost/test/unit_test.hpp>

#include <chrono>
#include <cstring>
#include <thread>

#include "plugin/core/error.h"
#include "plugin/launch/launch_options.h"
#include "plugin/rendezvous/memory_store.h"
#include "plugin/rendezvous/store_factory.h"
#include "plugin/rendezvous/tcp_store.h"
#include "tests/support/processes.h"
#include "tests/support/thread_ranks.h"

using namespace sfsync;
using std::chrono::milliseconds;

namespace {
std::vector<char> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<char>& v) { return {v.begin(), v.end()}; }

sf_status statusOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.status();
  }
  return SF_OK;
}
}  // namespace

BOOST_AUTO_TEST_SUITE(store_tests)

BOOST_AUTO_TEST_CASE(memory_store_is_shared_by_name_and_waits) {
  const std::string name = sftest::uniqueName("store");
  auto a = MemoryStore::named(name);
  auto b = MemoryStore::named(name);
  BOOST_TEST(a.get() == b.get());
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(50));
    b->set("k", bytes("value"));
  });
  BOOST_TEST(text(a->get("k")) == "value");  // waited for the other thread
  setter.join();
  BOOST_TEST(statusOf([&] { a->wait({"missing"}, milliseconds(100)); }) == SF_ERR_TIMEOUT);
}

BOOST_AUTO_TEST_CASE(tcp_store_serves_every_rank) {
  const int port = sftest::freePort();
  TcpStore server("127.0.0.1", port, true, milliseconds(5000));
  TcpStore client("127.0.0.1", port, false, milliseconds(5000));
  std::thread late([&] {
    std::this_thread::sleep_for(milliseconds(50));
    server.set("rank_0", bytes("addr0"));
  });
  BOOST_TEST(text(client.get("rank_0")) == "addr0");
  late.join();
  std::vector<char> big(100000, 'x');
  client.set("big", big);
  BOOST_TEST(server.get("big").size() == big.size());
  client.set("empty", {});
  BOOST_TEST(server.get("empty").empty());
}

BOOST_AUTO_TEST_CASE(tcp_store_wait_times_out_naming_the_key) {
  const int port = sftest::freePort();
  TcpStore server("127.0.0.1", port, true, milliseconds(5000));
  std::string message;
  try {
    server.wait({"never"}, milliseconds(150));
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_TIMEOUT);
    message = e.what();
  }
  BOOST_TEST(message.find("'never'") != std::string::npos, message);
}

BOOST_AUTO_TEST_CASE(tcp_store_without_a_server_times_out) {
  const int port = sftest::freePort();
  const auto t0 = std::chrono::steady_clock::now();
  BOOST_TEST(statusOf([&] { TcpStore c("127.0.0.1", port, false, milliseconds(300)); }) ==
             SF_ERR_TIMEOUT);
  BOOST_TEST((std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5)));
}

BOOST_AUTO_TEST_CASE(tcp_store_port_in_use_is_a_backend_error) {
  const int port = sftest::freePort();
  TcpStore first("127.0.0.1", port, true, milliseconds(2000));
  BOOST_TEST(statusOf([&] { TcpStore second("127.0.0.1", port, true, milliseconds(2000)); }) ==
             SF_ERR_BACKEND);
}

BOOST_AUTO_TEST_CASE(one_env_store_per_rendezvous_and_rank_while_held) {
  // Host and CUDA gradients in one context: two backends open the env://
  // store; rank 0 can listen on MASTER_PORT only once.
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(sftest::freePort()).c_str(), 1);
  sf_options o;
  optionsFromEnvironment(o);
  o.world_size = 2;
  o.timeout_ms = 2000;
  std::strcpy(o.rendezvous, "env://");
  auto gloo = openStore(o);
  auto nccl = openStore(o);
  BOOST_TEST(gloo.get() == nccl.get());
  gloo->set("k", bytes("v"));
  BOOST_TEST(text(nccl->get("k")) == "v");
  sf_options other = o;
  other.rank = 1;  // a thread rank of the same job gets its own client
  auto client = openStore(other);
  BOOST_TEST(client.get() != gloo.get());
  BOOST_TEST(text(client->get("k")) == "v");
  ::unsetenv("MASTER_ADDR");
  ::unsetenv("MASTER_PORT");
}

BOOST_AUTO_TEST_SUITE_END()
