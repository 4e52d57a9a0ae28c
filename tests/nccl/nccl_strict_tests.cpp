// The NCCL path where real NCCL is unforgiving (issue 16), on the strict
// CUDA and NCCL stand-ins (tests/standin): teardown never issues a
// collective that could pair with a peer's gradients, the window check rides
// in device-only layouts, ncclInProgress is settled before the reduction
// operator goes, sf_destroy is bounded, the device choice accepts one
// visible GPU and leaves a thread's device as it was; and the stand-in
// itself fails pairings that real NCCL would corrupt. Ranks are threads.

#include <boost/test/unit_test.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "sfsync.h"
#include "tests/nccl/nccl_support.h"
#include "tests/support/thread_ranks.h"

extern "C" {
void sfStandinInProgressMode(int on);
void sfStandinStallFinalize(int on);
}

using namespace sftest;

namespace {

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A meeting point for thread ranks (no sleeps: each waits for the others).
class Meeting {
 public:
  explicit Meeting(int n) : n_(n) {}
  void arrive() {
    const int g = generation_.load();
    if (count_.fetch_add(1) + 1 == n_) {
      count_ = 0;
      generation_.fetch_add(1);
      return;
    }
    while (generation_.load() == g) std::this_thread::yield();
  }

 private:
  const int n_;
  std::atomic<int> count_{0}, generation_{0};
};

struct Rank {
  sf_status status = SF_OK;
  std::string error;
  int failedWindow = -1;
  double value = 0;  // gradient element 0 after the last good window
};

// One rank on device `rank`: `windows` windows of 2 micro-batches over
// device gradients (grad-ready reported), each element += rank + 1 per
// micro-batch. `extraSyncAfter`: this rank synchronizes that window twice.
Rank trainDevice(int rank, int world, const std::string& rdv, int windows, sf_reduce_op op,
                 double prescale, int extraSyncAfter = -1, int64_t timeoutMs = 20000) {
  Rank out;
  cudaSetDevice(rank);
  cudaStream_t stream = nullptr;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  {
    ContextHandle h;
    sf_options o = rankOptions(rank, world, rdv, timeoutMs);
    o.local_rank = rank;
    o.reduce_op = op;
    o.prescale = prescale;
    o.bucket_cap_mb = 256.0 / 1048576.0;
    o.first_bucket_cap_mb = 128.0 / 1048576.0;
    auto ok = [&](sf_status st, int w) {
      if (st != SF_OK && out.status == SF_OK) {
        out.status = st;
        out.error = sf_last_error();
        out.failedWindow = w;
      }
      return st == SF_OK;
    };
    if (!ok(sf_create(&o, &h.ctx), -1) || !ok(sf_set_cuda_stream(h.ctx, stream), -1)) return out;
    const std::vector<int64_t> sizes = {40, 24, 64};
    std::vector<void*> data(sizes.size());
    for (size_t p = 0; p < sizes.size(); ++p) {
      int64_t id;
      if (!ok(sf_add_gradient(h.ctx, sizes[p], SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "g", &id), -1)) return out;
    }
    for (size_t p = 0; p < sizes.size(); ++p) {
      if (!ok(sf_gradient_data(h.ctx, int64_t(p), &data[p]), -1)) return out;
    }
    auto backward = [&] {
      const std::vector<void*> d = data;
      launch(stream, [=] {
        for (size_t p = 0; p < sizes.size(); ++p) {
          for (int64_t i = 0; i < sizes[p]; ++i) {
            storeValue(d[p], i, SF_DTYPE_FLOAT32, loadValue(d[p], i, SF_DTYPE_FLOAT32) + rank + 1);
          }
        }
      });
    };
    for (int w = 0; w < windows; ++w) {
      if (!ok(sf_zero_gradients(h.ctx), w) || !ok(sf_begin_accumulation(h.ctx), w)) return out;
      backward();
      if (!ok(sf_end_accumulation(h.ctx), w)) return out;
      backward();
      for (int p = int(sizes.size()) - 1; p >= 0; --p) {
        if (!ok(sf_grad_ready(h.ctx, p), w)) return out;
      }
      if (!ok(sf_synchronize(h.ctx), w)) return out;
      if (w == extraSyncAfter && !ok(sf_synchronize(h.ctx), w)) return out;
      out.value = readDevice(stream, data[0], 1, SF_DTYPE_FLOAT32)[0];
    }
  }
  cudaStreamDestroy(stream);
  return out;
}

}  // namespace

