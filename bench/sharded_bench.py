#!/usr/bin/python3
"""Sharded windows on simulated hosts: sfsync's distributed AdamW vs DDP, one command.

    sudo /usr/bin/python3 bench/sharded_bench.py            # the full run
    /usr/bin/python3 bench/sharded_bench.py --smoke          # loopback, 2 ranks, seconds

For every host count N (2, 4) and link rate (10gbit, 1gbit, 200mbit, and
loopback: N processes on this machine), runs this file as a worker on every
rank (``--worker``) with its variants taking turns window by window (the same
model, data and N micro-batches per window):

  ddp_adamw         DDP, no_sync() around forward+backward of 1..N-1 (correct), full AdamW
  zero_ddp          the same DDP + torch's ZeroRedundancyOptimizer(AdamW)
  sfsync_sharded    GradientSync(shard_optimizer=True, shard_layout="flat") + sync.optimizer(AdamW,
                    overlap_step=True):
                    one reduce-scatter per bucket, each bucket's shard stepped as soon as it
                    arrives, its all-gather started at once and waited at the end of its
                    own window (timed: the next window is another variant's; a gather left
                    in flight, --gathers-in-flight, as before 0.4, overlaps that variant's
                    window and slows it: by up to 20 % at 200 Mbit/s, sfsync_perbucket's
                    "1.06-1.20x DDP" of issue 24)
  sfsync_perbucket  GradientSync + sync.optimizer(AdamW, overlap_step=True) unsharded: each
                    bucket stepped as
                    soon as its all-reduce completes
  sfsync_adamw      GradientSync + a plain torch AdamW stepped after synchronize() (0.2)

and writes, under --out (default bench/results):
  sharded_bench.json   every run's record, the ratios, the load average
  sharded_bench.md     the table README shows
  sharded_bench.png    ms/window per variant vs link rate (python3-matplotlib)
Ratios (same run): sfsync_sharded / ddp_adamw (target <= 1.00), sfsync_sharded /
zero_ddp (<= 0.90), sfsync_perbucket / ddp_adamw (<= 0.97 at 1 and 10 Gbit/s).
A window is the slowest rank's wall time of forward, backward, synchronization
and optimizer step, median over the timed windows. Hosts are
scripts/cluster.sh namespaces (root); exit status 77 when clusters cannot run.
A benchmark, not a test: the machine is shared, the numbers are noisy.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_bench import PY, ROOT, bench_parser, plot_ms, run_grid, run_ranks  # noqa: E402

VARIANTS = ["ddp_adamw", "zero_ddp", "sfsync_sharded", "sfsync_perbucket", "sfsync_adamw"]


def parse_args(argv=None):
    p = bench_parser(__doc__, VARIANTS)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="sfsync and DDP")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", default=None, help="output file stem (default sharded_bench)")
    p.add_argument("--port", type=int, default=29700)
    p.add_argument("--smoke", action="store_true", help="loopback, 2 ranks, 3 windows, small")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="SF_TRACE of each sfsync variant: DIR/<variant>.rank<r>.json")
    p.add_argument("--gathers-in-flight", action="store_true",
                   help="leave sfsync_sharded's parameter gathers in flight when its window "
                        "ends (before 0.4: they then ran during the next variant's window)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.hosts, a.rates, a.windows, a.warmup, a.hidden = [2], ["loopback"], 3, 1, 512
    return a


# ---- the worker (one per rank) ------------------------------------------------


class Runner:
    def __init__(self, variant, base, a):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        sys.path.insert(0, os.path.join(ROOT, "samples", "python"))
        import ddp_common as common
        from sfsync import torch as sft
        self.variant, self.n = variant, a.micro_batches
        self.gathers_in_flight = a.gathers_in_flight
        self.model = common.clone_model(base)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.sync = self.ddp = None
        kw = dict(lr=1e-3, weight_decay=0.01)
        if variant.startswith("sfsync"):
            if a.trace:
                os.environ["SF_TRACE"] = os.path.join(os.path.abspath(a.trace),
                                                      variant + ".json")
            # Every parameter of the MLP gets a gradient: no used mask (the
            # sharded optimizer then steps per bucket).
            self.sync = sft.GradientSync(self.model, accumulation_steps=self.n,
                                         bucket_cap_mb=a.bucket_cap_mb,
                                         find_unused_parameters=False,
                                         shard_optimizer=variant == "sfsync_sharded",
                                         shard_layout="flat")
            os.environ.pop("SF_TRACE", None)
            self.module = self.model
            if variant == "sfsync_adamw":
                self.opt = torch.optim.AdamW(self.model.parameters(), **kw)
            else:
                # overlap_step: the per-bucket step these variants measure (the
                # loop reads no .grad before opt.step(); sharded: 1x the bytes)
                self.opt = self.sync.optimizer(torch.optim.AdamW, self.model.parameters(),
                                               overlap_step=True, **kw)
        else:
            self.ddp = DDP(self.model, bucket_cap_mb=a.bucket_cap_mb)
            self.module = self.ddp
            if variant == "zero_ddp":
                from torch.distributed.optim import ZeroRedundancyOptimizer
                self.opt = ZeroRedundancyOptimizer(self.ddp.parameters(),
                                                   optimizer_class=torch.optim.AdamW, **kw)
            else:
                self.opt = torch.optim.AdamW(self.ddp.parameters(), **kw)

    def _pass(self, x, y):
        (self.loss_fn(self.module(x), y) / self.n).backward()

    def run_window(self, batches):
        import contextlib
        if self.sync is not None:
            for x, y in batches:
                self._pass(x, y)
            assert self.sync.is_step()
        else:
            for i, (x, y) in enumerate(batches):
                with self.ddp.no_sync() if i < self.n - 1 else contextlib.nullcontext():
                    self._pass(x, y)
        self.opt.step()
        self.opt.zero_grad()
        if self.variant == "sfsync_sharded" and not self.gathers_in_flight:
            # Within its own window: the variants take turns window by window,
            # so a gather left in flight would overlap (and slow) the next
            # variant's window instead of this variant's next forward.
            self.opt.wait_parameters()

    def state_bytes(self):
        import torch
        opt = self.opt
        if hasattr(opt, "optim"):  # ZeroRedundancyOptimizer: its local optimizer
            opt = opt.optim
        return sum(v.numel() * v.element_size() for st in opt.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)

    def close(self):
        if self.sync is not None:
            self.sync.close()


def worker(a):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(ROOT, "samples", "python"))
    import ddp_common as common
    import sfsync
    from sfsync import shard
    torch.set_num_threads(1)
    rank, world = common.init_torch_distributed(1)
    base = common.make_mlp(a.features, a.hidden, a.classes, a.depth, 7)
    runners = [Runner(v, base, a) for v in a.variants]
    times = {r.variant: [] for r in runners}
    for w in range(a.warmup + a.windows):
        batches = [common.micro_batch(7, rank, w, m, a.batch_size, a.features, a.classes)
                   for m in range(a.micro_batches)]
        for r in runners:
            dist.barrier()
            t0 = time.perf_counter()
            r.run_window(batches)
            if w >= a.warmup:
                times[r.variant].append(time.perf_counter() - t0)
    results = []
    for r in runners:
        t = torch.tensor(times[r.variant], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = [x * 1e3 for x in t.tolist()]
        rec = {"variant": r.variant, "ms_per_window_median": round(statistics.median(ms), 3),
               "ms_per_window_min": round(min(ms), 3), "ms_per_window_max": round(max(ms), 3),
               "optimizer_state_bytes_rank0": r.state_bytes()}
        if r.sync is not None:
            st = shard.stats(r.sync.context)
            rec["stats"] = {k: st[k] for k in ("collectives_issued", "bytes_reduced",
                                               "reduce_scatters", "all_gathers",
                                               "bytes_gathered", "bucket_count",
                                               "windows_completed")}
        results.append(rec)
        r.close()
    if rank == 0:
        record = {"world_size": world, "micro_batches": a.micro_batches,
                  "gradient_bytes": common.gradient_bytes(base), "windows": a.windows,
                  "warmup": a.warmup, "torch": torch.__version__, "sfsync": sfsync.version(),
                  "results": results}
        print("JSON " + json.dumps(record, sort_keys=True), flush=True)
    common.shutdown()
    return 0


# ---- the driver --------------------------------------------------------------------


def run_one(a, n, rate):
    me = [PY, os.path.abspath(__file__), "--worker", "--windows", str(a.windows), "--warmup",
          str(a.warmup), "--micro-batches", str(a.micro_batches), "--batch-size",
          str(a.batch_size), "--features", str(a.features), "--hidden", str(a.hidden),
          "--depth", str(a.depth), "--classes", str(a.classes), "--bucket-cap-mb",
          str(a.bucket_cap_mb), "--variants"] + a.variants
    if a.trace:
        os.makedirs(a.trace, exist_ok=True)
        me += ["--trace", os.path.abspath(a.trace)]
    if a.gathers_in_flight:
        me.append("--gathers-in-flight")
    return run_ranks(a, n, rate, me, "sharded_bench")


def ratios(rec):
    ms = {r["variant"]: r["ms_per_window_median"] for r in rec["results"]}
    pairs = {"sharded_vs_ddp": ("sfsync_sharded", "ddp_adamw"),
             "sharded_vs_zero": ("sfsync_sharded", "zero_ddp"),
             "perbucket_vs_ddp": ("sfsync_perbucket", "ddp_adamw"),
             "adamw_vs_ddp": ("sfsync_adamw", "ddp_adamw")}
    return {k: round(ms[x] / ms[y], 3) for k, (x, y) in pairs.items() if x in ms and y in ms}


RATIO_COLS = [("sharded_vs_ddp", "sharded/DDP (<=1.00)"),
              ("sharded_vs_zero", "sharded/ZeRO (<=0.90)"),
              ("perbucket_vs_ddp", "per-bucket/DDP (<=0.97)"), ("adamw_vs_ddp", "0.2 sfsync/DDP")]


def table(records, variants):
    head = "| N | link | " + " | ".join(variants) + " | " + " | ".join(
        c for _, c in RATIO_COLS) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in records:
        ms = {r["variant"]: r["ms_per_window_median"] for r in rec["results"]}
        r = rec["ratios"]
        cells = ["%.0f" % ms[v] if v in ms else "-" for v in variants]
        lines.append("| %d | %s | %s | %s |" % (rec["hosts"], rec["rate"], " | ".join(cells),
                                               " | ".join("%.2f" % r[k] if k in r else "-"
                                                          for k, _ in RATIO_COLS)))
    state = {}
    for rec in records:
        for res in rec["results"]:
            state.setdefault((rec["hosts"], res["variant"]), res["optimizer_state_bytes_rank0"])
    lines.append("")
    lines.append("Optimizer state on rank 0 (bytes): " + "; ".join(
        "N=%d %s %d" % (n, v, b) for (n, v), b in sorted(state.items())))
    return "\n".join(lines)


def plot(records, variants, path):
    style = {"ddp_adamw": ("C1", "o", "-"), "zero_ddp": ("C3", "x", "-"),
             "sfsync_sharded": ("C0", "o", "-"), "sfsync_perbucket": ("C0", "s", "--"),
             "sfsync_adamw": ("C2", "^", ":")}
    plot_ms(records, variants, path, style, "%d hosts, AdamW, %d micro-batches per window")


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        return worker(a)

    def run(n, rate):
        rec = run_one(a, n, rate)
        rec["ratios"] = ratios(rec)
        rec["load"] = os.getloadavg()
        print("N=%d %-8s %s  %s  load %.1f" % (n, rate, " ".join(
            "%s=%.0f" % (r["variant"], r["ms_per_window_median"]) for r in rec["results"]),
            rec["ratios"], rec["load"][0]), flush=True)
        return [rec]

    _, rc = run_grid(a, "sharded_bench", run, lambda recs: table(recs, a.variants),
                     lambda recs, path: plot(recs, a.variants, path))
    return rc


if __name__ == "__main__":
    sys.exit(main())
