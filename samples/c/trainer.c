/*
 * A small C trainer on sfsync: W windows of N micro-batches of a linear
 * model with analytic gradients, data-parallel over the ranks that
 * sfsync-run starts. It prints, per window, the gradient collectives issued
 * inside the window (must be 0) and at synchronization (must be one per
 * bucket) with their bytes, and at the end the largest difference between its
 * weights and a single-process reference that sums the same micro-batches.
 *
 * With --weighted (weighted windows, sfsync 0.4) each rank's micro-batches
 * hold an unequal, deterministic number of samples ("tokens", 0..2*batch,
 * toy_tokens), the loss is a plain sum, and the context reduces with
 * SF_REDUCE_WEIGHTED: per micro-batch, sf_add_window_weight(tokens) before
 * its backward and sf_add_window_sums({loss sum, tokens}) before its
 * gradients are reported ready. Every window's gradients are then the sum
 * over ranks and micro-batches divided by the window's global token count;
 * the reference (toy_reference_weighted) divides the float64 sum of every
 * rank's plain-sum gradients by the total count. After each window the
 * trainer reads sf_get_window_totals; at the end it compares every window's
 * global weight and token count (exactly) and loss sum (1e-6 relative: the
 * reference computes it on its own weights) with the reference's, and
 * prints the last window's in a TOTALS line. --micro-mean trains the plain
 * data-parallel way on the same data (each micro-batch's mean loss / N,
 * SF_REDUCE_AVERAGE) against the same token-mean reference: it differs,
 * and the RESULT line says by how much.
 *
 * With --shard flat|parameter (sharded windows, since 0.3) each bucket is
 * reduce-scattered: the trainer waits for each bucket in turn, steps only the
 * part of the weights this rank owns (sf_shard_range), starts that bucket's
 * parameter gather at once, and waits for each bucket's gather (forward
 * order) just before the next window's forward needs the weights.
 *
 *   build/plugin/tools/sfsync-run -n 2 -- build/samples/c/sfsync-c-trainer
 *   build/plugin/tools/sfsync-run -n 3 -- build/samples/c/sfsync-c-trainer --shard flat
 *
 * Exit status: 0 ok, 1 weights differ from the reference, 2 wrong collective
 * counts or bytes, 3 an sfsync call failed, 4 bad command line, 5 (--weighted)
 * the window totals differ from the reference's.
 */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sfsync.h"
#include "toy_model.h"

#define MAX_WINDOWS 256

/* How the loss is normalized. */
enum { NORM_BATCH_MEAN = 0, NORM_WEIGHTED = 1, NORM_MICRO_MEAN = 2 };

typedef struct args {
  int windows;
  int micro[MAX_WINDOWS];
  double cap_mb, first_cap_mb; /* 0: keep the defaults / environment */
  int host_buffers;            /* register own buffers instead of the flat buffer */
  int grad_ready;              /* report grad-ready in the last micro-batch */
  int die_at_window;           /* rank 1 kills itself before that window's sync; -1 never */
  sf_shard_layout shard;       /* --shard: SF_SHARD_NONE (default), FLAT or PARAMETER */
  int norm;                    /* NORM_BATCH_MEAN (default), --weighted, --micro-mean */
  int quiet;
  toy_model model;
} args;

static int usage(const char* msg) {
  fprintf(stderr,
          "sfsync-c-trainer: %s\n"
          "usage: sfsync-c-trainer [--windows W] [--micro N | --schedule N1,N2,...]\n"
          "         [--blocks B] [--rows R] [--in I] [--batch S] [--cap-mb X] [--first-cap-mb Y]\n"
          "         [--host-buffers] [--no-grad-ready] [--die-at-window K] [--quiet]\n"
          "         [--shard none|flat|parameter] [--weighted | --micro-mean]\n",
          msg);
  return 4;
}

