// Concurrent first use of a context: many threads (autograd hooks) calling
// the implicitly-building entry points (sf_grad_ready, sf_gradient_data,
// sf_build_buckets, sf_zero_gradients, sf_synchronize, sf_bucket_info,
// sf_get_stats) on a context whose buckets are not built yet. Before 0.2 the
// implicit build ran outside the reducer's lock: two threads built at once,
// leaked flat buffers and crashed in Reducer::build / Reducer::start.
// Since 0.5 (issue 45), also the window calls from several host threads at
// once (two synchronizes of one window, zero, stats, begin and end racing
// a synchronize): see the section at the end.
// Labelled `unit`: the ASan and TSan builds run these.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/backend/gloo_backend.h"
#include "plugin/core/error.h"
#include "plugin/orchestrator/context.h"
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

// ---- Window calls from several host threads at once (issue 45) -------------
//
// Since 0.5 the window calls are serialized per context (include/sfsync.h,
// "Threads"): each call sees the window before or after another thread's,
// never between, and a synchronize that waited for another thread's
// returns that one's outcome instead of synchronizing again. Before, two
// synchronizes of one window both started bucket 0: SF_ERR_INTERNAL
// "bucket 0 (reduced): illegal transition to reducing", ranks left with
// different values, and the dropped Work of a collective in flight
// corrupting the heap (free(): corrupted unsorted chunks, stack smashing).

