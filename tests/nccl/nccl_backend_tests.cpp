// The NCCL backend (plugin/backend/nccl) end to end through the C ABI, on the
// CUDA and NCCL stand-ins (tests/standin; this executable runs with them
// first on LD_LIBRARY_PATH): the real libsfsync.so loads the real module
// libsfsync_nccl.so, which runs on stand-in streams, events and collectives.
// Ranks are threads; each uses GPU `rank` and its own non-blocking stream.

#include <boost/test/unit_test.hpp>

#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "sfsync.h"
#include "tests/nccl/nccl_support.h"
#include "tests/support/map_store.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

struct Scenario {
  int world = 2;
  sf_dtype dtype = SF_DTYPE_FLOAT32;
  bool flat = true;                           // plugin-owned flat device buffer, else cudaMalloc'd
  std::vector<int64_t> sizes = {300, 17, 200, 5, 64};
  std::vector<int> micro = {3, 2, 4};         // micro-batches per window
  double capMb = 1024.0 / 1048576.0;          // several buckets
  double firstCapMb = 512.0 / 1048576.0;
  sf_reduce_op op = SF_REDUCE_AVERAGE;
  double prescale = 1.0;
  bool gradReady = true;                      // report grad-ready in every micro-batch
  bool ownStream = true;                      // else the legacy default stream
  int slowBackwardMs = 0;                     // the last backward "kernel" takes this long
  bool adopt = false;                         // the host makes the communicator
  std::string rendezvous;                     // default: a fresh memory:// name
};

struct RankRun {
  sf_status status = SF_OK;
  std::string error;
  std::vector<std::vector<std::vector<double>>> results;  // [window][gradient][element]
  std::vector<int64_t> inside, perWindow, early;           // collectives per window
  int64_t buckets = 0;
  sf_stats stats{};
  int64_t adoptedCalls = -1;         // all-reduces the host's communicator carried
  bool adoptedUsableAfter = false;   // the host could still use it after sf_destroy
};

double expected(const Scenario& sc, int w, int p, int64_t i) {
  double sum = 0;
  for (int r = 0; r < sc.world; ++r) {
    for (int m = 0; m < sc.micro[size_t(w)]; ++m) sum += gradValue(r, w, m, p, i);
  }
  if (sc.op == SF_REDUCE_AVERAGE) return sum / sc.world;
  if (sc.op == SF_REDUCE_PRESCALED_SUM) return sum * sc.prescale;
  return sum;
}

RankRun trainRank(const Scenario& sc, int rank, const std::string& rdv, const ncclUniqueId* id) {
  RankRun run;
  auto ok = [&](sf_status st, const char* what) {
    if (st != SF_OK && run.status == SF_OK) {
      run.status = st;
      run.error = std::string(what) + ": " + sf_last_error();
    }
    return st == SF_OK;
  };
  cudaSetDevice(rank);
  cudaStream_t stream = nullptr;
  if (sc.ownStream) cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  ncclComm_t comm = nullptr;
  if (sc.adopt) ncclCommInitRank(&comm, sc.world, *id, rank);
  const int np = int(sc.sizes.size());
  std::vector<void*> own(size_t(np), nullptr);
  {
    sf_options o = rankOptions(rank, sc.world, rdv);
    o.local_rank = rank;
    o.bucket_cap_mb = sc.capMb;
    o.first_bucket_cap_mb = sc.firstCapMb;
    o.reduce_op = sc.op;
    o.prescale = sc.prescale;
    ContextHandle h;
    if (!ok(sf_create(&o, &h.ctx), "sf_create")) return run;
    if (!ok(sf_set_cuda_stream(h.ctx, stream), "sf_set_cuda_stream")) return run;
    if (sc.adopt && !ok(sf_adopt_nccl_comm(h.ctx, comm), "sf_adopt_nccl_comm")) return run;
    std::vector<void*> data(static_cast<size_t>(np));
    for (int p = 0; p < np; ++p) {
      int64_t gid = -1;
      const std::string name = "g" + std::to_string(p);
      if (sc.flat) {
        if (!ok(sf_add_gradient(h.ctx, sc.sizes[size_t(p)], sc.dtype, SF_DEVICE_CUDA, name.c_str(), &gid),
                "sf_add_gradient")) {
          return run;
        }
      } else {
        const size_t bytes = size_t(sc.sizes[size_t(p)]) * sfsync::dtypeSize(sc.dtype);
        cudaMalloc(&own[size_t(p)], bytes);
        cudaMemset(own[size_t(p)], 0, bytes);
        if (!ok(sf_register_gradient(h.ctx, own[size_t(p)], sc.sizes[size_t(p)], sc.dtype, SF_DEVICE_CUDA,
                                     name.c_str(), &gid),
                "sf_register_gradient")) {
          return run;
        }
      }
    }
    for (int p = 0; p < np; ++p) {
      if (!ok(sf_gradient_data(h.ctx, p, &data[size_t(p)]), "sf_gradient_data")) return run;
    }
    run.buckets = statsOf(h.ctx).bucket_count;

    auto backward = [&](int w, int m, int delayMs) {
      std::vector<int64_t> sizes = sc.sizes;
      const sf_dtype t = sc.dtype;
      launch(stream, [=] {
        if (delayMs) std::this_thread::sleep_for(std::chrono::milliseconds(delayMs));
        for (size_t p = 0; p < sizes.size(); ++p) {
          for (int64_t i = 0; i < sizes[p]; ++i) {
            storeValue(data[p], i, t, loadValue(data[p], i, t) + gradValue(rank, w, m, int(p), i));
          }
        }
      });
    };
    for (int w = 0; w < int(sc.micro.size()); ++w) {
      const sf_stats before = statsOf(h.ctx);
      if (!ok(sf_begin_accumulation(h.ctx), "sf_begin_accumulation")) return run;
      const int n = sc.micro[size_t(w)];
      for (int m = 0; m + 1 < n; ++m) {
        backward(w, m, 0);
        for (int p = np - 1; sc.gradReady && p >= 0; --p) {
          if (!ok(sf_grad_ready(h.ctx, p), "sf_grad_ready (inside)")) return run;
        }
      }
      run.inside.push_back(statsOf(h.ctx).collectives_issued - before.collectives_issued);
      if (!ok(sf_end_accumulation(h.ctx), "sf_end_accumulation")) return run;
      backward(w, n - 1, sc.slowBackwardMs);
      for (int p = np - 1; sc.gradReady && p >= 0; --p) {
        if (!ok(sf_grad_ready(h.ctx, p), "sf_grad_ready")) return run;
      }
      if (!ok(sf_synchronize(h.ctx), "sf_synchronize")) return run;
      const sf_stats after = statsOf(h.ctx);
      run.perWindow.push_back(after.collectives_issued - before.collectives_issued);
      run.early.push_back(after.early_launches - before.early_launches);
      std::vector<std::vector<double>> values;
      for (int p = 0; p < np; ++p) values.push_back(readDevice(stream, data[size_t(p)], sc.sizes[size_t(p)], sc.dtype));
      run.results.push_back(values);
      if (!ok(sf_zero_gradients(h.ctx), "sf_zero_gradients")) return run;
    }
    run.stats = statsOf(h.ctx);
  }
  if (sc.adopt) {
    sfStandinCommCounters(comm, &run.adoptedCalls, nullptr);
    // The host's communicator survived sf_destroy: the host can still use it.
    float* x = nullptr;
    cudaMalloc(reinterpret_cast<void**>(&x), sizeof(float));
    run.adoptedUsableAfter = ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, comm, stream) == ncclSuccess;
    drain(stream);
    cudaFree(x);
    ncclCommDestroy(comm);
  }
  for (void* p : own) cudaFree(p);
  if (stream) cudaStreamDestroy(stream);
  return run;
}