/* On failure: report, and leave through the cleanup at the end of main. */
#define CHECK(call)                                                                       \
  do {                                                                                    \
    sf_status st_ = (call);                                                               \
    if (st_ != SF_OK) {                                                                   \
      fprintf(stderr, "rank %d: %s failed: %s (%s)\n", rank, #call, sf_status_string(st_), \
              sf_last_error());                                                           \
      rc = 3;                                                                             \
      goto done;                                                                          \
    }                                                                                     \
  } while (0)

static int parse(int argc, char** argv, args* a) {
  int n = 4;
  const char* schedule = NULL;
  a->windows = 6;
  a->cap_mb = a->first_cap_mb = 0;
  a->host_buffers = 0;
  a->grad_ready = 1;
  a->die_at_window = -1;
  a->shard = SF_SHARD_NONE;
  a->norm = NORM_BATCH_MEAN;
  a->quiet = 0;
  a->model.in = 32;
  a->model.rows = 16;
  a->model.blocks = 6;
  a->model.batch = 8;
  for (int i = 1; i < argc; ++i) {
    const char* k = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
#define INT_ARG(name, field, min)                                   \
  if (!strcmp(k, name)) {                                           \
    if (!v || atoi(v) < (min)) return usage("bad value for " name); \
    field = atoi(v);                                                \
    ++i;                                                            \
    continue;                                                       \
  }
    INT_ARG("--windows", a->windows, 1)
    INT_ARG("--micro", n, 1)
    INT_ARG("--blocks", a->model.blocks, 1)
    INT_ARG("--rows", a->model.rows, 1)
    INT_ARG("--in", a->model.in, 1)
    INT_ARG("--batch", a->model.batch, 1)
    INT_ARG("--die-at-window", a->die_at_window, 0)
    if (!strcmp(k, "--schedule") && v) { schedule = v; ++i; continue; }
    if (!strcmp(k, "--cap-mb") && v) { a->cap_mb = atof(v); ++i; continue; }
    if (!strcmp(k, "--first-cap-mb") && v) { a->first_cap_mb = atof(v); ++i; continue; }
    if (!strcmp(k, "--host-buffers")) { a->host_buffers = 1; continue; }
    if (!strcmp(k, "--no-grad-ready")) { a->grad_ready = 0; continue; }
    if (!strcmp(k, "--quiet")) { a->quiet = 1; continue; }
    if (!strcmp(k, "--weighted")) { a->norm = NORM_WEIGHTED; continue; }
    if (!strcmp(k, "--micro-mean")) { a->norm = NORM_MICRO_MEAN; continue; }
    if (!strcmp(k, "--shard") && v) {
      if (!strcmp(v, "none")) a->shard = SF_SHARD_NONE;
      else if (!strcmp(v, "flat")) a->shard = SF_SHARD_FLAT;
      else if (!strcmp(v, "parameter")) a->shard = SF_SHARD_PARAMETER;
      else return usage("--shard is none, flat or parameter");
      ++i;
      continue;
    }
    return usage(k);
  }
  if (a->windows > MAX_WINDOWS) return usage("--windows is at most 256");
  if (schedule) {
    /* Windows of varying length: the schedule repeats over the windows. */
    int lens[MAX_WINDOWS], count = 0;
    for (const char* p = schedule; *p && count < MAX_WINDOWS;) {
      lens[count] = atoi(p);
      if (lens[count] < 1) return usage("--schedule needs positive lengths");
      ++count;
      p = strchr(p, ',');
      if (!p) break;
      ++p;
    }
    for (int w = 0; w < a->windows; ++w) a->micro[w] = lens[w % count];
  } else {
    for (int w = 0; w < a->windows; ++w) a->micro[w] = n;
  }
  return 0;
}

/* params -= lr * grads over [offset, offset + count) of one tensor. */
static void sgd_range(float* param, const float* grad, int64_t offset, int64_t count, float lr) {
  for (int64_t i = offset; i < offset + count; ++i) param[i] -= lr * grad[i];
}

