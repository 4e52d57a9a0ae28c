// The host's own store (sf_set_store): ranks as threads meet only through a
// store the test implements with C callbacks (tests/support/map_store.h),
// and get the same reduced gradients as through memory://; timeouts, the
// callbacks' failures and key prefixes behave as the header says.

#include <boost/test/unit_test.hpp>

#include <chrono>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "plugin/core/error.h"
#include "plugin/rendezvous/host_store.h"
#include "tests/support/map_store.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;
using Clock = std::chrono::steady_clock;

namespace {

struct SyncRun {
  sf_status status = SF_OK;
  std::string error;
  std::vector<std::vector<float>> grads;
};

constexpr int64_t kNumel[] = {1, 257, 4099};

// One rank: three host gradients with rank-dependent values, connect, one
// synchronization. `store` NULL means opts.rendezvous alone.
SyncRun syncRank(int rank, int world, const std::string& rendezvous, MapStore* store,
                 const std::string& prefix, int64_t timeoutMs = 30000) {
  SyncRun run;
  auto check = [&](sf_status st) {
    if (st != SF_OK && run.status == SF_OK) {
      run.status = st;
      run.error = sf_last_error();
    }
    return st == SF_OK;
  };
  sf_options o = rankOptions(rank, world, rendezvous, timeoutMs);
  ContextHandle h;
  if (!check(sf_create(&o, &h.ctx))) return run;
  if (store) {
    const sf_store s = store->handle();
    if (!check(sf_set_store(h.ctx, &s, prefix.c_str()))) return run;
  }
  for (size_t i = 0; i < 3; ++i) {
    std::vector<float> g(static_cast<size_t>(kNumel[i]));
    for (size_t j = 0; j < g.size(); ++j) g[j] = float(rank + 1) * float(i + 1) + float(j) * 0.001f;
    run.grads.push_back(std::move(g));
  }
  for (auto& g : run.grads) {
    int64_t id;
    if (!check(sf_register_gradient(h.ctx, g.data(), int64_t(g.size()), SF_DTYPE_FLOAT32,
                                    SF_DEVICE_HOST, nullptr, &id))) {
      return run;
    }
  }
  if (!check(sf_connect(h.ctx))) return run;
  check(sf_synchronize(h.ctx));
  return run;
}

void checkAverages(const std::vector<SyncRun>& runs, int world) {
  for (size_t r = 0; r < runs.size(); ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST_REQUIRE(runs[r].status == SF_OK, runs[r].error);
      for (size_t i = 0; i < 3; ++i) {
        for (size_t j = 0; j < runs[r].grads[i].size(); j += 97) {
          const double expected = (world + 1) / 2.0 * double(i + 1) + double(j) * 0.001;
          BOOST_TEST(runs[r].grads[i][j] == expected, boost::test_tools::tolerance(1e-5));
        }
      }
    }
  }
}

}  // namespace

BOOST_AUTO_TEST_SUITE(host_store_tests)

BOOST_AUTO_TEST_CASE(two_and_four_thread_ranks_sync_through_a_callback_store_as_through_memory) {
  for (int world : {2, 4}) {
    BOOST_TEST_CONTEXT("world " << world) {
      MapStore store;
      auto viaHost = runThreadRanks<SyncRun>(
          world, [&](int r) { return syncRank(r, world, "host://", &store, "job"); });
      checkAverages(viaHost, world);
      const std::string mem = "memory://" + uniqueName("host-parity");
      auto viaMemory =
          runThreadRanks<SyncRun>(world, [&](int r) { return syncRank(r, world, mem, nullptr, ""); });
      checkAverages(viaMemory, world);
      for (int r = 0; r < world; ++r) {  // bit for bit: the same collectives on the same data
        for (size_t i = 0; i < 3; ++i) {
          BOOST_TEST(std::memcmp(viaHost[size_t(r)].grads[i].data(),
                                 viaMemory[size_t(r)].grads[i].data(),
                                 viaHost[size_t(r)].grads[i].size() * sizeof(float)) == 0);
        }
      }
      // Every key went through the callbacks, under the prefix: the claims,
      // rank 0's roster and Gloo's per-rank addresses.
      BOOST_TEST(store.sets.load() >= 2 * world + 1);
      BOOST_TEST(store.gets.load() >= 2 * (world - 1));
      for (const auto& k : store.keysSet) BOOST_TEST(k.compare(0, 11, "job/sfsync/") == 0, k);
      BOOST_TEST(store.keysSet.count("job/sfsync/roster") == 1u);
      for (int r = 0; r < world; ++r) {
        BOOST_TEST(store.keysSet.count("job/sfsync/join/" + std::to_string(r)) == 1u);
      }
      // Waits never asked the host for more than timeout_ms.
      BOOST_TEST(store.largestTimeoutMs.load() <= 30000);
      BOOST_TEST(store.largestTimeoutMs.load() > 0);
    }
  }
}

