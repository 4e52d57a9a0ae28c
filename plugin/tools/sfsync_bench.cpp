// sfsync-bench: what a window's synchronization costs against one raw Gloo
// all-reduce of the same bytes, in the same process and run, and what the
// window calls cost inside a window. A benchmark, not a test: it prints a
// table and JSON, and asserts nothing about speed.
//
//   sfsync-bench --ranks 2 --sizes-mb 1,16,64 --grads 1,64,1024 --caps-mb 25,4
//
// Ranks are threads of this process over loopback TCP (memory:// store), so
// the plugin and the baseline see the same machine at the same moment;
// iterations alternate baseline / plugin and the median of each is reported.
// Two baselines: one raw allreduce of all the bytes (what the plugin aims to
// match), and raw allreduces of the plugin's bucket sizes one after another
// (what bucketing itself costs the transport; DDP pays the same).
//
// --cpu (issue 46) adds CPU-ms per window per rank for the three: the
// process's user+sys time (getrusage(RUSAGE_SELF): the kernel's accounting
// of every thread, Gloo's and sfsync's lanes included) read by rank 0 around
// each timed phase, divided by the ranks. The rank threads meet at a barrier
// before and after every phase so that the two readings enclose every rank's
// part of that phase and nothing else; without --cpu they run unaligned and
// the output is as before.

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <cxxopts.hpp>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include "plugin/core/thread_barrier.h"
#include "plugin/rendezvous/memory_store.h"
#include "sfsync.h"

