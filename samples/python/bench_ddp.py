"""Benchmark: time and bytes per accumulation window for sfsync and two ways
of using DDP's no_sync(), in one run.

    build/plugin/tools/sfsync-run -n 2 -- /usr/bin/python3 samples/python/bench_ddp.py

Variants (same model, same data, same number of micro-batches N per window):

  sfsync          with sync.accumulate(): micro-batches 1..N-1; last one; sync.synchronize()
  ddp_fwd_bwd     with ddp.no_sync(): forward AND backward of 1..N-1 (correct)
  ddp_bwd_only    forward outside, with ddp.no_sync(): backward only (the trap: DDP
                  decides in the forward whether the backward synchronizes, so every
                  micro-batch is all-reduced: N x the bytes, and nothing warns)
  ddp_fp16        ddp_fwd_bwd with torch's fp16_compress_hook (16-bit wire)
  sfsync_bf16     sfsync with wire_dtype bfloat16 (16-bit wire, float32 sums)
  sfsync_fp16     sfsync with wire_dtype float16
  sfsync_lanes1   sfsync with max_inflight 1 (one bucket collective at a time)
  ddp_same_cap    ddp_fwd_bwd with sfsync's bucket cap (--sfsync-bucket-cap-mb)

DDP runs with its own all-reduce (no comm hook) unless --ddp-count-hook, so
its time is DDP's; the bytes that left this rank's NIC per window
(/sys/class/net/$GLOO_SOCKET_IFNAME, "lo" by default: there every rank's
traffic counts) are reported for every variant. Several sfsync variants need
a rendezvous each: --sfsync-store-dir DIR gives each file://DIR/<variant>.

Bytes: sfsync from its stats (bytes_reduced); DDP from a comm hook that wraps
the all-reduce and counts bucket bytes. Time: wall time of a whole window
(forward, backward, synchronization, optimizer step), the slowest rank's,
median over the timed windows (after warm-up windows); the variants take
turns window by window, so that other load on the machine hits all alike. A benchmark, not a
test: it only fails if a variant's bytes are not what the variant implies.
Prints a table and one JSON line (prefix "JSON ").
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_common as common
import sfsync
from sfsync import torch as sfsync_torch

VARIANTS = ("sfsync", "ddp_fwd_bwd", "ddp_bwd_only", "ddp_fp16", "sfsync_bf16", "sfsync_fp16",
            "sfsync_lanes1", "ddp_same_cap")
DEFAULT_VARIANTS = ("sfsync", "ddp_fwd_bwd", "ddp_bwd_only")
WIRE = {"sfsync": 0, "sfsync_bf16": 3, "sfsync_fp16": 2, "sfsync_lanes1": 0}  # DTYPE_* of the wire
LANES = {"sfsync_lanes1": 1}  # max_inflight where not the default


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=10, help="timed windows per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed windows per variant first")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per window (N)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=3, help="hidden layers")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="sfsync and DDP (default 25)")
    p.add_argument("--first-bucket-cap-mb", type=float, default=1.0,
                   help="sfsync's first bucket (DDP's is fixed at 1)")
    p.add_argument("--sfsync-bucket-cap-mb", type=float,
                   help="sfsync's bucket cap, if not --bucket-cap-mb (DDP keeps --bucket-cap-mb)")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), metavar="VARIANT",
                   help="a subset of %s" % " ".join(VARIANTS))
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--torch-port-offset", type=int, default=1)
    p.add_argument("--ddp-count-hook", action="store_true",
                   help="count DDP's bytes with a Python comm hook (slows DDP down)")
    p.add_argument("--sfsync-store-dir", help="rendezvous file://DIR/<variant> per sfsync variant")
    args = p.parse_args(argv)
    args.variants = [v for item in args.variants for v in item.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error("unknown variant(s) %s" % ", ".join(sorted(unknown)))
    if args.micro_batches < 1 or args.windows < 1 or args.warmup < 0:
        p.error("--micro-batches and --windows must be >= 1, --warmup >= 0")
    if sum(v in WIRE for v in args.variants) > 1 and not args.sfsync_store_dir:
        p.error("several sfsync variants need --sfsync-store-dir (one rendezvous each)")
    return args


def nic_tx_bytes():
    """Bytes this host's NIC has sent (the interface Gloo uses)."""
    path = "/sys/class/net/%s/statistics/tx_bytes" % os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    try:
        with open(path) as f:
            return int(f.read())
    except OSError:
        return 0


