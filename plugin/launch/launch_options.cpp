#include "plugin/launch/launch_options.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "plugin/core/env.h"
#include "plugin/core/error.h"
#include "plugin/launch/mpi_bootstrap.h"

namespace sfsync {

namespace {

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
    return mpiProbe(launcher, envValue(env, "SF_MPI_LIBRARY"));
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
  return launcherFromEnvironment(processEnvironment());
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

}  // namespace

void discoverLaunchInfo(sf_launch_info& out, uint64_t structSize, const char* const* envp) {
  if (structSize < kLaunchInfoV1Size) {
    fail(SF_ERR_INVALID_ARGUMENT, "struct_size = " + std::to_string(structSize) +
                                      " is smaller than sizeof(sf_launch_info) = " +
                                      std::to_string(kLaunchInfoV1Size) + " of sfsync 0.4");
  }
  const LauncherEnv l =
      launcherFromEnvironment(envp ? envpEnvironment(envp) : processEnvironment());
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
  setDefaultOptions(o);
  EnvReader env;
  const LauncherEnv launch = launcherFromEnvironment();
  if (!launch.error.empty()) env.note(launch.error);
  o.rank = launch.rank;  // the defaults when the rank variables are in error
  o.world_size = launch.worldSize;
  o.local_rank = launch.localRank;
  static const char* const kBackends[] = {"auto", "gloo", "nccl"};
  env.readChoice("SF_BACKEND", o.backend, kBackends, 3);
  static const char* const kReduce[] = {"average", "sum", "prescaled_sum", "weighted"};
  env.readChoice("SF_REDUCE", o.reduce_op, kReduce, 4);
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
  if (!env.firstError().empty()) fail(SF_ERR_INVALID_ARGUMENT, env.firstError());
}

bool bucketCapFromEnvironment() { return envValue("SF_BUCKET_CAP_MB") != nullptr; }

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
  setDefaultOptions(o);
  std::memcpy(&o, caller, sizeof o < caller->struct_size ? sizeof o : caller->struct_size);
  o.struct_size = sizeof o;
  o.timeout_ms = clampTimeoutMs(o.timeout_ms);  // "forever" (INT64_MAX) included
  return o;
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
  } else if (o.reduce_op < SF_REDUCE_AVERAGE || o.reduce_op > SF_REDUCE_WEIGHTED) {
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