namespace {

using Clock = std::chrono::steady_clock;

double msSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// This process's user+sys CPU seconds, every thread (the kernel's accounting).
double processCpuSeconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

struct Config {
  double sizeMb;
  int grads;
  double capMb;
};

struct Row {
  Config c{};
  int64_t buckets = 0;
  std::vector<double> rawMs, bucketedMs, pluginMs;  // samples
  std::vector<double> rawCpuMs, bucketedCpuMs, pluginCpuMs;  // --cpu: rank 0's, per rank
  std::string error;
};

// One rank's part of one configuration; cpu: the ranks' barrier with --cpu,
// else null.
Row runRank(int rank, int world, const Config& c, int iters, sf_reduce_op op,
            const std::string& tag, sfsync::ThreadBarrier* cpu) {
  Row row;
  row.c = c;
  const int64_t totalFloats = int64_t(c.sizeMb * 1048576 / 4);
  const int64_t per = std::max<int64_t>(1, totalFloats / c.grads);

  // The baseline: a plain Gloo context and one allreduce of all the bytes.
  auto store = sfsync::MemoryStore::named(tag + "-raw");
  gloo::rendezvous::PrefixStore prefixed("raw", *store);
  auto dev = gloo::transport::tcp::CreateDevice(gloo::transport::tcp::attr("127.0.0.1"));
  auto raw = std::make_shared<gloo::rendezvous::Context>(rank, world);
  raw->connectFullMesh(prefixed, dev);
  std::vector<float> rawBuf(size_t(per * c.grads), 1.0f);

  // The plugin: the same bytes as `grads` gradients in its flat buffer.
  sf_options o;
  sf_options_init(&o, sizeof o);
  o.rank = rank;
  o.world_size = world;
  o.reduce_op = op;
  o.bucket_cap_mb = c.capMb;
  o.first_bucket_cap_mb = std::min(1.0, c.capMb);
  std::snprintf(o.rendezvous, sizeof o.rendezvous, "memory://%s-plugin", tag.c_str());
  sf_context* ctx = nullptr;
  if (sf_create(&o, &ctx) != SF_OK) {
    row.error = sf_last_error();
    return row;
  }
  for (int g = 0; g < c.grads; ++g) {
    int64_t id;
    sf_add_gradient(ctx, per, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
  }
  auto window = [&] {
    sf_begin_accumulation(ctx);
    for (int g = c.grads - 1; g >= 0; --g) sf_grad_ready(ctx, g);  // a pass, only counted
    sf_end_accumulation(ctx);
    const auto t0 = Clock::now();
    const sf_status st = sf_synchronize(ctx);
    const double ms = msSince(t0);
    if (st != SF_OK && row.error.empty()) row.error = sf_last_error();
    return ms;
  };
  // Raw allreduces of consecutive slices of rawBuf, one per size.
  auto rawOnce = [&](const std::vector<int64_t>& sliceBytes) {
    const auto t0 = Clock::now();
    float* at = rawBuf.data();
    for (int64_t bytes : sliceBytes) {
      gloo::AllreduceOptions opts(raw);
      opts.setOutput(at, size_t(bytes / 4));
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      gloo::allreduce(opts);
      at += bytes / 4;
    }
    return msSince(t0);
  };
  window();  // connects, checks the layout, warms up
  sf_stats s{};
  s.struct_size = sizeof s;
  sf_get_stats(ctx, &s);
  std::vector<int64_t> bucketBytes(size_t(s.bucket_count));
  for (int64_t b = 0; b < s.bucket_count; ++b) {
    sf_bucket_info(ctx, b, &bucketBytes[size_t(b)], nullptr, nullptr);
  }
  // --cpu: every rank enters a phase after rank 0's first reading and has
  // left it before its second; the process's CPU over the ranks is a rank's.
  // The sfsync window's CPU spans begin..synchronize (its wall time:
  // synchronize).
  auto phase = [&](std::vector<double>& cpuMs, const auto& run) {
    if (cpu == nullptr) return run();
    cpu->wait();
    const double c0 = rank == 0 ? processCpuSeconds() : 0;
    cpu->wait();
    const double ms = run();
    cpu->wait();
    if (rank == 0) cpuMs.push_back((processCpuSeconds() - c0) * 1e3 / world);
    return ms;
  };
  const std::vector<int64_t> whole = {int64_t(rawBuf.size() * 4)};
  rawOnce(whole);
  for (int i = 0; i < iters; ++i) {
    row.rawMs.push_back(phase(row.rawCpuMs, [&] { return rawOnce(whole); }));
    row.bucketedMs.push_back(phase(row.bucketedCpuMs, [&] { return rawOnce(bucketBytes); }));
    row.pluginMs.push_back(phase(row.pluginCpuMs, window));
  }
  row.buckets = s.bucket_count;
  sf_destroy(ctx);
  gloo::BarrierOptions b(raw);
  gloo::barrier(b);
  return row;
}

// Nanoseconds per call of the window calls on a world-size-1 context.
struct CallCosts {
  double beginEndNs, gradReadyNs;
};

CallCosts windowCallCosts(int64_t calls) {
  sf_options o;
  sf_options_init(&o, sizeof o);
  o.rank = 0;
  o.world_size = 1;
  o.rendezvous[0] = 0;
  sf_context* ctx = nullptr;
  sf_create(&o, &ctx);
  int64_t id;
  sf_add_gradient(ctx, 16, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id);
  sf_build_buckets(ctx);
  auto t0 = Clock::now();
  for (int64_t i = 0; i < calls; ++i) {
    sf_begin_accumulation(ctx);
    sf_end_accumulation(ctx);
  }
  const double pair = msSince(t0) * 1e6 / double(calls);
  sf_begin_accumulation(ctx);
  t0 = Clock::now();
  for (int64_t i = 0; i < calls; ++i) sf_grad_ready(ctx, 0);
  const double ready = msSince(t0) * 1e6 / double(calls);
  sf_end_accumulation(ctx);
  sf_destroy(ctx);
  return {pair / 2, ready};
}

// ---- The replica check (sf_check_replicas) and its digest (sf_digest) ------

struct ReplicaCosts {
  double checkMs = 0, rawMs = 0;  // medians: sf_check_replicas vs a raw Gloo allreduce of W int64
  double digestGBs = 0, memcpyGBs = 0;
  double world1Ns = 0;
  std::string error;
};

// Rank 0's medians over `iters` alternating calls; ranks as threads over
// memory://, a plain Gloo context as the baseline (the same all-gather size).
ReplicaCosts replicaCheckCosts(int world, int iters) {
  ReplicaCosts out;
  const std::string tag = "replica-bench-" + std::to_string(::getpid());
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto store = sfsync::MemoryStore::named(tag + "-raw");
      gloo::rendezvous::PrefixStore prefixed("raw", *store);
      auto dev = gloo::transport::tcp::CreateDevice(gloo::transport::tcp::attr("127.0.0.1"));
      auto raw = std::make_shared<gloo::rendezvous::Context>(r, world);
      raw->connectFullMesh(prefixed, dev);
      sf_options o;
      sf_options_init(&o, sizeof o);
      o.rank = r;
      o.world_size = world;
      std::snprintf(o.rendezvous, sizeof o.rendezvous, "memory://%s", tag.c_str());
      sf_context* ctx = nullptr;
      if (sf_create(&o, &ctx) != SF_OK || sf_connect(ctx) != SF_OK) {
        if (r == 0) out.error = sf_last_error();
        return;
      }
      std::vector<double> check, base;
      std::vector<int64_t> slots(static_cast<size_t>(world));
      for (int i = 0; i < iters + 3; ++i) {  // 3 warm-up rounds
        std::fill(slots.begin(), slots.end(), INT64_MIN);
        slots[size_t(r)] = 12345;
        auto t0 = Clock::now();
        gloo::AllreduceOptions opts(raw);
        opts.setOutput(slots.data(), slots.size());
        opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
            &gloo::max<int64_t>));
        gloo::allreduce(opts);
        const double b = msSince(t0);
        t0 = Clock::now();
        const sf_status st = sf_check_replicas(ctx, 0xfeedULL);
        const double c = msSince(t0);
        if (st != SF_OK && r == 0) out.error = sf_last_error();
        if (i >= 3) {
          base.push_back(b);
          check.push_back(c);
        }
      }
      gloo::BarrierOptions barrier(raw);
      gloo::barrier(barrier);
      sf_destroy(ctx);
      if (r == 0) {
        out.checkMs = median(check);
        out.rawMs = median(base);
      }
    });
  }
  for (auto& t : threads) t.join();

  // The digest against a plain copy of the same bytes (memory bandwidth).
  const size_t bytes = size_t(64) << 20;
  std::vector<unsigned char> a(bytes), b(bytes);
  for (size_t i = 0; i < bytes; ++i) a[i] = (unsigned char)(i * 131);
  std::vector<double> dig, cpy;
  uint64_t sink = 0;
  for (int i = 0; i < 7; ++i) {
    auto t0 = Clock::now();
    uint64_t d = 0;
    sf_digest(a.data(), bytes, 0, &d);
    dig.push_back(msSince(t0));
    sink ^= d;
    t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    cpy.push_back(msSince(t0));
    sink ^= b[size_t(i) * 4099];
  }
  out.digestGBs = double(bytes) / 1e6 / median(dig);
  out.memcpyGBs = double(bytes) / 1e6 / median(cpy);
  if (sink == 42) std::cout << "";  // keep the work

  sf_options o;
  sf_options_init(&o, sizeof o);
  o.world_size = 1;
  o.rank = 0;
  o.rendezvous[0] = 0;
  sf_context* ctx = nullptr;
  sf_create(&o, &ctx);
  const int calls = 1000000;
  auto t0 = Clock::now();
  for (int i = 0; i < calls; ++i) sf_check_replicas(ctx, uint64_t(i));
  out.world1Ns = msSince(t0) * 1e6 / calls;
  sf_destroy(ctx);
  return out;
}

