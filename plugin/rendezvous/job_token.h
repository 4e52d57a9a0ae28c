#pragma once
// The job's shared secret and the HMAC-SHA256 challenge-response that the
// env:// store and its clients use to admit only the job (SHA-256 and HMAC of
// plugin/core/sha256, checked against OpenSSL's in sha256_tests: the portable
// wheel cannot assume a libcrypto). Not responsible for transport.

#include <string>

namespace sfsync {

// SF_AUTH_TOKEN if set and not empty, else the contents of the file named by
// SF_AUTH_TOKEN_FILE (trailing newlines and spaces removed), else "" (no
// token: the store is open). Throws SF_ERR_INVALID_ARGUMENT naming the file
// when it cannot be read or holds no token.
std::string jobToken();

// n bytes from the system's cryptographic random generator; throws
// SF_ERR_INTERNAL if it fails.
std::string randomBytes(size_t n);

// HMAC-SHA256(key, role || a || b): the 32-byte proof that the sender of
// `role` knows `key`, bound to both nonces.
std::string proof(const std::string& key, const char* role, const std::string& a,
                  const std::string& b);

// Constant-time comparison (equal sizes and bytes).
bool sameSecret(const std::string& a, const std::string& b);

}  // namespace sfsync
