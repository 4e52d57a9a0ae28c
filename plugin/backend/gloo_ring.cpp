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

// [Note: receives before sends] Every step posts its receives before its
// sends, and must stay so. Gloo's TCP pair writes a send's bytes in the
// calling thread when the peer's receive is already known to it, holding
// the pair's mutex for the copy, while the device loop only try-locks that
// mutex and, its socket readable, spins through epoll_wait (about 25,000
// calls a transformer window and rank on loopback, 2-3 ms of a one-core
// rank's CPU). Posting the sends first makes the loop write them itself
// (500k -> 170-200k epoll_waits in 20 windows; the MLP's sharded window
// 0.98-1.09 -> 0.90 of the best DDP on loopback), but every send then
// waits for the receiver's notice, which on a slow link queues behind the
// bytes still in flight: at 1 Gbit/s each all-gather took 15 ms instead of
// 3 (median, SF_TRACE) and the MLP's sharded window 1.02 -> 1.21-1.31 of
// the best DDP. Issue 46 keeps the slow links: receives first. At two
// ranks the spin is avoided otherwise: a mesh per direction
// (gloo_backend.cpp), so that the socket written never receives.

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

int64_t ringChunkBytes(int64_t largestSegmentBytes, size_t elemBytes) {
  const int64_t most = largestSegmentBytes;
  int64_t c = std::max<int64_t>(kRingChunkBytes, (most + kRingMaxChunks - 1) / kRingMaxChunks);
  const int64_t e = int64_t(elemBytes);
  c = (c + e - 1) / e * e;  // whole elements
  return std::max<int64_t>(e, std::min(c, most));
}

namespace {

// A segment's spans cut into chunks of at most `chunk` bytes, in order:
// every rank cuts a segment's spans alike, so that chunk k of a send and of
// the matching receive have the same size (Gloo matches them by slot).
std::vector<RingSpan> chunksOf(const std::vector<RingSpan>& spans, int64_t chunk) {
  std::vector<RingSpan> out;
  for (const RingSpan& s : spans) {
    for (int64_t at = 0; at < s.bytes; at += chunk) {
      out.push_back({s.offsetBytes + at, std::min(chunk, s.bytes - at)});
    }
  }
  return out;
}

// The slot of chunk k of step s: at most 2 spans of at most kRingMaxChunks
// chunks each (a span is at most the largest segment) per step.
uint64_t chunkSlot(uint32_t tag, int step, size_t k) {
  constexpr uint64_t perStep = 2 * uint64_t(kRingMaxChunks) + 2;
  return (kReduceScatterPrefix << 56) | (uint64_t(tag) << 24) |
         ((uint64_t(step) * perStep + k) & 0xffffff);
}

}  // namespace

