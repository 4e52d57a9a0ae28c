#include "plugin/rendezvous/job_token.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "plugin/core/env.h"
#include "plugin/core/error.h"

namespace sfsync {

std::string jobToken() {
  if (const char* t = envValue("SF_AUTH_TOKEN")) return t;
  const char* path = envValue("SF_AUTH_TOKEN_FILE");
  if (!path) return "";
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  if (!f) {
    fail(SF_ERR_INVALID_ARGUMENT,
         std::string("environment variable SF_AUTH_TOKEN_FILE='") + path + "' cannot be read");
  }
  std::string token = s.str();
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ' ||
                            token.back() == '\t')) {
    token.pop_back();
  }
  if (token.empty()) {
    fail(SF_ERR_INVALID_ARGUMENT,
         std::string("environment variable SF_AUTH_TOKEN_FILE='") + path + "' holds no token");
  }
  return token;
}

std::string randomBytes(size_t n) {
  std::string out(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(&out[0]), int(n)) != 1) {
    fail(SF_ERR_INTERNAL, "OpenSSL RAND_bytes failed");
  }
  return out;
}

std::string proof(const std::string& key, const char* role, const std::string& a,
                  const std::string& b) {
  const std::string data = std::string(role) + '\0' + a + b;
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key.data(), int(key.size()),
            reinterpret_cast<const unsigned char*>(data.data()), data.size(), mac, &len)) {
    fail(SF_ERR_INTERNAL, "OpenSSL HMAC-SHA256 failed");
  }
  return std::string(reinterpret_cast<char*>(mac), len);
}

bool sameSecret(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace sfsync
