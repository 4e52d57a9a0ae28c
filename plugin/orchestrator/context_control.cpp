// The Context's control collectives between windows: admission (sf_connect),
// sf_broadcast, sf_allreduce_float64 and the replica check, each agreeing on
// its arguments across ranks first, so that ranks that disagree fail alike
// instead of pairing unequal buffers. "Control" in this project names these
// small collectives only.

#include <climits>
#include <cstring>
#include <iomanip>
#include <sstream>
#include <vector>

#include "plugin/core/digest.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/orchestrator/context.h"
#include "plugin/reducer/agreement.h"

namespace sfsync {

void Context::setStore(const sf_store& store, const char* prefix) {
  rendezvous_->setHostStore(store, prefix ? prefix : "");
}

void Context::checkIdle(const char* what) const {
  if (clock_.inWindow()) {
    fail(SF_ERR_INVALID_STATE, std::string(what) +
                                   " inside an accumulation window: every rank must call it "
                                   "between windows (after sf_synchronize)");
  }
  if (reducer_.inFlight()) {
    fail(SF_ERR_INVALID_STATE, std::string(what) +
                                   " while bucket collectives started by sf_grad_ready are in "
                                   "flight; call sf_synchronize first");
  }
}

void Context::connect() {
  std::lock_guard<std::mutex> lock(connectMutex_);
  if (connected_) return;
  if (options().world_size > 1) {
    Backend& backend = controlBackend();
    backend.connect();  // admission (Rendezvous::store) happens here
    // A second process that claimed a rank while the others connected wrote
    // its claim again; whoever sees that tells every rank, so that the whole
    // job fails the same way instead of some ranks training with a stranger.
    const std::string duplicate = rendezvous_->recheck();
    int64_t flag = duplicate.empty() ? 0 : int64_t(options().rank) + 1;
    backend.allreduceMaxInt64(&flag, 1);
    if (!duplicate.empty()) fail(SF_ERR_MISMATCH, duplicate);
    if (flag != 0) {
      fail(SF_ERR_MISMATCH, "rank " + std::to_string(flag - 1) +
                                " is claimed by two processes (that rank's log says which); "
                                "check RANK and the launcher");
    }
    SF_LOG(kInfo, "connect", "rank " << options().rank << " of " << options().world_size
                                     << " connected (" << backend.name() << ")");
  }
  connected_ = true;
}

void Context::broadcast(void* data, uint64_t bytes, int32_t root) {
  if (!data && bytes > 0) {
    fail(SF_ERR_INVALID_ARGUMENT, "data is NULL with bytes = " + std::to_string(bytes));
  }
  if (root < 0 || root >= options().world_size) {
    fail(SF_ERR_INVALID_ARGUMENT, "root = " + std::to_string(root) + " is not a rank in [0, " +
                                      std::to_string(options().world_size) + ")");
  }
  if (bytes > uint64_t(INT64_MAX)) {
    fail(SF_ERR_INVALID_ARGUMENT, "bytes = " + std::to_string(bytes) + " is too large");
  }
  checkIdle("sf_broadcast");
  if (options().world_size == 1) return;
  if (controlDevice() != SF_DEVICE_HOST) {
    fail(SF_ERR_UNSUPPORTED, "sf_broadcast copies host memory, which needs the Gloo transport: "
                             "with backend = nccl it is not available (use backend = auto)");
  }
  connect();
  Backend& backend = controlBackend();
  // Ranks that disagree on size or root would leave a receiver waiting for
  // bytes that never come (or overrun its buffer): check first, on every rank.
  const std::vector<RankRange> agree = agreeAcrossRanks(backend, {int64_t(bytes), root});
  if (!agree[0].agreed() || !agree[1].agreed()) {
    std::ostringstream s;
    s << "ranks passed different arguments: bytes from " << agree[0].lo << " to " << agree[0].hi
      << ", root from " << agree[1].lo << " to " << agree[1].hi << " (this rank: bytes = " << bytes
      << ", root = " << root << ")";
    fail(SF_ERR_MISMATCH, s.str());
  }
  if (bytes == 0) return;
  backend.broadcast(data, size_t(bytes), root);
}

uint64_t Context::digestGradients() {
  if (reducer_.gradientCount() == 0) {
    fail(SF_ERR_INVALID_STATE, "no gradient is registered");
  }
  reducer_.build();
  if (reducer_.inFlight()) {
    fail(SF_ERR_INVALID_STATE, "bucket collectives are in flight (their gradients are changing); "
                               "call sf_synchronize first");
  }
  uint64_t h = 0;
  const int64_t n = reducer_.gradientCount();
  for (int64_t id = 0; id < n; ++id) {
    const Reducer::GradientBytes g = reducer_.gradientBytesOf(id);
    if (g.device == SF_DEVICE_HOST) h = digest64(g.data, size_t(g.bytes), h);
  }
  return h;
}

void Context::checkReplicas(uint64_t digest) {
  checkIdle("sf_check_replicas");
  if (options().world_size == 1) return;
  connect();
  // An allgather as a max-reduction: each rank fills its own slot, the others
  // hold the smallest value (a digest equal to it still wins its own slot).
  const int world = options().world_size;
  std::vector<int64_t> slots(size_t(world), INT64_MIN);
  int64_t mine;
  std::memcpy(&mine, &digest, sizeof mine);
  slots[size_t(options().rank)] = mine;
  controlBackend().allreduceMaxInt64(slots.data(), world);
  std::vector<int> differ;
  for (int r = 1; r < world; ++r) {
    if (slots[size_t(r)] != slots[0]) differ.push_back(r);
  }
  if (differ.empty()) return;
  std::ostringstream s;
  s << std::hex << std::setfill('0');
  s << "replicas differ: rank" << (differ.size() > 1 ? "s " : " ");
  for (size_t i = 0; i < differ.size() && i < 32; ++i) s << (i ? ", " : "") << std::dec << differ[i];
  if (differ.size() > 32) s << ", ... (" << std::dec << differ.size() << " ranks)";
  s << " of " << std::dec << world << " hold a digest different from rank 0's (rank 0: 0x"
    << std::hex << std::setw(16) << uint64_t(slots[0]);
  for (size_t i = 0; i < differ.size() && i < 4; ++i) {
    s << ", rank " << std::dec << differ[i] << ": 0x" << std::hex << std::setw(16)
      << uint64_t(slots[size_t(differ[i])]);
  }
  s << ")";
  fail(SF_ERR_MISMATCH, s.str());
}

void Context::allreduceFloat64(double* values, int64_t count) {
  if (count < 0) fail(SF_ERR_INVALID_ARGUMENT, "count = " + std::to_string(count) + " is negative");
  if (!values && count > 0) {
    fail(SF_ERR_INVALID_ARGUMENT, "values is NULL with count = " + std::to_string(count));
  }
  checkIdle("sf_allreduce_float64");
  if (options().world_size == 1) return;
  if (controlDevice() != SF_DEVICE_HOST) {
    fail(SF_ERR_UNSUPPORTED, "sf_allreduce_float64 sums host memory, which needs the Gloo "
                             "transport: with backend = nccl it is not available (use auto)");
  }
  connect();
  Backend& backend = controlBackend();
  // Ranks that pass different counts would pair unequal buffers: check first.
  const RankRange agree = agreeAcrossRanks(backend, {count})[0];
  if (!agree.agreed()) {
    fail(SF_ERR_MISMATCH, "ranks passed different counts: from " + std::to_string(agree.lo) +
                              " to " + std::to_string(agree.hi) + " (this rank: count = " +
                              std::to_string(count) + ")");
  }
  if (count == 0) return;
  backend.allreduceSumFloat64(values, count);
}

}  // namespace sfsync
