#pragma once
// The context options: defaults, the SF_* environment, the launchers' rank
// variables and meeting point (launch/launcher_env.h), and the validation
// every entry point shares. Owns no state.

#include <cstddef>
#include <cstdint>
#include <string>

#include "plugin/core/deadline.h"
#include "plugin/launch/launcher_env.h"
#include "sfsync.h"

namespace sfsync {

// Sizes of the structs as first published (ABI version 1, sfsync 0.1/0.2).
// Frozen: fields are only ever appended, so a caller's struct_size is valid
// from these up; smaller values are rejected. options.cpp checks the v1
// layout field by field (static_assert + offsetof).
constexpr uint64_t kOptionsV1Size = 320;
constexpr uint64_t kStatsV1Size = 112;

constexpr double kDefaultBucketCapMb = 25.0;
constexpr double kDefaultFirstBucketCapMb = 1.0;
constexpr int64_t kDefaultTimeoutMs = 300000;
constexpr int32_t kDefaultMaxInflight = 4;
constexpr int32_t kMaxInflightLimit = 16;

// What the launchers' variables of this process say (discoverLauncher over
// getenv, with the real MPI probe).
LauncherEnv launcherFromEnvironment();

// Fills `opts` (full size) with defaults, then the environment. Throws
// sfsync::Error naming the first variable that does not parse, after applying
// every variable that does.
void optionsFromEnvironment(sf_options& opts);

// Copies the caller's struct (of its own struct_size) over defaults.
sf_options optionsFromCaller(const sf_options* caller);

// Throws SF_ERR_INVALID_ARGUMENT naming the field and value at fault.
void validateOptions(const sf_options& opts);
void validateCap(double mb, const char* what);

// Bytes of a cap given in MiB.
int64_t capBytes(double mb);

}  // namespace sfsync
