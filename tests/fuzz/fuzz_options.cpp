// libFuzzer target: the environment the options, the logger, the shim
// policy and the Gloo address read. The input is a list of NUL-separated
// items "<selector byte><value>": the selector picks the variable, the
// value is set with setenv in this process. Checks that parsing never
// crashes, that a rejected variable is an sfsync::Error naming it, and that
// accepted options are in range.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "plugin/core/error.h"
#include "plugin/core/log.h"
#include "plugin/launch/launch_options.h"
#include "plugin/rendezvous/store_factory.h"
#include "tests/fuzz/shim_policy_api.h"

namespace {

const char* const kVariables[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "SF_BACKEND", "SF_REDUCE", "SF_PRESCALE", "SF_BUCKET_CAP_MB",
    "SF_FIRST_BUCKET_CAP_MB", "SF_TIMEOUT_MS", "SF_RENDEZVOUS", "MASTER_ADDR", "MASTER_PORT",
    "SF_DEBUG", "SF_SHIM_MIN_BYTES", "SF_ACCUMULATION_STEPS", "SF_STRICT", "SF_GLOO_HOSTNAME"};
constexpr size_t kCount = sizeof kVariables / sizeof kVariables[0];

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_options: invariant broken: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (const char* v : kVariables) ::unsetenv(v);
  ::unsetenv("SF_DEBUG_FILE");  // never let the input name a file to write
  std::vector<std::string> set;  // the variables the input set
  size_t i = 0;
  while (i < size) {
    const size_t end = std::find(data + i, data + size, uint8_t(0)) - data;
    if (end > i) {
      const char* name = kVariables[data[i] % kCount];
      const std::string value(reinterpret_cast<const char*>(data) + i + 1, end - i - 1);
      ::setenv(name, value.c_str(), 1);
      set.push_back(name);
    }
    i = end + 1;
  }
  sf_options o;
  bool parsed = true;
  try {
    sfsync::optionsFromEnvironment(o);
  } catch (const sfsync::Error& e) {
    parsed = false;
    check(e.status() == SF_ERR_INVALID_ARGUMENT, "a bad variable is SF_ERR_INVALID_ARGUMENT");
    // The message names a variable the input set (the launchers' checks,
    // since 0.3, say "torchrun's variables ...: RANK=5 is not below ...").
    bool named = false;
    for (const std::string& n : set) named = named || std::strstr(e.what(), n.c_str()) != nullptr;
    check(named, "the message names the variable");
  }
  // Whatever happened, the struct holds defaults and valid variables only.
  check(o.struct_size == sizeof o, "struct_size");
  check(o.world_size >= 1 && o.rank >= 0 && o.local_rank >= 0, "rank and world size in range");
  check(o.timeout_ms > 0, "timeout positive");
  check(std::isfinite(o.prescale), "prescale finite");
  check(o.bucket_cap_mb > 0 && std::isfinite(o.bucket_cap_mb), "bucket cap positive and finite");
  check(o.first_bucket_cap_mb > 0 && std::isfinite(o.first_bucket_cap_mb), "first cap positive and finite");
  check(std::memchr(o.rendezvous, 0, sizeof o.rendezvous) != nullptr, "rendezvous terminated");
  check(o.backend >= 0 && o.backend <= 2 && o.reduce_op >= 0 && o.reduce_op <= 2, "enumerations in range");
  try {
    sfsync::validateOptions(o);
    // Accepted options must be usable: the caps convert to byte counts.
    check(sfsync::capBytes(o.bucket_cap_mb) > 0, "cap bytes positive");
    check(sfsync::capBytes(o.first_bucket_cap_mb) > 0, "first cap bytes positive");
  } catch (const sfsync::Error& e) {
    check(e.status() == SF_ERR_INVALID_ARGUMENT, "validateOptions throws SF_ERR_INVALID_ARGUMENT");
  }
  (void)parsed;
  const std::string host = sfsync::localHostname(o);
  check(!host.empty(), "a local host name");
  sffuzz::shim::ShimConfig shim = sffuzz::shim::shimConfigFromEnvironment();
  check(shim.minBytes >= 0 && shim.accumulationSteps >= 0, "shim config in range");
  sfsync::logReconfigure();
  return 0;
}
