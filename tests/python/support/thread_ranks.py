"""Ranks as threads of one test process (the Python suites' counterpart of
tests/support/thread_ranks.h): run_thread_ranks(world, fn) runs fn(rank)
on one thread per rank and returns the results in rank order; a rank's
exception is raised in the caller as an AssertionError naming the rank, and
a rank still running after `timeout` seconds fails the test instead of
hanging it."""

import threading


def run_thread_ranks(world, fn, timeout=120):
    out, errors = [None] * world, [None] * world

    def rank(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: B902 - reported by the main thread
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung (%d s)" % timeout
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError("rank %d: %r" % (r, e)) from e
    return out
