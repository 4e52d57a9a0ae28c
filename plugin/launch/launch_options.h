#pragma once
// The options a launched process starts from: the defaults
// (core/options.h), then the SF_* environment and the launchers' rank
// variables and meeting point (launcher_env.h), and the validation every
// entry point shares (its message names the launchers' variables when they
// are where a world size without a meeting point came from). Also
// sf_discover_launcher's struct. Owns no state. Here, not in core/, because
// it needs the launcher discovery and the MPI probe of this layer.

#include <cstdint>

#include "plugin/core/options.h"
#include "plugin/launch/launcher_env.h"
#include "sfsync.h"

namespace sfsync {

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

// Copies the caller's struct (of its own struct_size) over defaults; NULL:
// optionsFromEnvironment.
sf_options optionsFromCaller(const sf_options* caller);

// Throws SF_ERR_INVALID_ARGUMENT naming the field and value at fault.
void validateOptions(const sf_options& opts);

// SF_BUCKET_CAP_MB is set in this process's environment (an empty value
// counts as unset): the bucket cap was chosen, whatever its value, so a
// sharded context keeps it (since 0.5 the sharded default applies only to a
// cap never chosen: reducer.h, core/options.h's shardedDefaultCapMb).
bool bucketCapFromEnvironment();

}  // namespace sfsync
