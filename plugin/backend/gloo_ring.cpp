#include "plugin/backend/gloo_ring.h"

#include <algorithm>
#include <utility>

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

// A slot per step and span (at most two spans per segment: data, window check).
uint64_t slotOf(uint64_t prefix, uint32_t tag, int step, size_t span) {
  return (prefix << 56) | (uint64_t(tag) << 24) | (uint64_t(2 * step + int(span)) & 0xffffff);
}

int64_t bytesOf(const std::vector<RingSpan>& spans) {
  int64_t n = 0;
  for (const RingSpan& s : spans) n += s.bytes;
  return n;
}

// The bytes of the piece's fullest segment (0: nothing travels).
int64_t largestSegment(const RingPiece& piece) {
  int64_t most = 0;
  for (const auto& spans : piece.spans) most = std::max(most, bytesOf(spans));
  return most;
}

void waitOrFail(bool completed, const char* what) {
  if (!completed) fail(SF_ERR_TIMEOUT, std::string("gloo ") + what + ": wait aborted");
}

int mod(int a, int w) { return ((a % w) + w) % w; }

}  // namespace

RingPiece slicePiece(char* base, int64_t segmentElems, sf_dtype dtype, int world, int64_t begin,
                     int64_t count, const std::vector<int64_t>& used, int64_t dataEnd) {
  const int64_t esize = int64_t(dtypeSize(dtype));
  RingPiece piece{base, segmentElems * esize, dtype, {}};
  piece.spans.resize(size_t(world));
  const int64_t end = begin + count;
  for (int k = 0; k < world; ++k) {
    const int64_t u = used.empty() ? dataEnd : std::min(used[size_t(k)], dataEnd);
    for (auto range : {std::make_pair(int64_t(0), u), std::make_pair(dataEnd, segmentElems)}) {
      const int64_t lo = std::max(range.first, begin), hi = std::min(range.second, end);
      if (hi <= lo) continue;
      auto& spans = piece.spans[size_t(k)];
      if (!spans.empty() && spans.back().offsetBytes + spans.back().bytes == lo * esize) {
        spans.back().bytes += (hi - lo) * esize;
      } else {
        spans.push_back({lo * esize, (hi - lo) * esize});
      }
    }
  }
  return piece;
}

int64_t ringReduceScatter(gloo::Context& context, const RingPiece& piece, uint32_t tag,
                          std::chrono::milliseconds timeout, std::vector<char>& scratch) {
  const int w = context.size, r = context.rank;
  if (w == 1) return 0;
  const int64_t most = largestSegment(piece);
  if (most == 0) return 0;
  const int right = (r + 1) % w, left = (r - 1 + w) % w;
  if (scratch.size() < size_t(most)) scratch.resize(size_t(most));
  auto data = context.createUnboundBuffer(piece.base, size_t(piece.strideBytes) * size_t(w));
  auto incoming = context.createUnboundBuffer(scratch.data(), size_t(most));
  const size_t esize = dtypeSize(piece.dtype);
  int64_t sent = 0;
  for (int s = 0; s < w - 1; ++s) {
    const int sendChunk = mod(r - s - 1, w), recvChunk = mod(r - s - 2, w);
    const auto& in = piece.spans[size_t(recvChunk)];
    const auto& out = piece.spans[size_t(sendChunk)];
    int64_t at = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      incoming->recv(left, slotOf(kReduceScatterPrefix, tag, s, i), size_t(at), size_t(in[i].bytes));
      at += in[i].bytes;
    }
    for (size_t i = 0; i < out.size(); ++i) {
      data->send(right, slotOf(kReduceScatterPrefix, tag, s, i),
                 size_t(sendChunk * piece.strideBytes + out[i].offsetBytes), size_t(out[i].bytes));
      sent += out[i].bytes;
    }
    for (size_t i = 0; i < in.size(); ++i) waitOrFail(incoming->waitRecv(timeout), "reduce-scatter (recv)");
    at = 0;
    for (const RingSpan& span : in) {
      char* own = piece.base + recvChunk * piece.strideBytes + span.offsetBytes;
      addInto(own, own, scratch.data() + at, size_t(span.bytes) / esize, piece.dtype);  // 16-bit: in float32
      at += span.bytes;
    }
    for (size_t i = 0; i < out.size(); ++i) waitOrFail(data->waitSend(timeout), "reduce-scatter (send)");
  }
  return sent;
}

int64_t ringAllgather(gloo::Context& context, const RingPiece& piece, uint32_t tag,
                      std::chrono::milliseconds timeout) {
  const int w = context.size, r = context.rank;
  if (w == 1) return 0;
  const int64_t most = largestSegment(piece);
  if (most == 0) return 0;
  const int right = (r + 1) % w, left = (r - 1 + w) % w;
  auto data = context.createUnboundBuffer(piece.base, size_t(piece.strideBytes) * size_t(w));
  int64_t sent = 0;
  for (int s = 0; s < w - 1; ++s) {
    const int sendChunk = mod(r - s, w), recvChunk = mod(r - s - 1, w);
    const auto& in = piece.spans[size_t(recvChunk)];
    const auto& out = piece.spans[size_t(sendChunk)];
    for (size_t i = 0; i < in.size(); ++i) {
      data->recv(left, slotOf(kAllgatherPrefix, tag, s, i),
                 size_t(recvChunk * piece.strideBytes + in[i].offsetBytes), size_t(in[i].bytes));
    }
    for (size_t i = 0; i < out.size(); ++i) {
      data->send(right, slotOf(kAllgatherPrefix, tag, s, i),
                 size_t(sendChunk * piece.strideBytes + out[i].offsetBytes), size_t(out[i].bytes));
      sent += out[i].bytes;
    }
    for (size_t i = 0; i < in.size(); ++i) waitOrFail(data->waitRecv(timeout), "all-gather (recv)");
    for (size_t i = 0; i < out.size(); ++i) waitOrFail(data->waitSend(timeout), "all-gather (send)");
  }
  return sent;
}

}  // namespace sfsync
