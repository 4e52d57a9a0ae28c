#!/usr/bin/python3
"""PyTorch DDP over Gloo, 2 CPU processes, N micro-batches per optimizer step.

Run with Debian's /usr/bin/python3 (torch 1.13), or with pip's torch 2.x
(SF_PYTHON_TORCH2: the shim must detect its own Gloo and pass it through).
The ranks are started with torch.multiprocessing.spawn and meet through a
file store given to init_process_group: no RANK/WORLD_SIZE/MASTER_* in the
environment, so the shim can only learn the world size from the host's own
communicator.

--mode nosync   the reference: no_sync() around forward and backward of the
                first N-1 micro-batches (what DDP users write).
--mode calls    no no_sync(); two ctypes lines open and close the window on
                sfsync's default context (the shim must be preloaded).
--mode plain    the script untouched: no no_sync(), no calls (with the shim
                and SF_ACCUMULATION_STEPS=N: automatic windows).
--mode unsynced the window is never closed before the optimizer steps (a host
                bug the shim must report), from window --unsynced-from on
                (default 1; earlier windows as --mode calls).
--mode permicro a window around each non-final micro-batch on its own (begin,
                forward, backward, end), the last micro-batch synchronized:
                consecutive windows with no pass between them are one window,
                legal and silent.
--mode forgot   as --mode calls, but window --forgot-at never ends: the next
                sf_begin_accumulation is refused (its status ignored, as
                ctypes hosts do).
--mark          write a marker line through sf_log (the one logger) before
                every sf_begin_accumulation and around every backward, so
                that a test can check in SF_DEBUG_FILE where a warning came.

Checks (each a failing exit status with a message):
  --reference F    the final weights equal those in F (written by --save).
  --check-grads    after every micro-batch, compare the ranks' gradients
                   (all_gather): different after a deferred one (nothing was
                   all-reduced), the same after a synchronized one.
  --local-from P   the first backward pass (1-based, over all windows) whose
                   all-reduce the shim defers; later ones too, except the
                   last of each window. Without it nothing is deferred
                   (--mode nosync: the first N-1 of every window).
  --log-dir D      read every SF_DEBUG_FILE in directory D (one per process)
                   and check that each "A<B<C" of --order appears in this
                   order in some file: a warning B between the host's markers
                   A and C (given by --mark) came at that call or pass.
  --report P       SF_SHIM_REPORT pattern (with %r); checks the shim's report
                   of each rank against --expect: calls, auto (SF_ACCUMULATION_STEPS
                   = --steps), pass (nothing deferred), unsynced, lost (auto
                   until --foreign-at, then nothing deferred), foreign (a
                   host whose Gloo is not the system one, e.g. pip's torch:
                   every Gloo all-reduce passed unread, those of plain DDP,
                   nothing deferred; the pattern takes %p, the rank being
                   unknown to the shim).
"""

import argparse
import contextlib
import glob
import json
import os
import sys
import tempfile

from spawn_ranks import spawn

WORLD = 2


def rank_main(rank, args, store_file):
    """One rank, in a spawned process: torch is imported there only."""
    import ddp_accumulation_rank
    ddp_accumulation_rank.worker(rank, args, store_file)


def check_foreign_reports(args):
    """A foreign Gloo (--expect foreign): the shim read nothing, so the reports
    (one per process, by pid) hold calls only: plain DDP's, one gradient
    all-reduce per bucket and backward pass (one bucket in the first pass,
    two after the rebuild), none deferred."""
    paths = sorted(glob.glob(args.report.replace("%p", "*")))
    if len(paths) != WORLD:
        return [f"{len(paths)} reports match {args.report}, want {WORLD}"]
    passes = args.windows * args.steps
    want = 1 + 2 * (passes - 1)
    failures = []
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        print(f"{os.path.basename(path)}: mode {r['mode']}, {r['calls']} calls, "
              f"{r['foreign_gloo_calls']} of a foreign Gloo, {r['passed']} passed, "
              f"{r['deferred']} deferred, {r['windows']} windows (plain DDP: {want} calls)")
        if (r["mode"] != "off" or r["foreign_gloo_calls"] != want or r["calls"] != want or
                r["passed"] != want or r["deferred"] != 0 or r["bytes_deferred"] != 0 or
                r["windows"] != 0):
            failures.append(f"{path}: expected {want} foreign Gloo calls, all passed: {r}")
    return failures


