#include "toy_model.h"

#include <stdlib.h>
#include <string.h>

static uint64_t splitmix(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static float uniform(uint64_t* state) {
  return (float)((double)(splitmix(state) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

int toy_param_count(const toy_model* m) { return m->blocks + 1; }

int64_t toy_param_numel(const toy_model* m, int index) {
  return index < m->blocks ? (int64_t)m->rows * m->in : (int64_t)m->rows * m->blocks;
}

void toy_init_params(const toy_model* m, float* const* params) {
  uint64_t state = 42;
  for (int p = 0; p < toy_param_count(m); ++p) {
    for (int64_t i = 0; i < toy_param_numel(m, p); ++i) params[p][i] = 0.1f * uniform(&state);
  }
}

uint64_t toy_seed(int window, int micro, int rank) {
  uint64_t s = 0x5f5f0000ull ^ ((uint64_t)window << 40) ^ ((uint64_t)micro << 20) ^ (uint64_t)rank;
  return splitmix(&s);
}

/* The target: a fixed W* (from a fixed seed) applied to x. */
static float target(const toy_model* m, int out, const float* x) {
  uint64_t state = 1000003ull + (uint64_t)out;
  float y = 0.5f * uniform(&state);
  for (int i = 0; i < m->in; ++i) y += uniform(&state) * x[i];
  return y;
}

/* grads += scale * d(loss)/d(params) over `samples` samples drawn from
 * `seed`; each sample's loss 0.5 * err^2 is divided by `loss_div`. */
static double accumulate(const toy_model* m, float* const* params, uint64_t seed, int samples,
                         float scale, double loss_div, float* const* grads) {
  const int outs = m->rows * m->blocks;
  float* x = (float*)malloc(sizeof(float) * (size_t)m->in);
  uint64_t state = seed;
  double loss = 0;
  float* bias = params[m->blocks];
  float* dbias = grads[m->blocks];
  for (int s = 0; s < samples; ++s) {
    for (int i = 0; i < m->in; ++i) x[i] = uniform(&state);
    for (int o = 0; o < outs; ++o) {
      const float* w = params[o / m->rows] + (int64_t)(o % m->rows) * m->in;
      float* dw = grads[o / m->rows] + (int64_t)(o % m->rows) * m->in;
      float pred = bias[o];
      for (int i = 0; i < m->in; ++i) pred += w[i] * x[i];
      const float err = pred - target(m, o, x);
      loss += 0.5 * (double)err * err / loss_div;
      const float g = err * scale;
      for (int i = 0; i < m->in; ++i) dw[i] += g * x[i];
      dbias[o] += g;
    }
  }
  free(x);
  return loss;
}

double toy_accumulate_grads(const toy_model* m, float* const* params, uint64_t seed,
                            float* const* grads) {
  return accumulate(m, params, seed, m->batch, 1.0f / (float)m->batch, (double)m->batch, grads);
}

int toy_tokens(int window, int micro, int rank, int batch) {
  uint64_t s = 0x70c3e500ull ^ ((uint64_t)window << 40) ^ ((uint64_t)micro << 20) ^ (uint64_t)rank;
  return (int)(splitmix(&s) % (uint64_t)(2 * batch + 1));
}

double toy_accumulate_sum(const toy_model* m, float* const* params, uint64_t seed, int samples,
                          float scale, float* const* grads) {
  return accumulate(m, params, seed, samples, scale, 1.0, grads);
}

void toy_sgd_step(const toy_model* m, float* const* params, float* const* grads, float lr) {
  for (int p = 0; p < toy_param_count(m); ++p) {
    for (int64_t i = 0; i < toy_param_numel(m, p); ++i) params[p][i] -= lr * grads[p][i];
  }
}

void toy_reference(const toy_model* m, int world, int windows, const int* micro, float lr,
                   float* const* params) {
  const int np = toy_param_count(m);
  float** total = (float**)malloc(sizeof(float*) * (size_t)np);
  float** mine = (float**)malloc(sizeof(float*) * (size_t)np);
  for (int p = 0; p < np; ++p) {
    total[p] = (float*)malloc(sizeof(float) * (size_t)toy_param_numel(m, p));
    mine[p] = (float*)malloc(sizeof(float) * (size_t)toy_param_numel(m, p));
  }
  toy_init_params(m, params);
  for (int w = 0; w < windows; ++w) {
    for (int p = 0; p < np; ++p) memset(total[p], 0, sizeof(float) * (size_t)toy_param_numel(m, p));
    for (int r = 0; r < world; ++r) {
      /* As on a rank: sum its own micro-batches first, then across ranks. */
      for (int p = 0; p < np; ++p) memset(mine[p], 0, sizeof(float) * (size_t)toy_param_numel(m, p));
      for (int k = 0; k < micro[w]; ++k) toy_accumulate_grads(m, params, toy_seed(w, k, r), mine);
      for (int p = 0; p < np; ++p) {
        for (int64_t i = 0; i < toy_param_numel(m, p); ++i) total[p][i] += mine[p][i];
      }
    }
    for (int p = 0; p < np; ++p) {
      for (int64_t i = 0; i < toy_param_numel(m, p); ++i) total[p][i] *= 1.0f / (float)world;
    }
    toy_sgd_step(m, params, total, lr);
  }
  for (int p = 0; p < np; ++p) {
    free(total[p]);
    free(mine[p]);
  }
  free(total);
  free(mine);
}

void toy_reference_weighted(const toy_model* m, int world, int windows, const int* micro, float lr,
                            float* const* params, double* window_weight, double* window_loss) {
  const int np = toy_param_count(m);
  double** total = (double**)malloc(sizeof(double*) * (size_t)np);
  float** mine = (float**)malloc(sizeof(float*) * (size_t)np);
  for (int p = 0; p < np; ++p) {
    total[p] = (double*)malloc(sizeof(double) * (size_t)toy_param_numel(m, p));
    mine[p] = (float*)malloc(sizeof(float) * (size_t)toy_param_numel(m, p));
  }
  toy_init_params(m, params);
  for (int w = 0; w < windows; ++w) {
    double count = 0, loss = 0;
    for (int p = 0; p < np; ++p) memset(total[p], 0, sizeof(double) * (size_t)toy_param_numel(m, p));
    for (int r = 0; r < world; ++r) {
      for (int k = 0; k < micro[w]; ++k) {
        /* Each micro-batch's plain-sum gradient, added in float64. */
        const int tokens = toy_tokens(w, k, r, m->batch);
        for (int p = 0; p < np; ++p) memset(mine[p], 0, sizeof(float) * (size_t)toy_param_numel(m, p));
        loss += toy_accumulate_sum(m, params, toy_seed(w, k, r), tokens, 1.0f, mine);
        count += tokens;
        for (int p = 0; p < np; ++p) {
          for (int64_t i = 0; i < toy_param_numel(m, p); ++i) total[p][i] += mine[p][i];
        }
      }
    }
    if (window_weight) window_weight[w] = count;
    if (window_loss) window_loss[w] = loss;
    if (count == 0) continue; /* no tokens anywhere: no step (sfsync fails that window) */
    for (int p = 0; p < np; ++p) {
      for (int64_t i = 0; i < toy_param_numel(m, p); ++i) {
        params[p][i] -= lr * (float)(total[p][i] / count);
      }
    }
  }
  for (int p = 0; p < np; ++p) {
    free(total[p]);
    free(mine[p]);
  }
  free(total);
  free(mine);
}
