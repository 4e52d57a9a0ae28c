/* The declarations a C fragment of the docs uses without declaring them
 * (docs-test: compile c_prelude.h): tests/docs/run_examples.py compiles the
 * fragment as the body of sf_docs_fragment() after this file and links it
 * against libsfsync, so that every sf_* name, argument count and type in the
 * docs is the header's. Nothing here runs. */
#include <stdint.h>
#include <stdio.h>
#include <sfsync.h>

static sf_options o;
static sf_context* ctx;
static int64_t id, n = 4096, off, cnt, bucket, buckets;
static int64_t b;
static int steps = 1;
static float* grad;
static float* w;
static void* weights;
static uint64_t weight_bytes;
static void* my_store;
static int32_t my_set(void* user, const char* key, const void* value, uint64_t bytes) {
  (void)user, (void)key, (void)value, (void)bytes;
  return SF_STORE_OK;
}
static int32_t my_get(void* user, const char* key, int64_t timeout_ms, void* buffer,
                      uint64_t capacity, uint64_t* bytes) {
  (void)user, (void)key, (void)timeout_ms, (void)buffer, (void)capacity, (void)bytes;
  return SF_STORE_OK;
}
static void backward(float* g) { (void)g; }
static void optimizer_step(float* g) { (void)g; }
static void step(float* weights_, float* grads_, int64_t count) { (void)weights_, (void)grads_, (void)count; }

void sf_docs_fragment(void);
int main(void) { (void)sf_docs_fragment; return 0; }