/* One micro-batch's forward and backward (k of n, window w): the gradients
 * are added to grads; *loss and *tokens grow by its loss and sample count.
 * --weighted: its weight before the backward, its loss sum and token count
 * after it (before any gradient is reported ready). */
static sf_status micro_batch(sf_context* ctx, const args* a, float* const* params,
                             float* const* grads, int w, int k, int n, int rank, double* loss,
                             double* tokens) {
  const toy_model* m = &a->model;
  if (a->norm == NORM_BATCH_MEAN) {
    *loss += toy_accumulate_grads(m, params, toy_seed(w, k, rank), grads);
    *tokens += m->batch;
    return SF_OK;
  }
  const int t = toy_tokens(w, k, rank, m->batch);
  double l;
  if (a->norm == NORM_WEIGHTED) {
    sf_status st = sf_add_window_weight(ctx, (double)t);
    if (st != SF_OK) return st;
    l = toy_accumulate_sum(m, params, toy_seed(w, k, rank), t, 1.0f, grads);
    const double sums[2] = {l, (double)t}; /* slots 0 (loss sum) and 1 (token count) */
    st = sf_add_window_sums(ctx, sums, 2);
    if (st != SF_OK) return st;
  } else {
    /* Plain data parallelism: this micro-batch's mean loss / n, averaged
       over ranks (a micro-batch of no samples adds nothing). */
    l = t > 0 ? toy_accumulate_sum(m, params, toy_seed(w, k, rank), t, 1.0f / ((float)t * (float)n),
                                   grads)
              : 0.0;
  }
  *loss += l;
  *tokens += t;
  return SF_OK;
}

static sf_stats stats_of(sf_context* ctx) {
  sf_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  sf_get_stats(ctx, &s);
  return s;
}

