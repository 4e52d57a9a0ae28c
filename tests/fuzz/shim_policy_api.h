#pragma once
// The fuzz targets' view of the shim's policy wherever it lives: in
// plugin/shim_policy/ (namespace sfsync, 0.1) or in shim/policy/ (namespace
// sfshim, where helper "shim" moves it). Responsible for naming the policy,
// its config and the reduction probe; nothing else.

#include <functional>
#include <memory>
#include <string>

#if __has_include("shim/policy/shim_policy.h")
#include "shim/policy/reduce_probe.h"
#include "shim/policy/shim_policy.h"
namespace sffuzz {
namespace shim = ::sfshim;
// A policy with no explicit windows whose messages go to `onLine`.
inline std::unique_ptr<shim::ShimPolicy> makePolicy(shim::ShimConfig config, std::function<void()> onLine) {
  return std::make_unique<shim::ShimPolicy>(std::move(config), shim::ShimPolicy::WindowSource(),
                                            [onLine](int, const std::string&) { onLine(); });
}
}  // namespace sffuzz
#else
#include "plugin/shim_policy/reduce_probe.h"
#include "plugin/shim_policy/shim_policy.h"
namespace sffuzz {
namespace shim = ::sfsync;
inline std::unique_ptr<shim::ShimPolicy> makePolicy(shim::ShimConfig config, std::function<void()> onLine) {
  return std::make_unique<shim::ShimPolicy>(std::move(config), nullptr,
                                            [onLine](const std::string&) { onLine(); });
}
}  // namespace sffuzz
#endif