BOOST_AUTO_TEST_SUITE(nccl_strict_tests)

BOOST_AUTO_TEST_CASE(threads2_teardown_issues_no_collective) {
  // Both ranks finish two windows, then destroy their contexts: NCCL sees
  // no collective after the last synchronization (a teardown collective
  // would pair with a peer's next gradient bucket), the communicators are
  // finalized and destroyed, none aborted.
  const std::string rdv = "memory://" + uniqueName("bye");
  Meeting meet(2);
  std::atomic<int64_t> before{0};
  const int64_t aborts = sfStandinNcclCounter("ncclCommAbort");
  const int64_t finalizes = sfStandinNcclCounter("ncclCommFinalize");
  auto runs = runThreadRanks<Rank>(2, [&](int r) {
    Rank out;
    cudaSetDevice(r);
    {
      ContextHandle h;
      sf_options o = rankOptions(r, 2, rdv);
      o.local_rank = r;
      if (sf_create(&o, &h.ctx) != SF_OK) return out;
      int64_t id;
      sf_add_gradient(h.ctx, 32, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &id);
      for (int w = 0; w < 2; ++w) {
        const sf_status st = sf_synchronize(h.ctx);
        if (st != SF_OK && out.status == SF_OK) {
          out.status = st;
          out.error = sf_last_error();
        }
      }
      meet.arrive();
      if (r == 0) before = sfStandinNcclCounter("ncclAllReduce");
      meet.arrive();
    }
    return out;
  });
  for (int r = 0; r < 2; ++r) BOOST_TEST_REQUIRE(runs[size_t(r)].status == SF_OK, runs[size_t(r)].error);
  BOOST_TEST(sfStandinNcclCounter("ncclAllReduce") - before.load() == 0,
             "collectives issued by sf_destroy");
  BOOST_TEST(sfStandinNcclCounter("ncclCommFinalize") - finalizes == 2);
  BOOST_TEST(sfStandinNcclCounter("ncclCommAbort") - aborts == 0);
  BOOST_TEST(sfStandinLiveComms() == 0);
}

BOOST_AUTO_TEST_CASE(threads2_rank_leaving_mid_run_fails_the_peer_never_mixes) {
  // Rank 1 synchronizes window 0 and destroys its context (chaos N1); rank 0
  // goes on to window 1. Its synchronization must fail (its peer is gone),
  // within its timeout, never succeed with teardown bytes in the gradient.
  const std::string rdv = "memory://" + uniqueName("leave");
  const int64_t mismatches = sfStandinNcclCounter("mismatches");
  auto runs = runThreadRanks<Rank>(2, [&](int r) {
    return trainDevice(r, 2, rdv, r == 0 ? 2 : 1, SF_REDUCE_AVERAGE, 1.0, -1, 1500);
  });
  BOOST_TEST(runs[1].status == SF_OK, runs[1].error);
  BOOST_TEST((runs[0].status == SF_ERR_TIMEOUT || runs[0].status == SF_ERR_BACKEND), runs[0].error);
  BOOST_TEST(runs[0].failedWindow == 1, runs[0].error);
  BOOST_TEST(sfStandinNcclCounter("mismatches") - mismatches == 0, "no pairing with a teardown collective");
}

