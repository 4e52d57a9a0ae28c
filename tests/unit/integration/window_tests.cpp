// The window semantics with ranks as threads over Gloo (memory:// store):
// zero collectives inside windows, one per bucket per window, parity with a
// single-process reference, for several window lengths, world sizes, bucket
// layouts, buffer kinds and dtypes.

#include <boost/test/unit_test.hpp>

#include <cstring>

#include "plugin/core/dtype.h"
#include "tests/support/toy_training.h"

using namespace sftest;


BOOST_AUTO_TEST_SUITE(window_tests)

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_one_bucket_n_1_2_4_8) {
  for (int n : {1, 2, 4, 8}) {
    BOOST_TEST_CONTEXT("N = " << n) {
      Scenario sc;
      sc.micro = {n, n, n};
      checkRuns(sc, trainThreads(sc, "memory://" + uniqueName("one")), 1);
    }
  }
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_many_buckets_n_1_2_4_8) {
  for (int n : {1, 2, 4, 8}) {
    BOOST_TEST_CONTEXT("N = " << n) {
      Scenario sc;
      sc.micro = {n, n, n};
      sc.capMb = kSmallCapMb;
      sc.firstCapMb = kSmallFirstCapMb;
      checkRuns(sc, trainThreads(sc, "memory://" + uniqueName("many")), 4);
    }
  }
}

BOOST_AUTO_TEST_CASE(four_ranks_gloo_threads_many_buckets) {
  Scenario sc;
  sc.world = 4;
  sc.micro = {2, 4, 1};
  sc.capMb = kSmallCapMb;
  sc.firstCapMb = kSmallFirstCapMb;
  checkRuns(sc, trainThreads(sc, "memory://" + uniqueName("four")), 4);
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_windows_of_varying_length) {
  // Longer, then shorter, then length 1: Megatron's learned ready-counts break here.
  Scenario sc;
  sc.micro = {5, 2, 7, 1, 3, 1, 6};
  sc.capMb = kSmallCapMb;
  sc.firstCapMb = kSmallFirstCapMb;
  auto runs = trainThreads(sc, "memory://" + uniqueName("vary"));
  checkRuns(sc, runs, 4);
  int64_t expectedPasses = 0;  // every micro-batch but the last of each window
  for (int n : sc.micro) expectedPasses += n - 1;
  BOOST_TEST(runs[0].stats.deferred_passes == expectedPasses);
}

BOOST_AUTO_TEST_CASE(two_ranks_gloo_threads_host_buffers) {
  Scenario sc;
  sc.flat = false;
  sc.micro = {3, 3};
  sc.capMb = kSmallCapMb;
  sc.firstCapMb = kSmallFirstCapMb;
  checkRuns(sc, trainThreads(sc, "memory://" + uniqueName("host")), 4);
}

BOOST_AUTO_TEST_CASE(grad_ready_starts_every_bucket_before_synchronize) {
  Scenario sc;
  sc.micro = {4, 2};
  sc.capMb = kSmallCapMb;
  sc.firstCapMb = kSmallFirstCapMb;
  auto runs = trainThreads(sc, "memory://" + uniqueName("early"));
  checkRuns(sc, runs, 4);
  for (const auto& run : runs) {
    for (int64_t e : run.early) BOOST_TEST(e == 4);
  }
  sc.gradReady = false;  // a host without hooks: everything starts at synchronize
  runs = trainThreads(sc, "memory://" + uniqueName("late"));
  checkRuns(sc, runs, 4);
  for (const auto& run : runs) {
    for (int64_t e : run.early) BOOST_TEST(e == 0);
  }
}

BOOST_AUTO_TEST_CASE(world_size_one_needs_no_peer) {
  Scenario sc;
  sc.world = 1;
  sc.micro = {3, 1};
  std::vector<RankRun> runs = {trainRank(sc, 0, "")};
  checkRuns(sc, runs, 1);
}

