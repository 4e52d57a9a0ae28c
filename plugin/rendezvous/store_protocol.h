#pragma once
// The env:// store's wire protocol, as pure functions of bytes: framing,
// field decoding and the limits a frame must respect. No sockets, no
// clocks: the server and the client feed it what they read, and a fuzzer
// can feed it anything. Not responsible for what a request means (the
// server decides) nor for authentication (job_token.h).
//
// A frame is a 4-byte little-endian body length N (1 <= N <= limit), then
// the body: one type byte and up to kMaxFields fields, each a 4-byte
// little-endian length and that many bytes, filling the body exactly.
//
//   server -> client  'H' version nonce(32) authRequired("0"|"1") maxValueBytes(decimal)
//   client -> server  'A' nonce(32) mac(32, or empty without a token)
//   server -> client  'K' mac(32, or empty)      authenticated
//   client -> server  'C' rank(decimal)          claim a rank (once per job)
//                     'S' key value              set (each key written once)
//                     'G' key                    get
//   server -> client  'K' [value] | 'N' (not set yet) | 'E' code message
//
// Error codes: 'M' the job is inconsistent (two claimants, a key written
// twice), 'L' a limit was exceeded, 'A' authentication failed, 'P' not
// this protocol.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sfsync {
namespace store_protocol {

constexpr const char* kVersion = "sfsync-store-1";
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
constexpr size_t kMaxFields = 4;
// Frames before authentication (hello, auth) are small.
constexpr size_t kMaxHandshakeFrame = 512;

struct Message {
  char type = 0;
  std::vector<std::string> fields;
};

// Encodes one frame. Fields longer than 4 GiB are not representable (the
// callers' limits are far below).
std::string encode(char type, const std::vector<std::string>& fields);

// Cuts a byte stream into frames. Oversize or malformed input is an error
// as soon as it is visible (an oversize length is rejected from its 4-byte
// header, before any body is buffered); after an error the parser stays
// failed.
class FrameParser {
 public:
  explicit FrameParser(size_t maxFrameBytes) : maxFrame_(maxFrameBytes) {}

  enum class Result { kNeedMore, kMessage, kError };

  void setMaxFrame(size_t bytes) { maxFrame_ = bytes; }
  // Appends received bytes.
  void feed(const char* data, size_t n) { buffer_.append(data, n); }
  // The next complete frame, decoded into `out`; kError sets error().
  Result next(Message& out);
  const std::string& error() const { return error_; }
  // Bytes received but not consumed yet.
  size_t buffered() const { return buffer_.size() - offset_; }

 private:
  Result failWith(std::string message);

  size_t maxFrame_;
  std::string buffer_;
  size_t offset_ = 0;
  std::string error_;
};

// A client request, checked for shape: the right fields for its type,
// `key` within maxKeyBytes, `rank` a non-negative decimal int.
struct Request {
  char op = 0;  // 'A', 'C', 'S', 'G'
  std::string key, value;  // 'S', 'G'
  std::string nonce, mac;  // 'A'
  int rank = -1;           // 'C'
};

// false with *error set if `m` is not a well-formed request.
bool decodeRequest(const Message& m, size_t maxKeyBytes, Request& out, std::string* error);

}  // namespace store_protocol
}  // namespace sfsync
