// The wire counts (sf_stats.wire_*) against the transport itself: 2 ranks
// as threads over Gloo's TCP pairs (memory:// store, so the only TCP
// sockets of this process are the ranks' pairs), one window per mode, the
// bytes every socket of the process received (TCP_INFO's
// tcpi_bytes_received: Gloo's payload and its message headers) against the
// payload both ranks counted. The counts are the buffers handed over; a
// ring moves (W-1)/W of a reduce-scatter's or all-gather's buffer per rank
// and 2(W-1)/W of an all-reduce's, so at W = 2 the transport carries the
// all-reduces' counted bytes and half the scatters' and gathers'. What is
// left is Gloo's framing, allowed kFramingPerCollective bytes per counted
// collective.

#include <boost/test/unit_test.hpp>

#include <dirent.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "plugin/core/thread_barrier.h"
#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

// Gloo's header per message, a few per collective per rank (ring steps):
// generous, and small against the buckets below (3 x 256 KiB).
constexpr int64_t kFramingPerCollective = 1024;

// Per TCP socket of this process: bytes received and bytes sent (acked).
std::map<int, std::pair<int64_t, int64_t>> tcpBytesPerSocket() {
  std::map<int, std::pair<int64_t, int64_t>> out;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    const int fd = std::atoi(e->d_name);
    if (e->d_name[0] < '0' || e->d_name[0] > '9' || fd == dirfd(d)) continue;
    tcp_info info{};
    socklen_t len = sizeof info;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) continue;
    if (len < offsetof(tcp_info, tcpi_bytes_received) + sizeof info.tcpi_bytes_received) continue;
    out[fd] = {int64_t(info.tcpi_bytes_received), int64_t(info.tcpi_bytes_acked)};
  }
  closedir(d);
  return out;
}

int64_t bytesReceived(const std::map<int, std::pair<int64_t, int64_t>>& sockets) {
  int64_t total = 0;
  for (const auto& [fd, bytes] : sockets) total += bytes.first;
  return total;
}

struct Mode {
  const char* name;
  sf_shard_layout layout = SF_SHARD_NONE;
  bool owned = false;       // host-owned gradient buffers (per parameter), else the flat buffer
  bool weighted = false;
  bool bf16 = false;        // wire_dtype
  int64_t mask = 0;         // a used mask of this many float32 in a bucket ("sfsync.used")
  bool hostMask = false;    // sharded: the mask summed by sf_allreduce_float64, gradients gathered
};

struct Seen {
  std::string error;
  sf_stats delta{};
};