std::vector<RankRun> train(const Scenario& sc) {
  const std::string rdv = sc.rendezvous.empty() ? "memory://" + uniqueName("nccl") : sc.rendezvous;
  ncclUniqueId id;
  if (sc.adopt) ncclGetUniqueId(&id);
  return runThreadRanks<RankRun>(sc.world, [&](int r) { return trainRank(sc, r, rdv, &id); });
}

// Every rank succeeded, communicated once per bucket per window and never
// inside one, and holds the reference values (exactly: they are exact).
void checkRuns(const Scenario& sc, const std::vector<RankRun>& runs, const std::string& label) {
  for (int r = 0; r < sc.world; ++r) {
    const RankRun& run = runs[size_t(r)];
    BOOST_TEST_REQUIRE(run.status == SF_OK, label << " rank " << r << ": " << run.error);
    BOOST_TEST(run.buckets > 1, label << ": several buckets");
    BOOST_TEST_REQUIRE(run.results.size() == sc.micro.size());
    for (size_t w = 0; w < sc.micro.size(); ++w) {
      BOOST_TEST(run.inside[w] == 0, label << " window " << w << ": nothing inside the window");
      BOOST_TEST(run.perWindow[w] == run.buckets, label << " window " << w << ": one per bucket");
      if (sc.gradReady) BOOST_TEST(run.early[w] == run.buckets, label << ": all launched by grad-ready");
      for (size_t p = 0; p < sc.sizes.size(); ++p) {
        int bad = 0;
        for (int64_t i = 0; i < sc.sizes[p]; ++i) {
          const double want = expected(sc, int(w), int(p), i), got = run.results[w][p][size_t(i)];
          if (got != want && bad++ < 3) {
            BOOST_ERROR(label << " rank " << r << " window " << w << " g" << p << "[" << i << "] = " << got
                              << ", want " << want);
          }
        }
        BOOST_TEST(bad == 0, label << " rank " << r << " window " << w << " g" << p << ": " << bad << " wrong");
      }
    }
    BOOST_TEST(run.stats.collectives_issued == run.buckets * int64_t(sc.micro.size()));
  }
}

const char* dtypeLabel(sf_dtype t) { return sfsync::dtypeName(t); }

}  // namespace

BOOST_AUTO_TEST_SUITE(nccl_backend_tests)

BOOST_AUTO_TEST_CASE(nccl_is_available_on_the_standin) {
  BOOST_TEST(sf_backend_available(SF_BACKEND_NCCL) == SF_OK, sf_last_error());
  BOOST_TEST(sf_backend_available(SF_BACKEND_GLOO) == SF_OK);
  BOOST_TEST(sf_backend_available(SF_BACKEND_AUTO) == SF_OK);
  BOOST_TEST(sf_backend_available(7) == SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("backend = 7") != std::string::npos, sf_last_error());
}

BOOST_AUTO_TEST_CASE(world1_flat_buffer_counts_and_parity) {
  Scenario sc;
  sc.world = 1;
  checkRuns(sc, train(sc), "world 1");
}

