// agreeAcrossRanks (agreement.h): the pairs on the wire and their unpacking;
// nothing else.

#include "plugin/reducer/agreement.h"

namespace sfsync {

std::vector<RankRange> agreeAcrossRanks(Backend& backend, const std::vector<int64_t>& values) {
  // Pairs (x, -x), as 0.1 sent them: the max of -x is minus the min of x.
  // (-INT64_MIN would overflow; no caller passes it: counts, sizes, ranks,
  // window numbers and packed signatures are all far from it.)
  std::vector<int64_t> pairs;
  pairs.reserve(2 * values.size());
  for (int64_t x : values) {
    pairs.push_back(x);
    pairs.push_back(-x);
  }
  if (!pairs.empty()) backend.allreduceMaxInt64(pairs.data(), int64_t(pairs.size()));
  std::vector<RankRange> ranges(values.size());
  for (size_t i = 0; i < values.size(); ++i) ranges[i] = {-pairs[2 * i + 1], pairs[2 * i]};
  return ranges;
}

}  // namespace sfsync
