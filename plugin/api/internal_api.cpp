// The private interface of plugin/api/sfsync_internal.h (version node
// SFSYNC_PRIVATE_0.2): the window state that libsfsync.so publishes for its
// shim. One line into C++, as every entry point.

#include <atomic>

#include "plugin/api/default_context.h"
#include "plugin/api/guard.h"
#include "plugin/api/sfsync_internal.h"
#include "plugin/core/strict.h"

namespace sfsync {
namespace {

std::atomic<Context*> gDefault{nullptr};
std::atomic<bool> gFollowDefault{false};  // an interposer follows the default context

void windowState(const Context* given, int32_t flags, sf_window_state_v1& out) {
  if (out.struct_size != sizeof(sf_window_state_v1)) {
    fail(SF_ERR_INVALID_ARGUMENT, "out->struct_size = " + std::to_string(out.struct_size) +
                                      ", want " +
                                      std::to_string(sizeof(sf_window_state_v1)));
  }
  if ((flags & SF_INTERNAL_FOLLOW) && !given) gFollowDefault.store(true);
  const Context* ctx = given ? given : gDefault.load();
  if (ctx && (flags & SF_INTERNAL_FOLLOW)) ctx->markFollowed();
  const uint64_t size = out.struct_size;
  out = sf_window_state_v1{};
  out.struct_size = size;
  out.strict = strictMode() ? 1 : 0;
  if (!ctx) return;
  out.context_made = 1;
  // The flag before the count, with an acquire fence between: a reader that
  // sees the window open also sees its number (counted before the flag is set).
  out.in_window = ctx->inAccumulation() ? 1 : 0;
  std::atomic_thread_fence(std::memory_order_acquire);
  out.windows_begun = ctx->windowsBegun();
  out.windows_ended = ctx->windowsEnded();
  out.refused_begins = ctx->refusedBegins();
  out.refused_begin_window = ctx->refusedBeginWindow();
  out.gradients = ctx->gradientsRegistered();
}

}  // namespace

void publishDefaultContext(Context* ctx) noexcept {
  gDefault.store(ctx);
  if (gFollowDefault.load()) ctx->markFollowed();
}

Context* defaultContextIfMade() noexcept { return gDefault.load(); }

}  // namespace sfsync

extern "C" sf_status sf_internal_window_state_v1(const sf_context* ctx, int32_t flags,
                                                 sf_window_state_v1* out) {
  return sfsync::guard("sf_internal_window_state_v1",
                       [&] { sfsync::windowState(ctx, flags, sfsync::checked(out, "out")); });
}
