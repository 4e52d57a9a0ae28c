#include "plugin/core/options.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "plugin/core/error.h"
#include "plugin/launch/launcher_env.h"
#include "plugin/launch/mpi_bootstrap.h"

namespace sfsync {

// The version-1 layouts, frozen (see kOptionsV1Size): a change here breaks
// every binary built against 0.1.
static_assert(kOptionsV1Size == 320 && sizeof(sf_options) >= kOptionsV1Size, "sf_options v1");
static_assert(offsetof(sf_options, struct_size) == 0, "sf_options v1");
static_assert(offsetof(sf_options, rank) == 8, "sf_options v1");
static_assert(offsetof(sf_options, world_size) == 12, "sf_options v1");
static_assert(offsetof(sf_options, local_rank) == 16, "sf_options v1");
static_assert(offsetof(sf_options, backend) == 20, "sf_options v1");
static_assert(offsetof(sf_options, reduce_op) == 24, "sf_options v1");
static_assert(offsetof(sf_options, reserved0) == 28, "sf_options v1");
static_assert(offsetof(sf_options, prescale) == 32, "sf_options v1");
static_assert(offsetof(sf_options, bucket_cap_mb) == 40, "sf_options v1");
static_assert(offsetof(sf_options, first_bucket_cap_mb) == 48, "sf_options v1");
static_assert(offsetof(sf_options, timeout_ms) == 56, "sf_options v1");
static_assert(offsetof(sf_options, rendezvous) == 64 && SF_RENDEZVOUS_MAX == 256, "sf_options v1");
static_assert(kStatsV1Size == 112 && sizeof(sf_stats) >= kStatsV1Size, "sf_stats v1");
static_assert(offsetof(sf_stats, struct_size) == 0, "sf_stats v1");
static_assert(offsetof(sf_stats, windows_begun) == 8, "sf_stats v1");
static_assert(offsetof(sf_stats, windows_completed) == 16, "sf_stats v1");
static_assert(offsetof(sf_stats, deferred_passes) == 24, "sf_stats v1");
static_assert(offsetof(sf_stats, deferred_ready_calls) == 32, "sf_stats v1");
static_assert(offsetof(sf_stats, collectives_issued) == 40, "sf_stats v1");
static_assert(offsetof(sf_stats, early_launches) == 48, "sf_stats v1");
static_assert(offsetof(sf_stats, bytes_reduced) == 56, "sf_stats v1");
static_assert(offsetof(sf_stats, bucket_count) == 64, "sf_stats v1");
static_assert(offsetof(sf_stats, largest_bucket_bytes) == 72, "sf_stats v1");
static_assert(offsetof(sf_stats, smallest_bucket_bytes) == 80, "sf_stats v1");
static_assert(offsetof(sf_stats, gradient_count) == 88, "sf_stats v1");
static_assert(offsetof(sf_stats, gradient_bytes) == 96, "sf_stats v1");
static_assert(offsetof(sf_stats, sync_ns_total) == 104, "sf_stats v1");
// Fields appended since (0.2, 0.3): their offsets are frozen as well.
static_assert(offsetof(sf_options, max_inflight) == 320, "sf_options 0.2");
static_assert(offsetof(sf_options, wire_dtype) == 324, "sf_options 0.2");
static_assert(offsetof(sf_options, shard_layout) == 328, "sf_options 0.3");
static_assert(offsetof(sf_options, reserved1) == 332, "sf_options 0.3");
static_assert(sizeof(sf_options) == 336, "sf_options 0.3");
static_assert(offsetof(sf_stats, reduce_scatters) == 112, "sf_stats 0.3");
static_assert(offsetof(sf_stats, all_gathers) == 120, "sf_stats 0.3");
static_assert(offsetof(sf_stats, bytes_gathered) == 128, "sf_stats 0.3");
static_assert(sizeof(sf_stats) == 136, "sf_stats 0.3");
static_assert(sizeof(sf_launch_info) == kLaunchInfoV1Size, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, struct_size) == 0, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, rank) == 8, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, world_size) == 12, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, local_rank) == 16, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, truncated) == 20, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, launcher) == 24, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, rank_vars) == 40, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, rendezvous) == 1064, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, meeting) == 1320, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, error) == 2344, "sf_launch_info 0.4");
static_assert(offsetof(sf_launch_info, unmet) == 3368, "sf_launch_info 0.4");

