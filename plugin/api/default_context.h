#pragma once
// Where the process's default context (sf_default_context) can be found
// without making it: the private window-state interface
// (plugin/api/sfsync_internal.h) reports on it, and must not create it.

#include "plugin/orchestrator/context.h"

namespace sfsync {

// Called by sf_default_context (every call; idempotent).
void publishDefaultContext(Context* ctx) noexcept;
// The default context, or nullptr if it was not made yet. Thread-safe.
Context* defaultContextIfMade() noexcept;

}  // namespace sfsync