BOOST_AUTO_TEST_CASE(threads2_every_dtype_flat_and_host_registered) {
  const int64_t callsBefore = sfStandinNcclCounter("ncclAllReduce");
  int64_t issued = 0;
  for (sf_dtype t : {SF_DTYPE_FLOAT32, SF_DTYPE_FLOAT64, SF_DTYPE_FLOAT16, SF_DTYPE_BFLOAT16}) {
    for (bool flat : {true, false}) {
      Scenario sc;
      sc.dtype = t;
      sc.flat = flat;
      const auto runs = train(sc);
      checkRuns(sc, runs, std::string(dtypeLabel(t)) + (flat ? " flat" : " registered"));
      for (const auto& r : runs) issued += r.stats.collectives_issued;
    }
  }
  // What NCCL saw is what sfsync counted, plus per rank and context the two
  // all-reduces of the layout check and, per window, the window check's
  // two elements summed unscaled beside the averaged bucket (one NCCL
  // group); none at teardown.
  const int64_t calls = sfStandinNcclCounter("ncclAllReduce") - callsBefore;
  BOOST_TEST(calls == issued + 8 * 2 * 2 + 8 * 2 * 3);
}

BOOST_AUTO_TEST_CASE(threads4_average_sum_and_prescaled_sum) {
  for (sf_reduce_op op : {SF_REDUCE_AVERAGE, SF_REDUCE_SUM, SF_REDUCE_PRESCALED_SUM}) {
    for (sf_dtype t : {SF_DTYPE_FLOAT32, SF_DTYPE_BFLOAT16}) {
      Scenario sc;
      sc.world = 4;
      sc.op = op;
      sc.prescale = 0.5;
      sc.dtype = t;
      sc.micro = {2, 3};
      checkRuns(sc, train(sc), "op " + std::to_string(op) + " " + dtypeLabel(t));
    }
  }
}

BOOST_AUTO_TEST_CASE(threads2_without_grad_ready_everything_launches_at_synchronize) {
  Scenario sc;
  sc.gradReady = false;
  const auto runs = train(sc);
  checkRuns(sc, runs, "no hooks");
  for (const auto& r : runs) BOOST_TEST(r.stats.early_launches == 0);
}

BOOST_AUTO_TEST_CASE(threads2_one_big_bucket) {
  Scenario sc;
  sc.capMb = 25;
  sc.firstCapMb = 25;
  sc.sizes = {100000, 3, 70000};
  sc.micro = {2};
  const auto runs = train(sc);
  for (const auto& r : runs) {
    BOOST_TEST_REQUIRE(r.status == SF_OK, r.error);
    BOOST_TEST(r.buckets == 1);
    BOOST_TEST(r.perWindow[0] == 1);
    BOOST_TEST(r.results[0][0][99999] == expected(sc, 0, 0, 99999));
    BOOST_TEST(r.results[0][2][12345] == expected(sc, 0, 2, 12345));
  }
}

BOOST_AUTO_TEST_CASE(threads2_collectives_wait_for_the_hosts_stream) {
  // The last backward "kernel" takes 100 ms on the host's stream, and
  // grad-ready and synchronize are called right after queuing it, as a
  // host does with real kernels. A collective that did not wait for the
  // host's stream would reduce stale gradients.
  for (bool flat : {true, false}) {
    Scenario sc;
    sc.slowBackwardMs = 100;
    sc.flat = flat;
    sc.micro = {2, 2};
    checkRuns(sc, train(sc), flat ? "slow backward, flat" : "slow backward, registered");
  }
}

BOOST_AUTO_TEST_CASE(world1_legacy_default_stream) {
  Scenario sc;
  sc.world = 1;
  sc.ownStream = false;
  sc.slowBackwardMs = 50;
  checkRuns(sc, train(sc), "legacy stream");
}

BOOST_AUTO_TEST_CASE(world1_stream_order_events_and_no_device_synchronization) {
  // Per bucket: an event on the host's stream that the plugin's stream
  // waits for, and an event on the plugin's stream that the host's stream
  // waits for; never a device or stream synchronization.
  cudaSetDevice(0);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  o.bucket_cap_mb = 1024.0 / 1048576.0;
  o.first_bucket_cap_mb = 1024.0 / 1048576.0;
  BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK, sf_last_error());
  BOOST_TEST_REQUIRE(sf_set_cuda_stream(h.ctx, stream) == SF_OK, sf_last_error());
  int64_t id;
  for (int p = 0; p < 3; ++p) {
    BOOST_TEST_REQUIRE(sf_add_gradient(h.ctx, 256, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, nullptr, &id) == SF_OK,
                       sf_last_error());
  }
  BOOST_TEST_REQUIRE(sf_synchronize(h.ctx) == SF_OK, sf_last_error());  // layout check, first window
  const int64_t buckets = statsOf(h.ctx).bucket_count;
  BOOST_TEST(buckets == 3);
  const int64_t waits0 = sfStandinCudaCounter("cudaStreamWaitEvent");
  const int64_t records0 = sfStandinCudaCounter("cudaEventRecord");
  const int64_t deviceSyncs0 = sfStandinCudaCounter("cudaDeviceSynchronize");
  const int64_t streamSyncs0 = sfStandinCudaCounter("cudaStreamSynchronize");
  for (int w = 0; w < 3; ++w) {
    BOOST_TEST_REQUIRE(sf_begin_accumulation(h.ctx) == SF_OK);
    BOOST_TEST_REQUIRE(sf_end_accumulation(h.ctx) == SF_OK);
    const int64_t calls = sfStandinNcclCounter("ncclAllReduce");
    for (int p = 2; p >= 0; --p) {
      BOOST_TEST_REQUIRE(sf_grad_ready(h.ctx, p) == SF_OK, sf_last_error());
      // Overlap: each bucket's all-reduce is issued by the grad-ready that
      // completes it (one gradient per bucket here), not later.
      BOOST_TEST(sfStandinNcclCounter("ncclAllReduce") - calls == 3 - p);
    }
    BOOST_TEST_REQUIRE(sf_synchronize(h.ctx) == SF_OK, sf_last_error());
    BOOST_TEST(sfStandinNcclCounter("ncclAllReduce") - calls == 3);
    BOOST_TEST_REQUIRE(sf_zero_gradients(h.ctx) == SF_OK, sf_last_error());
  }
  BOOST_TEST(sfStandinCudaCounter("cudaStreamWaitEvent") - waits0 == 3 * 2 * buckets);
  BOOST_TEST(sfStandinCudaCounter("cudaEventRecord") - records0 == 3 * 2 * buckets);
  BOOST_TEST(sfStandinCudaCounter("cudaDeviceSynchronize") == deviceSyncs0);
  BOOST_TEST(sfStandinCudaCounter("cudaStreamSynchronize") == streamSyncs0);
  sf_destroy(h.ctx);
  h.ctx = nullptr;
  BOOST_TEST(sfStandinCudaCounter("cudaDeviceSynchronize") == deviceSyncs0);
  BOOST_TEST(sfStandinCudaCounter("cudaStreamSynchronize") == streamSyncs0);
  cudaStreamDestroy(stream);
}