namespace {

void setDefaults(sf_options& o) {
  std::memset(&o, 0, sizeof o);
  o.struct_size = sizeof o;
  o.rank = 0;
  o.world_size = 1;
  o.local_rank = 0;
  o.backend = SF_BACKEND_AUTO;
  o.reduce_op = SF_REDUCE_AVERAGE;
  o.prescale = 1.0;
  o.bucket_cap_mb = kDefaultBucketCapMb;
  o.first_bucket_cap_mb = kDefaultFirstBucketCapMb;
  o.timeout_ms = kDefaultTimeoutMs;
  o.max_inflight = kDefaultMaxInflight;
  o.wire_dtype = SF_DTYPE_FLOAT32;
  o.shard_layout = SF_SHARD_NONE;
}

// Collects parse errors so that every valid variable is still applied.
struct EnvReader {
  std::string firstError;

  const char* get(const char* name) {
    const char* v = std::getenv(name);
    return (v && *v) ? v : nullptr;
  }
  void bad(const char* name, const char* value, const char* expected) {
    if (!firstError.empty()) return;
    std::ostringstream s;
    s << "environment variable " << name << "='" << value << "' is not " << expected;
    firstError = s.str();
  }
  void readInt(const char* name, int32_t& out, long lo, long hi) {
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
  // A positive number of milliseconds: an integer, or a number such as 1e13;
  // values past kMaxTimeoutMs (INT64_MAX and larger included) are clamped.
  void readTimeoutMs(const char* name, int64_t& out) {
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
  void readDouble(const char* name, double& out, bool positive) {
    const char* v = get(name);
    if (!v) return;
    char* end = nullptr;
    double x = std::strtod(v, &end);
    if (*end || !std::isfinite(x) || (positive && x <= 0)) {
      return bad(name, v, positive ? "a positive finite number" : "a finite number");
    }
    out = x;
  }
  void readChoice(const char* name, int32_t& out, const char* const* names, int count) {
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
};

// "host:port" (or "[v6]:port") with a port in [1, 65535].
bool tcpAddress(const char* rest) {
  const char* colon = std::strrchr(rest, ':');
  if (!colon || colon == rest) return false;
  char* end = nullptr;
  errno = 0;
  const long port = std::strtol(colon + 1, &end, 10);
  return end != colon + 1 && *end == 0 && errno == 0 && port >= 1 && port <= 65535;
}

bool knownRendezvous(const char* url) {
  static const char* const kForms[] = {"env://", "file://", "redis://", "memory://", "host://",
                                       "tcp://", "mpi://"};
  for (const char* form : kForms) {
    const size_t n = std::strlen(form);
    const bool bare = std::strcmp(form, "env://") == 0 || std::strcmp(form, "host://") == 0 ||
                      std::strcmp(form, "mpi://") == 0;
    if (std::strncmp(url, form, n) == 0 && (url[n] != 0 || bare)) {
      if (std::strcmp(form, "mpi://") == 0) return url[n] == 0;
      return std::strcmp(form, "tcp://") != 0 || tcpAddress(url + n);
    }
  }
  return false;
}

}  // namespace

LauncherEnv launcherFromEnvironment(const EnvLookup& env) {
  LauncherEnv l = discoverLauncher(env, [&](const std::string& launcher) {
    const char* setting = env("SF_MPI_LIBRARY");
    return mpiProbe(launcher, setting && *setting ? setting : nullptr);
  });
  if (!l.error.empty()) {  // sf_options_init applies none of the rank variables then
    l.rank = 0;
    l.worldSize = 1;
    l.localRank = 0;
    l.rendezvous.clear();
    l.meeting.clear();
  } else if (l.rendezvous.size() >= SF_RENDEZVOUS_MAX) {  // the rank variables still apply
    l.error = "environment variable SF_RENDEZVOUS='" + l.rendezvous + "' is not shorter than " +
              std::to_string(SF_RENDEZVOUS_MAX) + " bytes";
    l.rendezvous.clear();
    l.meeting.clear();
  }
  return l;
}

LauncherEnv launcherFromEnvironment() {
  return launcherFromEnvironment([](const char* name) { return std::getenv(name); });
}

namespace {

// Copies `text` into the fixed field `dst` of `size` bytes, cut to fit with
// "..." at the end; true when it was cut.
bool copyText(char* dst, size_t size, const std::string& text) {
  if (text.size() < size) {
    std::memcpy(dst, text.c_str(), text.size() + 1);
    return false;
  }
  const size_t keep = size - 4;  // room for "..." and the NUL
  std::memcpy(dst, text.data(), keep);
  std::memcpy(dst + keep, "...", 4);
  return true;
}

// The value of `name` in an envp-style array: the first "name=" entry wins,
// as getenv's does.
const char* envpLookup(const char* const* envp, const char* name) {
  const size_t n = std::strlen(name);
  for (const char* const* e = envp; *e; ++e) {
    if (std::strncmp(*e, name, n) == 0 && (*e)[n] == '=') return *e + n + 1;
  }
  return nullptr;
}

}  // namespace

void discoverLaunchInfo(sf_launch_info& out, uint64_t structSize, const char* const* envp) {
  if (structSize < kLaunchInfoV1Size) {
    fail(SF_ERR_INVALID_ARGUMENT, "struct_size = " + std::to_string(structSize) +
                                      " is smaller than sizeof(sf_launch_info) = " +
                                      std::to_string(kLaunchInfoV1Size) + " of sfsync 0.4");
  }
  const LauncherEnv l =
      envp ? launcherFromEnvironment([envp](const char* name) { return envpLookup(envp, name); })
           : launcherFromEnvironment();
  sf_launch_info info;
  std::memset(&info, 0, sizeof info);
  info.struct_size = structSize;
  info.rank = l.rank;
  info.world_size = l.worldSize;
  info.local_rank = l.localRank;
  bool cut = copyText(info.launcher, sizeof info.launcher, l.launcher);
  cut |= copyText(info.rank_vars, sizeof info.rank_vars, l.rankVars);
  cut |= copyText(info.rendezvous, sizeof info.rendezvous, l.rendezvous);
  cut |= copyText(info.meeting, sizeof info.meeting, l.meeting);
  cut |= copyText(info.error, sizeof info.error, l.error);
  cut |= copyText(info.unmet, sizeof info.unmet, l.unmet);
  info.truncated = cut ? 1 : 0;
  std::memcpy(&out, &info, size_t(std::min<uint64_t>(structSize, sizeof info)));
}

void optionsFromEnvironment(sf_options& o) {
  setDefaults(o);
  EnvReader env;
  const LauncherEnv launch = launcherFromEnvironment();
  if (!launch.error.empty()) env.firstError = launch.error;
  o.rank = launch.rank;  // the defaults when the rank variables are in error
  o.world_size = launch.worldSize;
  o.local_rank = launch.localRank;
  static const char* const kBackends[] = {"auto", "gloo", "nccl"};
  env.readChoice("SF_BACKEND", o.backend, kBackends, 3);
  static const char* const kReduce[] = {"average", "sum", "prescaled_sum"};
  env.readChoice("SF_REDUCE", o.reduce_op, kReduce, 3);
  env.readDouble("SF_PRESCALE", o.prescale, false);
  env.readDouble("SF_BUCKET_CAP_MB", o.bucket_cap_mb, true);
  env.readDouble("SF_FIRST_BUCKET_CAP_MB", o.first_bucket_cap_mb, true);
  env.readTimeoutMs("SF_TIMEOUT_MS", o.timeout_ms);
  env.readInt("SF_MAX_INFLIGHT", o.max_inflight, 1, kMaxInflightLimit);
  static const char* const kWire[] = {"native", "bf16", "fp16"};
  int32_t wire = -1;
  env.readChoice("SF_WIRE_DTYPE", wire, kWire, 3);
  if (wire == 1) o.wire_dtype = SF_DTYPE_BFLOAT16;
  if (wire == 2) o.wire_dtype = SF_DTYPE_FLOAT16;
  static const char* const kShard[] = {"none", "flat", "parameter"};
  env.readChoice("SF_SHARD", o.shard_layout, kShard, 3);
  std::strcpy(o.rendezvous, launch.rendezvous.c_str());  // fits: launcherFromEnvironment checks
  if (!env.firstError.empty()) fail(SF_ERR_INVALID_ARGUMENT, env.firstError);
}

sf_options optionsFromCaller(const sf_options* caller) {
  sf_options o;
  if (!caller) {
    optionsFromEnvironment(o);
    return o;
  }
  if (caller->struct_size < kOptionsV1Size) {
    std::ostringstream s;
    s << "opts->struct_size = " << caller->struct_size << " is smaller than sizeof(sf_options) = "
      << kOptionsV1Size << " of ABI version 1 (fill it with sf_options_init)";
    fail(SF_ERR_INVALID_ARGUMENT, s.str());
  }
  setDefaults(o);
  std::memcpy(&o, caller, sizeof o < caller->struct_size ? sizeof o : caller->struct_size);
  o.struct_size = sizeof o;
  o.timeout_ms = clampTimeoutMs(o.timeout_ms);  // "forever" (INT64_MAX) included
  return o;
}

void validateCap(double mb, const char* what) {
  if (!(mb > 0) || !std::isfinite(mb)) {
    std::ostringstream s;
    s << what << " = " << mb << " is invalid: it must be a positive, finite number of MiB";
    fail(SF_ERR_INVALID_ARGUMENT, s.str());
  }
  if (mb * 1048576.0 > 9.0e18) {
    std::ostringstream s;
    s << what << " = " << mb << " MiB is too large";
    fail(SF_ERR_INVALID_ARGUMENT, s.str());
  }
}

int64_t capBytes(double mb) {
  int64_t b = int64_t(mb * 1048576.0);
  return b < 1 ? 1 : b;
}

void validateOptions(const sf_options& o) {
  std::ostringstream s;
  if (o.world_size < 1) {
    s << "opts->world_size = " << o.world_size << " must be at least 1";
  } else if (o.rank < 0 || o.rank >= o.world_size) {
    s << "opts->rank = " << o.rank << " is outside [0, world_size = " << o.world_size << ")";
  } else if (o.local_rank < 0) {
    s << "opts->local_rank = " << o.local_rank << " is negative";
  } else if (o.backend < SF_BACKEND_AUTO || o.backend > SF_BACKEND_NCCL) {
    s << "opts->backend = " << o.backend << " is not an sf_backend";
  } else if (o.reduce_op < SF_REDUCE_AVERAGE || o.reduce_op > SF_REDUCE_PRESCALED_SUM) {
    s << "opts->reduce_op = " << o.reduce_op << " is not an sf_reduce_op";
  } else if (!std::isfinite(o.prescale)) {
    s << "opts->prescale = " << o.prescale << " is not finite";
  } else if (o.timeout_ms <= 0) {
    s << "opts->timeout_ms = " << o.timeout_ms << " must be positive";
  } else if (o.reserved0 != 0) {
    s << "opts->reserved0 = " << o.reserved0 << " must be 0";
  } else if (::memchr(o.rendezvous, 0, SF_RENDEZVOUS_MAX) == nullptr) {
    s << "opts->rendezvous is not NUL-terminated within " << SF_RENDEZVOUS_MAX << " bytes";
  } else if (o.rendezvous[0] != 0 && !knownRendezvous(o.rendezvous)) {
    s << "opts->rendezvous = '" << o.rendezvous
      << "' is not one of env://, tcp://host:port, mpi://, file:///dir, redis://host:port[/prefix], "
         "memory://name, host://";
  } else if (o.max_inflight < 1 || o.max_inflight > kMaxInflightLimit) {
    s << "opts->max_inflight = " << o.max_inflight << " is outside [1, " << kMaxInflightLimit << "]";
  } else if (o.wire_dtype != SF_DTYPE_FLOAT32 && o.wire_dtype != SF_DTYPE_BFLOAT16 &&
             o.wire_dtype != SF_DTYPE_FLOAT16) {
    s << "opts->wire_dtype = " << o.wire_dtype
      << " is not SF_DTYPE_FLOAT32 (native), SF_DTYPE_BFLOAT16 or SF_DTYPE_FLOAT16";
  } else if (o.shard_layout < SF_SHARD_NONE || o.shard_layout > SF_SHARD_PARAMETER) {
    s << "opts->shard_layout = " << o.shard_layout
      << " is not an sf_shard_layout (0 none, 1 flat, 2 parameter)";
  } else if (o.reserved1 != 0) {
    s << "opts->reserved1 = " << o.reserved1 << " must be 0";
  } else if (o.world_size > 1 && o.rendezvous[0] == 0) {
    // Name the launcher's variables when they are where world_size came from.
    const LauncherEnv launch = launcherFromEnvironment();
    s << "opts->rendezvous is empty but world_size = " << o.world_size;
    if (!launch.unmet.empty() && launch.worldSize == o.world_size) {
      s << ": " << launch.unmet;
    } else {
      s << " (set SF_RENDEZVOUS, or MASTER_ADDR/MASTER_PORT for env://)";
    }
  } else {
    validateCap(o.bucket_cap_mb, "opts->bucket_cap_mb");
    validateCap(o.first_bucket_cap_mb, "opts->first_bucket_cap_mb");
    return;
  }
  fail(SF_ERR_INVALID_ARGUMENT, s.str());
}

}  // namespace sfsync