namespace {

constexpr int kRaceGradients = 8;  // of kRaceElems floats, one per bucket
constexpr int kRaceElems = 64;
// Windows per case, in every tree (the TSan tree's run is the slowest).
constexpr int kRaceWindows = 300;

// Rank `rank`'s value of element i of gradient g in window w: the two
// ranks' average is exact in float32 (rank 0: 7 + ..., rank 1: -1 + ...).
float raceValue(int rank, int g, int i, int w) {
  return float((rank == 0 ? 7 : -1) + g + (i + w) % 4);
}
float raceAverage(int world, int g, int i, int w) {
  return world == 1 ? raceValue(0, g, i, w)
                    : 0.5f * (raceValue(0, g, i, w) + raceValue(1, g, i, w));
}

sf_options raceOptions(int rank, int world, const std::string& rdv) {
  sf_options o = rankOptions(rank, world, rdv, 5000);
  o.bucket_cap_mb = 256.0 / 1048576.0;
  o.first_bucket_cap_mb = o.bucket_cap_mb;
  return o;
}

sf_context* makeRaceContext(int rank, int world, const std::string& rdv) {
  const sf_options o = raceOptions(rank, world, rdv);
  sf_context* ctx = nullptr;
  if (sf_create(&o, &ctx) != SF_OK) return nullptr;
  for (int g = 0; g < kRaceGradients; ++g) {
    int64_t id = -1;
    if (sf_add_gradient(ctx, kRaceElems, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id) != SF_OK) {
      sf_destroy(ctx);
      return nullptr;
    }
  }
  return ctx;
}

float* raceGradient(sf_context* ctx, int g) {
  float* p = nullptr;
  sf_gradient_data(ctx, g, reinterpret_cast<void**>(&p));
  return p;
}

void writeRaceValues(const std::function<float*(int)>& gradient, int rank, int w) {
  for (int g = 0; g < kRaceGradients; ++g) {
    float* p = gradient(g);
    for (int i = 0; i < kRaceElems; ++i) p[i] = raceValue(rank, g, i, w);
  }
}

// Whether every element equals want(g, i).
bool raceValuesAre(const std::function<float*(int)>& gradient,
                   const std::function<float(int, int)>& want) {
  for (int g = 0; g < kRaceGradients; ++g) {
    const float* p = gradient(g);
    for (int i = 0; i < kRaceElems; ++i) {
      if (!p || p[i] != want(g, i)) return false;
    }
  }
  return true;
}

// What one rank saw: the first window that broke the contract, if any.
struct RaceResult {
  int windows = 0;  // windows that kept the contract
  std::string bad;  // "" while the contract held
};

// Exactly one synchronization per window so far: w + 1 windows, one
// collective per bucket each.
void expectSynchronizedOnce(const sf_stats& s, int w, std::ostringstream& bad) {
  if (s.windows_completed != w + 1 || s.collectives_issued != int64_t(kRaceGradients) * (w + 1)) {
    bad << "windows_completed " << s.windows_completed << ", collectives " << s.collectives_issued
        << " after " << w + 1 << " windows of " << kRaceGradients << " buckets; ";
  }
}

// Two racing calls of which exactly one may succeed (the other refused).
void expectOneOfTwo(const char* what, const sf_status* st, const std::string* msg,
                    std::ostringstream& bad) {
  const bool allowed = (st[0] == SF_OK && st[1] == SF_ERR_INVALID_STATE) ||
                       (st[0] == SF_ERR_INVALID_STATE && st[1] == SF_OK);
  if (!allowed) {
    bad << what << ": statuses " << st[0] << ", " << st[1] << " ('" << msg[0] << "', '" << msg[1]
        << "'); ";
  }
}

// `windows` windows on `world` ranks (threads; memory:// store), each rank
// with its context from makeRaceContext; body(ctx, rank, w, bad) runs one
// window and says in `bad` what broke. A rank stops at its first bad window
// (its peer then fails within the timeout, 5 s).
std::vector<RaceResult> raceRanks(
    int world, int windows, const char* tag,
    const std::function<void(sf_context*, int, int, std::ostringstream&)>& body) {
  const std::string rdv = world > 1 ? "memory://" + uniqueName(tag) : "";
  return runThreadRanks<RaceResult>(world, [&](int rank) {
    RaceResult r;
    ContextHandle h;
    h.ctx = makeRaceContext(rank, world, rdv);
    if (!h.ctx) {
      r.bad = "create";
      return r;
    }
    for (int w = 0; w < windows && r.bad.empty(); ++w) {
      std::ostringstream bad;
      body(h.ctx, rank, w, bad);
      if (bad.str().empty()) {
        ++r.windows;
      } else {
        r.bad = "window " + std::to_string(w) + ": " + bad.str();
      }
    }
    return r;  // sf_destroy here, after every thread of the rank joined
  });
}

void expectRaceResults(const std::vector<RaceResult>& results, int windows) {
  for (size_t rank = 0; rank < results.size(); ++rank) {
    BOOST_TEST_CONTEXT("rank " << rank) {
      BOOST_TEST(results[rank].bad == "");
      BOOST_TEST(results[rank].windows == windows);
    }
  }
}

// ---- The Context itself, behind a gate -------------------------------------

// Holds a synchronization's collectives until `callers` synchronize calls of
// the context are under way (Context::synchronizeCallers(): a call counts
// itself once it has read what it joins): calls that a test starts "at
// once" then overlap on every run, however the threads are scheduled. (A
// call that starts after the other returned is a synchronization of its
// own: through the ABI alone, a late thread on one rank would pair with the
// peer's next window.) At most 10 s, then `timedOut` and the test fails.
struct SyncGate {
  std::atomic<const sfsync::Context*> ctx{nullptr};
  int callers = 2;
  std::atomic<bool> timedOut{false};
  void wait() {
    const sfsync::Context* c = ctx.load();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (c && c->synchronizeCallers() < callers) {
      if (std::chrono::steady_clock::now() > deadline) {
        timedOut = true;
        return;
      }
      std::this_thread::yield();
    }
  }
};

// A GlooBackend whose all-reduces start after the gate.
class GatedGloo : public sfsync::Backend {
 public:
  GatedGloo(const sf_options& opts, std::shared_ptr<sfsync::Rendezvous> rdv, SyncGate& gate)
      : inner_(opts, std::move(rdv)), gate_(gate) {}
  const char* name() const override { return inner_.name(); }
  void connect() override { inner_.connect(); }
  std::unique_ptr<sfsync::Work> startAllreduce(void* data, int64_t numel, sf_dtype dtype,
                                               sfsync::ReduceSpec spec) override {
    gate_.wait();
    return inner_.startAllreduce(data, numel, dtype, spec);
  }
  void allreduceMaxInt64(int64_t* data, int64_t n) override { inner_.allreduceMaxInt64(data, n); }
  void barrierQuietly() noexcept override { inner_.barrierQuietly(); }
  void broadcast(void* data, size_t bytes, int root) override {
    inner_.broadcast(data, bytes, root);
  }

