// Ranks out of step in a context whose gradients are mixed: some in host
// memory (Gloo buckets), some in device memory (NCCL buckets, on the strict
// CUDA and NCCL stand-ins of tests/standin). In step, every value is the
// exact average, host and device, with windows of changing and of uneven
// lengths; a skipped or added sf_synchronize fails every rank with
// SF_ERR_MISMATCH naming the window numbers, whichever bucket kind comes
// first and whichever kind carries the check, no synchronization returns
// SF_OK with values of the wrong windows, and later synchronizations keep
// failing without touching either kind's gradients. Ranks are threads.

#include <boost/test/unit_test.hpp>

#include <string>
#include <vector>

#include "sfsync.h"
#include "tests/nccl/nccl_support.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

struct Grad {
  int64_t numel;
  sf_dtype dtype;
  sf_device device;
};

// Bucket caps below every gradient's size: one bucket per gradient, so the
// number of device buckets is the number of device gradients.
constexpr double kCapMb = 64.0 / 1048576.0;

struct Plan {
  int world = 2;
  std::vector<Grad> grads;               // registration order (buckets: the reverse)
  std::vector<std::vector<int>> micro;   // [rank][window] micro-batches
  int skipRank = -1, skipWindow = -1;    // this rank does not synchronize window skipWindow
  int skipCount = 1;                     // ... nor the skipCount - 1 windows after it
  int extraRank = -1, extraWindow = -1;  // this rank synchronizes window extraWindow twice
  bool gradReady = true;
  bool flat = true;  // plugin-owned flat buffers, else host vectors and cudaMalloc'd memory
  sf_reduce_op op = SF_REDUCE_AVERAGE;
  int laterSyncs = 0;  // after a failed synchronize: this many more micro-batches and synchronizes
};

struct Outcome {
  sf_status status = SF_OK;
  std::string error;
  int failedAtSync = -1;  // index of the sf_synchronize call that failed first
  int syncs = 0;          // sf_synchronize calls made before the later ones
  int okSyncs = 0;        // of those, the ones that returned SF_OK
  int checked = 0;        // SF_OK synchronizes whose values were compared (all in-step windows)
  int64_t hostCompared = 0, deviceCompared = 0;  // elements compared
  int64_t hostWrong = 0, deviceWrong = 0;        // of those, not exactly the expected average
  std::string firstWrong;
  std::vector<sf_status> later;
  std::vector<std::string> laterErrors;
  int64_t laterCollectives = 0;              // sf_stats: collectives the later synchronizes issued
  int64_t laterHostChanged = 0, laterDeviceChanged = 0;  // elements a later (failed) synchronize changed
  int64_t buckets = 0;
};

// Every element of gradient p on rank r after window w: the sum of its
// micro-batches (gradValue: exact in float32 and float64).
double localSum(int r, int w, int n, int p, int64_t i) {
  double s = 0;
  for (int m = 0; m < n; ++m) s += gradValue(r, w, m, p, i);
  return s;
}

double expectedValue(const Plan& plan, int w, int p, int64_t i) {
  double s = 0;
  for (int r = 0; r < plan.world; ++r) s += localSum(r, w, plan.micro[size_t(r)][size_t(w)], p, i);
  return plan.op == SF_REDUCE_AVERAGE ? s / plan.world : s;
}

