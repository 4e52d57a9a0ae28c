#include "plugin/core/strict.h"

#include <cstdlib>
#include <string>

#include "plugin/core/env.h"
#include "plugin/core/log.h"

namespace sfsync {

bool strictMode() noexcept {
  static const bool strict = [] {
    const char* v = envValue("SF_STRICT");  // empty: unset, 0 as before
    if (!v) return false;
    const std::string s = v;
    if (s == "1" || s == "true" || s == "yes") return true;
    if (!(s.empty() || s == "0" || s == "false" || s == "no")) {
      SF_LOG(kWarn, "config", "SF_STRICT=" << s << " is not 0 or 1; using 0");
    }
    return false;
  }();
  return strict;
}

}  // namespace sfsync
