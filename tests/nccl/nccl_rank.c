/*
 * One rank of a data-parallel job with CUDA gradients, in plain C99 over
 * sfsync.h and the CUDA runtime API: the multi-process test of the NCCL
 * backend (on the stand-ins, or unchanged on GPUs). Options come from the
 * environment (RANK, WORLD_SIZE, LOCAL_RANK, SF_RENDEZVOUS, SF_TIMEOUT_MS).
 * Two gradients live in the plugin's flat device buffer, two in the rank's
 * own cudaMalloc'd buffers; "backward" uploads the accumulated gradient on
 * the rank's own stream. Every window's result is checked against the
 * exact reference. SF_TEST_STOP_AFTER_WINDOW=k makes the rank exit after
 * window k (a peer that disappears).
 * Prints "RESULT rank=R ok=0|1 status=S buckets=B collectives=C early=E".
 * Exit: 0 ok, 1 wrong values, 2 setup failure, 3 an sfsync call failed.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sfsync.h"

#define NGRAD 4
#define NWINDOWS 3

static const int64_t kSizes[NGRAD] = {700, 33, 1000, 129};
static const int kMicro[NWINDOWS] = {2, 3, 1};

static double grad_value(int r, int w, int m, int p, int64_t i) {
  return 0.25 * (double)((r + 1) * (m + 1) + (int)(i % 5) + p + w);
}

int main(void) {
  sf_options o;
  sf_context* ctx = NULL;
  sf_stats stats;
  cudaStream_t stream = NULL;
  void* data[NGRAD];
  void* own[NGRAD] = {NULL, NULL, NULL, NULL};
  float* upload[NGRAD][4]; /* per micro-batch, alive until the window ends */
  float* result = NULL;
  int rank, world, w, m, p, bad = 0, stop_after = -1;
  int64_t i, id;
  sf_status st = SF_OK;
  const char* stop = getenv("SF_TEST_STOP_AFTER_WINDOW");
  cudaError_t ce;

  memset(upload, 0, sizeof upload);
  if (sf_options_init(&o, sizeof o) != SF_OK) {
    fprintf(stderr, "sf_options_init: %s\n", sf_last_error());
    return 2;
  }
  rank = o.rank;
  world = o.world_size;
  if (stop && *stop) stop_after = atoi(stop);
  o.bucket_cap_mb = 2048.0 / 1048576.0;
  o.first_bucket_cap_mb = 1024.0 / 1048576.0;
  ce = cudaSetDevice(o.local_rank);
  if (ce == cudaSuccess) ce = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (ce != cudaSuccess) {
    fprintf(stderr, "rank %d: CUDA: %s\n", rank, cudaGetErrorString(ce));
    return 2;
  }
#define CALL(x)                                                                  \
  do {                                                                           \
    st = (x);                                                                    \
    if (st != SF_OK) {                                                           \
      fprintf(stderr, "rank %d: %s failed (status %d): %s\n", rank, #x, (int)st, \
              sf_last_error());                                                  \
      goto done;                                                                 \
    }                                                                            \
  } while (0)

  CALL(sf_create(&o, &ctx));
  CALL(sf_set_cuda_stream(ctx, stream));
  for (p = 0; p < NGRAD; ++p) {
    char name[16];
    snprintf(name, sizeof name, "layer%d", p);
    if (p < 2) {
      CALL(sf_add_gradient(ctx, kSizes[p], SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, name, &id));
    } else {
      if (cudaMalloc(&own[p], (size_t)kSizes[p] * 4) != cudaSuccess) return 2;
      CALL(sf_register_gradient(ctx, own[p], kSizes[p], SF_DTYPE_FLOAT32, SF_DEVICE_CUDA, name, &id));
    }
  }
  for (p = 0; p < NGRAD; ++p) CALL(sf_gradient_data(ctx, p, &data[p]));
  CALL(sf_zero_gradients(ctx));
  result = (float*)malloc(1000 * sizeof(float));

  for (w = 0; w < NWINDOWS; ++w) {
    const int n = kMicro[w];
    if (w == stop_after) {
      fprintf(stderr, "rank %d: leaving after window %d\n", rank, w);
      fflush(stderr);
      _Exit(0);
    }
    CALL(sf_begin_accumulation(ctx));
    for (m = 0; m < n; ++m) {
      if (m == n - 1) CALL(sf_end_accumulation(ctx));
      for (p = NGRAD - 1; p >= 0; --p) { /* backward: last layer first */
        upload[p][m] = (float*)malloc((size_t)kSizes[p] * sizeof(float));
        for (i = 0; i < kSizes[p]; ++i) {
          double acc = 0;
          int k;
          for (k = 0; k <= m; ++k) acc += grad_value(rank, w, k, p, i);
          upload[p][m][i] = (float)acc;
        }
        cudaMemcpyAsync(data[p], upload[p][m], (size_t)kSizes[p] * 4, cudaMemcpyHostToDevice, stream);
        CALL(sf_grad_ready(ctx, p));
      }
    }
    CALL(sf_synchronize(ctx));
    for (p = 0; p < NGRAD; ++p) {
      cudaMemcpyAsync(result, data[p], (size_t)kSizes[p] * 4, cudaMemcpyDeviceToHost, stream);
      cudaStreamSynchronize(stream); /* the host's own wait, for reading */
      for (i = 0; i < kSizes[p]; ++i) {
        double want = 0;
        int r, k;
        for (r = 0; r < world; ++r)
          for (k = 0; k < n; ++k) want += grad_value(r, w, k, p, i);
        want /= world;
        if ((double)result[i] != want) {
          if (bad < 5) {
            fprintf(stderr, "rank %d window %d layer%d[%ld] = %g, want %g\n", rank, w, p, (long)i,
                    (double)result[i], want);
          }
          ++bad;
        }
      }
      for (m = 0; m < n; ++m) {
        free(upload[p][m]);
        upload[p][m] = NULL;
      }
    }
  }

done:
  memset(&stats, 0, sizeof stats);
  stats.struct_size = sizeof stats;
  if (ctx) sf_get_stats(ctx, &stats);
  printf("RESULT rank=%d ok=%d status=%d buckets=%lld collectives=%lld early=%lld\n", rank,
         st == SF_OK && bad == 0, (int)st, (long long)stats.bucket_count,
         (long long)stats.collectives_issued, (long long)stats.early_launches);
  fflush(stdout);
  sf_destroy(ctx);
  free(result);
  for (p = 0; p < NGRAD; ++p)
    for (m = 0; m < 4; ++m) free(upload[p][m]);
  for (p = 0; p < NGRAD; ++p) cudaFree(own[p]);
  if (stream) cudaStreamDestroy(stream);
  if (st != SF_OK) return 3;
  return bad ? 1 : 0;
}