#define WIRE_TRY(call)                                            \
  do {                                                            \
    if ((call) != SF_OK) {                                        \
      seen.error = std::string(#call) + ": " + sf_last_error();   \
      barrierOnError = true;                                      \
    }                                                             \
  } while (0)

struct Run {
  std::vector<Seen> ranks;
  int64_t transport = 0;
  // Per socket, over the timed window: bytes received, bytes sent.
  std::map<int, std::pair<int64_t, int64_t>> sockets;
};

Run runMode(const Mode& m) {
  const std::string rdv = "memory://" + uniqueName(std::string("wire-") + m.name);
  sfsync::ThreadBarrier barrier(2);
  std::map<int, std::pair<int64_t, int64_t>> socketsBefore, socketsAfter;
  const std::vector<int64_t> sizes = {65536, 65536, 65536};  // 256 KiB each: a bucket each
  Run run;
  run.ranks = runThreadRanks<Seen>(2, [&](int rank) {
    Seen seen;
    bool barrierOnError = false;
    sf_options o = rankOptions(rank, 2, rdv, 30000);
    o.bucket_cap_mb = 0.25;
    o.first_bucket_cap_mb = 0.25;
    o.shard_layout = m.layout;
    if (m.weighted) o.reduce_op = SF_REDUCE_WEIGHTED;
    if (m.bf16) o.wire_dtype = SF_DTYPE_BFLOAT16;
    ContextHandle h;
    WIRE_TRY(sf_create(&o, &h.ctx));
    std::vector<std::vector<float>> grads(sizes.size()), params(sizes.size());
    std::vector<int64_t> ids;
    if (m.mask > 0) {
      int64_t id = -1;
      WIRE_TRY(sf_add_gradient(h.ctx, m.mask, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "sfsync.used", &id));
      ids.push_back(id);
    }
    for (size_t k = 0; k < sizes.size(); ++k) {
      int64_t id = -1;
      grads[k].assign(size_t(sizes[k]), 0.5f);
      if (m.owned) {
        WIRE_TRY(sf_register_gradient(h.ctx, grads[k].data(), sizes[k], SF_DTYPE_FLOAT32,
                                      SF_DEVICE_HOST, nullptr, &id));
      } else {
        WIRE_TRY(sf_add_gradient(h.ctx, sizes[k], SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id));
      }
      if (m.layout != SF_SHARD_NONE) {
        params[k].assign(size_t(sizes[k]), 1.0f);
        WIRE_TRY(sf_register_parameter(h.ctx, id, params[k].data(), sizes[k], SF_DTYPE_FLOAT32,
                                       SF_DEVICE_HOST));
      }
      ids.push_back(id);
    }
    std::vector<double> hostMask(sizes.size(), 1.0);
    auto window = [&] {
      WIRE_TRY(sf_begin_accumulation(h.ctx));
      if (m.weighted) WIRE_TRY(sf_add_window_weight(h.ctx, 2.0 + rank));
      for (auto it = ids.rbegin(); it != ids.rend(); ++it) WIRE_TRY(sf_grad_ready(h.ctx, *it));
      WIRE_TRY(sf_end_accumulation(h.ctx));
      for (auto it = ids.rbegin(); it != ids.rend(); ++it) WIRE_TRY(sf_grad_ready(h.ctx, *it));
      WIRE_TRY(sf_synchronize(h.ctx));
      if (m.hostMask) {
        WIRE_TRY(sf_gather_gradients(h.ctx));
        WIRE_TRY(sf_allreduce_float64(h.ctx, hostMask.data(), int64_t(hostMask.size())));
      }
      if (m.layout != SF_SHARD_NONE) WIRE_TRY(sf_gather_parameters(h.ctx));
    };
    if (!barrierOnError) window();  // connect, claims, the layout check
    barrier.wait();
    if (rank == 0) socketsBefore = tcpBytesPerSocket();
    barrier.wait();
    const sf_stats a = statsOf(h.ctx);
    if (!barrierOnError) window();
    sf_stats b = statsOf(h.ctx);
    barrier.wait();
    if (rank == 0) socketsAfter = tcpBytesPerSocket();
    barrier.wait();
    const int64_t* pa = &a.wire_allreduces;
    int64_t* pb = &b.wire_allreduces;
    for (int k = 0; k < 12; ++k) pb[k] -= pa[k];
    seen.delta = b;
    return seen;
  });
  run.transport = bytesReceived(socketsAfter) - bytesReceived(socketsBefore);
  for (const auto& [fd, bytes] : socketsAfter) {
    const auto was = socketsBefore.count(fd) ? socketsBefore[fd] : std::make_pair(int64_t(0), int64_t(0));
    run.sockets[fd] = {bytes.first - was.first, bytes.second - was.second};
  }
  return run;
}

// At two ranks the rings' bytes go one way per socket (gloo_backend.cpp's
// [Note: a mesh per direction]): no socket both sends and receives more
// than Gloo's framing, and the payload arrives.
void checkOneWayPerSocket(const Mode& m) {
  const Run run = runMode(m);
  int64_t collectives = 0;
  for (const Seen& s : run.ranks) {
    BOOST_REQUIRE_MESSAGE(s.error.empty(), s.error);
    collectives += s.delta.wire_reduce_scatters + s.delta.wire_all_gathers +
                   s.delta.wire_allreduces + s.delta.wire_controls;
  }
  const int64_t framing = kFramingPerCollective * collectives;
  for (const auto& [fd, bytes] : run.sockets) {
    BOOST_TEST_MESSAGE(m.name << ": socket " << fd << " received " << bytes.first << ", sent "
                              << bytes.second);
    BOOST_TEST(std::min(bytes.first, bytes.second) <= framing,
               m.name << ": socket " << fd << " received " << bytes.first << " and sent "
                      << bytes.second << " bytes (framing allowed: " << framing << ")");
  }
  BOOST_TEST(run.transport > 3 * 65536 * 4 / 2);  // at least each bucket's half, once
}

void check(const Mode& m) {
  const Run run = runMode(m);
  int64_t expected = 0, collectives = 0, counted = 0;
  for (const Seen& s : run.ranks) {
    BOOST_REQUIRE_MESSAGE(s.error.empty(), s.error);
    const sf_stats& d = s.delta;
    BOOST_TEST(d.wire_bytes == d.wire_gradient_bytes + d.wire_parameter_bytes + d.wire_mask_bytes +
                                   d.wire_check_bytes + d.wire_weight_bytes + d.wire_host_bytes);
    // Control collectives: the count's agreement (16 bytes) and the sum.
    const int64_t control = d.wire_controls > 0 ? d.wire_host_bytes + 16 : 0;
    const int64_t rings = d.wire_bytes - control;  // all-reduces, or scatters and gathers
    expected += (d.wire_allreduces > 0 ? rings : rings / 2) + control;
    collectives += d.wire_allreduces + d.wire_reduce_scatters + d.wire_all_gathers +
                   d.wire_broadcasts + d.wire_controls;
    counted += d.wire_bytes;
  }
  BOOST_TEST_MESSAGE(m.name << ": counted " << counted << " bytes (both ranks), expected on the "
                            "wire " << expected << ", TCP received " << run.transport << " in "
                            << collectives << " collectives");
  BOOST_TEST(run.transport >= expected);
  BOOST_TEST(run.transport - expected <= kFramingPerCollective * collectives);
}

}  // namespace