BOOST_AUTO_TEST_CASE(threads2_adopted_host_communicator) {
  const int liveBefore = sfStandinLiveComms();
  Scenario sc;
  sc.adopt = true;
  // A rendezvous that would fail if it were used: adoption needs none.
  sc.rendezvous = "redis://127.0.0.1:1/sfsync-never-used";
  const auto runs = train(sc);
  checkRuns(sc, runs, "adopted");
  for (const auto& r : runs) {
    // The host's communicator carried everything: the layout check (2), the
    // buckets, the window check's unscaled sum per window (3); nothing at
    // teardown.
    BOOST_TEST(r.adoptedCalls == r.stats.collectives_issued + 2 + 3);
    BOOST_TEST(r.adoptedUsableAfter, "sf_destroy must not destroy the host's communicator");
  }
  BOOST_TEST(sfStandinLiveComms() == liveBefore);  // the host destroyed its own, nothing leaked
}

BOOST_AUTO_TEST_CASE(adoption_is_checked) {
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  std::vector<ncclComm_t> comms(2);
  runThreadRanks<int>(2, [&](int r) {
    cudaSetDevice(r);
    return int(ncclCommInitRank(&comms[size_t(r)], 2, id, r));
  });
  {
    ContextHandle h;  // world 1 context, communicator of 2 ranks
    sf_options o = rankOptions(0, 1, "");
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    BOOST_TEST(sf_adopt_nccl_comm(h.ctx, comms[0]) == SF_ERR_INVALID_ARGUMENT);
    BOOST_TEST(std::string(sf_last_error()).find("rank 0 of 2") != std::string::npos, sf_last_error());
    BOOST_TEST(sf_adopt_nccl_comm(h.ctx, nullptr) == SF_ERR_INVALID_ARGUMENT);
  }
  {
    ContextHandle h;  // rank 0 context, rank 1's communicator
    sf_options o = rankOptions(0, 2, "memory://" + uniqueName("adopt"));
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    BOOST_TEST(sf_adopt_nccl_comm(h.ctx, comms[1]) == SF_ERR_INVALID_ARGUMENT);
    BOOST_TEST(std::string(sf_last_error()).find("rank 1 of 2") != std::string::npos, sf_last_error());
  }
  {
    ContextHandle h;  // gradients already on GPU 0, communicator on GPU 1
    sf_options o = rankOptions(1, 2, "memory://" + uniqueName("adopt"));
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    int64_t gid;
    BOOST_TEST_REQUIRE(sf_add_gradient(h.ctx, 8, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) == SF_OK);
    BOOST_TEST_REQUIRE(sf_build_buckets(h.ctx) == SF_OK, sf_last_error());
    BOOST_TEST(sf_adopt_nccl_comm(h.ctx, comms[1]) == SF_ERR_INVALID_ARGUMENT);
    BOOST_TEST(std::string(sf_last_error()).find("GPU 1") != std::string::npos, sf_last_error());
  }
  {
    ContextHandle h;  // backend = gloo takes no NCCL communicator
    sf_options o = rankOptions(0, 2, "memory://" + uniqueName("adopt"));
    o.backend = SF_BACKEND_GLOO;
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    BOOST_TEST(sf_adopt_nccl_comm(h.ctx, comms[0]) == SF_ERR_UNSUPPORTED);
    BOOST_TEST(std::string(sf_last_error()).find("backend = gloo") != std::string::npos, sf_last_error());
  }
  for (auto c : comms) ncclCommDestroy(c);
}

BOOST_AUTO_TEST_CASE(adoption_after_the_first_synchronization_is_invalid_state) {
  cudaSetDevice(0);
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ncclComm_t comm;
  BOOST_TEST_REQUIRE(ncclCommInitRank(&comm, 1, id, 0) == ncclSuccess);
  {
    ContextHandle h;
    sf_options o = rankOptions(0, 1, "");
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    int64_t gid;
    BOOST_TEST_REQUIRE(sf_add_gradient(h.ctx, 8, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) == SF_OK);
    BOOST_TEST_REQUIRE(sf_synchronize(h.ctx) == SF_OK, sf_last_error());
    BOOST_TEST(sf_adopt_nccl_comm(h.ctx, comm) == SF_ERR_INVALID_STATE);
    BOOST_TEST(std::string(sf_last_error()).find("before the first synchronization") != std::string::npos,
               sf_last_error());
  }
  ncclCommDestroy(comm);
}

