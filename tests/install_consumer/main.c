/* Links against the installed library, synchronizes one window at world size 1. */
#include <stdio.h>
#include <sfsync.h>

int main(void) {
  sf_context* ctx = NULL;
  int64_t id;
  float* g;
  if (sf_abi_version() != SF_ABI_VERSION || sf_create(NULL, &ctx) != SF_OK ||
      sf_add_gradient(ctx, 4, SF_DTYPE_FLOAT32, SF_DEVICE_HOST, "g", &id) != SF_OK ||
      sf_gradient_data(ctx, id, (void**)&g) != SF_OK) {
    fprintf(stderr, "consumer: %s\n", sf_last_error());
    return 1;
  }
  g[0] = 2.0f;
  if (sf_begin_accumulation(ctx) || sf_end_accumulation(ctx) || sf_synchronize(ctx) || g[0] != 2.0f) {
    fprintf(stderr, "consumer: %s\n", sf_last_error());
    return 1;
  }
  sf_destroy(ctx);
  printf("consumer OK: sfsync %s\n", sf_version_string());
  return 0;
}