BOOST_AUTO_TEST_CASE(threads2_extra_synchronization_on_device_only_layout_is_mismatch) {
  // Only device gradients: the window check rides in a device bucket. Rank 1
  // synchronizes window 0 twice; the next synchronization fails with
  // SF_ERR_MISMATCH on both ranks, naming the window numbers.
  const std::string rdv = "memory://" + uniqueName("step");
  auto runs = runThreadRanks<Rank>(2, [&](int r) {
    return trainDevice(r, 2, rdv, 3, SF_REDUCE_AVERAGE, 1.0, r == 1 ? 0 : -1);
  });
  for (int r = 0; r < 2; ++r) {
    BOOST_TEST_CONTEXT("rank " << r) {
      BOOST_TEST(runs[size_t(r)].status == SF_ERR_MISMATCH, runs[size_t(r)].error);
      BOOST_TEST(runs[size_t(r)].error.find("out of step") != std::string::npos, runs[size_t(r)].error);
    }
  }
}

BOOST_AUTO_TEST_CASE(threads2_device_only_windows_in_step_are_exact) {
  // The window-check elements are summed unscaled beside an averaged, summed or
  // pre-scaled bucket; the gradients are exact: 2 micro-batches of rank + 1.
  for (sf_reduce_op op : {SF_REDUCE_AVERAGE, SF_REDUCE_SUM, SF_REDUCE_PRESCALED_SUM}) {
    const std::string rdv = "memory://" + uniqueName("exact");
    auto runs = runThreadRanks<Rank>(2, [&](int r) { return trainDevice(r, 2, rdv, 3, op, 0.25); });
    const double sum = 2 * 1 + 2 * 2;
    const double want = op == SF_REDUCE_AVERAGE ? sum / 2 : op == SF_REDUCE_SUM ? sum : sum * 0.25;
    for (int r = 0; r < 2; ++r) {
      BOOST_TEST_REQUIRE(runs[size_t(r)].status == SF_OK, "op " << op << ": " << runs[size_t(r)].error);
      BOOST_TEST(runs[size_t(r)].value == want, "op " << op << " rank " << r);
    }
  }
}

BOOST_AUTO_TEST_CASE(threads2_in_progress_calls_settle_before_the_operator_goes) {
  // The stand-in's in-progress mode: collectives on the non-blocking
  // communicator return ncclInProgress; destroying the pre-multiplied sum's
  // operator before they settle fails the communicator.
  sfStandinInProgressMode(1);
  const std::string rdv = "memory://" + uniqueName("inprogress");
  auto runs = runThreadRanks<Rank>(2, [&](int r) {
    return trainDevice(r, 2, rdv, 2, SF_REDUCE_PRESCALED_SUM, 0.5);
  });
  sfStandinInProgressMode(0);
  for (int r = 0; r < 2; ++r) {
    BOOST_TEST(runs[size_t(r)].status == SF_OK, runs[size_t(r)].error);
    BOOST_TEST(runs[size_t(r)].value == 3.0);
  }
}

BOOST_AUTO_TEST_CASE(threads2_destroy_is_bounded_when_finalize_never_settles) {
  // A peer's network flush that never ends: sf_destroy gives up at
  // timeout_ms (+ the documented 2 s slack) and aborts the communicator.
  const std::string rdv = "memory://" + uniqueName("stall");
  const int64_t aborts = sfStandinNcclCounter("ncclCommAbort");
  Meeting meet(2);
  std::vector<double> seconds(2, 0);
  auto runs = runThreadRanks<Rank>(2, [&](int r) {
    Rank out;
    cudaSetDevice(r);
    sf_context* ctx = nullptr;
    sf_options o = rankOptions(r, 2, rdv, 1000);
    o.local_rank = r;
    if (sf_create(&o, &ctx) != SF_OK) return out;
    int64_t id;
    sf_add_gradient(ctx, 32, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &id);
    out.status = sf_synchronize(ctx);
    meet.arrive();
    if (r == 0) sfStandinStallFinalize(1);
    meet.arrive();
    const auto t0 = Clock::now();
    sf_destroy(ctx);
    seconds[size_t(r)] = secondsSince(t0);
    return out;
  });
  sfStandinStallFinalize(0);
  for (int r = 0; r < 2; ++r) {
    BOOST_TEST(runs[size_t(r)].status == SF_OK);
    BOOST_TEST(seconds[size_t(r)] < 1.0 + 2.0, "rank " << r << ": sf_destroy took " << seconds[size_t(r)]
                                                            << " s with timeout_ms = 1000");
  }
  BOOST_TEST(sfStandinNcclCounter("ncclCommAbort") - aborts == 2);
  BOOST_TEST(sfStandinLiveComms() == 0);
}