Outcome runRank(const Plan& plan, int rank, const std::string& rdv) {
  Outcome out;
  auto setup = [&](sf_status st, const char* what) {
    if (st != SF_OK && out.status == SF_OK) {
      out.status = SF_ERR_INTERNAL;  // not the status under test: the setup failed
      out.error = std::string("setup: ") + what + ": " + sf_last_error();
    }
    return st == SF_OK;
  };
  cudaSetDevice(rank);
  cudaStream_t stream = nullptr;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  const int np = int(plan.grads.size());
  std::vector<std::vector<char>> hostOwn(static_cast<size_t>(np));
  std::vector<void*> deviceOwn(size_t(np), nullptr);
  {
    ContextHandle h;
    sf_options o = rankOptions(rank, plan.world, rdv, 5000);
    o.local_rank = rank;
    o.bucket_cap_mb = kCapMb;
    o.first_bucket_cap_mb = kCapMb;
    o.reduce_op = plan.op;
    if (!setup(sf_create(&o, &h.ctx), "sf_create") ||
        !setup(sf_set_cuda_stream(h.ctx, stream), "sf_set_cuda_stream")) {
      return out;
    }
    std::vector<void*> data(size_t(np), nullptr);
    for (int p = 0; p < np; ++p) {
      const Grad& g = plan.grads[size_t(p)];
      const std::string name = std::string(g.device == SF_DEVICE_HOST ? "host" : "cuda") + std::to_string(p);
      int64_t id = -1;
      if (plan.flat) {
        if (!setup(sf_add_gradient(h.ctx, g.numel, g.dtype, g.device, name.c_str(), &id), "sf_add_gradient")) {
          return out;
        }
      } else {
        const size_t bytes = size_t(g.numel) * sfsync::dtypeSize(g.dtype);
        void* mem = nullptr;
        if (g.device == SF_DEVICE_HOST) {
          hostOwn[size_t(p)].assign(bytes, 0);
          mem = hostOwn[size_t(p)].data();
        } else {
          cudaMalloc(&deviceOwn[size_t(p)], bytes);
          cudaMemset(deviceOwn[size_t(p)], 0, bytes);
          mem = deviceOwn[size_t(p)];
        }
        if (!setup(sf_register_gradient(h.ctx, mem, g.numel, g.dtype, g.device, name.c_str(), &id),
                   "sf_register_gradient")) {
          return out;
        }
      }
    }
    for (int p = 0; p < np; ++p) {
      if (!setup(sf_gradient_data(h.ctx, p, &data[size_t(p)]), "sf_gradient_data")) return out;
    }
    out.buckets = statsOf(h.ctx).bucket_count;

    // One micro-batch of window w: host gradients written here, device ones
    // by a "kernel" on the host's stream; grad-ready in backward order.
    auto microBatch = [&](int w, int m) {
      for (int p = np - 1; p >= 0; --p) {
        const Grad g = plan.grads[size_t(p)];
        void* d = data[size_t(p)];
        auto add = [=] {
          for (int64_t i = 0; i < g.numel; ++i) {
            storeValue(d, i, g.dtype, loadValue(d, i, g.dtype) + gradValue(rank, w, m, p, i));
          }
        };
        if (g.device == SF_DEVICE_HOST) {
          add();
        } else {
          launch(stream, add);
        }
        if (plan.gradReady) setup(sf_grad_ready(h.ctx, p), "sf_grad_ready");
      }
    };
    // Both kinds' values, read in stream order for the device ones.
    auto values = [&](int p) {
      const Grad& g = plan.grads[size_t(p)];
      if (g.device != SF_DEVICE_HOST) return readDevice(stream, data[size_t(p)], g.numel, g.dtype);
      std::vector<double> v(size_t(g.numel));
      for (int64_t i = 0; i < g.numel; ++i) v[size_t(i)] = loadValue(data[size_t(p)], i, g.dtype);
      return v;
    };
    auto synchronize = [&](int w, bool inStep) {
      const sf_status st = sf_synchronize(h.ctx);
      const int index = out.syncs++;
      if (st != SF_OK) {
        if (out.status == SF_OK) {
          out.status = st;
          out.error = sf_last_error();
          out.failedAtSync = index;
        }
        return false;
      }
      ++out.okSyncs;
      if (!inStep) return true;
      ++out.checked;
      for (int p = 0; p < np; ++p) {
        const bool host = plan.grads[size_t(p)].device == SF_DEVICE_HOST;
        const std::vector<double> got = values(p);
        for (size_t i = 0; i < got.size(); ++i) {
          const double want = expectedValue(plan, w, p, int64_t(i));
          (host ? out.hostCompared : out.deviceCompared) += 1;
          if (got[i] == want) continue;
          (host ? out.hostWrong : out.deviceWrong) += 1;
          if (out.firstWrong.empty()) {
            out.firstWrong = "window " + std::to_string(w) + " gradient " + std::to_string(p) + "[" +
                             std::to_string(i) + "] = " + std::to_string(got[i]) + ", want " +
                             std::to_string(want);
          }
        }
      }
      return true;
    };

    const std::vector<int>& micro = plan.micro[size_t(rank)];
    for (int w = 0; w < int(micro.size()) && out.status == SF_OK; ++w) {
      const int n = micro[size_t(w)];
      if (!setup(sf_zero_gradients(h.ctx), "sf_zero_gradients")) break;
      if (n > 1 && !setup(sf_begin_accumulation(h.ctx), "sf_begin_accumulation")) break;
      for (int m = 0; m + 1 < n; ++m) microBatch(w, m);
      if (n > 1 && !setup(sf_end_accumulation(h.ctx), "sf_end_accumulation")) break;
      microBatch(w, n - 1);
      if (rank == plan.skipRank && w >= plan.skipWindow && w < plan.skipWindow + plan.skipCount) continue;
      // Every window before a skip or an extra synchronization is in step
      // on every rank: its values are checked (uneven lengths included).
      const bool inStep = (plan.skipRank < 0 || w < plan.skipWindow) &&
                          (plan.extraRank < 0 || w <= plan.extraWindow);
      if (!synchronize(w, inStep)) break;
      if (rank == plan.extraRank && w == plan.extraWindow && !synchronize(w, false)) break;
    }
    // A failed context stays failed: each later synchronize fails at once,
    // issues nothing and leaves both kinds of gradients as they were.
    const int64_t failedAt = statsOf(h.ctx).collectives_issued;
    for (int k = 0; k < plan.laterSyncs && out.status != SF_OK; ++k) {
      microBatch(100 + k, 0);
      std::vector<std::vector<double>> before;
      for (int p = 0; p < np; ++p) before.push_back(values(p));
      out.later.push_back(sf_synchronize(h.ctx));
      out.laterErrors.push_back(sf_last_error());
      for (int p = 0; p < np; ++p) {
        const bool host = plan.grads[size_t(p)].device == SF_DEVICE_HOST;
        const std::vector<double> after = values(p);
        for (size_t i = 0; i < after.size(); ++i) {
          if (after[i] != before[size_t(p)][i]) (host ? out.laterHostChanged : out.laterDeviceChanged) += 1;
        }
      }
    }
    out.laterCollectives = statsOf(h.ctx).collectives_issued - failedAt;
  }
  for (void* p : deviceOwn) cudaFree(p);
  cudaStreamDestroy(stream);
  return out;
}

