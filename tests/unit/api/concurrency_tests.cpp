// Concurrent first use of a context: many threads (autograd hooks) calling
// the implicitly-building entry points (sf_grad_ready, sf_gradient_data,
// sf_build_buckets, sf_zero_gradients, sf_synchronize, sf_bucket_info,
// sf_get_stats) on a context whose buckets are not built yet. Before 0.2 the
// implicit build ran outside the reducer's lock: two threads built at once,
// leaked flat buffers and crashed in Reducer::build / Reducer::start.
// Labelled `unit`: the ASan and TSan builds run these.

#include <boost/test/unit_test.hpp>

#include <atomic>
#include <cmath>
#include <functional>
#include <set>
#include <thread>
#include <vector>

#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

constexpr int kThreads = 16;
constexpr int kGradients = 64;

// Starts `n` threads that wait on one flag, so that they hit the context together.
void together(int n, const std::function<void(int)>& body) {
  std::atomic<int> arrived{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      arrived.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      body(t);
    });
  }
  while (arrived.load() < n) std::this_thread::yield();
  go.store(true, std::memory_order_release);
  for (auto& th : threads) th.join();
}

// A context with kGradients gradients of 1..kGradients floats, small buckets.
sf_context* makeContext(int rank, int world, const std::string& rdv, bool flat,
                        std::vector<std::vector<float>>* own) {
  sf_options o = rankOptions(rank, world, rdv, 20000);
  o.bucket_cap_mb = 256.0 / 1048576.0;
  o.first_bucket_cap_mb = 64.0 / 1048576.0;
  sf_context* ctx = nullptr;
  if (sf_create(&o, &ctx) != SF_OK) return nullptr;
  if (own) own->assign(size_t(kGradients), {});
  for (int g = 0; g < kGradients; ++g) {
    int64_t id = -1;
    sf_status st;
    if (flat) {
      st = sf_add_gradient(ctx, g + 1, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
    } else {
      (*own)[size_t(g)].assign(size_t(g + 1), 0.0f);
      st = sf_register_gradient(ctx, (*own)[size_t(g)].data(), g + 1, SF_DTYPE_FLOAT32,
                                SF_DEVICE_HOST, nullptr, &id);
    }
    if (st != SF_OK || id != g) {
      sf_destroy(ctx);
      return nullptr;
    }
  }
  return ctx;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(concurrency_tests)

BOOST_AUTO_TEST_CASE(sixteen_threads_grad_ready_first_use_one_rank) {
  for (bool flat : {true, false}) {
    for (int round = 0; round < 20; ++round) {
      BOOST_TEST_CONTEXT((flat ? "flat" : "host buffers") << ", round " << round) {
        std::vector<std::vector<float>> own;
        ContextHandle h;
        h.ctx = makeContext(0, 1, "", flat, &own);
        BOOST_REQUIRE(h.ctx);
        std::atomic<int> failures{0};
        together(kThreads, [&](int t) {
          // Thread t reports gradients t, t + 16, ... last to first, as hooks do.
          for (int g = kGradients - 1 - t; g >= 0; g -= kThreads) {
            if (sf_grad_ready(h.ctx, g) != SF_OK) failures.fetch_add(1);
          }
        });
        BOOST_TEST(failures.load() == 0);
        BOOST_TEST(sf_synchronize(h.ctx) == SF_OK, sf_last_error());
        const sf_stats s = statsOf(h.ctx);
        BOOST_TEST(s.bucket_count > 1);
        BOOST_TEST(s.collectives_issued == s.bucket_count);  // each bucket exactly once
        BOOST_TEST(s.bytes_reduced == s.gradient_bytes);
        BOOST_TEST(s.gradient_bytes == int64_t(4 * kGradients * (kGradients + 1) / 2));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(every_building_call_at_once_one_rank) {
  for (int round = 0; round < 20; ++round) {
    BOOST_TEST_CONTEXT("round " << round) {
      ContextHandle h;
      h.ctx = makeContext(0, 1, "", true, nullptr);
      BOOST_REQUIRE(h.ctx);
      std::vector<std::vector<void*>> seen(static_cast<size_t>(kThreads));
      std::atomic<int> unexpected{0};
      together(kThreads, [&](int t) {
        auto& mine = seen[size_t(t)];
        mine.assign(size_t(kGradients), nullptr);
        for (int g = 0; g < kGradients; ++g) {
          if (sf_gradient_data(h.ctx, g, &mine[size_t(g)]) != SF_OK) unexpected.fetch_add(1);
        }
        sf_status st = SF_OK;
        switch (t % 4) {
          case 0: st = sf_build_buckets(h.ctx); break;
          case 1: {
            // Not built yet is SF_ERR_INVALID_STATE; built gives a size.
            int64_t bytes = -1;
            st = sf_bucket_info(h.ctx, 0, &bytes, nullptr, nullptr);
            if (st == SF_ERR_INVALID_STATE || (st == SF_OK && bytes > 0)) st = SF_OK;
            break;
          }
          case 2: {
            sf_stats s{};
            s.struct_size = sizeof s;
            st = sf_get_stats(h.ctx, &s);
            break;
          }
          default: st = sf_zero_gradients(h.ctx); break;
        }
        if (st != SF_OK) unexpected.fetch_add(1);
      });
      BOOST_TEST(unexpected.load() == 0, sf_last_error());
      // One flat buffer: every thread saw the same address for each gradient,
      // and the addresses are distinct.
      std::set<void*> distinct;
      for (int g = 0; g < kGradients; ++g) {
        distinct.insert(seen[0][size_t(g)]);
        for (int t = 1; t < kThreads; ++t) BOOST_TEST(seen[size_t(t)][size_t(g)] == seen[0][size_t(g)]);
      }
      BOOST_TEST(distinct.size() == size_t(kGradients));
      BOOST_TEST(distinct.count(nullptr) == 0u);
    }
  }
}

BOOST_AUTO_TEST_CASE(grad_ready_synchronize_and_zero_race_without_crash_one_rank) {
  // Misuse from the host (zero and synchronize racing with hooks) must be a
  // status, never a crash or a torn state.
  for (int round = 0; round < 20; ++round) {
    ContextHandle h;
    h.ctx = makeContext(0, 1, "", true, nullptr);
    BOOST_REQUIRE(h.ctx);
    std::atomic<int> bad{0};
    together(kThreads, [&](int t) {
      sf_status st;
      if (t == 0) {
        st = sf_synchronize(h.ctx);
      } else if (t == 1) {
        st = sf_zero_gradients(h.ctx);
        if (st == SF_ERR_INVALID_STATE) st = SF_OK;  // a bucket was in flight
      } else {
        for (int g = kGradients - 1 - t; g >= 0; g -= kThreads) {
          st = sf_grad_ready(h.ctx, g);
          if (st != SF_OK && st != SF_ERR_INVALID_STATE) bad.fetch_add(1);
        }
        st = SF_OK;
      }
      if (st != SF_OK) bad.fetch_add(1);
    });
    BOOST_TEST(bad.load() == 0, sf_last_error());
    BOOST_TEST(statsOf(h.ctx).bucket_count > 1);
  }
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_eight_hook_threads_each) {
  // Two ranks (threads, memory:// store), each with 8 hook threads reporting
  // every gradient of a fresh context at once; the averages are exact.
  const int world = 2, hooks = 8;
  for (int round = 0; round < 3; ++round) {
    const std::string rdv = "memory://" + uniqueName("concurrent");
    struct Result {
      sf_status status = SF_OK;
      std::string error;
      double worst = 0;
      int64_t collectives = 0, buckets = 0;
    };
    auto results = runThreadRanks<Result>(world, [&](int rank) {
      Result r;
      ContextHandle h;
      h.ctx = makeContext(rank, world, rdv, true, nullptr);
      if (!h.ctx) {
        r.status = SF_ERR_INTERNAL;
        r.error = "create";
        return r;
      }
      std::atomic<int> failures{0};
      together(hooks, [&](int t) {
        for (int g = kGradients - 1 - t; g >= 0; g -= hooks) {
          float* p = nullptr;
          if (sf_gradient_data(h.ctx, g, reinterpret_cast<void**>(&p)) != SF_OK) {
            failures.fetch_add(1);
            continue;
          }
          for (int i = 0; i <= g; ++i) p[i] = float(rank + 1) * float(g);
          if (sf_grad_ready(h.ctx, g) != SF_OK) failures.fetch_add(1);
        }
      });
      r.status = failures.load() ? SF_ERR_INTERNAL : sf_synchronize(h.ctx);
      r.error = sf_last_error();
      for (int g = 0; g < kGradients; ++g) {
        float* p = nullptr;
        sf_gradient_data(h.ctx, g, reinterpret_cast<void**>(&p));
        for (int i = 0; i <= g; ++i) {
          const double d = std::abs(double(p[i]) - 1.5 * g);  // (1 + 2) / 2 * g
          if (d > r.worst) r.worst = d;
        }
      }
      const sf_stats s = statsOf(h.ctx);
      r.collectives = s.collectives_issued;
      r.buckets = s.bucket_count;
      return r;
    });
    for (int rank = 0; rank < world; ++rank) {
      BOOST_TEST_CONTEXT("round " << round << ", rank " << rank) {
        const Result& r = results[size_t(rank)];
        BOOST_TEST_REQUIRE(r.status == SF_OK, r.error);
        BOOST_TEST(r.worst == 0.0);
        BOOST_TEST(r.collectives == r.buckets);
      }
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
