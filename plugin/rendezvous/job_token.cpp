#include "plugin/rendezvous/job_token.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "plugin/core/env.h"
#include "plugin/core/error.h"
#include "plugin/core/sha256.h"

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
  secureRandomBytes(&out[0], n);
  return out;
}

std::string proof(const std::string& key, const char* role, const std::string& a,
                  const std::string& b) {
  const std::string data = std::string(role) + '\0' + a + b;
  const Sha256Digest mac = hmacSha256(key.data(), key.size(), data.data(), data.size());
  return std::string(reinterpret_cast<const char*>(mac.data()), mac.size());
}

bool sameSecret(const std::string& a, const std::string& b) {
  return a.size() == b.size() && equalConstantTime(a.data(), b.data(), a.size());
}

}  // namespace sfsync
