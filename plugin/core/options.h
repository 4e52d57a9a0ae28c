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
// sf_launch_info as first published (0.4), frozen the same way.
constexpr uint64_t kLaunchInfoV1Size = 4392;

constexpr double kDefaultBucketCapMb = 25.0;
constexpr double kDefaultFirstBucketCapMb = 1.0;
constexpr int64_t kDefaultTimeoutMs = 300000;
constexpr int32_t kDefaultMaxInflight = 4;
constexpr int32_t kMaxInflightLimit = 16;

// What sf_options_init takes from the launchers' variables: discoverLauncher
// over `env` with the real MPI probe (SF_MPI_LIBRARY read from `env` too),
// plus the options' own limit (a rendezvous that does not fit
// sf_options.rendezvous is an error). With `error` set from the rank
// variables, rank, worldSize and localRank are the defaults (0, 1, 0): what
// sf_options_init leaves in the struct. The one discovery behind
// sf_options_init, sf_create's "unmet" message and sf_discover_launcher.
LauncherEnv launcherFromEnvironment(const EnvLookup& env);
// The same over this process's environment (getenv).
LauncherEnv launcherFromEnvironment();

// sf_discover_launcher: launcherFromEnvironment over `env` (NULL: getenv;
// else an envp-style "NAME=VALUE" array, NULL-terminated) into the caller's
// struct of `structSize` bytes (at least kLaunchInfoV1Size, else
// SF_ERR_INVALID_ARGUMENT).
void discoverLaunchInfo(sf_launch_info& out, uint64_t structSize, const char* const* env);

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
