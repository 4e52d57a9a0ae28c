// checkLayoutAcrossRanks (layout_check.h): what is compared and how the
// first difference is worded; when it runs is the reducer's.

#include "plugin/reducer/layout_check.h"

#include <sstream>
#include <string>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"
#include "plugin/reducer/agreement.h"
#include "plugin/reducer/window_check.h"

namespace sfsync {

namespace {

int64_t signature(const Gradient& x) {
  return (x.numel << 4) | (int64_t(x.dtype) << 1) | int64_t(x.device & 1);
}

std::string describe(int64_t signature) {
  // Inverse of signature().
  std::ostringstream s;
  s << (signature >> 4) << " x " << dtypeName(sf_dtype((signature >> 1) & 7)) << " on "
    << deviceName(sf_device(signature & 1));
  return s.str();
}

}  // namespace

void checkLayoutAcrossRanks(Backend& backend, const std::vector<Gradient>& grads,
                            const LayoutClaim& claim, int64_t window) {
  const int64_t g = int64_t(grads.size());
  const std::vector<int64_t> header = {g,           claim.buckets,  claim.capBytes,
                                       claim.firstCapBytes, claim.reduceOp, claim.shardLayout};
  // The window number rides in the same collective, after the layout.
  std::vector<int64_t> sent = header;
  sent.push_back(window);
  const std::vector<RankRange> h = agreeAcrossRanks(backend, sent);
  // The gradients every rank has, compared one by one.
  const int64_t minG = h[0].lo;
  std::vector<int64_t> s;
  for (int64_t i = 0; i < minG; ++i) s.push_back(signature(grads[size_t(i)]));
  const std::vector<RankRange> r = agreeAcrossRanks(backend, s);
  for (int64_t i = 0; i < minG; ++i) {
    if (r[size_t(i)].agreed()) continue;
    const Gradient& x = grads[size_t(i)];
    fail(SF_ERR_MISMATCH,
         "ranks registered different gradient layouts: the first difference is gradient " +
             std::to_string(i) + " ('" + x.name + "'): this rank has " + describe(signature(x)) +
             ", ranks range from " + describe(r[size_t(i)].lo) + " to " +
             describe(r[size_t(i)].hi));
  }
  static const char* const kFields[] = {"gradient counts", "bucket counts", "bucket_cap_mb",
                                        "first_bucket_cap_mb", "reduce ops", "shard layouts"};
  for (size_t f = 0; f < header.size(); ++f) {
    if (h[f].agreed()) continue;
    std::ostringstream m;
    m << "ranks registered different gradient layouts: " << kFields[f] << " differ (from "
      << h[f].lo << " to " << h[f].hi << ", this rank " << header[f] << ")";
    if (f == 0) {
      m << "; the first difference is gradient " << minG;
      if (minG < g) m << " ('" << grads[size_t(minG)].name << "')";
      m << ", missing on some ranks";
    }
    fail(SF_ERR_MISMATCH, m.str());
  }
  const RankRange& w = h[header.size()];
  if (!w.agreed()) fail(SF_ERR_MISMATCH, outOfStepMessage(window, w.lo, w.hi));
}

}  // namespace sfsync