// The run, and the stand-in NCCL's all-reduce calls it made (all ranks).
struct Run {
  std::vector<Outcome> ranks;
  int64_t ncclAllReduces = 0;
  int64_t ncclMismatches = 0;  // pairings the stand-in refused (real NCCL would corrupt or hang)
};

Run runPlan(const Plan& plan) {
  Run run;
  const std::string rdv = "memory://" + uniqueName("mixedstep");
  const int64_t calls = sfStandinNcclCounter("ncclAllReduce");
  const int64_t mismatches = sfStandinNcclCounter("mismatches");
  run.ranks = runThreadRanks<Outcome>(plan.world, [&](int r) { return runRank(plan, r, rdv); });
  run.ncclAllReduces = sfStandinNcclCounter("ncclAllReduce") - calls;
  run.ncclMismatches = sfStandinNcclCounter("mismatches") - mismatches;
  return run;
}

int countOn(const Plan& plan, sf_device d) {
  int n = 0;
  for (const Grad& g : plan.grads) n += g.device == d;
  return n;
}

// Every synchronize returned SF_OK and every value, host and device, is the
// exact reduction of every window.
void expectInStep(const Plan& plan, const Run& run) {
  const size_t windows = plan.micro[0].size();
  int64_t hostElems = 0, deviceElems = 0;
  for (const Grad& g : plan.grads) (g.device == SF_DEVICE_HOST ? hostElems : deviceElems) += g.numel;
  BOOST_TEST(run.ncclMismatches == 0);
  for (size_t r = 0; r < run.ranks.size(); ++r) {
    const Outcome& o = run.ranks[r];
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST_REQUIRE(o.status == SF_OK, o.error);
      BOOST_TEST(o.buckets == int64_t(plan.grads.size()));
      BOOST_TEST(o.checked == int(windows));
      BOOST_TEST(o.hostCompared == hostElems * int64_t(windows));
      BOOST_TEST(o.deviceCompared == deviceElems * int64_t(windows));
      BOOST_TEST(o.hostWrong == 0, o.firstWrong);
      BOOST_TEST(o.deviceWrong == 0, o.firstWrong);
    }
  }
}