BOOST_AUTO_TEST_CASE(threads2_timeout_aborts_the_communicator_instead_of_hanging) {
  // Both ranks synchronize window 1; in window 2 only rank 0 does. Rank 0
  // must get SF_ERR_TIMEOUT after about timeout_ms, having aborted its
  // communicator; rank 1 then gets an error from its own synchronize rather
  // than hanging: inside one node NCCL does not tell a peer of an abort, so
  // rank 1 times out too.
  const std::string rdv = "memory://" + uniqueName("timeout");
  struct Result {
    sf_status first = -1, second = -1, again = -1;
    std::string message;
    double seconds = 0;
  };
  std::atomic<bool> rank0Done{false};
  auto results = runThreadRanks<Result>(2, [&](int r) {
    Result res;
    cudaSetDevice(r);
    ContextHandle h;
    sf_options o = rankOptions(r, 2, rdv, 1500);
    o.local_rank = r;
    if (sf_create(&o, &h.ctx) != SF_OK) return res;
    int64_t gid;
    sf_add_gradient(h.ctx, 64, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid);
    res.first = sf_synchronize(h.ctx);
    if (r == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      res.second = sf_synchronize(h.ctx);
      res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      res.message = sf_last_error();
      res.again = sf_synchronize(h.ctx);
      rank0Done = true;
    } else {
      while (!rank0Done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      res.second = sf_synchronize(h.ctx);
      res.message = sf_last_error();
    }
    return res;
  });
  BOOST_TEST(results[0].first == SF_OK);
  BOOST_TEST(results[1].first == SF_OK);
  BOOST_TEST(results[0].second == SF_ERR_TIMEOUT, results[0].message);
  BOOST_TEST(results[0].message.find("timeout_ms = 1500") != std::string::npos, results[0].message);
  BOOST_TEST(results[0].message.find("aborted") != std::string::npos, results[0].message);
  BOOST_TEST(results[0].seconds >= 1.4);
  BOOST_TEST(results[0].seconds < 10.0);
  BOOST_TEST(results[0].again == SF_ERR_TIMEOUT, "a failed context keeps failing");
  BOOST_TEST(results[1].second == SF_ERR_TIMEOUT, results[1].message);
  BOOST_TEST(results[1].message.find("aborted") != std::string::npos, results[1].message);
}

BOOST_AUTO_TEST_CASE(asynchronous_nccl_error_becomes_a_status_with_the_nccl_message) {
  cudaSetDevice(0);
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ncclComm_t comm;
  BOOST_TEST_REQUIRE(ncclCommInitRank(&comm, 1, id, 0) == ncclSuccess);
  const int liveBefore = sfStandinLiveComms();
  {
    ContextHandle h;
    sf_options o = rankOptions(0, 1, "");
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    BOOST_TEST_REQUIRE(sf_adopt_nccl_comm(h.ctx, comm) == SF_OK, sf_last_error());
    int64_t gid;
    BOOST_TEST_REQUIRE(sf_add_gradient(h.ctx, 64, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) == SF_OK);
    BOOST_TEST_REQUIRE(sf_synchronize(h.ctx) == SF_OK, sf_last_error());
    sfStandinInjectAsyncError(comm, ncclSystemError, "injected: network interface went down");
    BOOST_TEST(sf_synchronize(h.ctx) == SF_ERR_BACKEND);
    const std::string m = sf_last_error();
    BOOST_TEST(m.find("asynchronous error") != std::string::npos, m);
    BOOST_TEST(m.find("unhandled system error") != std::string::npos, m);
    BOOST_TEST(m.find("injected: network interface went down") != std::string::npos, m);
    BOOST_TEST(m.find("aborted") != std::string::npos, m);
  }
  // The plugin aborted the host's communicator (it could not finish otherwise).
  BOOST_TEST(sfStandinLiveComms() == liveBefore - 1);
}

BOOST_AUTO_TEST_CASE(failed_nccl_call_becomes_a_status_with_the_nccl_message) {
  cudaSetDevice(0);
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int64_t gid;
  BOOST_TEST_REQUIRE(sf_add_gradient(h.ctx, 64, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) == SF_OK);
  BOOST_TEST_REQUIRE(sf_synchronize(h.ctx) == SF_OK, sf_last_error());
  sfStandinFailNext("ncclAllReduce", ncclInvalidUsage);
  BOOST_TEST(sf_synchronize(h.ctx) == SF_ERR_BACKEND);
  const std::string m = sf_last_error();
  BOOST_TEST(m.find("ncclAllReduce failed") != std::string::npos, m);
  BOOST_TEST(m.find("invalid usage") != std::string::npos, m);
  BOOST_TEST(m.find("injected failure of ncclAllReduce") != std::string::npos, m);
}

BOOST_AUTO_TEST_CASE(failed_communicator_creation_is_reported) {
  cudaSetDevice(0);
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int64_t gid;
  BOOST_TEST_REQUIRE(sf_add_gradient(h.ctx, 64, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) == SF_OK);
  sfStandinFailNext("ncclCommInitRank", ncclUnhandledCudaError);
  BOOST_TEST(sf_synchronize(h.ctx) == SF_ERR_BACKEND);
  const std::string m = sf_last_error();
  BOOST_TEST(m.find("ncclCommInitRankConfig") != std::string::npos, m);
  BOOST_TEST(m.find("unhandled cuda error") != std::string::npos, m);
}

// A peer that is admitted (sf_connect: claims and roster through the host's
// store) but never takes part in NCCL: it only connects Gloo, and times out
// there (the host store bounds Gloo's waits by timeout_ms).
sf_status admittedButSilentPeer(int rank, MapStore& store, int64_t timeoutMs) {
  ContextHandle h;
  sf_options o = rankOptions(rank, 2, "host://", timeoutMs);
  o.backend = SF_BACKEND_GLOO;
  const sf_store s = store.handle();
  if (sf_create(&o, &h.ctx) != SF_OK || sf_set_store(h.ctx, &s, "job") != SF_OK) {
    return SF_ERR_INTERNAL;
  }
  return sf_connect(h.ctx);
}

BOOST_AUTO_TEST_CASE(threads2_missing_peer_at_communicator_creation_times_out) {
  // Rank 1 is admitted at the store but never calls NCCL: rank 0 publishes
  // the unique id and waits in the non-blocking ncclCommInitRankConfig.
  // (A peer missing altogether is caught earlier, at admission: see
  // connect_tests and host_store_tests.)
  MapStore store;
  auto results = runThreadRanks<std::pair<sf_status, std::string>>(2, [&](int r) {
    if (r == 1) return std::make_pair(admittedButSilentPeer(1, store, 1000), std::string());
    cudaSetDevice(0);
    ContextHandle h;
    sf_options o = rankOptions(0, 2, "host://", 1000);
    const sf_store s = store.handle();
    if (sf_create(&o, &h.ctx) != SF_OK || sf_set_store(h.ctx, &s, "job") != SF_OK) {
      return std::make_pair(SF_ERR_INTERNAL, std::string());
    }
    int64_t gid;
    if (sf_add_gradient(h.ctx, 64, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) != SF_OK) {
      return std::make_pair(SF_ERR_INTERNAL, std::string(sf_last_error()));
    }
    const auto t0 = std::chrono::steady_clock::now();
    const sf_status st = sf_synchronize(h.ctx);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return std::make_pair(st, std::string(sf_last_error()) + (secs < 10.0 ? "" : " (too late)"));
  });
  const std::string& m = results[0].second;
  BOOST_TEST(results[0].first == SF_ERR_TIMEOUT, m);
  BOOST_TEST(m.find("ncclCommInitRankConfig") != std::string::npos, m);
  BOOST_TEST(m.find("timeout_ms = 1000") != std::string::npos, m);
  BOOST_TEST(m.find("too late") == std::string::npos, m);
  BOOST_TEST(results[1].first == SF_ERR_TIMEOUT);  // its Gloo peer never came
}

BOOST_AUTO_TEST_CASE(rank_without_the_unique_id_times_out) {
  // Rank 0 is admitted but never publishes the NCCL unique id.
  MapStore store;
  auto results = runThreadRanks<std::pair<sf_status, std::string>>(2, [&](int r) {
    if (r == 0) return std::make_pair(admittedButSilentPeer(0, store, 500), std::string());
    cudaSetDevice(1);
    ContextHandle h;
    sf_options o = rankOptions(1, 2, "host://", 500);
    o.local_rank = 1;
    const sf_store s = store.handle();
    if (sf_create(&o, &h.ctx) != SF_OK || sf_set_store(h.ctx, &s, "job") != SF_OK) {
      return std::make_pair(SF_ERR_INTERNAL, std::string());
    }
    int64_t gid;
    if (sf_add_gradient(h.ctx, 64, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) != SF_OK) {
      return std::make_pair(SF_ERR_INTERNAL, std::string(sf_last_error()));
    }
    const sf_status st = sf_synchronize(h.ctx);
    return std::make_pair(st, std::string(sf_last_error()));
  });
  BOOST_TEST(results[1].first == SF_ERR_TIMEOUT, results[1].second);
  BOOST_TEST(results[1].second.find("unique id") != std::string::npos, results[1].second);
}

BOOST_AUTO_TEST_CASE(threads2_unique_id_travels_through_the_hosts_store) {
  // host:// and sf_set_store: the NCCL unique id goes through the host's
  // callbacks, under the context's prefix, and no other store is opened.
  MapStore store;
  auto results = runThreadRanks<std::string>(2, [&](int r) -> std::string {
    cudaSetDevice(r);
    ContextHandle h;
    sf_options o = rankOptions(r, 2, "host://", 20000);
    o.local_rank = r;
    const sf_store s = store.handle();
    if (sf_create(&o, &h.ctx) != SF_OK) return sf_last_error();
    if (sf_set_store(h.ctx, &s, "nccljob") != SF_OK) return sf_last_error();
    int64_t gid;
    void* data = nullptr;
    if (sf_add_gradient(h.ctx, 64, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) != SF_OK ||
        sf_gradient_data(h.ctx, gid, &data) != SF_OK) {
      return sf_last_error();
    }
    for (int64_t i = 0; i < 64; ++i) storeValue(data, i, SF_DTYPE_FLOAT32, double(r + 1) * double(i));
    if (sf_synchronize(h.ctx) != SF_OK) return sf_last_error();
    cudaDeviceSynchronize();
    for (int64_t i = 0; i < 64; ++i) {
      if (loadValue(data, i, SF_DTYPE_FLOAT32) != 1.5 * double(i)) return "wrong average";
    }
    return "ok";
  });
  BOOST_TEST(results[0] == "ok");
  BOOST_TEST(results[1] == "ok");
  BOOST_TEST(store.keysSet.count("nccljob/sfsync/nccl_unique_id") == 1u);
  for (const auto& k : store.keysSet) BOOST_TEST(k.compare(0, 15, "nccljob/sfsync/") == 0, k);
}

BOOST_AUTO_TEST_CASE(threads2_layout_mismatch_over_nccl) {
  const std::string rdv = "memory://" + uniqueName("mismatch");
  auto results = runThreadRanks<std::pair<sf_status, std::string>>(2, [&](int r) {
    cudaSetDevice(r);
    ContextHandle h;
    sf_options o = rankOptions(r, 2, rdv, 10000);
    o.local_rank = r;
    sf_create(&o, &h.ctx);
    int64_t gid;
    sf_add_gradient(h.ctx, 64, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "a", &gid);
    sf_add_gradient(h.ctx, r == 0 ? 32 : 33, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "b", &gid);
    const sf_status st = sf_synchronize(h.ctx);
    return std::make_pair(st, std::string(sf_last_error()));
  });
  for (const auto& r : results) {
    BOOST_TEST(r.first == SF_ERR_MISMATCH, r.second);
    BOOST_TEST(r.second.find("'b'") != std::string::npos, r.second);
  }
}

BOOST_AUTO_TEST_CASE(threads2_host_and_cuda_gradients_in_one_context) {
  // Host gradients go through Gloo, CUDA gradients through NCCL, each with
  // its own flat buffer and buckets.
  const std::string rdv = "memory://" + uniqueName("mixed");
  auto results = runThreadRanks<std::string>(2, [&](int r) -> std::string {
    cudaSetDevice(r);
    ContextHandle h;
    sf_options o = rankOptions(r, 2, rdv, 20000);
    o.local_rank = r;
    if (sf_create(&o, &h.ctx) != SF_OK) return sf_last_error();
    int64_t a, b;
    if (sf_add_gradient(h.ctx, 100, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "host", &a) != SF_OK ||
        sf_add_gradient(h.ctx, 100, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "cuda", &b) != SF_OK) {
      return sf_last_error();
    }
    void *hp, *dp;
    sf_gradient_data(h.ctx, a, &hp);
    sf_gradient_data(h.ctx, b, &dp);
    for (int i = 0; i < 100; ++i) {
      static_cast<float*>(hp)[i] = float(r + i);
      static_cast<float*>(dp)[i] = float(2 * r + i);  // stand-in device memory is host memory
    }
    if (sf_synchronize(h.ctx) != SF_OK) return sf_last_error();
    const sf_stats s = statsOf(h.ctx);
    if (s.bucket_count != 2 || s.collectives_issued != 2) return "wrong bucket or collective count";
    for (int i = 0; i < 100; ++i) {
      if (static_cast<float*>(hp)[i] != 0.5f + float(i)) return "host gradient " + std::to_string(i);
      if (static_cast<float*>(dp)[i] != 1.0f + float(i)) return "cuda gradient " + std::to_string(i);
    }
    return "";
  });
  for (const auto& r : results) BOOST_TEST(r == "");
}

BOOST_AUTO_TEST_CASE(zero_gradients_zeroes_device_gradients_on_the_hosts_stream) {
  cudaSetDevice(0);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  void* own = nullptr;
  cudaMalloc(&own, 40 * sizeof(double));
  {
    ContextHandle h;
    sf_options o = rankOptions(0, 1, "");
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    sf_set_cuda_stream(h.ctx, stream);
    int64_t a, b;
    BOOST_TEST_REQUIRE(sf_add_gradient(h.ctx, 40, SF_DTYPE_FLOAT64, SF_DEVICE_CUDA, "a", &a) == SF_OK);
    BOOST_TEST_REQUIRE(sf_register_gradient(h.ctx, own, 40, SF_DTYPE_FLOAT64, SF_DEVICE_CUDA, "b", &b) == SF_OK,
                       sf_last_error());
    void* pa;
    sf_gradient_data(h.ctx, a, &pa);
    BOOST_TEST(readDevice(stream, pa, 40, SF_DTYPE_FLOAT64) == std::vector<double>(40, 0.0),
               "the flat device buffer starts zeroed");
    // A slow "kernel" writes ones; zeroing queued after it must win.
    launch(stream, [=] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      for (int i = 0; i < 40; ++i) {
        static_cast<double*>(pa)[i] = 1;
        static_cast<double*>(own)[i] = 1;
      }
    });
    BOOST_TEST_REQUIRE(sf_zero_gradients(h.ctx) == SF_OK, sf_last_error());
    BOOST_TEST(readDevice(stream, pa, 40, SF_DTYPE_FLOAT64) == std::vector<double>(40, 0.0));
    BOOST_TEST(readDevice(stream, own, 40, SF_DTYPE_FLOAT64) == std::vector<double>(40, 0.0));
  }
  cudaFree(own);
  cudaStreamDestroy(stream);
}

