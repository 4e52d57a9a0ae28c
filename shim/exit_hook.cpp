// At exit: the unsynchronized-window guard and SF_SHIM_REPORT (in the
// plugin), and SF_STRICT's verdict. A destructor of the shim runs before
// those of libsfsync.so, which the shim depends on.

#include <unistd.h>

#include "plugin/api/sfsync_shim_internal.h"
#include "shim/forward.h"

__attribute__((destructor)) static void sfShimAtExit() {
  if (!sfshim::pluginUsable()) return;
  if (sf_shim_finish() == SF_ERR_INVALID_STATE) _exit(1);  // SF_STRICT=1 (message already said)
}