class Runner:
    """One variant: a fresh copy of the model and its way to run a window.
    run_window() returns (all-reduce calls, bytes) of that window."""

    def __init__(self, variant, base, args):
        self.variant = variant
        self.model = common.clone_model(base)
        self.n = args.micro_batches
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.sync = None
        self.ddp = None
        self.counter = None
        if variant in WIRE:
            extra = {"wire_dtype": WIRE[variant]}
            if variant in LANES:
                extra["max_inflight"] = LANES[variant]
            if args.sfsync_store_dir:
                extra["rendezvous"] = "file://%s/%s" % (args.sfsync_store_dir, variant)
            cap = args.sfsync_bucket_cap_mb or args.bucket_cap_mb
            # Every parameter of this MLP gets a gradient: no used-mask, so the
            # bytes on the wire are exactly the gradients' (as DDP's default).
            self.sync = sfsync_torch.GradientSync(self.model, bucket_cap_mb=cap,
                                                  first_bucket_cap_mb=args.first_bucket_cap_mb,
                                                  find_unused_parameters=False, **extra)
            self.module = self.model
        else:
            cap = args.bucket_cap_mb
            if variant == "ddp_same_cap":
                cap = args.sfsync_bucket_cap_mb or args.bucket_cap_mb
            self.ddp = DDP(self.model, bucket_cap_mb=cap)
            if variant == "ddp_fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
                self.ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif args.ddp_count_hook:
                self.counter = common.CommCounter()
                self.ddp.register_comm_hook(self.counter, common.counting_allreduce_hook)
            self.module = self.ddp
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.01)

    def _step(self, x, y):
        (self.loss_fn(self.module(x), y) / self.n).backward()

    def run_window(self, batches):
        if self.sync is not None:
            s0 = self.sync.stats()
            with self.sync.accumulate():
                for x, y in batches[:-1]:
                    self._step(x, y)
            self._step(*batches[-1])
            self.sync.synchronize()
            self.opt.step()
            self.sync.zero_grad()
            s1 = self.sync.stats()
            return (s1["collectives_issued"] - s0["collectives_issued"],
                    s1["bytes_reduced"] - s0["bytes_reduced"])
        c0 = self.counter.snapshot() if self.counter else (None, None)
        if self.variant in ("ddp_fwd_bwd", "ddp_fp16", "ddp_same_cap"):
            with self.ddp.no_sync():
                for x, y in batches[:-1]:
                    self._step(x, y)
        else:  # ddp_bwd_only: the forward runs outside no_sync()
            for x, y in batches[:-1]:
                loss = self.loss_fn(self.ddp(x), y) / self.n
                with self.ddp.no_sync():
                    loss.backward()
        self._step(*batches[-1])
        self.opt.step()
        self.opt.zero_grad()
        if not self.counter:
            return None, None
        c1 = self.counter.snapshot()
        return c1[0] - c0[0], c1[1] - c0[1]

    def sync_ms_total(self):
        return self.sync.stats()["sync_ns_total"] / 1e6 if self.sync else None

    def close(self):
        if self.sync is not None:
            self.sync.close()


def summarize(runner, times, calls, nbytes, sync_ms, nic):
    # A window is as slow as its slowest rank.
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ms = [x * 1e3 for x in t.tolist()]
    return {
        "variant": runner.variant,
        "ms_per_window_median": round(statistics.median(ms), 3),
        "ms_per_window_min": round(min(ms), 3),
        "ms_per_window_max": round(max(ms), 3),
        "bytes_per_window": nbytes[0] if len(set(nbytes)) == 1 else nbytes,
        "allreduces_per_window": calls[0] if len(set(calls)) == 1 else calls,
        "sync_wait_ms_per_window": None if sync_ms is None else round(sync_ms, 3),
        "nic_tx_bytes_per_window": int(statistics.median(nic)) if nic else None,
    }


