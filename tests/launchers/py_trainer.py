"""A small Python trainer on sfsync.Context (numpy, no torch), for the
launcher tests: W windows of N micro-batches of made-up gradients, the rank
and world taken from whatever launched it (sfsync-run, mpirun, srun). It
prints one line

  RESULT rank=R world=W windows=.. buckets=.. collectives=.. bytes=.. max_abs_diff=.. OK

where max_abs_diff compares its weights with a single-process reference that
averages every rank's micro-batches. Exit status 1 when they differ.
"""

import sys

import numpy as np

import sfsync

WINDOWS, MICRO, LR = 4, 3, 0.1
SIZES = (3000, 129, 7)


def micro_batch(n, window, k, rank):
    return np.sin(np.arange(n, dtype=np.float64) * 0.01 + window + 0.3 * k + 1.7 * rank)


def main():
    ctx = sfsync.Context(bucket_cap_mb=0.005, first_bucket_cap_mb=0.001)
    o = ctx.options()
    rank, world = o["rank"], o["world_size"]
    ids = [ctx.add_gradient(n, name="g%d" % i) for i, n in enumerate(SIZES)]
    ctx.build_buckets()
    grads = [ctx.gradient_array(i) for i in ids]
    weights = [np.zeros(n, np.float32) for n in SIZES]
    for w in range(WINDOWS):
        ctx.zero_gradients()
        with ctx.accumulate():
            for k in range(MICRO - 1):
                for g, n in zip(grads, SIZES):
                    g += micro_batch(n, w, k, rank).astype(np.float32)
        for g, n in zip(grads, SIZES):
            g += micro_batch(n, w, MICRO - 1, rank).astype(np.float32)
        ctx.synchronize()
        for weight, g in zip(weights, grads):
            weight -= LR * g
    diff = 0.0
    for weight, n in zip(weights, SIZES):
        ref = -LR * sum(micro_batch(n, w, k, r) for w in range(WINDOWS) for k in range(MICRO)
                        for r in range(world)) / world
        diff = max(diff, float(np.max(np.abs(weight - ref))))
    s = ctx.stats()
    ok = diff < 1e-4
    print("RESULT rank=%d world=%d windows=%d buckets=%d collectives=%d bytes=%d max_abs_diff=%.3g %s"
          % (rank, world, s["windows_completed"], s["bucket_count"], s["collectives_issued"],
             s["bytes_reduced"], diff, "OK" if ok else "DIFFERS"), flush=True)
    ctx.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
