#include "plugin/backend/gloo_ring.h"

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include "plugin/core/dtype.h"
#include "plugin/core/error.h"

namespace sfsync {

namespace {

// Slots of our own prefixes (Gloo's collectives use 0x01..0x08), one per
// step, so that concurrent collectives (distinct tags) never match.
constexpr uint64_t kReduceScatterPrefix = 0x20;
constexpr uint64_t kAllgatherPrefix = 0x21;

uint64_t slotOf(uint64_t prefix, uint32_t tag, int step) {
  return (prefix << 56) | (uint64_t(tag) << 24) | uint64_t(step & 0xffffff);
}

void waitOrFail(bool completed, const char* what) {
  if (!completed) fail(SF_ERR_TIMEOUT, std::string("gloo ") + what + ": wait aborted");
}

int mod(int a, int w) { return ((a % w) + w) % w; }

}  // namespace

int64_t ringReduceScatter(gloo::Context& context, const RingPiece& piece, uint32_t tag,
                          std::chrono::milliseconds timeout, std::vector<char>& scratch) {
  const int w = context.size, r = context.rank;
  if (w == 1 || piece.bytes == 0) return 0;
  const int right = (r + 1) % w, left = (r - 1 + w) % w;
  if (scratch.size() < size_t(piece.bytes)) scratch.resize(size_t(piece.bytes));
  auto data = context.createUnboundBuffer(piece.base, size_t(piece.strideBytes) * size_t(w));
  auto incoming = context.createUnboundBuffer(scratch.data(), size_t(piece.bytes));
  const size_t esize = dtypeSize(piece.dtype);
  int64_t sent = 0;
  for (int s = 0; s < w - 1; ++s) {
    const int sendChunk = mod(r - s - 1, w), recvChunk = mod(r - s - 2, w);
    const uint64_t slot = slotOf(kReduceScatterPrefix, tag, s);
    incoming->recv(left, slot, 0, size_t(piece.bytes));
    data->send(right, slot, size_t(sendChunk * piece.strideBytes + piece.offsetBytes),
               size_t(piece.bytes));
    waitOrFail(incoming->waitRecv(timeout), "reduce-scatter (recv)");
    char* own = piece.base + recvChunk * piece.strideBytes + piece.offsetBytes;
    addInto(own, own, scratch.data(), size_t(piece.bytes) / esize, piece.dtype);  // 16-bit: in float32
    waitOrFail(data->waitSend(timeout), "reduce-scatter (send)");
    sent += piece.bytes;
  }
  return sent;
}

int64_t ringAllgather(gloo::Context& context, const RingPiece& piece, uint32_t tag,
                      std::chrono::milliseconds timeout) {
  const int w = context.size, r = context.rank;
  if (w == 1 || piece.bytes == 0) return 0;
  const int right = (r + 1) % w, left = (r - 1 + w) % w;
  auto data = context.createUnboundBuffer(piece.base, size_t(piece.strideBytes) * size_t(w));
  int64_t sent = 0;
  for (int s = 0; s < w - 1; ++s) {
    const int sendChunk = mod(r - s, w), recvChunk = mod(r - s - 1, w);
    const uint64_t slot = slotOf(kAllgatherPrefix, tag, s);
    data->recv(left, slot, size_t(recvChunk * piece.strideBytes + piece.offsetBytes),
               size_t(piece.bytes));
    data->send(right, slot, size_t(sendChunk * piece.strideBytes + piece.offsetBytes),
               size_t(piece.bytes));
    waitOrFail(data->waitRecv(timeout), "all-gather (recv)");
    waitOrFail(data->waitSend(timeout), "all-gather (send)");
    sent += piece.bytes;
  }
  return sent;
}

}  // namespace sfsync