BOOST_AUTO_TEST_CASE(host_memory_registered_as_cuda_is_rejected) {
  cudaSetDevice(0);
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  std::vector<float> host(16);
  int64_t gid;
  BOOST_TEST(sf_register_gradient(h.ctx, host.data(), 16, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) ==
             SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("not CUDA device memory") != std::string::npos, sf_last_error());
  // Device memory of another GPU than local_rank's.
  cudaSetDevice(3);
  void* other = nullptr;
  cudaMalloc(&other, 64);
  cudaSetDevice(0);
  BOOST_TEST(sf_register_gradient(h.ctx, other, 16, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) ==
             SF_ERR_INVALID_ARGUMENT);
  BOOST_TEST(std::string(sf_last_error()).find("device 3") != std::string::npos, sf_last_error());
  // A range that runs past the allocation.
  BOOST_TEST(sf_register_gradient(h.ctx, other, 17, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) ==
             SF_ERR_INVALID_ARGUMENT);
  cudaFree(other);
}

BOOST_AUTO_TEST_CASE(backend_selection) {
  cudaSetDevice(0);
  int64_t gid;
  {
    ContextHandle h;  // gloo cannot take CUDA gradients
    sf_options o = rankOptions(0, 1, "");
    o.backend = SF_BACKEND_GLOO;
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    BOOST_TEST(sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) == SF_ERR_UNSUPPORTED);
    BOOST_TEST(std::string(sf_last_error()).find("backend = gloo cannot reduce CUDA gradients") !=
                   std::string::npos,
               sf_last_error());
  }
  {
    ContextHandle h;  // nccl cannot take host gradients
    sf_options o = rankOptions(0, 1, "");
    o.backend = SF_BACKEND_NCCL;
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    BOOST_TEST(sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "w", &gid) == SF_OK);
    BOOST_TEST(sf_synchronize(h.ctx) == SF_ERR_UNSUPPORTED);
    BOOST_TEST(std::string(sf_last_error()).find("cannot reduce host-memory gradients") != std::string::npos,
               sf_last_error());
  }
  for (sf_backend b : {SF_BACKEND_AUTO, SF_BACKEND_NCCL}) {
    ContextHandle h;  // auto and nccl take CUDA gradients with NCCL
    sf_options o = rankOptions(0, 1, "");
    o.backend = b;
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    BOOST_TEST_REQUIRE(sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) == SF_OK,
                       sf_last_error());
    const int64_t before = sfStandinNcclCounter("ncclAllReduce");
    BOOST_TEST_REQUIRE(sf_synchronize(h.ctx) == SF_OK, sf_last_error());
    BOOST_TEST(sfStandinNcclCounter("ncclAllReduce") - before == 3);  // layout check (2) + the bucket
  }
  {
    ContextHandle h;  // auto takes host gradients with the host backends, not NCCL
    sf_options o = rankOptions(0, 1, "");
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    BOOST_TEST_REQUIRE(sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "w", &gid) == SF_OK);
    const int64_t before = sfStandinNcclCounter("ncclAllReduce");
    BOOST_TEST_REQUIRE(sf_synchronize(h.ctx) == SF_OK, sf_last_error());
    BOOST_TEST(sfStandinNcclCounter("ncclAllReduce") == before);
  }
}

