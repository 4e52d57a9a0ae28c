#pragma once
// agreeAcrossRanks: what every rank learns of a few int64 values that all
// ranks should hold alike (a layout's counts, a call's arguments, a window
// number), in one small control collective. Responsible for the (x, -x)
// max-reduce trick only: each value travels with its negation, so one
// elementwise max gives every rank the same largest and smallest value of
// each slot, and therefore the same verdict (no rank is left waiting in a
// collective that the others skip). Not responsible for what a difference
// means: the caller words the error.

#include <cstdint>
#include <vector>

#include "plugin/backend/backend.h"

namespace sfsync {

// The smallest and largest value of one slot across the ranks.
struct RankRange {
  int64_t lo = 0;
  int64_t hi = 0;
  bool agreed() const { return lo == hi; }
};

// Blocking, collective: every rank passes the same number of values (the
// caller has agreed on that count already, or it is fixed). Throws what the
// backend's allreduceMaxInt64 throws. One collective whatever the count.
std::vector<RankRange> agreeAcrossRanks(Backend& backend, const std::vector<int64_t>& values);

}  // namespace sfsync
