#include "plugin/rendezvous/launch_attempt.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "plugin/core/deadline.h"  // kStoreProbe
#include "plugin/core/env.h"
#include "plugin/core/error.h"
#include "plugin/core/log.h"

namespace sfsync {

namespace {

constexpr int64_t kMarkedAttempts = 64;

const char* envOrNull(const char* name) { return envValue(name); }

int64_t countFrom(const char* variable, const char* text) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end || v < 0) {
    fail(SF_ERR_INVALID_ARGUMENT, std::string("environment variable ") + variable + "='" + text +
                                      "' is not a restart count (an integer >= 0)");
  }
  return v;
}

std::string markerKey(int64_t attempt) { return "superseded/" + std::to_string(attempt); }

// The key's value now, or "" when it is not there (or the store cannot say).
std::string probe(gloo::rendezvous::Store& store, const std::string& key) {
  try {
    store.wait({key}, kStoreProbe);
    const std::vector<char> v = store.get(key);
    return std::string(v.begin(), v.end());
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace

LaunchAttempt::LaunchAttempt(std::string launcher, std::string runId, int64_t count,
                             std::string variable)
    : launcher_(std::move(launcher)),
      runId_(std::move(runId)),
      count_(count),
      variable_(std::move(variable)) {}

LaunchAttempt LaunchAttempt::fromEnvironment() {
  if (const char* c = envOrNull("TORCHELASTIC_RESTART_COUNT")) {
    const char* run = envOrNull("TORCHELASTIC_RUN_ID");
    return LaunchAttempt("torchrun", run ? run : "none",
                         countFrom("TORCHELASTIC_RESTART_COUNT", c), "TORCHELASTIC_RESTART_COUNT");
  }
  if (const char* c = envOrNull("SLURM_RESTART_COUNT")) {
    const char* job = envOrNull("SLURM_JOB_ID");
    return LaunchAttempt("slurm", job ? job : "none", countFrom("SLURM_RESTART_COUNT", c),
                         "SLURM_RESTART_COUNT");
  }
  return LaunchAttempt();
}

std::string LaunchAttempt::runScope() const { return launcher_ + "/" + runId_; }

std::string LaunchAttempt::attemptScope() const {
  return runScope() + "/attempt/" + std::to_string(count_);
}

std::string LaunchAttempt::describe() const {
  if (!scoped()) return "an unscoped job";
  return "attempt " + std::to_string(count_) + " of " + launcher_ + " run '" + runId_ + "' (" +
         variable_ + "=" + std::to_string(count_) + ")";
}

AttemptGuard::AttemptGuard(LaunchAttempt attempt,
                           std::shared_ptr<gloo::rendezvous::Store> runStore)
    : attempt_(std::move(attempt)), store_(std::move(runStore)) {}

void AttemptGuard::supersedeEarlier() {
  const int64_t now = attempt_.count();
  const std::string value = std::to_string(now);
  for (int64_t a = now - 1; a >= std::max<int64_t>(0, now - kMarkedAttempts); --a) {
    if (!probe(*store_, markerKey(a)).empty()) continue;
    try {
      store_->set(markerKey(a), std::vector<char>(value.begin(), value.end()));
    } catch (const std::exception& e) {  // a write-once store that another rank 0 beat to it
      SF_LOG(kTrace, "rendezvous", "marking attempt " << a << " superseded: " << e.what());
    }
  }
}

std::string AttemptGuard::supersededBy() {
  const std::string by = probe(*store_, markerKey(attempt_.count()));
  if (by.empty()) return "";
  return "this process belongs to " + attempt_.describe() + ", but attempt " + by +
         " of that run has started since: a process left over from before a restart is "
         "refused, not admitted (the launcher restarted the job; this process should exit)";
}

}  // namespace sfsync