def check_reports(args, grad_bytes):
    """The shim's own account, per rank, against what this script did."""
    if args.expect == "foreign":
        return check_foreign_reports(args)
    n, windows, t = args.steps, args.windows, grad_bytes
    failures = []
    for rank in range(WORLD):
        path = args.report.replace("%r", str(rank))
        with open(path) as f:
            r = json.load(f)
        per = r["per_window"]
        sent = [x["gradient_bytes_sent"] for x in per]
        deferred = [x["bytes_deferred"] for x in per]
        print(f"rank {rank}: mode {r['mode']}, {r['calls']} calls, {r['deferred']} deferred, "
              f"{r['passed']} passed; gradient bytes per pass {t}; sent per window {sent}; "
              f"deferred per window {deferred}")
        if r["world_size"] != WORLD or r["rank"] != rank:
            failures.append(f"rank {rank}: report says rank {r['rank']} of {r['world_size']}")
        def deferred_passes(last_window):
            return [p for p in range(1, last_window * n + 1) if p > 5 and p % n != 0]
        want_sent = want_def = None
        if args.expect == "pass":
            if r["deferred"] != 0 or r["gradient_bytes_sent"] != windows * n * t:
                failures.append(f"rank {rank}: expected every pass sent: {n * windows * t} bytes, "
                                f"got {r['gradient_bytes_sent']} sent, {r['bytes_deferred']} deferred")
        elif args.expect == "permicro":
            # A physical window per non-final micro-batch; per optimizer step
            # (N - 1) x T deferred and T sent.
            if (r["bytes_deferred"] != windows * (n - 1) * t or
                    r["gradient_bytes_sent"] != windows * t or r["windows"] != windows * (n - 1)):
                failures.append(f"rank {rank}: expected {windows * (n - 1) * t} bytes deferred in "
                                f"{windows * (n - 1)} windows and {windows * t} sent: {r}")
        elif args.expect == "calls":
            want_sent, want_def = [t] * windows, [(n - 1) * t] * windows
        elif args.expect == "unsynced":
            k = args.unsynced_from - 1  # windows synchronized before
            want_sent = [t] * k + [0] * (windows - k)
            want_def = [(n - 1) * t] * k + [n * t] * (windows - k)
        elif args.expect == "lost":
            # Automatic mode until the foreign all-reduce before window F, then
            # every call sent (the foreign one included).
            a = r["automatic"]
            d = len(deferred_passes(args.foreign_at - 1))
            foreign = 40000 * 4
            if (a["state"] != "lost" or r["bytes_deferred"] != d * t or
                    r["gradient_bytes_sent"] != (windows * n - d) * t + foreign):
                failures.append(f"rank {rank}: expected {d} passes deferred, then everything "
                                f"sent after the foreign call: {r}")
        else:  # auto: N micro-batches per window, learned after 5 passes
            a = r["automatic"]
            if a["state"] != "tracking" or a["pass_bytes"] != t or a["learned_after_passes"] != 5:
                failures.append(f"rank {rank}: automatic mode did not learn the passes: {a}")
            want_sent, want_def = [], []
            for w in range(1, windows + 1):
                d = len([p for p in deferred_passes(windows) if (p - 1) // n + 1 == w])
                want_sent.append((n - d) * t)
                want_def.append(d * t)
        if want_sent is not None and (sent != want_sent or deferred != want_def):
            failures.append(f"rank {rank}: sent per window {sent} (want {want_sent}), "
                            f"deferred {deferred} (want {want_def})")
        if r["unsynchronized_windows"] != args.unsynchronized:
            failures.append(f"rank {rank}: unsynchronized windows {r['unsynchronized_windows']}, "
                            f"want {args.unsynchronized}")
    return failures


def check_log_order(args):
    """Each "A<B<C" of --order: in both ranks' files, the first line containing A,
    then the first after it containing B, then the first after that containing C,
    with nothing of the next pass between (B came at once)."""
    failures = []
    logs = []
    for name in sorted(os.listdir(args.log_dir)):
        with open(os.path.join(args.log_dir, name)) as f:
            lines = f.read().splitlines()
        if any(" host " in line for line in lines):
            logs.append((name, lines))
    if len(logs) != WORLD:
        return [f"{len(logs)} SF_DEBUG_FILE logs with host markers in {args.log_dir}, want {WORLD}"]
    for order in args.order:
        parts = order.split("<")
        for name, lines in logs:
            at, found = 0, []
            for part in parts:
                hit = next((i for i in range(at, len(lines)) if part in lines[i]), None)
                if hit is None:
                    break
                found.append(hit)
                at = hit + 1
            if len(found) != len(parts):
                failures.append(f"{name}: {parts[len(found)]!r} not found after "
                                f"{parts[:len(found)]!r}")
            else:
                print(f"{name}: " + " < ".join(f"line {i + 1}" for i in found) + f" for {order}")
    return failures


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["nosync", "calls", "plain", "unsynced", "permicro", "forgot"],
                   required=True)
    p.add_argument("--unsynced-from", type=int, default=1)
    p.add_argument("--forgot-at", type=int, default=1)
    p.add_argument("--mark", action="store_true")
    p.add_argument("--log-dir")
    p.add_argument("--order", action="append", default=[])
    p.add_argument("--steps", type=int, default=4, help="micro-batches per optimizer step (N)")
    p.add_argument("--windows", type=int, default=6, help="optimizer steps (W)")
    p.add_argument("--save")
    p.add_argument("--reference")
    p.add_argument("--check-grads", action="store_true")
    p.add_argument("--local-from", type=int)
    p.add_argument("--foreign-at", type=int)
    p.add_argument("--report")
    p.add_argument("--expect",
                   choices=["calls", "auto", "pass", "unsynced", "lost", "permicro", "foreign"])
    p.add_argument("--unsynchronized", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=[])
    args = p.parse_args()
    if args.log_dir:  # SF_DEBUG_FILE points into it; start empty
        os.makedirs(args.log_dir, exist_ok=True)
        for name in os.listdir(args.log_dir):
            os.remove(os.path.join(args.log_dir, name))
    if args.report:  # the shim writes the reports at the ranks' exit
        os.makedirs(os.path.dirname(args.report) or ".", exist_ok=True)
        for path in [args.report.replace("%r", str(rank)) for rank in range(WORLD)] + \
                glob.glob(args.report.replace("%p", "*").replace("%r", "*")):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        spawn(rank_main, (args, os.path.join(tmp, "store")), WORLD)
        with open(os.path.join(tmp, "grad_bytes-0")) as f:
            grad_bytes = int(f.read())
    failures = check_reports(args, grad_bytes) if args.report else []
    if args.log_dir:
        failures += check_log_order(args)
    for f in failures:
        print("FAILED: " + f, file=sys.stderr)
    if failures:
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