int main(int argc, char** argv) {
  args a;
  int rank = -1, rc = 0;
  int bad = parse(argc, argv, &a);
  if (bad) return bad;
  const toy_model* m = &a.model;
  const int np = toy_param_count(m);
  /* Everything that the cleanup at the end releases, allocated up front. */
  float** params = calloc((size_t)np, sizeof(float*));
  float** grads = calloc((size_t)np, sizeof(float*));
  float** ref = calloc((size_t)np, sizeof(float*));
  int64_t* bucket_of = calloc((size_t)np, sizeof(int64_t));
  int64_t* own_offset = calloc((size_t)np, sizeof(int64_t));
  int64_t* own_count = calloc((size_t)np, sizeof(int64_t));
  int64_t owned = 0;
  int counts_ok = 1, totals_ok = 1;
  /* --weighted: each window's sf_get_window_totals (weight, then slots 0..3). */
  double got_weight[MAX_WINDOWS], got_sums[MAX_WINDOWS][SF_WINDOW_SUMS];
  double ref_weight[MAX_WINDOWS], ref_loss[MAX_WINDOWS];
  double max_diff = 0;
  const double tolerance = 1e-5;
  const float lr = 0.05f;
  sf_stats s0, end;

  sf_options opts;
  sf_context* ctx = NULL;
  CHECK(sf_options_init(&opts, sizeof opts)); /* RANK, WORLD_SIZE, MASTER_* from sfsync-run */
  rank = opts.rank;
  if (a.cap_mb > 0) opts.bucket_cap_mb = a.cap_mb;
  if (a.first_cap_mb > 0) opts.first_bucket_cap_mb = a.first_cap_mb;
  if (a.shard != SF_SHARD_NONE) opts.shard_layout = a.shard;
  if (a.norm == NORM_WEIGHTED) opts.reduce_op = SF_REDUCE_WEIGHTED;
  if (a.norm == NORM_MICRO_MEAN) opts.reduce_op = SF_REDUCE_AVERAGE;
  CHECK(sf_create(&opts, &ctx));

  for (int p = 0; p < np; ++p) {
    char name[32];
    int64_t id;
    snprintf(name, sizeof name, p < m->blocks ? "W%d" : "bias", p);
    /* Sharded with the flat buffer: the weights are views into the plugin's
       flat parameter buffer (gathers copy nothing), set after the build. */
    if (a.shard == SF_SHARD_NONE || a.host_buffers) {
      params[p] = malloc(sizeof(float) * (size_t)toy_param_numel(m, p));
    }
    if (a.host_buffers) {
      grads[p] = calloc((size_t)toy_param_numel(m, p), sizeof(float));
      CHECK(sf_register_gradient(ctx, grads[p], toy_param_numel(m, p), SF_DTYPE_FLOAT32,
                                 SF_DEVICE_HOST, name, &id));
    } else {
      CHECK(sf_add_gradient(ctx, toy_param_numel(m, p), SF_DTYPE_FLOAT32, SF_DEVICE_HOST, name, &id));
    }
    if (a.shard != SF_SHARD_NONE) {
      CHECK(sf_register_parameter(ctx, id, a.host_buffers ? params[p] : NULL,
                                  toy_param_numel(m, p), SF_DTYPE_FLOAT32, SF_DEVICE_HOST));
    }
  }
  CHECK(sf_build_buckets(ctx));
  for (int p = 0; p < np; ++p) {
    if (!a.host_buffers) CHECK(sf_gradient_data(ctx, p, (void**)&grads[p]));
    if (a.shard != SF_SHARD_NONE && !a.host_buffers) CHECK(sf_parameter_data(ctx, p, (void**)&params[p]));
    CHECK(sf_gradient_bucket(ctx, p, &bucket_of[p]));
    CHECK(sf_shard_range(ctx, p, &own_offset[p], &own_count[p]));
    owned += own_count[p];
  }
  toy_init_params(m, params);
  s0 = stats_of(ctx);
  if (rank == 0) {
    printf("sfsync %s: %d ranks, %d gradients (%lld bytes) in %lld buckets, %s%s%s\n",
           sf_version_string(), opts.world_size, np, (long long)s0.gradient_bytes,
           (long long)s0.bucket_count, a.host_buffers ? "host buffers" : "flat buffer",
           a.shard == SF_SHARD_FLAT        ? ", sharded (flat)"
           : a.shard == SF_SHARD_PARAMETER ? ", sharded (parameter)"
                                           : "",
           a.norm == NORM_WEIGHTED     ? ", weighted windows (token sums / global tokens)"
           : a.norm == NORM_MICRO_MEAN ? ", per-micro-batch means (plain data parallelism)"
                                       : "");
  }
  if (a.shard != SF_SHARD_NONE && !a.quiet) {
    printf("rank %d owns %lld of the weights\n", rank, (long long)owned);
  }

  for (int w = 0; w < a.windows; ++w) {
    const int n = a.micro[w];
    if (a.shard != SF_SHARD_NONE && w > 0) {
      /* The next forward's pre-hooks: each bucket's weights before first use,
         the first layers (the last bucket) first. */
      for (int64_t b = s0.bucket_count - 1; b >= 0; --b) CHECK(sf_wait_gather(ctx, b));
    }
    CHECK(sf_zero_gradients(ctx));
    const sf_stats before = stats_of(ctx);
    double loss = 0, tokens = 0;
    if (n > 1) CHECK(sf_begin_accumulation(ctx));
    for (int k = 0; k < n - 1; ++k) {
      CHECK(micro_batch(ctx, &a, params, grads, w, k, n, rank, &loss, &tokens));
      if (a.grad_ready) {
        for (int p = np - 1; p >= 0; --p) CHECK(sf_grad_ready(ctx, p)); /* only counted */
      }
    }
    if (n > 1) CHECK(sf_end_accumulation(ctx));
    const sf_stats inside = stats_of(ctx);
    CHECK(micro_batch(ctx, &a, params, grads, w, n - 1, n, rank, &loss, &tokens));
    if (a.grad_ready) {
      /* Backward produces the last layers' gradients first: buckets start early. */
      for (int p = np - 1; p >= 0; --p) CHECK(sf_grad_ready(ctx, p));
    }
    if (w == a.die_at_window && rank == 1) {
      fprintf(stderr, "rank 1: killing itself before the synchronization of window %d\n", w);
      fflush(stderr);
      raise(SIGKILL);
    }
    if (a.shard == SF_SHARD_NONE) {
      CHECK(sf_synchronize(ctx));
    } else {
      /* Per bucket: wait for its reduce-scatter, step this rank's part, start
         its gather at once; sf_synchronize then checks and counts the window. */
      CHECK(sf_synchronize_start(ctx));
      for (int64_t b = 0; b < s0.bucket_count; ++b) {
        CHECK(sf_wait_bucket(ctx, b));
        for (int p = 0; p < np; ++p) {
          if (bucket_of[p] == b) sgd_range(params[p], grads[p], own_offset[p], own_count[p], lr);
        }
        CHECK(sf_start_gather(ctx, b));
      }
      CHECK(sf_synchronize(ctx));
    }
    const sf_stats after = stats_of(ctx);
    if (a.norm == NORM_WEIGHTED) {
      CHECK(sf_get_window_totals(ctx, &got_weight[w], got_sums[w], SF_WINDOW_SUMS));
    }
    const long long in_window = inside.collectives_issued - before.collectives_issued;
    const long long at_sync = after.collectives_issued - inside.collectives_issued;
    const long long bytes = after.bytes_reduced - before.bytes_reduced;
    if (in_window != 0 || at_sync != after.bucket_count || bytes != after.gradient_bytes) {
      counts_ok = 0;
    }
    if (a.shard != SF_SHARD_NONE &&
        (after.reduce_scatters - before.reduce_scatters != after.bucket_count ||
         after.all_gathers - before.all_gathers != after.bucket_count ||
         after.bytes_gathered - before.bytes_gathered != after.gradient_bytes)) {
      counts_ok = 0;
    }
    if (!a.quiet && a.norm == NORM_BATCH_MEAN) {
      printf("window %d: %d micro-batches, loss %.5f, collectives inside window %lld, at sync %lld "
             "(%lld early), %lld bytes\n",
             w, n, loss / n, in_window, at_sync, (long long)(after.early_launches - before.early_launches),
             bytes);
    } else if (!a.quiet) {
      char global[64] = "";
      if (a.norm == NORM_WEIGHTED) snprintf(global, sizeof global, " (global %.17g)", got_weight[w]);
      printf("window %d: %d micro-batches, %.17g tokens%s, loss %.5f per token, collectives inside "
             "window %lld, at sync %lld (%lld early), %lld bytes\n",
             w, n, tokens, global, tokens > 0 ? loss / tokens : 0.0, in_window, at_sync,
             (long long)(after.early_launches - before.early_launches), bytes);
    }
    if (a.shard == SF_SHARD_NONE) toy_sgd_step(m, params, grads, lr);
  }
  if (a.shard != SF_SHARD_NONE) CHECK(sf_wait_gather(ctx, -1)); /* the last window's */

  for (int p = 0; p < np; ++p) ref[p] = malloc(sizeof(float) * (size_t)toy_param_numel(m, p));
  if (a.norm == NORM_BATCH_MEAN) {
    toy_reference(m, opts.world_size, a.windows, a.micro, lr, ref);
  } else {
    /* Both weighted modes are judged by the token mean of the whole window. */
    toy_reference_weighted(m, opts.world_size, a.windows, a.micro, lr, ref, ref_weight, ref_loss);
  }
  if (a.norm == NORM_WEIGHTED) {
    /* Global weight and token count exact (integers); the loss sum as the
       reference computes it on its own (float32) weights. */
    for (int w = 0; w < a.windows; ++w) {
      const double* got = got_sums[w];
      const double loss_err = fabs(got[0] - ref_loss[w]) / fmax(1.0, fabs(ref_loss[w]));
      if (got_weight[w] != ref_weight[w] || got[1] != ref_weight[w] || !(loss_err <= 1e-6) ||
          got[2] != 0 || got[3] != 0) {
        totals_ok = 0;
        fprintf(stderr,
                "rank %d: window %d totals: weight %.17g, sums {%.17g, %.17g, %g, %g}; reference "
                "weight %.17g, loss sum %.17g (relative difference %.3g)\n",
                rank, w, got_weight[w], got[0], got[1], got[2], got[3], ref_weight[w], ref_loss[w],
                loss_err);
      }
    }
    const int last = a.windows - 1;
    printf("TOTALS rank=%d window=%d weight=%.17g loss_sum=%.17g tokens=%.17g found_inf=%g user=%g "
           "reference_weight=%.17g reference_loss_sum=%.17g %s\n",
           rank, last, got_weight[last], got_sums[last][0], got_sums[last][1], got_sums[last][2],
           got_sums[last][3], ref_weight[last], ref_loss[last], totals_ok ? "OK" : "FAILED");
  }
  for (int p = 0; p < np; ++p) {
    for (int64_t i = 0; i < toy_param_numel(m, p); ++i) {
      const double d = fabs((double)params[p][i] - (double)ref[p][i]);
      if (d > max_diff || isnan(d)) max_diff = isnan(d) ? INFINITY : d;
    }
  }
  if (a.norm != NORM_BATCH_MEAN) {
    /* The size of a miss, against how far the reference moved the weights. */
    double moved = 0;
    float** init = calloc((size_t)np, sizeof(float*));
    for (int p = 0; p < np; ++p) init[p] = malloc(sizeof(float) * (size_t)toy_param_numel(m, p));
    toy_init_params(m, init);
    for (int p = 0; p < np; ++p) {
      for (int64_t i = 0; i < toy_param_numel(m, p); ++i) {
        moved = fmax(moved, fabs((double)ref[p][i] - (double)init[p][i]));
      }
      free(init[p]);
    }
    free(init);
    printf("rank %d: %s: max |w - w_ref| = %.3g against the token-mean reference, which moved the "
           "weights by up to %.3g in %d windows\n",
           rank, a.norm == NORM_WEIGHTED ? "weighted windows" : "per-micro-batch means", max_diff,
           moved, a.windows);
  }
  end = stats_of(ctx);
  printf("RESULT rank=%d world=%d windows=%lld buckets=%lld collectives=%lld bytes=%lld "
         "deferred_passes=%lld early=%lld reduce_scatters=%lld all_gathers=%lld "
         "max_abs_diff=%.3g %s\n",
         rank, opts.world_size, (long long)end.windows_completed, (long long)end.bucket_count,
         (long long)end.collectives_issued, (long long)end.bytes_reduced,
         (long long)end.deferred_passes, (long long)end.early_launches,
         (long long)end.reduce_scatters, (long long)end.all_gathers, max_diff,
         max_diff <= tolerance && counts_ok && totals_ok ? "OK" : "FAILED");
  if (!counts_ok) rc = 2;
  else if (max_diff > tolerance) rc = 1;
  else if (!totals_ok) rc = 5;
done:
  sf_destroy(ctx);
  for (int p = 0; p < np; ++p) {
    if (a.shard == SF_SHARD_NONE || a.host_buffers) free(params[p]);
    free(ref[p]);
    if (a.host_buffers) free(grads[p]);
  }
  free(params);
  free(grads);
  free(ref);
  free(bucket_of);
  free(own_offset);
  free(own_count);
  return rc;
}
