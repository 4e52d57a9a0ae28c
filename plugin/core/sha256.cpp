#include "plugin/core/sha256.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "plugin/core/error.h"

namespace sfsync {

namespace {

// FIPS 180-4, 4.2.2: the first 32 bits of the fractional parts of the cube
// roots of the first 64 primes.
constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// FIPS 180-4, 5.3.3: the first 32 bits of the fractional parts of the square
// roots of the first 8 primes.
constexpr uint32_t kInitial[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                  0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

constexpr size_t kBlock = 64;

inline uint32_t rotr(uint32_t x, int r) { return (x >> r) | (x << (32 - r)); }

// Big-endian by bytes, so the host's byte order does not matter.
inline uint32_t loadBigEndian32(const unsigned char* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | uint32_t(p[3]);
}

inline void storeBigEndian32(uint32_t v, unsigned char* p) {
  p[0] = static_cast<unsigned char>(v >> 24);
  p[1] = static_cast<unsigned char>(v >> 16);
  p[2] = static_cast<unsigned char>(v >> 8);
  p[3] = static_cast<unsigned char>(v);
}

// Zeroes through a volatile pointer: a store the compiler may not drop
// because the buffer dies right after.
void wipe(void* p, size_t n) {
  volatile unsigned char* v = static_cast<volatile unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) v[i] = 0;
}

// The hash over data given in pieces (HMAC hashes a pad block and then the
// message without copying them together).
class Sha256 {
 public:
  Sha256() { std::memcpy(state_, kInitial, sizeof state_); }
  ~Sha256() {
    wipe(state_, sizeof state_);
    wipe(pending_, sizeof pending_);
  }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void update(const void* data, size_t bytes) {
    if (bytes == 0) return;
    const unsigned char* p = static_cast<const unsigned char*>(data);
    total_ += bytes;
    if (used_ > 0) {
      const size_t take = bytes < kBlock - used_ ? bytes : kBlock - used_;
      std::memcpy(pending_ + used_, p, take);
      used_ += take;
      p += take;
      bytes -= take;
      if (used_ < kBlock) return;
      compress(pending_);
      used_ = 0;
    }
    for (; bytes >= kBlock; p += kBlock, bytes -= kBlock) compress(p);
    std::memcpy(pending_, p, bytes);
    used_ = bytes;
  }

  // FIPS 180-4, 5.1.1: a 1 bit, zeros up to 56 mod 64 bytes, then the
  // message's length in bits as a 64-bit big-endian number.
  Sha256Digest finish() {
    const uint64_t bits = total_ * 8;
    unsigned char tail[kBlock + 8] = {0x80};
    const size_t pad = used_ < 56 ? 56 - used_ : kBlock + 56 - used_;
    for (int i = 0; i < 8; ++i) tail[pad + i] = static_cast<unsigned char>(bits >> (56 - 8 * i));
    update(tail, pad + 8);
    Sha256Digest out;
    for (int i = 0; i < 8; ++i) storeBigEndian32(state_[i], out.data() + 4 * i);
    return out;
  }

 private:
  // FIPS 180-4, 6.2.2: one 64-byte block into the state.
  void compress(const unsigned char* block) {
    uint32_t w[64];
    for (int t = 0; t < 16; ++t) w[t] = loadBigEndian32(block + 4 * t);
    for (int t = 16; t < 64; ++t) {
      const uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
      const uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
      w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
    uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
    for (int t = 0; t < 64; ++t) {
      const uint32_t sum1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
      const uint32_t choose = (e & f) ^ (~e & g);
      const uint32_t t1 = h + sum1 + choose + kRound[t] + w[t];
      const uint32_t sum0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
      const uint32_t majority = (a & b) ^ (a & c) ^ (b & c);
      const uint32_t t2 = sum0 + majority;
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a;
    state_[1] += b;
    state_[2] += c;
    state_[3] += d;
    state_[4] += e;
    state_[5] += f;
    state_[6] += g;
    state_[7] += h;
    wipe(w, sizeof w);
  }

  uint32_t state_[8];
  unsigned char pending_[kBlock] = {};
  size_t used_ = 0;
  uint64_t total_ = 0;  // bytes so far (the length field is mod 2^64 bits)
};

}  // namespace

Sha256Digest sha256(const void* data, size_t bytes) noexcept {
  Sha256 h;
  h.update(data, bytes);
  return h.finish();
}

// RFC 2104, section 2: H(K ^ opad || H(K ^ ipad || message)), K the key
// zero-padded to the block (hashed first if longer than one).
Sha256Digest hmacSha256(const void* key, size_t keyBytes, const void* msg,
                        size_t msgBytes) noexcept {
  unsigned char padded[kBlock] = {};
  if (keyBytes > kBlock) {
    Sha256Digest hashed = sha256(key, keyBytes);
    std::memcpy(padded, hashed.data(), hashed.size());
    wipe(hashed.data(), hashed.size());
  } else if (keyBytes > 0) {
    std::memcpy(padded, key, keyBytes);
  }
  unsigned char pad[kBlock];
  for (size_t i = 0; i < kBlock; ++i) pad[i] = padded[i] ^ 0x36;
  Sha256 inner;
  inner.update(pad, kBlock);
  inner.update(msg, msgBytes);
  Sha256Digest innerDigest = inner.finish();
  for (size_t i = 0; i < kBlock; ++i) pad[i] = padded[i] ^ 0x5c;
  Sha256 outer;
  outer.update(pad, kBlock);
  outer.update(innerDigest.data(), innerDigest.size());
  wipe(padded, sizeof padded);
  wipe(pad, sizeof pad);
  wipe(innerDigest.data(), innerDigest.size());
  return outer.finish();
}

bool equalConstantTime(const void* a, const void* b, size_t bytes) noexcept {
  const unsigned char* pa = static_cast<const unsigned char*>(a);
  const unsigned char* pb = static_cast<const unsigned char*>(b);
  // volatile: the compiler may not turn the loop into an early exit.
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < bytes; ++i) diff = diff | (pa[i] ^ pb[i]);
  return diff == 0;
}

void secureRandomBytes(void* out, size_t bytes) {
  unsigned char* p = static_cast<unsigned char*>(out);
  size_t done = 0;
  while (done < bytes) {
    // One call returns at most 32 MiB - 1 bytes, and fewer when a signal
    // arrives after the first 256: short reads are normal, not errors.
    const ssize_t got = ::getrandom(p + done, bytes - done, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      fail(SF_ERR_INTERNAL, "getrandom(2) failed for " + std::to_string(bytes - done) +
                                " random bytes (the job token's secret and nonces): " +
                                std::strerror(err) +
                                (err == ENOSYS ? " (the kernel predates Linux 3.17)" : ""));
    }
    done += size_t(got);
  }
}

}  // namespace sfsync