void printReplicaCosts(int world, int iters, std::ofstream& json) {
  const ReplicaCosts c = replicaCheckCosts(world, iters);
  if (!c.error.empty()) {
    std::cout << "replica check: " << c.error << "\n\n";
    return;
  }
  std::cout << std::fixed << std::setprecision(3) << "replica check (" << world
            << " ranks, median of " << iters << "): sf_check_replicas " << c.checkMs
            << " ms, raw Gloo allreduce of " << world << " int64 " << c.rawMs << " ms, ratio "
            << std::setprecision(2) << c.checkMs / c.rawMs << "; world size 1: "
            << std::setprecision(1) << c.world1Ns << " ns\n"
            << "sf_digest (XXH64, 64 MiB, one thread): " << std::setprecision(2) << c.digestGBs
            << " GB/s; memcpy of the same bytes " << c.memcpyGBs << " GB/s\n\n";
  if (json.is_open()) {
    json << "{\"kind\":\"replica_check\",\"ranks\":" << world << ",\"check_ms\":" << c.checkMs
         << ",\"raw_allreduce_ms\":" << c.rawMs << ",\"ratio\":" << c.checkMs / c.rawMs
         << ",\"world1_ns\":" << c.world1Ns << ",\"digest_gbs\":" << c.digestGBs
         << ",\"memcpy_gbs\":" << c.memcpyGBs << "}\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  cxxopts::Options options("sfsync-bench",
                           "Window synchronization through sfsync vs one raw Gloo allreduce of the "
                           "same bytes (ranks as threads, loopback TCP)");
  options.add_options()
      ("ranks", "ranks (threads)", cxxopts::value<int>()->default_value("2"))
      ("sizes-mb", "gradient MiB per window", cxxopts::value<std::vector<double>>()->default_value("1,16,64"))
      ("grads", "gradient counts", cxxopts::value<std::vector<int>>()->default_value("1,64,1024"))
      ("caps-mb", "bucket caps in MiB", cxxopts::value<std::vector<double>>()->default_value("25,4"))
      ("iters", "timed iterations per connection", cxxopts::value<int>()->default_value("9"))
      ("repeats", "fresh connections per configuration (Gloo's TCP latency can differ per connection)", cxxopts::value<int>()->default_value("3"))
      ("reduce", "average or sum", cxxopts::value<std::string>()->default_value("sum"))
      ("calls", "calls for the window-call cost", cxxopts::value<int64_t>()->default_value("2000000"))
      ("json", "also write JSON lines here", cxxopts::value<std::string>())
      ("replica-iters", "sf_check_replicas calls timed (0: skip that section)", cxxopts::value<int>()->default_value("200"))
      ("replica-only", "only the replica-check section")
      ("cpu", "also CPU-ms per window per rank: user+sys of the whole process (getrusage, every "
              "thread: Gloo's and sfsync's too) over each timed phase / ranks, rank threads "
              "aligned by a barrier around every phase; columns raw_cpu, bkt_cpu, sf_cpu "
              "(the sfsync window begin..synchronize) and their ratios cpu_vs_raw, cpu_vs_bkt")
      ("h,help", "print this help");
  cxxopts::ParseResult args;
  try {
    args = options.parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "sfsync-bench: " << e.what() << "\n" << options.help() << std::endl;
    return 2;
  }
  if (args.count("help")) {
    std::cout << options.help() << std::endl;
    return 0;
  }
  const int ranks = args["ranks"].as<int>();
  const int iters = args["iters"].as<int>();
  const int repeats = args["repeats"].as<int>();
  const std::string reduce = args["reduce"].as<std::string>();
  if (ranks < 2 || iters < 1 || repeats < 1 || (reduce != "sum" && reduce != "average")) {
    std::cerr << "sfsync-bench: need --ranks >= 2, --iters >= 1, --repeats >= 1, --reduce sum|average" << std::endl;
    return 2;
  }
  const sf_reduce_op op = reduce == "sum" ? SF_REDUCE_SUM : SF_REDUCE_AVERAGE;
  std::ofstream json;
  if (args.count("json")) json.open(args["json"].as<std::string>());

  const CallCosts costs = windowCallCosts(args["calls"].as<int64_t>());
  std::cout << "window calls (world size 1, no communication): begin/end " << std::fixed
            << std::setprecision(1) << costs.beginEndNs << " ns each, grad_ready inside a window "
            << costs.gradReadyNs << " ns\n\n";
  if (json.is_open()) {
    json << "{\"kind\":\"window_calls\",\"begin_end_ns\":" << costs.beginEndNs
         << ",\"grad_ready_in_window_ns\":" << costs.gradReadyNs << "}\n";
  }

  if (args["replica-iters"].as<int>() > 0) printReplicaCosts(ranks, args["replica-iters"].as<int>(), json);
  if (args.count("replica-only")) return 0;

  const bool cpu = args.count("cpu") > 0;
  std::cout << "reduce=" << reduce << ", " << ranks << " ranks, median of " << iters << " x "
            << repeats << " iterations (" << repeats << " fresh connections)";
  if (cpu) {
    std::cout << "; *_cpu: CPU-ms per rank (user+sys of the process / ranks), phases aligned";
  }
  std::cout << "\n"
            << std::setw(8) << "MiB" << std::setw(7) << "grads" << std::setw(9) << "cap_MiB"
            << std::setw(9) << "buckets" << std::setw(10) << "raw_ms" << std::setw(14)
            << "raw_bkt_ms" << std::setw(11) << "sfsync_ms" << std::setw(11) << "vs_raw"
            << std::setw(11) << "vs_bkt";
  if (cpu) {
    std::cout << std::setw(10) << "raw_cpu" << std::setw(10) << "bkt_cpu" << std::setw(10)
              << "sf_cpu" << std::setw(12) << "cpu_vs_raw" << std::setw(12) << "cpu_vs_bkt";
  }
  std::cout << "\n";
  int configIndex = 0;
  for (double size : args["sizes-mb"].as<std::vector<double>>()) {
    for (int grads : args["grads"].as<std::vector<int>>()) {
      for (double cap : args["caps-mb"].as<std::vector<double>>()) {
        const Config c{size, grads, cap};
        Row all;  // rank 0's samples over every repeat
        for (int rep = 0; rep < repeats; ++rep) {
          const std::string tag =
              "bench-" + std::to_string(::getpid()) + "-" + std::to_string(configIndex++);
          std::vector<Row> rows(static_cast<size_t>(ranks));
          std::vector<std::thread> threads;
          sfsync::ThreadBarrier barrier(ranks);
          sfsync::ThreadBarrier* phases = cpu ? &barrier : nullptr;
          for (int r = 0; r < ranks; ++r) {
            threads.emplace_back(
                [&, r] { rows[size_t(r)] = runRank(r, ranks, c, iters, op, tag, phases); });
          }
          for (auto& t : threads) t.join();
          if (!rows[0].error.empty()) {
            std::cerr << "sfsync-bench: " << rows[0].error << std::endl;
            return 1;
          }
          all.buckets = rows[0].buckets;
          for (auto v : {&Row::rawMs, &Row::bucketedMs, &Row::pluginMs, &Row::rawCpuMs,
                         &Row::bucketedCpuMs, &Row::pluginCpuMs}) {
            (all.*v).insert((all.*v).end(), (rows[0].*v).begin(), (rows[0].*v).end());
          }
        }
        struct {
          int64_t buckets;
          double rawMs, bucketedMs, pluginMs;
          double rawCpuMs, bucketedCpuMs, pluginCpuMs;
        } row{all.buckets,          median(all.rawMs),    median(all.bucketedMs),
              median(all.pluginMs), median(all.rawCpuMs), median(all.bucketedCpuMs),
              median(all.pluginCpuMs)};
        const double ratio = row.pluginMs / row.rawMs;
        const double ratioBucketed = row.pluginMs / row.bucketedMs;
        const double cpuRatio = row.pluginCpuMs / row.rawCpuMs;
        const double cpuRatioBucketed = row.pluginCpuMs / row.bucketedCpuMs;
        std::cout << std::setw(8) << std::setprecision(1) << size << std::setw(7) << grads
                  << std::setw(9) << cap << std::setw(9) << row.buckets << std::setw(10)
                  << std::setprecision(3) << row.rawMs << std::setw(14) << row.bucketedMs
                  << std::setw(11) << row.pluginMs << std::setw(11) << std::setprecision(2)
                  << ratio << std::setw(11) << ratioBucketed;
        if (cpu) {
          std::cout << std::setprecision(3) << std::setw(10) << row.rawCpuMs << std::setw(10)
                    << row.bucketedCpuMs << std::setw(10) << row.pluginCpuMs
                    << std::setprecision(2) << std::setw(12) << cpuRatio << std::setw(12)
                    << cpuRatioBucketed;
        }
        std::cout << std::endl;
        if (json.is_open()) {
          json << "{\"kind\":\"window_sync\",\"reduce\":\"" << reduce << "\",\"ranks\":" << ranks
               << ",\"mib\":" << size << ",\"grads\":" << grads << ",\"cap_mib\":" << cap
               << ",\"buckets\":" << row.buckets << ",\"raw_ms\":" << row.rawMs
               << ",\"raw_bucketed_ms\":" << row.bucketedMs << ",\"sfsync_ms\":" << row.pluginMs
               << ",\"ratio\":" << ratio << ",\"ratio_vs_bucketed\":" << ratioBucketed;
          if (cpu) {
            json << ",\"raw_cpu_ms\":" << row.rawCpuMs
                 << ",\"raw_bucketed_cpu_ms\":" << row.bucketedCpuMs
                 << ",\"sfsync_cpu_ms\":" << row.pluginCpuMs << ",\"cpu_ratio\":" << cpuRatio
                 << ",\"cpu_ratio_vs_bucketed\":" << cpuRatioBucketed;
          }
          json << "}\n";
        }
      }
    }
  }
  return 0;
}