// Every rank's synchronize number `atSync` failed with SF_ERR_MISMATCH
// naming the range of window numbers; every synchronize before it returned
// SF_OK with exact values (none returned SF_OK with another window's).
void expectOutOfStep(const Run& run, int atSync, int64_t lo, int64_t hi) {
  const std::string range = "from " + std::to_string(lo) + " to " + std::to_string(hi);
  BOOST_TEST(run.ncclMismatches == 0);
  for (size_t r = 0; r < run.ranks.size(); ++r) {
    const Outcome& o = run.ranks[r];
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST(o.status == SF_ERR_MISMATCH, o.error);
      BOOST_TEST(o.error.find("out of step") != std::string::npos, o.error);
      BOOST_TEST(o.error.find(range) != std::string::npos, o.error);
      BOOST_TEST(o.failedAtSync == atSync);
      BOOST_TEST(o.okSyncs == atSync);
      BOOST_TEST(o.checked == atSync);
      BOOST_TEST(o.hostWrong == 0, o.firstWrong);
      BOOST_TEST(o.deviceWrong == 0, o.firstWrong);
    }
  }
}

// Layouts: host and device gradients in different orders; float32 and
// float64 (exact for every value here).
std::vector<Grad> hostFirst() {
  return {{40, SF_DTYPE_FLOAT32, SF_DEVICE_HOST},
          {24, SF_DTYPE_FLOAT64, SF_DEVICE_HOST},
          {36, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA},
          {20, SF_DTYPE_FLOAT64, SF_DEVICE_CUDA}};
}

std::vector<Grad> deviceFirst() {
  return {{36, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA},
          {20, SF_DTYPE_FLOAT64, SF_DEVICE_CUDA},
          {40, SF_DTYPE_FLOAT32, SF_DEVICE_HOST},
          {24, SF_DTYPE_FLOAT64, SF_DEVICE_HOST}};
}

std::vector<Grad> interleaved() {
  return {{36, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA},
          {40, SF_DTYPE_FLOAT32, SF_DEVICE_HOST},
          {20, SF_DTYPE_FLOAT64, SF_DEVICE_CUDA},
          {24, SF_DTYPE_FLOAT32, SF_DEVICE_HOST}};
}

struct Named {
  const char* name;
  std::vector<Grad> grads;
};

std::vector<Named> mixedLayouts() {
  return {{"host registered first (device buckets first)", hostFirst()},
          {"device registered first (host buckets first)", deviceFirst()},
          {"interleaved", interleaved()}};
}

}  // namespace

BOOST_AUTO_TEST_SUITE(nccl_mixed_step_tests)