BOOST_AUTO_TEST_SUITE(wire_transport_tests)

BOOST_AUTO_TEST_CASE(flat_buffer_2_gloo_threads) { check({"flat"}); }

BOOST_AUTO_TEST_CASE(per_parameter_buffers_2_gloo_threads) {
  Mode m{"owned"};
  m.owned = true;
  check(m);
}

BOOST_AUTO_TEST_CASE(bf16_wire_2_gloo_threads) {
  Mode m{"bf16"};
  m.bf16 = true;
  check(m);
}

BOOST_AUTO_TEST_CASE(used_mask_in_a_bucket_2_gloo_threads) {
  Mode m{"mask"};
  m.mask = 3;
  check(m);
}

BOOST_AUTO_TEST_CASE(weighted_2_gloo_threads) {
  Mode m{"weighted"};
  m.weighted = true;
  check(m);
}

BOOST_AUTO_TEST_CASE(sharded_flat_with_the_mask_sum_2_gloo_threads) {
  Mode m{"sharded-flat"};
  m.layout = SF_SHARD_FLAT;
  m.hostMask = true;
  check(m);
}

BOOST_AUTO_TEST_CASE(sharded_parameter_2_gloo_threads) {
  Mode m{"sharded-parameter"};
  m.layout = SF_SHARD_PARAMETER;
  check(m);
}

BOOST_AUTO_TEST_CASE(two_ranks_send_each_way_on_a_socket_of_its_own_sharded) {
  Mode m{"one-way-sharded"};
  m.layout = SF_SHARD_FLAT;
  checkOneWayPerSocket(m);
}

BOOST_AUTO_TEST_CASE(two_ranks_send_each_way_on_a_socket_of_its_own_bf16_wire) {
  Mode m{"one-way-bf16"};
  m.bf16 = true;
  checkOneWayPerSocket(m);
}

BOOST_AUTO_TEST_SUITE_END()
