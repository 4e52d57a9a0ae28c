"""The installed wheel's smoke test: two ranks (two processes) doing raw-
binding collectives through ctypes, with only the standard library (no numpy,
no torch): what tests/python/packaging/test_wheel.py runs inside the minimal Debian root
(and, once more, from the torch 2.x venv that installed the wheel).

    python3 wheel_smoke.py [--timeout S]

Starts itself twice (--rank 0 / 1) as a launcher does: RANK, WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT (--port, else a free one) and a fresh job
token SF_AUTH_TOKEN, so the ranks meet through sfsync's own env:// store
(rank 0 serves it; each client answers its HMAC-SHA256 challenge: the
package's own HMAC-SHA256 at work) and connect Gloo's pairs over
loopback. test_wheel.py runs it in a network namespace of its own (a private
loopback: the port cannot collide with anything). Each rank, in one
sfsync.Context (rendezvous env://, backend gloo):

* registers two plugin-owned gradients (float32 x 1000, float64 x 37: two
  dtypes, so two buckets), fills them with rank-dependent values;
* one accumulation window (begin, a second micro-batch added locally, end),
  then synchronize(): the average over the ranks of what each summed, checked
  element by element; the stats count no collective inside the window and one
  all-reduce per bucket at the synchronization;
* sf_broadcast of a bytearray from rank 0;
* prints "RESULT rank=R OK library=PATH" (PATH: sfsync.library_path()).

The parent checks both ranks' lines and that the library is the installed one
(not a source tree's): exit 0 only then.
"""

import argparse
import ctypes
import os
import secrets
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, timeout_ms):
    import sfsync
    path = sfsync.library_path()
    errors = []
    ctx = sfsync.Context(rendezvous="env://", backend="gloo", timeout_ms=timeout_ms)
    o = ctx.options()
    if (o["rank"], o["world_size"]) != (rank, world):
        errors.append("env:// discovery: rank %d of %d, expected %d of %d"
                      % (o["rank"], o["world_size"], rank, world))
    sizes = [(1000, sfsync.DTYPE_FLOAT32, ctypes.c_float),
             (37, sfsync.DTYPE_FLOAT64, ctypes.c_double)]
    ids = [ctx.add_gradient(n, dtype, name="g%d" % i) for i, (n, dtype, _) in enumerate(sizes)]
    ctx.build_buckets()
    views = [(ctype * n).from_address(ctx.gradient_data(gid))
             for gid, (n, _, ctype) in zip(ids, sizes)]

    def value(r, g, i, micro):
        return float((r + 1) * (g + 1) + i % 7 + micro * 0.5)

    before = ctx.stats()
    with ctx.accumulate():  # micro-batch 1 of 2: summed locally, nothing sent
        for g, view in enumerate(views):
            for i in range(len(view)):
                view[i] = value(rank, g, i, 0)
    inside = ctx.stats()
    for g, view in enumerate(views):  # micro-batch 2: added to the same buffer
        for i in range(len(view)):
            view[i] += value(rank, g, i, 1)
    ctx.synchronize()
    after = ctx.stats()
    for g, view in enumerate(views):
        for i in range(len(view)):
            want = sum(value(r, g, i, 0) + value(r, g, i, 1) for r in range(world)) / world
            if abs(view[i] - want) > 1e-5 * max(1.0, abs(want)):
                errors.append("gradient %d[%d] = %r, expected %r" % (g, i, view[i], want))
                break
    issued = after["collectives_issued"] - before["collectives_issued"]
    if inside["collectives_issued"] != before["collectives_issued"]:
        errors.append("collectives inside the window: %d"
                      % (inside["collectives_issued"] - before["collectives_issued"]))
    if issued != after["bucket_count"] or after["bucket_count"] != 2:
        errors.append("synchronize issued %d collectives for %d buckets (expected 2 and 2)"
                      % (issued, after["bucket_count"]))
    if after["windows_completed"] - before["windows_completed"] != 1:
        errors.append("windows_completed: %r -> %r" % (before["windows_completed"],
                                                        after["windows_completed"]))
    payload = bytearray(b"sfsync-wheel-smoke" if rank == 0 else b"x" * 18)
    ctx.broadcast(payload, root=0)
    if bytes(payload) != b"sfsync-wheel-smoke":
        errors.append("broadcast from rank 0 gave %r" % bytes(payload))
    ctx.close()
    for e in errors:
        print("RESULT rank=%d FAIL %s" % (rank, e), flush=True)
    if not errors:
        print("RESULT rank=%d OK library=%s version=%s gradients=%s" % (
            rank, path, sfsync.version(), "+".join(str(n) for n, _, _ in sizes)), flush=True)
    return 1 if errors else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--port", type=int, help="MASTER_PORT (default: a free port)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds, for the whole run")
    args = p.parse_args()
    if args.rank is not None:
        return rank_main(args.rank, args.world, int(args.timeout * 1000 / 2))

    start = time.monotonic()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port or free_port()),
               WORLD_SIZE=str(args.world), SF_AUTH_TOKEN=secrets.token_hex(32))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r),
                               "--world", str(args.world), "--timeout", str(args.timeout)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(args.world)]
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, args.timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = proc.communicate()
            out += "\n(timed out after %.0f s)" % args.timeout
        outs.append((proc.returncode, out))
    ok = True
    for r, (code, out) in enumerate(outs):
        sys.stdout.write("---- rank %d (exit %s)\n%s" % (r, code, out))
        line = [l for l in out.splitlines() if l.startswith("RESULT rank=%d OK " % r)]
        if code != 0 or len(line) != 1:
            ok = False
    print("SMOKE %s: %d ranks, %.1f s" % ("PASSED" if ok else "FAILED", args.world,
                                            time.monotonic() - start), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