// Each dtype, each reduction, flat and host buffers: rank r contributes
// r + 1 (exact in every dtype), so the results are exact.
BOOST_AUTO_TEST_CASE(every_dtype_and_reduction_two_ranks_gloo_threads) {
  struct Case {
    sf_reduce_op op;
    double prescale;
    double expected;  // from 1 + 2
  };
  const Case cases[] = {{SF_REDUCE_AVERAGE, 1, 1.5}, {SF_REDUCE_SUM, 1, 3}, {SF_REDUCE_PRESCALED_SUM, 0.25, 0.75}};
  for (sf_dtype dtype : {SF_DTYPE_FLOAT32, SF_DTYPE_FLOAT64, SF_DTYPE_FLOAT16, SF_DTYPE_BFLOAT16}) {
    for (const Case& c : cases) {
      BOOST_TEST_CONTEXT(sfsync::dtypeName(dtype) << " op " << c.op) {
        const std::string rdv = "memory://" + uniqueName("dtype");
        struct Out {
          sf_status st = SF_OK;
          std::string err;
          std::vector<double> host, flat;
          int64_t bytes = 0;
        };
        auto outs = runThreadRanks<Out>(2, [&](int rank) {
          Out out;
          sf_options o = rankOptions(rank, 2, rdv);
          o.reduce_op = c.op;
          o.prescale = c.prescale;
          ContextHandle h;
          const size_t es = sfsync::dtypeSize(dtype);
          std::vector<char> host(1001 * es);
          int64_t a = -1, b = -1;
          void* flat = nullptr;
          auto fill = [&](void* p, int64_t n) {  // rank + 1 in the dtype
            const double value = double(rank + 1);
            const float f = float(value);
            for (int64_t i = 0; i < n; ++i) {
              char* dst = static_cast<char*>(p) + size_t(i) * es;
              switch (dtype) {
                case SF_DTYPE_FLOAT32: std::memcpy(dst, &f, 4); break;
                case SF_DTYPE_FLOAT64: std::memcpy(dst, &value, 8); break;
                case SF_DTYPE_FLOAT16: { uint16_t h16 = sfsync::floatToHalf(f); std::memcpy(dst, &h16, 2); break; }
                default: { uint16_t b16 = sfsync::floatToBf16(f); std::memcpy(dst, &b16, 2); break; }
              }
            }
          };
          auto read = [&](const void* p, int64_t n) {
            std::vector<double> v;
            for (int64_t i = 0; i < n; ++i) {
              const char* src = static_cast<const char*>(p) + size_t(i) * es;
              float f;
              double d;
              uint16_t u;
              switch (dtype) {
                case SF_DTYPE_FLOAT32: std::memcpy(&f, src, 4); v.push_back(f); break;
                case SF_DTYPE_FLOAT64: std::memcpy(&d, src, 8); v.push_back(d); break;
                case SF_DTYPE_FLOAT16: std::memcpy(&u, src, 2); v.push_back(sfsync::halfToFloat(u)); break;
                default: std::memcpy(&u, src, 2); v.push_back(sfsync::bf16ToFloat(u)); break;
              }
            }
            return v;
          };
          if ((out.st = sf_create(&o, &h.ctx)) ||
              (out.st = sf_register_gradient(h.ctx, host.data(), 1001, dtype, SF_DEVICE_HOST, "host", &a)) ||
              (out.st = sf_add_gradient(h.ctx, 7, dtype, SF_DEVICE_HOST, "flat", &b)) ||
              (out.st = sf_gradient_data(h.ctx, b, &flat))) {
            out.err = sf_last_error();
            return out;
          }
          fill(host.data(), 1001);
          fill(flat, 7);
          if ((out.st = sf_synchronize(h.ctx))) {
            out.err = sf_last_error();
            return out;
          }
          out.host = read(host.data(), 1001);
          out.flat = read(flat, 7);
          out.bytes = statsOf(h.ctx).bytes_reduced;
          return out;
        });
        for (const auto& out : outs) {
          BOOST_TEST_REQUIRE(out.st == SF_OK, out.err);
          BOOST_TEST(out.bytes == int64_t(1008 * sfsync::dtypeSize(dtype)));
          for (double v : out.host) BOOST_TEST(v == c.expected);
          for (double v : out.flat) BOOST_TEST(v == c.expected);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
