// checkLayoutAcrossRanks on its own (plugin/reducer/layout_check.h), without
// the C ABI: each rank is a thread of this test holding its own gradient
// list, claim and window number, and the control collectives go through an
// in-memory exchange of this file (MaxExchange: the elementwise max over
// the threads' arrays, no socket). What every rank must see: the same
// verdict; two control collectives when the ranks agree; SF_ERR_MISMATCH
// naming the first differing gradient (its name, both sizes, dtypes,
// devices), the differing header field with its range, or the window
// numbers compared exactly (not modulo p as the window check does); the
// layout's difference before the window's. Rank bodies assert nothing
// (Boost.Test is not thread-safe): they return what happened.

#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/core/error.h"
#include "plugin/reducer/bucket_memory.h"
#include "plugin/reducer/layout_check.h"

using namespace sfsync;

namespace {

// The elementwise max of every thread rank's array, handed to all of them.
// A rank that waits more than 30 s (a peer skipped the collective: a bug
// under test) gets SF_ERR_TIMEOUT instead of a hang.
class MaxExchange {
 public:
  explicit MaxExchange(int world) : world_(world), inputs_(size_t(world)) {}
  void maxReduce(int rank, int64_t* data, int64_t n) {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t generation = generation_;
    inputs_[size_t(rank)].assign(data, data + n);
    if (++arrived_ == world_) {
      sizesDiffer_ = false;
      result_ = inputs_[0];
      for (const auto& in : inputs_) {
        if (in.size() != result_.size()) sizesDiffer_ = true;
        for (size_t i = 0; i < std::min(in.size(), result_.size()); ++i) {
          result_[i] = std::max(result_[i], in[i]);
        }
      }
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, std::chrono::seconds(30),
                             [&] { return generation_ != generation; })) {
      fail(SF_ERR_TIMEOUT, "a thread rank never joined the control collective");
    }
    if (sizesDiffer_) fail(SF_ERR_INTERNAL, "the ranks sent arrays of different lengths");
    std::copy(result_.begin(), result_.end(), data);
  }

 private:
  const int world_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  bool sizesDiffer_ = false;
  std::vector<std::vector<int64_t>> inputs_;
  std::vector<int64_t> result_;
};

// A rank's backend: control collectives only, counted.
class ExchangeBackend : public Backend {
 public:
  ExchangeBackend(MaxExchange& exchange, int rank) : exchange_(exchange), rank_(rank) {}
  int controls = 0;
  const char* name() const override { return "exchange"; }
  void connect() override {}
  std::unique_ptr<Work> startAllreduce(void*, int64_t, sf_dtype, ReduceSpec) override {
    fail(SF_ERR_INTERNAL, "the layout check started a bucket collective");
  }
  void allreduceMaxInt64(int64_t* data, int64_t n) override {
    ++controls;
    exchange_.maxReduce(rank_, data, n);
  }
  void barrierQuietly() noexcept override {}
  void broadcast(void*, size_t, int) override {}

 private:
  MaxExchange& exchange_;
  int rank_;
};

// What one rank registered and claims.
struct Layout {
  std::vector<Gradient> grads;
  LayoutClaim claim{1, 25 << 20, 1 << 20, SF_REDUCE_AVERAGE, SF_SHARD_NONE};
  int64_t window = 1;
  void add(int64_t numel, sf_dtype dtype, const char* name, sf_device device = SF_DEVICE_HOST) {
    grads.push_back(Gradient{nullptr, numel, dtype, device, name, true});
  }
};

struct Verdict {
  sf_status status = SF_OK;
  std::string message;
  int controls = 0;
};

