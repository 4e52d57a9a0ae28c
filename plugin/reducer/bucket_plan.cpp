#include "plugin/reducer/bucket_plan.h"

#include <algorithm>
#include <map>
#include <utility>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"

namespace sfsync {

std::vector<PlannedBucket> planBuckets(const std::vector<GradSpec>& grads, int64_t capBytes,
                                       int64_t firstCapBytes) {
  struct Open {
    PlannedBucket bucket;
    bool closedOne = false;  // has this group closed its first bucket yet
    int64_t lastPosition = 0;  // walk position of the bucket's last gradient
  };
  std::map<std::pair<sf_dtype, sf_device>, Open> open;
  // (position of the last gradient, bucket): a bucket is complete when its
  // last gradient is ready, so that is the order in which they can start.
  std::vector<std::pair<int64_t, PlannedBucket>> closed;
  int64_t position = 0;

  auto close = [&](Open& o) {
    closed.emplace_back(o.lastPosition, std::move(o.bucket));
    o.bucket = PlannedBucket{};
    o.closedOne = true;
  };

  for (int64_t id = int64_t(grads.size()) - 1; id >= 0; --id, ++position) {
    const GradSpec& g = grads[size_t(id)];
    // Checked: the Reducer keeps the total below 2^62, but the plan is a pure
    // function of its arguments and must not wrap on any of them.
    int64_t bytes = 0, sum = 0;
    if (g.numel < 0 || __builtin_mul_overflow(g.numel, int64_t(dtypeSize(g.dtype)), &bytes)) {
      fail(SF_ERR_INVALID_ARGUMENT, "gradient " + std::to_string(id) + ": numel = " +
                                        std::to_string(g.numel) + " is out of range");
    }
    Open& o = open[{g.dtype, g.device}];
    // No bucket takes a gradient that would carry it past the bucket cap (the
    // first one: past the larger of the two caps).
    const int64_t limit = o.closedOne ? capBytes : std::max(capBytes, firstCapBytes);
    if (__builtin_add_overflow(o.bucket.bytes, bytes, &sum)) close(o);  // sum > any cap
    if (!o.bucket.grads.empty() && o.bucket.bytes + bytes > limit) close(o);
    if (o.bucket.grads.empty()) {
      o.bucket.dtype = g.dtype;
      o.bucket.device = g.device;
    }
    o.bucket.grads.push_back(id);
    o.bucket.bytes += bytes;
    o.lastPosition = position;
    const int64_t capNow = o.closedOne ? capBytes : firstCapBytes;
    if (o.bucket.bytes >= capNow) close(o);
  }
  for (auto& kv : open) {
    if (!kv.second.bucket.grads.empty()) close(kv.second);
  }

  std::stable_sort(closed.begin(), closed.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<PlannedBucket> out;
  out.reserve(closed.size());
  for (auto& c : closed) out.push_back(std::move(c.second));
  return out;
}

}  // namespace sfsync
