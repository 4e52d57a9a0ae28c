#pragma once
// checkLayoutAcrossRanks: that every rank registered the same gradient
// layout and bucket settings, once, before the first bucket collective.
// Responsible for what is compared (the counts, caps, reduce op, shard
// layout, and each gradient's numel, dtype and device) and for the message
// that names the first difference; two small control collectives through
// agreeAcrossRanks, so every rank reaches the same verdict. Not responsible
// for when it runs (the reducer, before its first collective).

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

// Blocking, collective. Throws SF_ERR_MISMATCH naming the first difference,
// or what the backend throws.
void checkLayoutAcrossRanks(Backend& backend, const std::vector<Gradient>& grads,
                            const LayoutClaim& claim);

}  // namespace sfsync
