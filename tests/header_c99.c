/* Compiled with -std=c99 -pedantic -Werror by CTest: the public header must
 * be plain C99 and usable on its own. */
#include "sfsync.h"

int main(void) {
  sf_options o;
  sf_stats s;
  sf_context* ctx = 0;
  (void)s;
  if (sf_options_init(&o, sizeof o) != SF_OK) return 1;
  if (sf_create(&o, &ctx) != SF_OK) return 1;
  sf_destroy(ctx);
  return sf_abi_version() == SF_ABI_VERSION ? 0 : 1;
}