BOOST_AUTO_TEST_CASE(local_rank_beyond_the_visible_gpus_wraps) {
  // A launcher that shows each rank one GPU (CUDA_VISIBLE_DEVICES per rank)
  // still sets LOCAL_RANK: GPU local_rank % visible GPUs (8 here).
  cudaSetDevice(3);
  void* mem = nullptr;
  cudaMalloc(&mem, 64 * sizeof(float));
  cudaSetDevice(0);
  {
    ContextHandle h;
    sf_options o = rankOptions(0, 1, "");
    o.local_rank = 11;
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    int64_t gid;
    BOOST_TEST(sf_register_gradient(h.ctx, mem, 64, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) == SF_OK,
               sf_last_error());
    BOOST_TEST(sf_synchronize(h.ctx) == SF_OK, sf_last_error());
  }
  cudaFree(mem);
}

BOOST_AUTO_TEST_CASE(a_thread_without_a_device_is_left_without_one) {
  // sfsync switches a host thread to its GPU for each call and back to
  // exactly what the thread had: no context (never GPU 0), or the host's own
  // choice.
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  o.local_rank = 3;
  BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int devBare = -2, devChosen = -2;
  sf_status st = SF_ERR_INTERNAL;
  std::thread bare([&] {
    int64_t gid;
    st = sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid);
    if (st == SF_OK) st = sf_synchronize(h.ctx);
    devBare = int(sfStandinCudaCounter("thread_device"));
  });
  bare.join();
  BOOST_TEST(st == SF_OK, sf_last_error());
  BOOST_TEST(devBare == -1, "a thread that never chose a device is on device " << devBare);
  std::thread chosen([&] {
    cudaSetDevice(5);
    sf_synchronize(h.ctx);
    devChosen = int(sfStandinCudaCounter("thread_device"));
  });
  chosen.join();
  BOOST_TEST(devChosen == 5);
}

BOOST_AUTO_TEST_CASE(standin_fails_mismatched_pairings_and_departed_peers) {
  // The stand-in's strictness itself: an all-reduce of 4 floats paired with
  // one of 8, or with a rank that destroyed its communicator, fails on the
  // ranks that wait (ncclInvalidUsage, saying why), never adds stale bytes.
  for (int variant = 0; variant < 2; ++variant) {
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    Meeting meet(2);
    std::vector<ncclResult_t> async(2, ncclSuccess);
    std::vector<std::string> why(2);
    runThreadRanks<int>(2, [&](int r) {
      cudaSetDevice(r);
      ncclComm_t comm = nullptr;
      ncclCommInitRank(&comm, 2, id, r);
      cudaStream_t s;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      float* x = nullptr;
      cudaMalloc(reinterpret_cast<void**>(&x), 8 * sizeof(float));
      if (variant == 0 || r == 0) {
        if (variant == 1) meet.arrive();  // rank 1 destroyed its communicator
        ncclAllReduce(x, x, r == 0 ? 4 : 8, ncclFloat32, ncclSum, comm, s);
        drain(s);
        ncclCommGetAsyncError(comm, &async[size_t(r)]);
        why[size_t(r)] = ncclGetLastError(comm);
        ncclCommAbort(comm);
      } else {
        ncclCommDestroy(comm);
        meet.arrive();
      }
      cudaFree(x);
      cudaStreamDestroy(s);
      return 0;
    });
    const int ranks = variant == 0 ? 2 : 1;
    for (int r = 0; r < ranks; ++r) {
      BOOST_TEST_CONTEXT("variant " << variant << " rank " << r) {
        BOOST_TEST(async[size_t(r)] == ncclInvalidUsage, why[size_t(r)]);
        BOOST_TEST(why[size_t(r)].find(variant == 0 ? "was paired with" : "destroyed its communicator") !=
                       std::string::npos,
                   why[size_t(r)]);
      }
    }
  }
}

BOOST_AUTO_TEST_SUITE_END()
