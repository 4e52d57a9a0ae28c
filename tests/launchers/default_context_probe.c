/* Makes the process's default context (sf_default_context, the one the shim
 * and Python's Context.default() use) from the environment and prints its
 * rank and world ("OK rank=R world=W"), or the failure ("ERROR <status>:
 * <message>", exit status 3). For tests/launch_process_tests.cpp. */
#include <stdio.h>

#include "sfsync.h"

int main(void) {
  sf_context* ctx = NULL;
  sf_options o;
  sf_status st = sf_default_context(&ctx);
  if (st == SF_OK) {
    o.struct_size = sizeof o;
    st = sf_get_options(ctx, &o);
  }
  if (st != SF_OK) {
    printf("ERROR %s: %s\n", st == SF_ERR_INVALID_ARGUMENT ? "SF_ERR_INVALID_ARGUMENT" : sf_status_string(st),
           sf_last_error());
    return 3;
  }
  printf("OK rank=%d world=%d rendezvous=%s\n", o.rank, o.world_size, o.rendezvous);
  return 0;
}