BOOST_AUTO_TEST_CASE(no_visible_gpu_or_a_cuda_error_is_unsupported) {
  int64_t gid;
  for (const auto& env : std::vector<std::pair<const char*, const char*>>{
           {"SF_STANDIN_DEVICES", "0"}, {"SF_STANDIN_CUDA_ERROR", "35"}}) {
    ::setenv(env.first, env.second, 1);
    BOOST_TEST(sf_backend_available(SF_BACKEND_NCCL) == SF_ERR_UNSUPPORTED);
    const std::string m = sf_last_error();
    ContextHandle h;
    sf_options o = rankOptions(0, 1, "");
    BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
    BOOST_TEST(sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "w", &gid) == SF_ERR_UNSUPPORTED);
    const std::string m2 = sf_last_error();
    ::unsetenv(env.first);
    if (std::string(env.first) == "SF_STANDIN_DEVICES") {
      BOOST_TEST(m.find("no GPU is visible") != std::string::npos, m);
      BOOST_TEST(m2.find("no GPU is visible") != std::string::npos, m2);
    } else {
      BOOST_TEST(m.find("cudaGetDeviceCount failed with cudaErrorInsufficientDriver (35)") != std::string::npos, m);
      BOOST_TEST(m2.find("cudaErrorInsufficientDriver") != std::string::npos, m2);
    }
    // Host gradients in the same context still work.
    BOOST_TEST(sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "h", &gid) == SF_OK);
    BOOST_TEST(sf_synchronize(h.ctx) == SF_OK, sf_last_error());
  }
  BOOST_TEST(sf_backend_available(SF_BACKEND_NCCL) == SF_OK, sf_last_error());
}