BOOST_AUTO_TEST_CASE(two_contexts_with_different_prefixes_share_one_store) {
  // Two jobs of two ranks at once on one store: without the prefixes their
  // keys (join/0, roster, Gloo's "0", "1") would collide.
  MapStore store;
  auto runs = runThreadRanks<SyncRun>(4, [&](int t) {
    const int job = t / 2;
    return syncRank(t % 2, 2, "host://", &store, job == 0 ? "jobA" : "jobB/sub");
  });
  checkAverages({runs[0], runs[1]}, 2);
  checkAverages({runs[2], runs[3]}, 2);
  int a = 0, b = 0;
  for (const auto& k : store.keysSet) {
    const bool inA = k.compare(0, 12, "jobA/sfsync/") == 0;
    const bool inB = k.compare(0, 16, "jobB/sub/sfsync/") == 0;
    BOOST_TEST((inA || inB), k);
    a += inA;
    b += inB;
  }
  BOOST_TEST(a == b);  // the same keys for each job
  BOOST_TEST(a >= 5);
}

BOOST_AUTO_TEST_CASE(forever_timeouts_do_not_overflow_2_thread_ranks) {
  // INT64_MAX ms ("forever"; sf_create clamps it to 2^40 ms, ~35 years):
  // deadlines computed from it must not overflow the clock and expire at once.
  MapStore store;
  const int64_t clamp = int64_t(1) << 40;
  auto runs = runThreadRanks<SyncRun>(
      2, [&](int r) { return syncRank(r, 2, "host://", &store, "forever", INT64_MAX); });
  checkAverages(runs, 2);
  BOOST_TEST(store.largestTimeoutMs.load() > clamp / 2);  // passed on to the host
  BOOST_TEST(store.largestTimeoutMs.load() <= clamp);
}

BOOST_AUTO_TEST_CASE(a_prefix_reused_by_a_later_job_fails_it_2_thread_ranks) {
  // The keys of the first job stay in the store: the second job with the same
  // prefix must fail (not meet the first job's dead ranks and hang).
  MapStore store;
  auto first = runThreadRanks<SyncRun>(
      2, [&](int r) { return syncRank(r, 2, "host://", &store, "same", 3000); });
  checkAverages(first, 2);
  const auto t0 = Clock::now();
  auto second = runThreadRanks<SyncRun>(
      2, [&](int r) { return syncRank(r, 2, "host://", &store, "same", 3000); });
  BOOST_TEST(second[0].status == SF_ERR_MISMATCH, second[0].error);
  BOOST_TEST(second[0].error.find("used by an earlier job") != std::string::npos, second[0].error);
  BOOST_TEST(second[1].status == SF_ERR_MISMATCH, second[1].error);
  BOOST_TEST(second[1].error.find("claimed by two processes") != std::string::npos);
  BOOST_TEST(std::chrono::duration<double>(Clock::now() - t0).count() < 3.0 + 3.0);
}

