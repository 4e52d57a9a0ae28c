#include "plugin/rendezvous/store_protocol.h"

#include <cstring>

namespace sfsync {
namespace store_protocol {

namespace {

void putU32(std::string& out, uint32_t v) {
  char b[4] = {char(v & 0xff), char((v >> 8) & 0xff), char((v >> 16) & 0xff), char((v >> 24) & 0xff)};
  out.append(b, 4);
}

uint32_t getU32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return uint32_t(u[0]) | uint32_t(u[1]) << 8 | uint32_t(u[2]) << 16 | uint32_t(u[3]) << 24;
}

bool isRequestType(char t) { return t == 'A' || t == 'C' || t == 'S' || t == 'G'; }

}  // namespace

std::string encode(char type, const std::vector<std::string>& fields) {
  size_t body = 1;
  for (const auto& f : fields) body += 4 + f.size();
  std::string out;
  out.reserve(4 + body);
  putU32(out, uint32_t(body));
  out.push_back(type);
  for (const auto& f : fields) {
    putU32(out, uint32_t(f.size()));
    out += f;
  }
  return out;
}

FrameParser::Result FrameParser::failWith(std::string message) {
  error_ = std::move(message);
  return Result::kError;
}

FrameParser::Result FrameParser::next(Message& out) {
  if (!error_.empty()) return Result::kError;
  const size_t avail = buffer_.size() - offset_;
  if (avail < 4) return Result::kNeedMore;
  const uint32_t body = getU32(buffer_.data() + offset_);
  if (body == 0) return failWith("empty frame");
  if (body > maxFrame_) {
    return failWith("frame of " + std::to_string(body) + " bytes exceeds the limit of " +
                    std::to_string(maxFrame_) + " bytes");
  }
  if (avail - 4 < body) return Result::kNeedMore;
  const char* p = buffer_.data() + offset_ + 4;
  const char* end = p + body;
  out.type = *p++;
  out.fields.clear();
  while (p < end) {
    if (out.fields.size() == kMaxFields) return failWith("more than " + std::to_string(kMaxFields) + " fields");
    if (end - p < 4) return failWith("truncated field length");
    const uint32_t n = getU32(p);
    p += 4;
    if (uint64_t(end - p) < n) return failWith("field of " + std::to_string(n) + " bytes overruns its frame");
    out.fields.emplace_back(p, n);
    p += n;
  }
  offset_ += 4 + body;
  // Keep the buffer from growing with consumed bytes.
  if (offset_ == buffer_.size()) {
    buffer_.clear();
    offset_ = 0;
  } else if (offset_ > 65536 && offset_ * 2 > buffer_.size()) {
    buffer_.erase(0, offset_);
    offset_ = 0;
  }
  return Result::kMessage;
}

bool decodeRequest(const Message& m, size_t maxKeyBytes, Request& out, std::string* error) {
  auto bad = [&](const std::string& why) {
    *error = why;
    return false;
  };
  if (!isRequestType(m.type)) {
    return bad("unknown request type 0x" + std::to_string(int(static_cast<unsigned char>(m.type))));
  }
  out = Request{};
  out.op = m.type;
  const size_t n = m.fields.size();
  switch (m.type) {
    case 'A':
      if (n != 2) return bad("auth needs 2 fields, got " + std::to_string(n));
      if (m.fields[0].size() != kNonceBytes) return bad("auth nonce is not " + std::to_string(kNonceBytes) + " bytes");
      if (!m.fields[1].empty() && m.fields[1].size() != kMacBytes) return bad("auth mac is not 0 or 32 bytes");
      out.nonce = m.fields[0];
      out.mac = m.fields[1];
      return true;
    case 'C': {
      if (n != 1) return bad("claim needs 1 field, got " + std::to_string(n));
      const std::string& r = m.fields[0];
      if (r.empty() || r.size() > 9) return bad("claim rank is not a decimal number");
      int rank = 0;
      for (char c : r) {
        if (c < '0' || c > '9') return bad("claim rank is not a decimal number");
        rank = rank * 10 + (c - '0');
      }
      out.rank = rank;
      return true;
    }
    case 'S':
    case 'G':
      if (n != (m.type == 'S' ? 2u : 1u)) return bad(std::string(1, m.type) + " has " + std::to_string(n) + " fields");
      if (m.fields[0].empty()) return bad("empty key");
      if (m.fields[0].size() > maxKeyBytes) {
        return bad("key of " + std::to_string(m.fields[0].size()) + " bytes exceeds the limit of " +
                   std::to_string(maxKeyBytes));
      }
      out.key = m.fields[0];
      if (m.type == 'S') out.value = m.fields[1];
      return true;
  }
  return bad("unreachable");
}

}  // namespace store_protocol
}  // namespace sfsync
