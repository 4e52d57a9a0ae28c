#pragma once
// Ranks as threads of the test process: one thread per rank sharing an
// in-memory store (memory://name). Rank bodies must not use Boost.Test
// assertions (they are not thread-safe): they return what happened and the
// test thread asserts on it.

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "sfsync.h"

namespace sftest {

// A name no other test of this process (or another process) uses.
inline std::string uniqueName(const std::string& tag) {
  static std::atomic<int> counter{0};
  return tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

inline sf_options rankOptions(int rank, int world, const std::string& rendezvous,
                              int64_t timeoutMs = 30000) {
  sf_options o;
  sf_options_init(&o, sizeof o);
  o.rank = rank;
  o.world_size = world;
  o.timeout_ms = timeoutMs;
  std::strncpy(o.rendezvous, rendezvous.c_str(), SF_RENDEZVOUS_MAX - 1);
  return o;
}

template <typename R>
std::vector<R> runThreadRanks(int world, const std::function<R(int)>& body) {
  std::vector<R> results(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] { results[size_t(r)] = body(r); });
  }
  for (auto& t : threads) t.join();
  return results;
}

// Owns a context; destroys it at scope exit.
struct ContextHandle {
  sf_context* ctx = nullptr;
  ContextHandle() = default;
  ContextHandle(const ContextHandle&) = delete;
  ContextHandle& operator=(const ContextHandle&) = delete;
  ~ContextHandle() { sf_destroy(ctx); }
};

inline sf_stats statsOf(const sf_context* ctx) {
  sf_stats s{};
  s.struct_size = sizeof s;
  sf_get_stats(ctx, &s);
  return s;
}

}  // namespace sftest