 private:
  sfsync::GlooBackend inner_;
  SyncGate& gate_;
};

// A Context call as the C boundary returns it (plugin/api/guard.h).
sf_status contextCall(const std::function<void()>& f, std::string& message) {
  try {
    f();
    return SF_OK;
  } catch (const sfsync::Error& e) {
    message = e.what();
    return e.status();
  } catch (const std::exception& e) {
    message = e.what();
    return SF_ERR_INTERNAL;
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(two_threads_synchronize_at_once_two_ranks_gloo_threads) {
  // The case, on the Context behind a gate (so that the two calls
  // overlap on every run): on each rank, after a window, two threads call
  // synchronize at once. Both return SF_OK: one synchronized, the other
  // waited for that same synchronization. The window is synchronized once
  // (one collective per bucket), every rank holds the exact average, and the
  // context's teardown is clean.
  const int world = 2;
  const std::string rdv = "memory://" + uniqueName("sync-race");
  auto results = runThreadRanks<RaceResult>(world, [&](int rank) {
    RaceResult r;
    SyncGate gate;
    std::unique_ptr<sfsync::Context> ctx;
    std::string msg;
    const sf_status made = contextCall([&] {
      ctx = std::make_unique<sfsync::Context>(
          raceOptions(rank, world, rdv),
          [&gate](sf_device, const sf_options& opts,
                  const std::shared_ptr<sfsync::Rendezvous>& rv) {
            return std::unique_ptr<sfsync::Backend>(std::make_unique<GatedGloo>(opts, rv, gate));
          });
      gate.ctx = ctx.get();
      for (int g = 0; g < kRaceGradients; ++g) {
        ctx->registerGradient(nullptr, kRaceElems, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr);
      }
    }, msg);
    if (made != SF_OK) {
      r.bad = "create: " + msg;
      return r;
    }
    auto gradient = [&](int g) { return static_cast<float*>(ctx->gradientData(g)); };
    for (int w = 0; w < kRaceWindows && r.bad.empty(); ++w) {
      std::ostringstream bad;
      sf_status st[2];
      std::string m[2];
      if (contextCall([&] { ctx->beginAccumulation(); }, m[0]) != SF_OK) {
        bad << "begin: " << m[0] << "; ";
      }
      writeRaceValues(gradient, rank, w);
      if (contextCall([&] { ctx->endAccumulation(); }, m[0]) != SF_OK) {
        bad << "end: " << m[0] << "; ";
      }
      together(2, [&](int t) { st[t] = contextCall([&] { ctx->synchronize(); }, m[t]); });
      for (int t = 0; t < 2; ++t) {
        if (st[t] != SF_OK) bad << "thread " << t << ": status " << st[t] << " '" << m[t] << "'; ";
      }
      if (gate.timedOut) bad << "the two calls did not overlap within 10 s; ";
      if (!raceValuesAre(gradient, [&](int g, int i) { return raceAverage(world, g, i, w); })) {
        bad << "values are not the average; ";
      }
      expectSynchronizedOnce(ctx->stats(), w, bad);
      if (bad.str().empty()) {
        ++r.windows;
      } else {
        r.bad = "window " + std::to_string(w) + ": " + bad.str();
      }
    }
    ctx.reset();  // the teardown of sf_destroy
    return r;
  });
  expectRaceResults(results, kRaceWindows);
}

BOOST_AUTO_TEST_CASE(two_threads_synchronize_at_once_one_rank) {
  // The same through the ABI (libsfsync.so) on one rank, where a second
  // synchronization (a thread that came late) pairs with nobody: both calls
  // return SF_OK, never SF_ERR_INTERNAL; each window is synchronized once
  // or, when the second call started after the first returned, twice; the
  // values stay the rank's own; sf_destroy is clean.
  const int world = 1;
  auto results = raceRanks(world, kRaceWindows, "", [&](sf_context* ctx, int rank, int w,
                                                        std::ostringstream& bad) {
    auto gradient = [&](int g) { return raceGradient(ctx, g); };
    const sf_stats before = statsOf(ctx);
    if (sf_begin_accumulation(ctx) != SF_OK) bad << "begin: " << sf_last_error() << "; ";
    writeRaceValues(gradient, rank, w);
    if (sf_end_accumulation(ctx) != SF_OK) bad << "end: " << sf_last_error() << "; ";
    sf_status st[2];
    std::string msg[2];
    together(2, [&](int t) {
      st[t] = sf_synchronize(ctx);
      msg[t] = sf_last_error();
    });
    for (int t = 0; t < 2; ++t) {
      if (st[t] != SF_OK) bad << "thread " << t << ": status " << st[t] << " '" << msg[t] << "'; ";
    }
    const sf_stats s = statsOf(ctx);
    const int64_t syncs = s.windows_completed - before.windows_completed;
    if ((syncs != 1 && syncs != 2) ||
        s.collectives_issued - before.collectives_issued != syncs * kRaceGradients) {
      bad << "windows_completed +" << syncs << ", collectives +"
          << s.collectives_issued - before.collectives_issued << "; ";
    }
    if (!raceValuesAre(gradient, [&](int g, int i) { return raceAverage(world, g, i, w); })) {
      bad << "values changed; ";
    }
  });
  expectRaceResults(results, kRaceWindows);
}

BOOST_AUTO_TEST_CASE(zero_and_stats_race_synchronize_two_ranks_gloo_threads) {
  // After a window, one thread synchronizes while another zeroes the
  // gradients and a third reads the stats. The zero is served before or
  // after the synchronization, never during it: a rank holds zeros (it
  // zeroed after) or exactly half the peer's values (it zeroed before and
  // the peer after), never a mix. The stats are one window's or the next's.
  const int world = 2;
  auto results = raceRanks(world, kRaceWindows, "zero-race", [&](sf_context* ctx, int rank, int w,
                                                                 std::ostringstream& bad) {
    auto gradient = [&](int g) { return raceGradient(ctx, g); };
    if (sf_begin_accumulation(ctx) != SF_OK) bad << "begin: " << sf_last_error() << "; ";
    writeRaceValues(gradient, rank, w);
    if (sf_end_accumulation(ctx) != SF_OK) bad << "end: " << sf_last_error() << "; ";
    sf_status st[3];
    std::string msg[3];
    sf_stats seen{};
    seen.struct_size = sizeof seen;
    together(3, [&](int t) {
      if (t == 0) st[t] = sf_synchronize(ctx);
      if (t == 1) st[t] = sf_zero_gradients(ctx);
      if (t == 2) st[t] = sf_get_stats(ctx, &seen);
      msg[t] = sf_last_error();
    });
    const char* what[3] = {"synchronize", "zero", "stats"};
    for (int t = 0; t < 3; ++t) {
      if (st[t] != SF_OK) bad << what[t] << ": status " << st[t] << " '" << msg[t] << "'; ";
    }
    if (seen.windows_completed != w && seen.windows_completed != w + 1) {
      bad << "stats in the race: windows_completed " << seen.windows_completed << "; ";
    }
    const int peer = 1 - rank;
    if (!raceValuesAre(gradient, [](int, int) { return 0.0f; }) &&
        !raceValuesAre(gradient, [&](int g, int i) { return 0.5f * raceValue(peer, g, i, w); })) {
      bad << "values are neither zero nor half the peer's; ";
    }
    expectSynchronizedOnce(statsOf(ctx), w, bad);
  });
  expectRaceResults(results, kRaceWindows);
}

BOOST_AUTO_TEST_CASE(end_races_synchronize_two_ranks_gloo_threads) {
  // Inside a window, one thread ends it while another synchronizes: the end
  // succeeds; the synchronize comes after it (SF_OK) or before it and is
  // refused (SF_ERR_INVALID_STATE, inside a window), and the rank then
  // synchronizes once more. Every window is synchronized once, to the exact
  // average.
  const int world = 2;
  auto results = raceRanks(world, kRaceWindows, "end-race", [&](sf_context* ctx, int rank, int w,
                                                               std::ostringstream& bad) {
    auto gradient = [&](int g) { return raceGradient(ctx, g); };
    if (sf_begin_accumulation(ctx) != SF_OK) bad << "begin: " << sf_last_error() << "; ";
    writeRaceValues(gradient, rank, w);
    sf_status st[2];
    std::string msg[2];
    together(2, [&](int t) {
      st[t] = t == 0 ? sf_end_accumulation(ctx) : sf_synchronize(ctx);
      msg[t] = sf_last_error();
    });
    if (st[0] != SF_OK) bad << "end: status " << st[0] << " '" << msg[0] << "'; ";
    if (st[1] != SF_OK && st[1] != SF_ERR_INVALID_STATE) {
      bad << "synchronize: status " << st[1] << " '" << msg[1] << "'; ";
    }
    if (st[1] == SF_ERR_INVALID_STATE && sf_synchronize(ctx) != SF_OK) {
      bad << "synchronize after the end: " << sf_last_error() << "; ";
    }
    if (!raceValuesAre(gradient, [&](int g, int i) { return raceAverage(world, g, i, w); })) {
      bad << "values are not the average; ";
    }
    expectSynchronizedOnce(statsOf(ctx), w, bad);
  });
  expectRaceResults(results, kRaceWindows);
}

BOOST_AUTO_TEST_CASE(window_calls_race_each_other_one_rank) {
  // The window calls against each other (one rank: which of two racing
  // calls wins may differ from rank to rank, which is the host's error):
  // two begins at once open one window (the other refused), two ends at
  // once close it once, and a begin racing a synchronize either follows it
  // (both SF_OK) or precedes it (the synchronize refused inside the
  // window). The counts then say exactly that.
  const int world = 1;
  auto results = raceRanks(world, kRaceWindows, "", [&](sf_context* ctx, int rank, int w,
                                                        std::ostringstream& bad) {
    auto gradient = [&](int g) { return raceGradient(ctx, g); };
    const sf_stats before = statsOf(ctx);
    sf_status st[2];
    std::string msg[2];
    auto pair = [&](const std::function<sf_status(int)>& call) {
      together(2, [&](int t) {
        st[t] = call(t);
        msg[t] = sf_last_error();
      });
    };
    pair([&](int) { return sf_begin_accumulation(ctx); });
    expectOneOfTwo("two begins", st, msg, bad);
    writeRaceValues(gradient, rank, w);
    pair([&](int) { return sf_end_accumulation(ctx); });
    expectOneOfTwo("two ends", st, msg, bad);
    pair([&](int t) { return t == 0 ? sf_synchronize(ctx) : sf_begin_accumulation(ctx); });
    if (st[0] != SF_OK && st[0] != SF_ERR_INVALID_STATE) {
      bad << "synchronize: status " << st[0] << " '" << msg[0] << "'; ";
    }
    if (st[1] != SF_OK) bad << "begin: status " << st[1] << " '" << msg[1] << "'; ";
    if (sf_in_accumulation(ctx) != 1) bad << "not inside the window the begin opened; ";
    // Close the window the racing begin opened and synchronize it.
    if (sf_end_accumulation(ctx) != SF_OK) bad << "end: " << sf_last_error() << "; ";
    if (sf_synchronize(ctx) != SF_OK) bad << "synchronize: " << sf_last_error() << "; ";
    const sf_stats s = statsOf(ctx);
    const int64_t syncs = st[0] == SF_OK ? 2 : 1;
    if (s.windows_begun != before.windows_begun + 2 ||
        s.windows_completed != before.windows_completed + syncs ||
        s.collectives_issued != before.collectives_issued + syncs * kRaceGradients) {
      bad << "windows begun +" << s.windows_begun - before.windows_begun << ", completed +"
          << s.windows_completed - before.windows_completed << ", collectives +"
          << s.collectives_issued - before.collectives_issued << " (want 2, " << syncs << ", "
          << syncs * kRaceGradients << "); ";
    }
    if (!raceValuesAre(gradient, [&](int g, int i) { return raceAverage(world, g, i, w); })) {
      bad << "values changed; ";
    }
  });
  expectRaceResults(results, kRaceWindows);
}

BOOST_AUTO_TEST_SUITE_END()
