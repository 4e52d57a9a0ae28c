"""spawn(fn, args, nprocs): torch.multiprocessing.spawn's contract (fn(rank,
*args) in nprocs spawned processes; the first that fails ends the others and
this process with its exit status) for a parent that never imports torch:
its ranks import it, and the parent's own import (0.95 CPU-s under torch
1.13, 1.55 under torch 2.x) is saved. A rank's exception is printed by that
rank (multiprocessing prints its traceback)."""

import multiprocessing
import multiprocessing.connection
import sys


def spawn(fn, args, nprocs):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=fn, args=(rank,) + tuple(args)) for rank in range(nprocs)]
    for p in procs:
        p.start()
    alive = list(procs)
    failed = None
    while alive and failed is None:
        multiprocessing.connection.wait([p.sentinel for p in alive])
        for p in [p for p in alive if p.exitcode is not None]:
            alive.remove(p)
            if p.exitcode != 0 and failed is None:
                failed = p
    for p in alive:
        p.terminate()
    for p in procs:
        p.join()
    if failed is not None:
        rank = procs.index(failed)
        print("spawn_ranks: rank %d exited with status %d" % (rank, failed.exitcode),
              file=sys.stderr)
        sys.exit(failed.exitcode if failed.exitcode > 0 else 1)
