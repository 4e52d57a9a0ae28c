#pragma once
// The digest of sf_digest: XXH64 (xxHash's 64-bit hash, seed as given),
// written out here so that the library needs no extra package. Responsible
// for being bit-exact with XXH64 on any machine for the same bytes (inputs are
// read as little-endian 64/32-bit words whatever the host's byte order) and
// fast (about one byte per cycle per lane, four lanes); not for resisting an
// attacker: it is not a cryptographic hash.

#include <cstddef>
#include <cstdint>

namespace sfsync {

// XXH64 of `bytes` bytes at `data` with `seed`. `data` may be NULL when
// `bytes` is 0. Pure; thread-safe.
uint64_t digest64(const void* data, size_t bytes, uint64_t seed) noexcept;

}  // namespace sfsync
