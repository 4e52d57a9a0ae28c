#pragma once
// checkLayoutAcrossRanks: that every rank registered the same gradient
// layout and bucket settings, once, before the first bucket collective.
// Responsible for what is compared (the counts, caps, reduce op, shard
// layout, and each gradient's numel, dtype and device) and for the message
// that names the first difference; two small control collectives through
// agreeAcrossRanks, so every rank reaches the same verdict. The first of
// them also carries the number of the window being synchronized (the
// context's first), compared exactly: ranks that restored different counts
// (sf_restore_windows) are out of step whatever the difference, where the
// window check (window_check.h) compares modulo p. Not responsible for when
// it runs (the reducer, before its first collective) or for the number.

#include <cstdint>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/reducer/bucket_memory.h"

namespace sfsync {

// What a rank's layout claims besides its gradients.
struct LayoutClaim {
  int64_t buckets;
  int64_t capBytes;
  int64_t firstCapBytes;
  int64_t reduceOp;
  int64_t shardLayout;
};

// Blocking, collective. Throws SF_ERR_MISMATCH naming the first difference
// (the layout's before the window numbers', and then the out-of-step
// message), or what the backend throws.
void checkLayoutAcrossRanks(Backend& backend, const std::vector<Gradient>& grads,
                            const LayoutClaim& claim, int64_t window);

}  // namespace sfsync
