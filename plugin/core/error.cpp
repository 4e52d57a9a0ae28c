#include "plugin/core/error.h"

namespace sfsync {

void fail(sf_status status, const std::string& message) { throw Error(status, message); }

}  // namespace sfsync