BOOST_AUTO_TEST_CASE(missing_rank_times_out_within_timeout_plus_slack_naming_it) {
  MapStore store;
  const int64_t timeoutMs = 1500;
  const auto t0 = Clock::now();
  SyncRun run = syncRank(0, 3, "host://", &store, "lonely", timeoutMs);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  BOOST_TEST(run.status == SF_ERR_TIMEOUT, run.error);
  BOOST_TEST(run.error.find("ranks 1, 2 of world_size 3 did not join") != std::string::npos,
             run.error);
  BOOST_TEST(run.error.find("timeout_ms = 1500") != std::string::npos, run.error);
  BOOST_TEST(s >= 1.4);
  BOOST_TEST(s < 1.5 + 3.0);  // documented slack: scheduling on a loaded machine
  BOOST_TEST(store.largestTimeoutMs.load() <= timeoutMs);
}

BOOST_AUTO_TEST_CASE(rank_without_rank_0_times_out_naming_the_roster) {
  MapStore store;
  const auto t0 = Clock::now();
  SyncRun run = syncRank(1, 2, "host://", &store, "", 1000);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  BOOST_TEST(run.status == SF_ERR_TIMEOUT, run.error);
  BOOST_TEST(run.error.find("rank 1 did not receive rank 0's roster") != std::string::npos,
             run.error);
  BOOST_TEST(run.error.find("'sfsync/roster'") != std::string::npos, run.error);  // no prefix
  BOOST_TEST(s < 1.0 + 3.0);
}

BOOST_AUTO_TEST_CASE(callback_failures_become_statuses_naming_the_key) {
  struct Case {
    int32_t setResult, getResult;
    bool unset;
    sf_status expected;
    const char* text;
  };
  const Case cases[] = {
      {SF_STORE_ERROR, SF_STORE_OK, false, SF_ERR_BACKEND,
       "set of key 'p/sfsync/join/1' failed (the host's callback returned SF_STORE_ERROR)"},
      {SF_STORE_OK, SF_STORE_TIMEOUT, false, SF_ERR_TIMEOUT,
       "key 'p/sfsync/roster' did not appear within 5000 ms"},
      {SF_STORE_OK, SF_STORE_ERROR, false, SF_ERR_BACKEND, "get of key 'p/sfsync/roster' failed"},
      {SF_STORE_OK, 7, false, SF_ERR_BACKEND, "returned 7, which is not SF_STORE_OK"},
      {SF_STORE_OK, SF_STORE_OK, true, SF_ERR_BACKEND, "without setting *bytes"},
  };
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT(c.text) {
      MapStore store;
      store.put("p/sfsync/roster", "ok\n");  // so that a working get would find it
      store.setResult = c.setResult;
      store.getResult = c.getResult;
      store.leaveBytesUnset = c.unset;
      const auto t0 = Clock::now();
      SyncRun run = syncRank(1, 2, "host://", &store, "p", 5000);
      BOOST_TEST(run.status == c.expected, run.error);
      BOOST_TEST(run.error.find(c.text) != std::string::npos, run.error);
      BOOST_TEST(run.error.find("sf_connect") == 0u, run.error);  // surfaced at connect
      // Failures reported by the host are not waited out.
      BOOST_TEST(std::chrono::duration<double>(Clock::now() - t0).count() < 3.0);
    }
  }
}

