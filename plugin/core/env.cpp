#include "plugin/core/env.h"

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "plugin/core/deadline.h"

namespace sfsync {

EnvLookup processEnvironment() {
  return [](const char* name) -> const char* { return std::getenv(name); };
}

EnvLookup envpEnvironment(const char* const* envp) {
  return [envp](const char* name) -> const char* {
    const size_t n = std::strlen(name);
    for (const char* const* e = envp; *e; ++e) {
      if (std::strncmp(*e, name, n) == 0 && (*e)[n] == '=') return *e + n + 1;
    }
    return nullptr;
  };
}

const char* envValue(const EnvLookup& env, const char* name) {
  const char* v = env ? env(name) : nullptr;
  return (v && *v) ? v : nullptr;
}

const char* envValue(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

const char* envRawValue(const char* name) { return std::getenv(name); }

void EnvReader::bad(const char* name, const char* value, const char* expected) {
  if (!firstError_.empty()) return;
  std::ostringstream s;
  s << "environment variable " << name << "='" << value << "' is not " << expected;
  firstError_ = s.str();
}

void EnvReader::readInt(const char* name, int32_t& out, long lo, long hi) {
  const char* v = get(name);
  if (!v) return;
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v, &end, 10);
  if (errno || *end || x < lo || x > hi) {
    std::ostringstream e;
    e << "an integer in [" << lo << ", " << hi << "]";
    bad(name, v, e.str().c_str());
    return;
  }
  out = int32_t(x);
}

void EnvReader::readTimeoutMs(const char* name, int64_t& out) {
  const char* v = get(name);
  if (!v) return;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  if (*end == 0 && errno == ERANGE && x == LLONG_MAX) {
    out = kMaxTimeoutMs;
    return;
  }
  if (*end == 0 && errno == 0) {
    if (x <= 0) return bad(name, v, "a positive integer");
    out = clampTimeoutMs(x);
    return;
  }
  const double d = std::strtod(v, &end);  // 1e13, 2.5e6
  if (*end || !std::isfinite(d) || d < 1) return bad(name, v, "a positive integer");
  out = d >= double(kMaxTimeoutMs) ? kMaxTimeoutMs : int64_t(std::llround(d));
}

void EnvReader::readDouble(const char* name, double& out, bool positive) {
  const char* v = get(name);
  if (!v) return;
  char* end = nullptr;
  double x = std::strtod(v, &end);
  if (*end || !std::isfinite(x) || (positive && x <= 0)) {
    return bad(name, v, positive ? "a positive finite number" : "a finite number");
  }
  out = x;
}

void EnvReader::readChoice(const char* name, int32_t& out, const char* const* names, int count) {
  const char* v = get(name);
  if (!v) return;
  for (int i = 0; i < count; ++i) {
    if (std::strcmp(v, names[i]) == 0) {
      out = i;
      return;
    }
  }
  std::string expected = "one of";
  for (int i = 0; i < count; ++i) expected += std::string(i ? ", " : " ") + names[i];
  bad(name, v, expected.c_str());
}

}  // namespace sfsync