BOOST_AUTO_TEST_CASE(set_cuda_stream_while_in_flight_is_invalid_state) {
  cudaSetDevice(0);
  ContextHandle h;
  sf_options o = rankOptions(0, 1, "");
  o.bucket_cap_mb = 64.0 / 1048576.0;
  o.first_bucket_cap_mb = 64.0 / 1048576.0;
  BOOST_TEST_REQUIRE(sf_create(&o, &h.ctx) == SF_OK);
  int64_t gid;
  sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "a", &gid);
  sf_add_gradient(h.ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, "b", &gid);
  BOOST_TEST_REQUIRE(sf_grad_ready(h.ctx, 1) == SF_OK, sf_last_error());  // bucket 0 in flight
  BOOST_TEST(sf_set_cuda_stream(h.ctx, nullptr) == SF_ERR_INVALID_STATE);
  BOOST_TEST(sf_synchronize(h.ctx) == SF_OK, sf_last_error());
  BOOST_TEST(sf_set_cuda_stream(h.ctx, nullptr) == SF_OK);
  BOOST_TEST(sf_set_cuda_stream(nullptr, nullptr) == SF_ERR_INVALID_ARGUMENT);
}

BOOST_AUTO_TEST_CASE(device_memory_is_released_with_the_context) {
  const int64_t live = sfStandinCudaCounter("live_allocations");
  for (bool flat : {true, false}) {
    Scenario sc;
    sc.flat = flat;
    sc.micro = {2};
    checkRuns(sc, train(sc), "leak check");
  }
  BOOST_TEST(sfStandinCudaCounter("live_allocations") == live);
}

BOOST_AUTO_TEST_SUITE_END()
