/*
 * A small model with analytic gradients, shared by the C sample and the
 * tests: multi-output linear regression y = W x + b with a mean-squared-error
 * loss. W is split into `blocks` row blocks so that the model has several
 * parameter tensors (blocks + 1 with the bias), which is what bucketing needs.
 * Everything is deterministic from seeds: any process can regenerate any
 * rank's micro-batches, which is how the single-process reference is built.
 */
#ifndef SFSYNC_TOY_MODEL_H
#define SFSYNC_TOY_MODEL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct toy_model {
  int in;     /* input features */
  int rows;   /* rows of W per block */
  int blocks; /* row blocks; outputs = rows * blocks */
  int batch;  /* samples per micro-batch */
} toy_model;

/* blocks + 1: W blocks 0..blocks-1, then the bias. */
int toy_param_count(const toy_model* m);
int64_t toy_param_numel(const toy_model* m, int index);

/* Deterministic initial weights (the same on every rank). */
void toy_init_params(const toy_model* m, float* const* params);

/* The seed of one rank's micro-batch. */
uint64_t toy_seed(int window, int micro, int rank);

/* grads += gradient of the loss on the micro-batch drawn from `seed`.
 * @return the loss before the step. */
double toy_accumulate_grads(const toy_model* m, float* const* params, uint64_t seed,
                            float* const* grads);

/* Weighted windows (sfsync 0.4): the number of samples ("tokens") of one
 * rank's micro-batch, unequal across ranks and micro-batches: 0..2*batch
 * (0: a micro-batch that is all padding). */
int toy_tokens(int window, int micro, int rank, int batch);

/* grads += scale * gradient of the plain-sum loss (sum over `samples`
 * samples of 0.5 * err^2, no division by the batch) on the samples drawn
 * from `seed` (the first `samples` of what toy_accumulate_grads draws).
 * @return the loss sum (not scaled). */
double toy_accumulate_sum(const toy_model* m, float* const* params, uint64_t seed, int samples,
                          float scale, float* const* grads);

/* params -= lr * grads. */
void toy_sgd_step(const toy_model* m, float* const* params, float* const* grads, float lr);

/* The single-process reference: `windows` windows of micro[w] micro-batches
 * on each of `world` ranks, gradients summed per rank, averaged over ranks,
 * one SGD step per window. `params` receives the final weights. */
void toy_reference(const toy_model* m, int world, int windows, const int* micro, float lr,
                   float* const* params);

/* The token-mean reference of weighted windows: per window, the plain-sum
 * gradients of every rank's micro-batches (toy_tokens samples each), added
 * in float64 and divided by the window's total token count, one SGD step.
 * window_weight[w] / window_loss[w] (either may be NULL) receive each
 * window's total count and loss sum. A window of no tokens takes no step. */
void toy_reference_weighted(const toy_model* m, int world, int windows, const int* micro, float lr,
                            float* const* params, double* window_weight, double* window_loss);

#ifdef __cplusplus
}
#endif

#endif /* SFSYNC_TOY_MODEL_H */