BOOST_AUTO_TEST_CASE(set_store_checks_its_arguments_and_when_it_is_called) {
  sf_store s;
  BOOST_TEST(sf_store_init(nullptr, sizeof s) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(sf_store_init(&s, 31) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("struct_size = 31") != std::string::npos);
  std::memset(&s, 0xff, sizeof s);
  BOOST_TEST(sf_store_init(&s, sizeof s) == SF_OK);
  BOOST_TEST(s.struct_size == sizeof s);
  BOOST_TEST(s.user == nullptr);
  BOOST_TEST((s.set == nullptr && s.get == nullptr));

  MapStore store;
  sf_options o = rankOptions(0, 1, "");
  ContextHandle h;
  BOOST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  sf_store good = store.handle();
  BOOST_TEST(sf_set_store(nullptr, &good, "x") == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(sf_set_store(h.ctx, nullptr, "x") == SF_ERR_INVALID_ARGUMENT);
  sf_store bad = good;
  bad.set = nullptr;
  BOOST_TEST(sf_set_store(h.ctx, &bad, "x") == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("store->set is NULL") != std::string::npos);
  bad = good;
  bad.get = nullptr;
  BOOST_TEST(sf_set_store(h.ctx, &bad, "x") == SF_ERR_INVALID_ARGUMENT);
  bad = good;
  bad.struct_size = 8;
  BOOST_TEST(sf_set_store(h.ctx, &bad, "x") == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("store->struct_size = 8") != std::string::npos);
  BOOST_TEST(sf_set_store(h.ctx, &good, nullptr) == SF_OK);  // NULL prefix: none
  BOOST_TEST(sf_connect(h.ctx) == SF_OK);                     // world size 1: no store needed
  BOOST_TEST(store.sets.load() == 0);
  BOOST_TEST(store.gets.load() == 0);

  // host:// without sf_set_store: a clear error at the first collective.
  MapStore unused;
  auto runs = runThreadRanks<SyncRun>(1, [&](int) { return syncRank(0, 2, "host://", nullptr, ""); });
  BOOST_TEST(runs[0].status == SF_ERR_INVALID_STATE, runs[0].error);
  BOOST_TEST(runs[0].error.find("sf_set_store was not called") != std::string::npos, runs[0].error);
}

BOOST_AUTO_TEST_CASE(set_store_after_connect_is_invalid_state_2_thread_ranks) {
  MapStore store;
  auto results = runThreadRanks<std::string>(2, [&](int r) -> std::string {
    sf_options o = rankOptions(r, 2, "host://", 10000);
    ContextHandle h;
    sf_store s = store.handle();
    if (sf_create(&o, &h.ctx) != SF_OK) return "create";
    if (sf_set_store(h.ctx, &s, "late") != SF_OK) return sf_last_error();
    if (sf_connect(h.ctx) != SF_OK) return sf_last_error();
    if (sf_connect(h.ctx) != SF_OK) return sf_last_error();  // idempotent
    const sf_status st = sf_set_store(h.ctx, &s, "other");
    return st == SF_ERR_INVALID_STATE ? std::string("ok") : "status " + std::to_string(st);
  });
  BOOST_TEST(results[0] == "ok");
  BOOST_TEST(results[1] == "ok");
}

BOOST_AUTO_TEST_CASE(values_larger_than_the_first_buffer_take_a_second_call) {
  MapStore store;
  std::string big(100000, 'x');
  for (size_t i = 0; i < big.size(); ++i) big[i] = char('a' + i % 26);
  store.put("pre/sfsync/big", big);
  store.put("pre/sfsync/small", "abc");
  store.put("pre/sfsync/empty", "");
  sfsync::HostStore host(store.handle(), "pre", std::chrono::milliseconds(2000));
  const std::vector<char> v = host.get("big");
  BOOST_TEST(std::string(v.begin(), v.end()) == big);
  BOOST_TEST(store.gets.load() == 2);  // the first call reported the size
  const std::vector<char> s = host.get("small");
  BOOST_TEST(std::string(s.begin(), s.end()) == "abc");
  BOOST_TEST(host.get("empty").empty());
  BOOST_TEST(store.gets.load() == 4);
  // wait() fetches within one deadline and keeps the value for get().
  host.wait({"small", "big"}, std::chrono::milliseconds(1000));
  const int before = store.gets.load();
  BOOST_TEST(host.get("big").size() == big.size());
  BOOST_TEST(store.gets.load() == before);
  // A missing key: SF_ERR_TIMEOUT naming it, after the timeout.
  const auto t0 = Clock::now();
  try {
    host.wait({"small", "missing"}, std::chrono::milliseconds(300));
    BOOST_TEST(false, "no timeout");
  } catch (const sfsync::Error& e) {
    BOOST_TEST(e.status() == SF_ERR_TIMEOUT);
    BOOST_TEST(std::string(e.what()).find("'pre/sfsync/missing'") != std::string::npos, e.what());
  }
  const double s2 = std::chrono::duration<double>(Clock::now() - t0).count();
  BOOST_TEST(s2 >= 0.28);
  BOOST_TEST(s2 < 0.3 + 3.0);
}

BOOST_AUTO_TEST_SUITE_END()
