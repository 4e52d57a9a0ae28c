// Bytes on the wire of a sharded window (reduce-scatter + all-gather) against
// an unsharded one (ring all-reduce) of the same gradients, measured as the
// loopback interface's transmitted bytes (/proc/net/dev, TCP/IP headers
// included). Run it alone in a network namespace of its own (ctest does:
// `unshare -n`), where nothing else talks on lo. Ranks are threads over
// memory:// (Gloo). Prints one line per world size and layout; exits 1 when
// a ratio passes --max-ratio (default 1.02), 77 when lo cannot be read.
//
// Usage: sfsync-shard-wire [--max-ratio R]

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/thread_ranks.h"

using namespace sftest;

namespace {

// bench_ddp's MLP 256-1024x1024x1024-10 (weights and biases), float32.
const std::vector<int64_t> kModel = {256 * 1024, 1024, 1024 * 1024, 1024, 1024 * 1024, 1024,
                                     1024 * 10, 10};

long long loTxBytes() {
  std::ifstream f("/proc/net/dev");
  std::string line;
  while (std::getline(f, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name != "lo") continue;
    std::istringstream in(line.substr(colon + 1));
    long long v[9] = {0};
    for (auto& x : v) in >> x;
    return v[8];  // transmit bytes
  }
  return -1;
}

// Bytes on lo for one window (after a first, unmeasured one that connects).
long long measure(int world, sf_shard_layout layout, std::string& error) {
  const std::string rdv = "memory://" + uniqueName("wire");
  long long before = 0, after = 0;
  std::atomic<int> arrived{0};
  auto barrier = [&](int target) {
    arrived.fetch_add(1);
    while (arrived.load() < target) std::this_thread::yield();
  };
  auto errors = runThreadRanks<std::string>(world, [&](int r) -> std::string {
    sf_options o = rankOptions(r, world, rdv);
    o.shard_layout = layout;
    o.max_inflight = 1;
    ContextHandle h;
    if (sf_create(&o, &h.ctx) != SF_OK) return sf_last_error();
    for (int64_t n : kModel) {
      int64_t id;
      if (sf_add_gradient(h.ctx, n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, nullptr, &id) != SF_OK ||
          (layout != SF_SHARD_NONE &&
           sf_register_parameter(h.ctx, id, nullptr, n, SF_DTYPE_FLOAT32, SF_DEVICE_HOST) != SF_OK)) {
        return sf_last_error();
      }
    }
    auto window = [&] {
      if (sf_synchronize(h.ctx) != SF_OK) return false;
      return layout == SF_SHARD_NONE || sf_gather_parameters(h.ctx) == SF_OK;
    };
    if (!window()) return sf_last_error();
    barrier(world);
    if (r == 0) before = loTxBytes();
    barrier(2 * world);
    if (!window()) return sf_last_error();
    barrier(3 * world);
    if (r == 0) after = loTxBytes();
    barrier(4 * world);
    return "";
  });
  for (const auto& e : errors) {
    if (!e.empty()) error = e;
  }
  return after - before;
}

}  // namespace

int main(int argc, char** argv) {
  double maxRatio = 1.02;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--max-ratio") == 0) maxRatio = std::atof(argv[i + 1]);
  }
  if (loTxBytes() < 0) {
    std::printf("no lo in /proc/net/dev: skipped\n");
    return 77;
  }
  int64_t bytes = 0;
  for (int64_t n : kModel) bytes += 4 * n;
  bool ok = true;
  for (int world : {2, 3, 4}) {
    std::string error;
    const long long plain = measure(world, SF_SHARD_NONE, error);
    for (sf_shard_layout layout : {SF_SHARD_FLAT, SF_SHARD_PARAMETER}) {
      const long long sharded = measure(world, layout, error);
      if (!error.empty()) {
        std::printf("W=%d: %s\n", world, error.c_str());
        return 1;
      }
      const double ratio = double(sharded) / double(plain);
      const double ideal = 2.0 * (world - 1) * double(bytes);  // all ranks, payload only
      std::printf("W=%d %-9s model %lld B: all-reduce window %lld B on lo, reduce-scatter + "
                  "all-gather %lld B (ratio %.4f; payload of a ring all-reduce %.0f B)\n",
                  world, layout == SF_SHARD_FLAT ? "flat" : "parameter", (long long)bytes, plain,
                  sharded, ratio, ideal);
      // Both layouts: a segment's padding stays off the wire (the
      // parameter-aligned layout pads to the bucket's largest group).
      if (ratio > maxRatio) ok = false;
    }
  }
  std::printf("%s (max ratio %.3f)\n", ok ? "OK" : "FAILED", maxRatio);
  return ok ? 0 : 1;
}