int64_t ringReduceScatter(const RingLinks& links, const RingPiece& piece, uint32_t tag,
                          std::chrono::milliseconds timeout, std::vector<char>& scratch,
                          double factor, int64_t scaledEnd) {
  const int w = links.send.size, r = links.send.rank;
  const size_t esize = dtypeSize(piece.dtype);
  char* mine = piece.base + r * piece.strideBytes;
  // This rank's sums in [offsetBytes, offsetBytes + bytes) of its segment,
  // times the factor below scaledEnd.
  const int64_t scaledEndBytes = scaledEnd < 0 ? piece.strideBytes : scaledEnd * int64_t(esize);
  auto scaleMine = [&](const RingSpan& span) {
    const int64_t hi = std::min(span.offsetBytes + span.bytes, scaledEndBytes);
    if (factor != 1.0 && hi > span.offsetBytes) {
      scaleInPlace(mine + span.offsetBytes, (hi - span.offsetBytes) / int64_t(esize), piece.dtype,
                   factor);
    }
  };
  const int64_t most = largestSegment(piece);
  if (w == 1 || most == 0) {  // no sum travels: the segment holds them already
    for (const RingSpan& span : piece.spans[size_t(r)]) scaleMine(span);
    return 0;
  }
  const int right = (r + 1) % w, left = (r - 1 + w) % w;
  // The neighbour's partial sums arrive chunk by chunk into two halves of
  // the scratch in turn, each added while the next one arrives: the scratch
  // stays at two chunks (1 MiB for segments up to 32 MiB), not the largest
  // segment (it stays allocated per lane: 0.3 held a whole shard per lane).
  const int64_t chunk = ringChunkBytes(most, esize);
  if (scratch.size() < size_t(2 * chunk)) scratch.resize(size_t(2 * chunk));
  auto data = links.send.createUnboundBuffer(piece.base, size_t(piece.strideBytes) * size_t(w));
  std::unique_ptr<gloo::transport::UnboundBuffer> halves[2] = {
      links.recv.createUnboundBuffer(scratch.data(), size_t(chunk)),
      links.recv.createUnboundBuffer(scratch.data() + chunk, size_t(chunk))};
  int64_t sent = 0;
  for (int s = 0; s < w - 1; ++s) {
    const int sendChunk = mod(r - s - 1, w), recvChunk = mod(r - s - 2, w);
    const std::vector<RingSpan> in = chunksOf(piece.spans[size_t(recvChunk)], chunk);
    const std::vector<RingSpan> out = chunksOf(piece.spans[size_t(sendChunk)], chunk);
    for (size_t k = 0; k < in.size() && k < 2; ++k) {  // [Note: receives before sends]
      halves[k]->recv(left, chunkSlot(tag, s, k), 0, size_t(in[k].bytes));
    }
    for (size_t k = 0; k < out.size(); ++k) {
      data->send(right, chunkSlot(tag, s, k),
                 size_t(sendChunk * piece.strideBytes + out[k].offsetBytes), size_t(out[k].bytes));
      sent += out[k].bytes;
    }
    for (size_t k = 0; k < in.size(); ++k) {
      auto& half = halves[k % 2];
      waitOrFail(half->waitRecv(timeout), "reduce-scatter (recv)");
      char* own = piece.base + recvChunk * piece.strideBytes + in[k].offsetBytes;
      addInto(own, own, scratch.data() + (k % 2) * chunk, size_t(in[k].bytes) / esize,
              piece.dtype);  // 16-bit: in float32
      if (s == w - 2) scaleMine(in[k]);  // the last step receives this rank's own segment
      if (k + 2 < in.size()) half->recv(left, chunkSlot(tag, s, k + 2), 0, size_t(in[k + 2].bytes));
    }
    for (size_t k = 0; k < out.size(); ++k) waitOrFail(data->waitSend(timeout), "reduce-scatter (send)");
  }
  return sent;
}

int64_t ringAllgather(const RingLinks& links, const RingPiece& piece, uint32_t tag,
                      std::chrono::milliseconds timeout) {
  const int w = links.send.size, r = links.send.rank;
  if (w == 1) return 0;
  const int64_t most = largestSegment(piece);
  if (most == 0) return 0;
  const int right = (r + 1) % w, left = (r - 1 + w) % w;
  auto data = links.send.createUnboundBuffer(piece.base, size_t(piece.strideBytes) * size_t(w));
  auto into = links.recv.createUnboundBuffer(piece.base, size_t(piece.strideBytes) * size_t(w));
  int64_t sent = 0;
  for (int s = 0; s < w - 1; ++s) {
    const int sendChunk = mod(r - s, w), recvChunk = mod(r - s - 1, w);
    const auto& in = piece.spans[size_t(recvChunk)];
    const auto& out = piece.spans[size_t(sendChunk)];
    for (size_t i = 0; i < in.size(); ++i) {  // [Note: receives before sends]
      into->recv(left, slotOf(kAllgatherPrefix, tag, s, i),
                 size_t(recvChunk * piece.strideBytes + in[i].offsetBytes), size_t(in[i].bytes));
    }
    for (size_t i = 0; i < out.size(); ++i) {
      data->send(right, slotOf(kAllgatherPrefix, tag, s, i),
                 size_t(sendChunk * piece.strideBytes + out[i].offsetBytes), size_t(out[i].bytes));
      sent += out[i].bytes;
    }
    for (size_t i = 0; i < in.size(); ++i) waitOrFail(into->waitRecv(timeout), "all-gather (recv)");
    for (size_t i = 0; i < out.size(); ++i) waitOrFail(data->waitSend(timeout), "all-gather (send)");
  }
  return sent;
}

