#include "plugin/core/options.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "plugin/core/error.h"

namespace sfsync {

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
  void readInt64(const char* name, int64_t& out) {
    const char* v = get(name);
    if (!v) return;
    char* end = nullptr;
    errno = 0;
    long long x = std::strtoll(v, &end, 10);
    if (errno || *end || x <= 0) return bad(name, v, "a positive integer");
    out = x;
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

bool knownRendezvous(const char* url) {
  static const char* const kForms[] = {"env://", "file://", "redis://", "memory://", "host://"};
  for (const char* form : kForms) {
    const size_t n = std::strlen(form);
    const bool bare = std::strcmp(form, "env://") == 0 || std::strcmp(form, "host://") == 0;
    if (std::strncmp(url, form, n) == 0 && (url[n] != 0 || bare)) {
      return true;
    }
  }
  return false;
}

}  // namespace

void optionsFromEnvironment(sf_options& o) {
  setDefaults(o);
  EnvReader env;
  env.readInt("RANK", o.rank, 0, 1 << 30);
  env.readInt("WORLD_SIZE", o.world_size, 1, 1 << 30);
  env.readInt("LOCAL_RANK", o.local_rank, 0, 1 << 30);
  static const char* const kBackends[] = {"auto", "gloo", "nccl"};
  env.readChoice("SF_BACKEND", o.backend, kBackends, 3);
  static const char* const kReduce[] = {"average", "sum", "prescaled_sum"};
  env.readChoice("SF_REDUCE", o.reduce_op, kReduce, 3);
  env.readDouble("SF_PRESCALE", o.prescale, false);
  env.readDouble("SF_BUCKET_CAP_MB", o.bucket_cap_mb, true);
  env.readDouble("SF_FIRST_BUCKET_CAP_MB", o.first_bucket_cap_mb, true);
  env.readInt64("SF_TIMEOUT_MS", o.timeout_ms);
  const char* rdv = env.get("SF_RENDEZVOUS");
  if (!rdv && env.get("MASTER_ADDR")) rdv = "env://";
  if (rdv) {
    if (std::strlen(rdv) >= SF_RENDEZVOUS_MAX) {
      env.bad("SF_RENDEZVOUS", rdv, "shorter than 256 bytes");
    } else {
      std::strcpy(o.rendezvous, rdv);
    }
  }
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
      << "' is not one of env://, file:///dir, redis://host:port[/prefix], memory://name, host://";
  } else if (o.world_size > 1 && o.rendezvous[0] == 0) {
    s << "opts->rendezvous is empty but world_size = " << o.world_size
      << " (set SF_RENDEZVOUS, or MASTER_ADDR/MASTER_PORT for env://)";
  } else {
    validateCap(o.bucket_cap_mb, "opts->bucket_cap_mb");
    validateCap(o.first_bucket_cap_mb, "opts->first_bucket_cap_mb");
    return;
  }
  fail(SF_ERR_INVALID_ARGUMENT, s.str());
}

}  // namespace sfsync
