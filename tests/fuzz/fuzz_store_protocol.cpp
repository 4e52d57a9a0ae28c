// libFuzzer target: the env:// store's wire protocol as the server reads it
// (plugin/rendezvous/store_protocol.h). The input's first bytes choose the
// frame limit, the key limit and how the rest is cut into reads; the rest is
// what a client (or a stranger) sends. Checks: no crash or over-read; a
// frame over the limit is refused from its header (nothing is buffered past
// one frame); once failed the parser stays failed; every decoded message
// encodes back to a frame that parses to the same message; a decoded
// request respects the limits it was decoded with.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "plugin/rendezvous/store_protocol.h"

namespace {

namespace sp = sfsync::store_protocol;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_store_protocol: invariant broken: %s\n", what);
    std::abort();
  }
}

void roundTrip(const sp::Message& m, size_t maxFrame) {
  const std::string frame = sp::encode(m.type, m.fields);
  sp::FrameParser again(maxFrame + 16);
  again.feed(frame.data(), frame.size());
  sp::Message back;
  check(again.next(back) == sp::FrameParser::Result::kMessage, "an encoded message parses");
  check(back.type == m.type && back.fields == m.fields, "the same message back");
  check(again.buffered() == 0, "nothing left after one frame");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const size_t maxFrame = 1 + (size_t(data[0]) << 4);  // 1 .. 4081 bytes
  const size_t maxKey = size_t(data[1]);
  const size_t chunk = 1 + data[2] % 64;
  data += 3;
  size -= 3;
  sp::FrameParser parser(maxFrame);
  bool failed = false;
  size_t fed = 0;
  while (fed < size) {
    const size_t n = std::min(chunk, size - fed);
    parser.feed(reinterpret_cast<const char*>(data) + fed, n);
    fed += n;
    for (;;) {
      sp::Message m;
      const auto r = parser.next(m);
      if (r == sp::FrameParser::Result::kNeedMore) break;
      if (r == sp::FrameParser::Result::kError) {
        check(!parser.error().empty(), "an error says why");
        failed = true;
        break;
      }
      check(!failed, "a failed parser stays failed");
      check(m.fields.size() <= sp::kMaxFields, "at most kMaxFields fields");
      size_t body = 1;
      for (const auto& f : m.fields) body += 4 + f.size();
      check(body <= maxFrame, "a frame within the limit");
      roundTrip(m, maxFrame);
      sp::Request req;
      std::string error;
      if (sp::decodeRequest(m, maxKey, req, &error)) {
        check(req.op == 'A' || req.op == 'C' || req.op == 'S' || req.op == 'G', "a known request");
        if (req.op == 'S' || req.op == 'G') check(req.key.size() <= maxKey, "key within its limit");
        if (req.op == 'C') check(req.rank >= 0, "a rank is not negative");
      } else {
        check(!error.empty(), "a refused request says why");
      }
    }
    if (failed) {
      sp::Message m;
      check(parser.next(m) == sp::FrameParser::Result::kError, "a failed parser stays failed");
      break;
    }
    // Drained: at most one partial frame is held.
    check(parser.buffered() < 4 + maxFrame, "no more than one partial frame buffered");
  }
  return 0;
}