BOOST_AUTO_TEST_CASE(threads2_in_step_windows_of_changing_lengths_are_exact_on_host_and_device) {
  // All ranks use the same length in a window; the length changes from
  // window to window (1: no sf_begin_accumulation at all).
  for (const Named& layout : mixedLayouts()) {
    for (bool hooks : {true, false}) {
      for (bool flat : {true, false}) {
        BOOST_TEST_CONTEXT(layout.name << (hooks ? ", hooks" : ", no hooks")
                                       << (flat ? ", flat" : ", host-registered")) {
          Plan p;
          p.grads = layout.grads;
          p.micro = {{3, 1, 2, 4, 1}, {3, 1, 2, 4, 1}};
          p.gradReady = hooks;
          p.flat = flat;
          expectInStep(p, runPlan(p));
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(threads2_and_4_uneven_lengths_per_rank_are_exact_on_host_and_device) {
  // Different lengths on different ranks in one window stay legal: every
  // value is the average of what each rank accumulated.
  for (const Named& layout : mixedLayouts()) {
    BOOST_TEST_CONTEXT(layout.name << ", 2 ranks") {
      Plan p;
      p.grads = layout.grads;
      p.micro = {{4, 1, 2, 1, 5}, {1, 3, 1, 2, 2}};
      expectInStep(p, runPlan(p));
    }
  }
  BOOST_TEST_CONTEXT("4 ranks, sum") {
    Plan p;
    p.world = 4;
    p.op = SF_REDUCE_SUM;
    p.grads = interleaved();
    p.micro = {{2, 1, 3}, {1, 1, 2}, {3, 2, 1}, {2, 4, 1}};
    expectInStep(p, runPlan(p));
  }
}

BOOST_AUTO_TEST_CASE(threads2_one_rank_skips_a_synchronize) {
  // Rank 1 skips window 1's synchronization (no grad-ready hooks, as in the
  // host-only suite): its next one is window 3, rank 0's is window 2.
  for (const Named& layout : mixedLayouts()) {
    for (bool flat : {true, false}) {
      BOOST_TEST_CONTEXT(layout.name << (flat ? ", flat" : ", host-registered")) {
        Plan p;
        p.grads = layout.grads;
        p.micro = {{2, 2, 2, 2}, {2, 2, 2, 2}};
        p.gradReady = false;
        p.flat = flat;
        p.skipRank = 1;
        p.skipWindow = 1;
        const Run run = runPlan(p);
        expectOutOfStep(run, 1, 2, 3);
        BOOST_TEST(run.ranks[0].error.find("synchronizing window 2") != std::string::npos, run.ranks[0].error);
        BOOST_TEST(run.ranks[1].error.find("synchronizing window 3") != std::string::npos, run.ranks[1].error);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(threads2_one_rank_adds_a_synchronize) {
  // Rank 0 synchronizes window 0 twice (grad-ready hooks: a synchronize
  // with no report since the last one is an extra one); its second claims
  // window 1 again while rank 1 is at 2.
  for (const Named& layout : mixedLayouts()) {
    for (bool flat : {true, false}) {
      BOOST_TEST_CONTEXT(layout.name << (flat ? ", flat" : ", host-registered")) {
        Plan p;
        p.grads = layout.grads;
        p.micro = {{2, 1, 3, 2}, {2, 1, 3, 2}};
        p.flat = flat;
        p.extraRank = 0;
        p.extraWindow = 0;
        expectOutOfStep(runPlan(p), 1, 1, 2);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(threads4_one_skips_one_adds) {
  {
    Plan p;
    p.world = 4;
    p.grads = hostFirst();
    p.micro = std::vector<std::vector<int>>(4, {3, 2, 2});
    p.gradReady = false;
    p.skipRank = 2;
    p.skipWindow = 0;
    expectOutOfStep(runPlan(p), 0, 1, 2);
  }
  {
    Plan p;
    p.world = 4;
    p.grads = deviceFirst();
    p.micro = std::vector<std::vector<int>>(4, {3, 2, 2});
    p.flat = false;
    p.extraRank = 3;
    p.extraWindow = 1;
    expectOutOfStep(runPlan(p), 2, 2, 3);
  }
}

BOOST_AUTO_TEST_CASE(threads2_a_failed_check_fails_every_later_synchronize_host_and_device) {
  // Rank 1 adds a synchronization in window 1; both ranks then go on: three
  // more micro-batches and synchronizes each. Every one fails with the
  // first failure (said again at once), issues no collective, and leaves
  // the host and the device gradients exactly as the rank left them.
  for (const Named& layout : mixedLayouts()) {
    BOOST_TEST_CONTEXT(layout.name) {
      Plan p;
      p.grads = layout.grads;
      p.micro = {{2, 2, 2, 2}, {2, 2, 2, 2}};
      p.extraRank = 1;
      p.extraWindow = 1;
      p.laterSyncs = 3;
      const Run run = runPlan(p);
      expectOutOfStep(run, 2, 2, 3);
      for (size_t r = 0; r < run.ranks.size(); ++r) {
        const Outcome& o = run.ranks[r];
        BOOST_TEST_CONTEXT("rank " << r) {
          BOOST_TEST_REQUIRE(o.later.size() == 3u);
          for (size_t k = 0; k < o.later.size(); ++k) {
            BOOST_TEST(o.later[k] == SF_ERR_MISMATCH, o.laterErrors[k]);
            BOOST_TEST(o.laterErrors[k].find("failed earlier") != std::string::npos, o.laterErrors[k]);
            BOOST_TEST(o.laterErrors[k].find("out of step") != std::string::npos, o.laterErrors[k]);
          }
          BOOST_TEST(o.laterCollectives == 0);
          BOOST_TEST(o.laterHostChanged == 0);
          BOOST_TEST(o.laterDeviceChanged == 0);
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(threads2_the_check_holds_whichever_bucket_kind_carries_it) {
  // The check rides in one bucket of the most exact dtype: a host one when
  // one is that exact (Gloo, memcpy), else a device one (NCCL: the two
  // values go through a pinned copy and a second, unscaled ncclAllReduce). The stand-in's
  // all-reduce count shows which kind carried it; in step the values are
  // exact and out of step every rank fails, with either carrier.
  struct Case {
    const char* name;
    std::vector<Grad> grads;
    bool deviceCarries;
  };
  const std::vector<Case> cases = {
      {"host-only layout", {{40, SF_DTYPE_FLOAT32, SF_DEVICE_HOST}, {24, SF_DTYPE_FLOAT64, SF_DEVICE_HOST}}, false},
      {"device-only layout", {{36, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA}, {20, SF_DTYPE_FLOAT64, SF_DEVICE_CUDA}}, true},
      // The most exact dtype carries (it sets the modulus), a host bucket
      // among equals.
      {"mixed, float64 host and float32 device",
       {{40, SF_DTYPE_FLOAT64, SF_DEVICE_HOST}, {20, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA}}, false},
      {"mixed, float32 host and float64 device",
       {{40, SF_DTYPE_FLOAT32, SF_DEVICE_HOST}, {20, SF_DTYPE_FLOAT64, SF_DEVICE_CUDA}}, true},
      {"mixed, bfloat16 host and float32 device",
       {{20, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA}, {40, SF_DTYPE_BFLOAT16, SF_DEVICE_HOST}}, true},
      {"mixed, device bucket first", hostFirst(), false},
      {"mixed, host bucket first", deviceFirst(), false}};
  for (const Case& c : cases) {
    BOOST_TEST_CONTEXT(c.name) {
      Plan p;
      p.grads = c.grads;
      p.micro = {{2, 3, 2, 1}, {2, 3, 2, 1}};
      const Run clean = runPlan(p);
      expectInStep(p, clean);
      // Per rank and window: one all-reduce per device bucket, one more when
      // a device bucket carries the check; the layout check (two int64
      // all-reduces per rank) goes over the backend of the first bucket
      // started, the last registered gradient's.
      const int64_t devices = countOn(p, SF_DEVICE_CUDA);
      const int64_t windows = int64_t(p.micro[0].size());
      const bool layoutOnNccl = c.grads.back().device == SF_DEVICE_CUDA;
      BOOST_TEST(clean.ncclAllReduces ==
                 p.world * (windows * (devices + (c.deviceCarries ? 1 : 0)) + (layoutOnNccl ? 2 : 0)));

      Plan extra = p;
      extra.extraRank = 1;
      extra.extraWindow = 1;
      expectOutOfStep(runPlan(extra), 2, 2, 3);
      Plan skip = p;
      skip.gradReady = false;
      // Rank 0 skips window 1 (both it and the next begin: a skipped
      // window of one micro-batch, with no begin, is not told apart).
      skip.skipRank = 0;
      skip.skipWindow = 1;
      expectOutOfStep(runPlan(skip), 1, 2, 3);
    }
  }
}

BOOST_AUTO_TEST_CASE(threads2_a_16_bit_host_bucket_does_not_shrink_a_float32_device_layouts_modulus) {
  // The modulus is the layout's most exact dtype's (sfsync.h: float32 on 2
  // ranks p = 2897; the small 16-bit ones, p = 12 for bfloat16 and 33 for
  // float16 on 2 ranks, only for 16-bit-only layouts). Here a float32 device
  // gradient beside a 16-bit host one: rank 0 skips the synchronizes of
  // exactly the 16-bit modulus' number of windows. With a 16-bit carrier the
  // numbers agree modulo p and both ranks return SF_OK with gradients of two
  // different windows averaged.
  for (sf_dtype hostDtype : {SF_DTYPE_BFLOAT16, SF_DTYPE_FLOAT16}) {
    const int skips = hostDtype == SF_DTYPE_BFLOAT16 ? 12 : 33;
    BOOST_TEST_CONTEXT("host dtype " << hostDtype << ", " << skips << " windows skipped") {
      Plan p;
      p.grads = {{40, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA}, {24, hostDtype, SF_DEVICE_HOST}};
      p.micro = {std::vector<int>(size_t(skips + 2), 2), {2, 2}};
      p.gradReady = false;
      p.skipRank = 0;
      p.skipWindow = 1;
      p.skipCount = skips;
      const Run run = runPlan(p);
      expectOutOfStep(run, 1, 2, skips + 2);
      const std::string mine = "synchronizing window " + std::to_string(skips + 2) + ",";
      BOOST_TEST(run.ranks[0].error.find(mine) != std::string::npos, run.ranks[0].error);
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
