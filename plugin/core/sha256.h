#pragma once
// SHA-256 (FIPS 180-4), HMAC-SHA256 (RFC 2104), a constant-time comparison
// and the kernel's random bytes: what the env:// store's job token needs
// (rendezvous/job_token.h), written out here so that the library links no
// libcrypto (the portable wheel cannot assume one on the host). Responsible
// for being bit-exact with the standards on any host (checked against the
// FIPS and RFC 4231 vectors and against OpenSSL: tests/unit/core/
// sha256_tests.cpp) and for taking time that does not depend on the bytes
// (no table indexed by data, no branch on data); not for speed (one block at
// a time, plain C++) nor for any other primitive.

#include <array>
#include <cstddef>
#include <cstdint>

namespace sfsync {

constexpr size_t kSha256Bytes = 32;
using Sha256Digest = std::array<uint8_t, kSha256Bytes>;

// SHA-256 of `bytes` bytes at `data`. `data` may be NULL when `bytes` is 0.
// Pure; thread-safe.
Sha256Digest sha256(const void* data, size_t bytes) noexcept;

// HMAC-SHA256 of the message (`msgBytes` at `msg`) under the key (`keyBytes`
// at `key`; any length: a key longer than the 64-byte block is hashed first,
// as RFC 2104 says). Either pointer may be NULL when its length is 0. Pure;
// thread-safe; the copies of the key it makes are wiped before it returns.
Sha256Digest hmacSha256(const void* key, size_t keyBytes, const void* msg,
                        size_t msgBytes) noexcept;

// Whether the `bytes` bytes at `a` and at `b` are equal, reading all of them
// whatever they hold (a MAC check must not tell how many leading bytes of a
// guess were right). NULL is allowed when `bytes` is 0 (then true).
bool equalConstantTime(const void* a, const void* b, size_t bytes) noexcept;

// Fills `bytes` bytes at `out` from the kernel's cryptographic random
// generator (getrandom(2), no flags: blocks only until the generator is
// seeded, early at boot; retried on EINTR and short reads). `out` may be NULL
// when `bytes` is 0. Throws Error(SF_ERR_INTERNAL) naming the errno when the
// kernel refuses (ENOSYS before Linux 3.17, EPERM under a seccomp filter).
// Thread-safe.
void secureRandomBytes(void* out, size_t bytes);

}  // namespace sfsync
