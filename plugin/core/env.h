#pragma once
// The one way sfsync reads its environment: a lookup (this process's
// environment, an envp-style array, or whatever a test injects), the value
// of one variable through it (an empty value counts as unset), and
// EnvReader, the typed readers that collect the first parse error so that
// every valid variable is still applied. Every SF_* variable read through
// these is declared once in the parameter table (params.h); other
// launchers' variables (RANK, OMPI_*, SLURM_*, ...) go through the same
// lookup. Pure: depends on the C++ library only, so the separately loaded
// modules (the NCCL module, the shim) compile it in as well.

#include <cstdint>
#include <functional>
#include <string>

namespace sfsync {

// A variable's value, or nullptr when it is unset (an empty value counts as unset).
using EnvLookup = std::function<const char*(const char* name)>;

// This process's environment (getenv).
EnvLookup processEnvironment();
// An envp-style "NAME=VALUE" array, NULL-terminated: the first "NAME=" entry
// wins, as getenv's does. The array must outlive the lookup.
EnvLookup envpEnvironment(const char* const* envp);

// `name`'s value through `env` (default: this process's), or nullptr when
// it is unset or empty.
const char* envValue(const EnvLookup& env, const char* name);
const char* envValue(const char* name);
// The value as set in this process's environment, an empty one included
// (nullptr: unset), for the readers whose rule for an empty value is not
// "unset" (the shim's SF_SHIM_MIN_BYTES, SF_SHIM_REPORT).
const char* envRawValue(const char* name);

// Typed readers over one lookup. A variable that is unset leaves `out` as it
// is; one that does not parse leaves it too and records
// "environment variable NAME='VALUE' is not EXPECTED" (the first only).
class EnvReader {
 public:
  explicit EnvReader(EnvLookup env = processEnvironment()) : env_(std::move(env)) {}

  const char* get(const char* name) const { return envValue(env_, name); }
  // A decimal integer in [lo, hi].
  void readInt(const char* name, int32_t& out, long lo, long hi);
  // A positive number of milliseconds: an integer, or a number such as 1e13;
  // values past kMaxTimeoutMs (INT64_MAX and larger included) are clamped.
  void readTimeoutMs(const char* name, int64_t& out);
  // A finite number (positive: > 0).
  void readDouble(const char* name, double& out, bool positive);
  // One of `names`: `out` becomes its index.
  void readChoice(const char* name, int32_t& out, const char* const* names, int count);

  // Records a failure of `name`='value' unless one is recorded already.
  void bad(const char* name, const char* value, const char* expected);
  // Records `message` unless a failure is recorded already.
  void note(const std::string& message) {
    if (firstError_.empty()) firstError_ = message;
  }
  const std::string& firstError() const { return firstError_; }

 private:
  EnvLookup env_;
  std::string firstError_;
};

}  // namespace sfsync
