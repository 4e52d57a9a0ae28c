// At exit: the window left open, SF_SHIM_REPORT, and SF_STRICT's verdict
// (the shim's policy, shim/policy/). A destructor of the shim runs before
// those of libsfsync.so, which the shim depends on (its logger).

#include <unistd.h>

#include "shim/forward.h"
#include "shim/shim_instance.h"

__attribute__((destructor)) static void sfShimAtExit() {
  if (!sfshim::pluginUsable()) return;
  if (!sfshim::finish()) _exit(1);  // SF_STRICT=1 (the message was already said)
}