int64_t ringAllreduce16(const RingLinks& links, float* data, int64_t count, int64_t scaled,
                        sf_dtype wire, float prescale, float postscale, uint32_t tag,
                        std::chrono::milliseconds timeout, std::vector<uint16_t>& scratch) {
  const int w = links.send.size, r = links.send.rank;
  // Segment k: elements [k seg, min(count, (k + 1) seg)), possibly short or
  // empty; the scratch spans whole segments (the buffers the rings register).
  const int64_t seg = (count + w - 1) / w;
  if (scratch.size() < size_t(seg * w)) scratch.resize(size_t(seg * w));
  uint16_t* wireData = scratch.data();
  // f over [lo, hi) in at most two calls: the scaled elements, then the rest.
  auto byFactor = [scaled](int64_t lo, int64_t hi, float factor, auto&& f) {
    const int64_t mid = std::max(lo, std::min(hi, scaled));
    if (mid > lo) f(lo, mid - lo, factor);
    if (hi > mid) f(mid, hi - mid, 1.0f);
  };
  auto narrow = [&](int64_t lo, int64_t hi) {
    byFactor(lo, hi, prescale, [&](int64_t at, int64_t n, float k) {
      narrowTo16(wireData + at, data + at, n, wire, k);
    });
  };
  int64_t sent = 0;
  if (w == 1) {
    narrow(0, count);
  } else if (count > 0) {
    std::vector<int64_t> used(static_cast<size_t>(w));
    for (int k = 0; k < w; ++k) used[size_t(k)] = std::max<int64_t>(0, std::min(seg, count - k * seg));
    const RingPiece piece =
        slicePiece(reinterpret_cast<char*>(wireData), seg, wire, w, 0, seg, used, seg);
    const int64_t chunk = ringChunkBytes(largestSegment(piece), 2);
    // A chunk's elements [lo, lo + n) of the piece.
    auto elems = [&](int k, const RingSpan& c) {
      return std::make_pair(k * seg + c.offsetBytes / 2, c.bytes / 2);
    };
    const int right = (r + 1) % w, left = (r - 1 + w) % w;
    auto buffer = links.send.createUnboundBuffer(wireData, size_t(seg * w) * 2);
    for (int s = 0; s < w - 1; ++s) {
      const int sendSeg = mod(r - s - 1, w), recvSeg = mod(r - s - 2, w);
      const std::vector<RingSpan> in = chunksOf(piece.spans[size_t(recvSeg)], chunk);
      const std::vector<RingSpan> out = chunksOf(piece.spans[size_t(sendSeg)], chunk);
      // Every chunk's receive posted first, each into a buffer of its own
      // (so that its wait is its own), the sum taken as each one arrives.
      std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> inBuffers;
      for (size_t k = 0; k < in.size(); ++k) {
        const auto [lo, n] = elems(recvSeg, in[k]);
        inBuffers.push_back(links.recv.createUnboundBuffer(wireData + lo, size_t(n) * 2));
        inBuffers.back()->recv(left, chunkSlot(tag, s, k), 0, size_t(n) * 2);
      }
      for (size_t k = 0; k < out.size(); ++k) {
        const auto [lo, n] = elems(sendSeg, out[k]);
        if (s == 0) narrow(lo, lo + n);  // later steps send the sums of the step before
        buffer->send(right, chunkSlot(tag, s, k), size_t(lo) * 2, size_t(n) * 2);
        sent += n * 2;
      }
      for (size_t k = 0; k < in.size(); ++k) {
        const auto [lo, n] = elems(recvSeg, in[k]);
        waitOrFail(inBuffers[k]->waitRecv(timeout), "16-bit reduce-scatter (recv)");
        byFactor(lo, lo + n, prescale, [&](int64_t at, int64_t m, float f) {
          addOwnTo16(wireData + at, data + at, m, wire, f);
        });
      }
      for (size_t k = 0; k < out.size(); ++k) {
        waitOrFail(buffer->waitSend(timeout), "16-bit reduce-scatter (send)");
      }
    }
    sent += ringAllgather(links, piece, tag, timeout);
  }
  byFactor(0, count, postscale, [&](int64_t at, int64_t n, float k) {
    widenFrom16(data + at, wireData + at, n, wire, k);
  });
  return sent;
}

}  // namespace sfsync