// `world` thread ranks, rank r checking layout(r).
std::vector<Verdict> check(int world, const std::function<Layout(int)>& layout) {
  MaxExchange exchange(world);
  std::vector<Verdict> out(static_cast<size_t>(world));
  std::vector<Layout> layouts;
  for (int r = 0; r < world; ++r) layouts.push_back(layout(r));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      ExchangeBackend backend(exchange, r);
      const Layout& l = layouts[size_t(r)];
      try {
        checkLayoutAcrossRanks(backend, l.grads, l.claim, l.window);
      } catch (const Error& e) {
        out[size_t(r)].status = e.status();
        out[size_t(r)].message = e.what();
      }
      out[size_t(r)].controls = backend.controls;
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// Every rank failed with SF_ERR_MISMATCH, its message holding every fragment.
void expectMismatch(const std::vector<Verdict>& out, const std::vector<std::string>& fragments) {
  for (size_t r = 0; r < out.size(); ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST(out[r].status == SF_ERR_MISMATCH, out[r].message);
      for (const auto& f : fragments) {
        BOOST_TEST(out[r].message.find(f) != std::string::npos, "'" << f << "' in: " << out[r].message);
      }
    }
  }
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

Layout fourGradients(int64_t third) {
  Layout l;
  l.add(10, SF_DTYPE_FLOAT32, "layer0.weight");
  l.add(10, SF_DTYPE_FLOAT32, "layer0.bias");
  l.add(third, SF_DTYPE_FLOAT32, "layer1.weight");
  l.add(5, SF_DTYPE_FLOAT32, "layer1.bias");
  return l;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(layout_check_tests)

BOOST_AUTO_TEST_CASE(the_same_layout_passes_with_two_control_collectives_2_and_4_thread_ranks) {
  for (int world : {1, 2, 4}) {
    BOOST_TEST_CONTEXT(world << " ranks") {
      const auto out = check(world, [](int) { return fourGradients(20); });
      for (const auto& v : out) {
        BOOST_TEST(v.status == SF_OK, v.message);
        BOOST_TEST(v.controls == 2);  // the header with the window, then the gradients
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(a_different_size_names_the_gradient_on_every_rank_2_thread_ranks) {
  const auto out = check(2, [](int r) { return fourGradients(r == 1 ? 30 : 20); });
  expectMismatch(out, {"ranks registered different gradient layouts", "the first difference is gradient 2",
                       "'layer1.weight'", "ranks range from 20 x float32 on host to 30 x float32 on host"});
  BOOST_TEST(contains(out[0].message, "this rank has 20 x float32 on host"), out[0].message);
  BOOST_TEST(contains(out[1].message, "this rank has 30 x float32 on host"), out[1].message);
  for (const auto& v : out) BOOST_TEST(v.controls == 2);
}

BOOST_AUTO_TEST_CASE(a_different_dtype_4_thread_ranks) {
  const auto out = check(4, [](int r) {
    Layout l;
    l.add(10, SF_DTYPE_FLOAT32, "a");
    l.add(10, r == 3 ? SF_DTYPE_FLOAT64 : SF_DTYPE_FLOAT32, "b");
    return l;
  });
  expectMismatch(out, {"gradient 1", "'b'", "float64", "float32"});
  BOOST_TEST(contains(out[3].message, "this rank has 10 x float64"), out[3].message);
  BOOST_TEST(contains(out[0].message, "this rank has 10 x float32"), out[0].message);
}

BOOST_AUTO_TEST_CASE(a_different_device_3_thread_ranks) {
  const auto out = check(3, [](int r) {
    Layout l;
    l.add(8, SF_DTYPE_BFLOAT16, "w", r == 1 ? SF_DEVICE_CUDA : SF_DEVICE_HOST);
    return l;
  });
  expectMismatch(out, {"gradient 0", "'w'", "from 8 x bfloat16 on host to 8 x bfloat16 on cuda"});
}

BOOST_AUTO_TEST_CASE(only_the_first_difference_is_named) {
  const auto out = check(2, [](int r) {
    Layout l;
    l.add(4, SF_DTYPE_FLOAT32, "same");
    l.add(r == 0 ? 5 : 6, SF_DTYPE_FLOAT32, "first");
    l.add(r == 0 ? 7 : 9, SF_DTYPE_FLOAT16, "second");
    return l;
  });
  expectMismatch(out, {"gradient 1", "'first'"});
  for (const auto& v : out) BOOST_TEST(!contains(v.message, "'second'"), v.message);
}

BOOST_AUTO_TEST_CASE(a_gradient_missing_on_one_rank_2_thread_ranks) {
  const auto out = check(2, [](int r) {
    Layout l;
    l.add(10, SF_DTYPE_FLOAT32, "a");
    l.add(10, SF_DTYPE_FLOAT32, "b");
    if (r == 0) l.add(10, SF_DTYPE_FLOAT32, "extra");
    return l;
  });
  expectMismatch(out, {"gradient counts differ (from 2 to 3", "the first difference is gradient 2",
                       "missing on some ranks"});
  BOOST_TEST(contains(out[0].message, "this rank 3)"), out[0].message);
  BOOST_TEST(contains(out[0].message, "gradient 2 ('extra')"), out[0].message);
  BOOST_TEST(contains(out[1].message, "this rank 2)"), out[1].message);
  BOOST_TEST(!contains(out[1].message, "'extra'"), out[1].message);  // rank 1 has no name for it
  for (const auto& v : out) BOOST_TEST(v.controls == 2);  // the second over the 2 common ones
}

BOOST_AUTO_TEST_CASE(each_header_field_is_named_with_its_range_2_thread_ranks) {
  struct Field {
    const char* words;
    std::function<void(LayoutClaim&)> change;  // rank 1's
    int64_t lo, hi;
  };
  const std::vector<Field> fields = {
      {"bucket counts differ", [](LayoutClaim& c) { c.buckets = 3; }, 1, 3},
      {"bucket_cap_mb differ", [](LayoutClaim& c) { c.capBytes = 4096; }, 4096, 25 << 20},
      {"first_bucket_cap_mb differ", [](LayoutClaim& c) { c.firstCapBytes = 2 << 20; }, 1 << 20, 2 << 20},
      {"reduce ops differ", [](LayoutClaim& c) { c.reduceOp = SF_REDUCE_SUM; }, SF_REDUCE_AVERAGE, SF_REDUCE_SUM},
      {"shard layouts differ", [](LayoutClaim& c) { c.shardLayout = SF_SHARD_PARAMETER; }, SF_SHARD_NONE,
       SF_SHARD_PARAMETER}};
  for (const Field& f : fields) {
    BOOST_TEST_CONTEXT(f.words) {
      const auto out = check(2, [&](int r) {
        Layout l = fourGradients(20);
        if (r == 1) f.change(l.claim);
        return l;
      });
      const std::string range = "(from " + std::to_string(f.lo) + " to " + std::to_string(f.hi);
      expectMismatch(out, {std::string("ranks registered different gradient layouts: ") + f.words, range});
    }
  }
}

BOOST_AUTO_TEST_CASE(window_numbers_are_compared_exactly_2_thread_ranks) {
  // 2897 apart is a multiple of float32's modulus on 2 ranks: the window
  // check would not see it; the layout check must.
  for (int64_t other : {int64_t(7), int64_t(5 + 2897), int64_t(6)}) {
    BOOST_TEST_CONTEXT("windows 5 and " << other) {
      const auto out = check(2, [&](int r) {
        Layout l = fourGradients(20);
        l.window = r == 0 ? 5 : other;
        return l;
      });
      expectMismatch(out, {"ranks are out of step", "the ranks' window numbers range from 5 to " +
                                                        std::to_string(other)});
      BOOST_TEST(contains(out[0].message, "synchronizing window 5,"), out[0].message);
      BOOST_TEST(contains(out[1].message, "synchronizing window " + std::to_string(other) + ","),
                 out[1].message);
    }
  }
}

BOOST_AUTO_TEST_CASE(a_layout_difference_is_named_before_the_window_numbers) {
  const auto out = check(2, [](int r) {
    Layout l = fourGradients(r == 0 ? 20 : 21);
    l.window = r == 0 ? 1 : 4;
    if (r == 1) l.claim.capBytes = 1024;
    return l;
  });
  // The gradients first, then the header fields, then the window.
  expectMismatch(out, {"the first difference is gradient 2"});
  for (const auto& v : out) {
    BOOST_TEST(!contains(v.message, "out of step"), v.message);
    BOOST_TEST(!contains(v.message, "bucket_cap_mb"), v.message);
  }
}

BOOST_AUTO_TEST_CASE(no_gradients_need_only_the_header_collective) {
  const auto out = check(2, [](int) { return Layout{}; });
  for (const auto& v : out) {
    BOOST_TEST(v.status == SF_OK, v.message);
    BOOST_TEST(v.controls == 1);  // nothing to compare one by one
  }
}

BOOST_AUTO_TEST_CASE(a_failed_control_collective_is_rethrown_as_it_is) {
  struct Broken : ExchangeBackend {
    using ExchangeBackend::ExchangeBackend;
    void allreduceMaxInt64(int64_t*, int64_t) override { fail(SF_ERR_BACKEND, "peer lost (test)"); }
  };
  MaxExchange unused(1);
  Broken backend(unused, 0);
  const Layout l = fourGradients(20);
  try {
    checkLayoutAcrossRanks(backend, l.grads, l.claim, l.window);
    BOOST_ERROR("no error");
  } catch (const Error& e) {
    BOOST_TEST(e.status() == SF_ERR_BACKEND);
    BOOST_TEST(std::string(e.what()) == "peer lost (test)");
  }
}

BOOST_AUTO_TEST_SUITE_END()