def bench(base, args, rank):
    """Runs the variants' windows in turn (window 0 of each, window 1 of
    each, ...), so that a change in machine load hits every variant alike."""
    runners = [Runner(v, base, args) for v in args.variants]
    times = {r.variant: [] for r in runners}
    calls = {r.variant: [] for r in runners}
    nbytes = {r.variant: [] for r in runners}
    nic = {r.variant: [] for r in runners}
    sync0 = {}
    for w in range(args.warmup + args.windows):
        batches = [common.micro_batch(args.seed, rank, w, m, args.batch_size, args.features,
                                      args.classes) for m in range(args.micro_batches)]
        for runner in runners:
            if w == args.warmup:
                sync0[runner.variant] = runner.sync_ms_total()
            dist.barrier()  # every rank starts the window together
            n0 = nic_tx_bytes()
            t0 = time.perf_counter()
            c, b = runner.run_window(batches)
            elapsed = time.perf_counter() - t0
            if w >= args.warmup:
                nic[runner.variant].append(nic_tx_bytes() - n0)
                times[runner.variant].append(elapsed)
                calls[runner.variant].append(c)
                nbytes[runner.variant].append(b)
    results = []
    for runner in runners:
        v = runner.variant
        if runner.sync is not None:
            runner.bucket_bytes = [b[0] if isinstance(b, (tuple, list)) else b.get("bytes")
                                   for b in runner.sync.buckets()]
        else:  # torch 1.13's logging data keeps the plan from before DDP rebuilds its buckets
            runner.bucket_bytes = None
        sync_ms = None
        if runner.sync is not None:
            sync_ms = (runner.sync_ms_total() - sync0[v]) / args.windows
        results.append(summarize(runner, times[v], calls[v], nbytes[v], sync_ms, nic[v]))
        results[-1]["bucket_bytes"] = runner.bucket_bytes
        runner.close()
    return results


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rank, world = common.init_torch_distributed(args.torch_port_offset)
    base = common.make_mlp(args.features, args.hidden, args.classes, args.depth, args.seed)
    grad_bytes = common.gradient_bytes(base)
    n = args.micro_batches
    started = time.perf_counter()
    results = bench(base, args, rank)

    expected = {"sfsync": grad_bytes, "sfsync_bf16": grad_bytes, "sfsync_fp16": grad_bytes,
                "sfsync_lanes1": grad_bytes,
                "ddp_fwd_bwd": grad_bytes, "ddp_same_cap": grad_bytes,
                "ddp_bwd_only": n * grad_bytes}
    problems = ["%s moved %s bytes per window, expected %d" % (r["variant"], r["bytes_per_window"],
                                                               expected[r["variant"]])
                for r in results if r["bytes_per_window"] is not None
                and r["variant"] in expected and r["bytes_per_window"] != expected[r["variant"]]]
    if rank == 0:
        print("sfsync %s, torch %s: %d ranks, MLP %d-%s-%d (%d parameters, %.2f MB of gradients), "
              "%d micro-batches x %d samples per window, %d timed windows after %d warm-up"
              % (sfsync.version(), torch.__version__, world, args.features,
                 "x".join([str(args.hidden)] * args.depth), args.classes,
                 sum(p.numel() for p in base.parameters()), grad_bytes / 1e6, n, args.batch_size,
                 args.windows, args.warmup))
        print("%-14s %12s %12s %14s %12s %12s %14s" % ("variant", "ms/window", "(min-max)",
                                                        "bytes/window", "x gradient",
                                                        "all-reduces", "nic_tx/window"))
        for r in results:
            b = r["bytes_per_window"]
            ratio = b / grad_bytes if isinstance(b, int) else float("nan")
            print("%-14s %12.1f %12s %14s %12.2f %12s %14s" % (
                r["variant"], r["ms_per_window_median"],
                "%.0f-%.0f" % (r["ms_per_window_min"], r["ms_per_window_max"]), b, ratio,
                r["allreduces_per_window"], r["nic_tx_bytes_per_window"]))
        record = {"bench": "sfsync_vs_ddp", "world_size": world, "micro_batches": n,
                  "batch_size": args.batch_size, "gradient_bytes": grad_bytes,
                  "bucket_cap_mb": args.bucket_cap_mb, "windows": args.windows,
                  "warmup": args.warmup, "threads": args.threads, "torch": torch.__version__,
                  "sfsync": sfsync.version(), "results": results,
                  "wall_s": round(time.perf_counter() - started, 2)}
        print("JSON " + json.dumps(record, sort_keys=True), flush=True)
    for p in problems:
        print("UNEXPECTED (rank %d): %s" % (rank, p), flush=True)
    common.shutdown()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
