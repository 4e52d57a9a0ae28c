#!/usr/bin/python3
"""sfsync against torch 2.x's anchors (DDP, FSDP2, ZeRO), two models, with the limit.

    sudo /usr/bin/python3 bench/torch2_bench.py                  # the full grid
    sudo /usr/bin/python3 bench/torch2_bench.py --hosts 2 4 --rates 1gbit
    /usr/bin/python3 bench/torch2_bench.py --smoke                # loopback, 2 ranks, seconds

The driver is any Python; the ranks run pip's torch 2.x (--python, default
the project's venv /root/.cache/sfsync/venv-torch2/bin/python): FSDP2 exists
only there. The torch 1.13 anchors stay in bench/sharded_bench.py. For every
model (mlp: 2.4 M parameters, 8 tensors; transformer: 12 blocks, 148 tensors,
11.6 M parameters), host count N and link rate (scripts/cluster.sh hosts, or
loopback: N processes here), every rank runs this file as a worker with
every variant on the same model copy, data, micro-batches and optimizer
(AdamW lr 1e-3, weight decay 0.01, foreach=True unless said):

  compute_only       no collective: forward+backward of the N micro-batches on
                     a plain copy of the model, then AdamW over all of it
  compute_only_shard the same, AdamW over 1/W of the parameters (the sharded
                     variants' step)
  ddp_foreach        DDP, no_sync() around forward+backward of 1..N-1
  ddp_fused          the same, AdamW(fused=True) (CPU build permitting)
  fsdp2_reshard      fully_shard per block/Linear + root, reshard_after_forward=True,
                     set_requires_gradient_sync(False) on micro-batches 1..N-1
  fsdp2_keep         the same, reshard_after_forward=False, and set_reshard_after_backward(False)
                     on 1..N-1 (the parameters stay whole through the window: one gather)
  zero_ddp           DDP (no_sync() as above) + ZeroRedundancyOptimizer(AdamW)
  sfsync_sharded     GradientSync(shard_optimizer=True, flat) + sync.optimizer(AdamW,
                     overlap_step=True): reduce-scatter, per-bucket step, gather
                     overlapping the next forward (sfsync's sharded default
                     buckets: about 1/8 of the gradients each; DDP keeps 25
                     MiB unless --bucket-cap-mb sets both)
  sfsync_final       GradientSync + sync.optimizer(AdamW): every .grad final when
                     the last backward returns, then one step
  sfsync_perbucket   GradientSync + sync.optimizer(AdamW, overlap_step=True)

Timing: rounds; in each round every variant in turn runs a block of
--block consecutive windows (each after a barrier; the block's first window
is not timed: nothing of an earlier window of the same variant was in flight
before it), then waits for whatever it still has in flight (sfsync's
gathers) untimed. A window is the slowest rank's wall time of forward,
backward, synchronization and step; the median of the timed windows.

The limit columns: compute-only = the compute_only (or, for sharded
variants, compute_only_shard) window of the same run; wire bytes per rank
and window = what the variant's collectives carry through one rank's NIC
in the busier direction (ring algorithms: (W-1)/W of a reduce-scatter's or
all-gather's whole buffer, 2(W-1)/W of an all-reduce's; torch's Gloo
reduce-scatter is an all-reduce of the whole buffer: 2(W-1)/W, as its NIC
counters show; sfsync's Gloo reduce-scatter is a ring: (W-1)/W), counted from
sfsync's stats (bytes_reduced, bytes_gathered), DDP's buckets (its logging
data), and the torch.distributed calls FSDP2 and ZeRO issue (counted by
wrapping them); wire ms = those bytes at the link rate (none on loopback);
exposed = window - compute-only, also as a fraction of the wire time;
bound = the least exposed time of any schedule that communicates once per
window: the wire time less one micro-batch's forward+backward and the step
of the compute-only run (the last backward can hide the reductions, the next
forward the gathers, and nothing else can: the gradients are final only at
the last backward, and every forward needs the new parameters), also as
window bound = compute-only + bound, over DDP's window. On
the cluster each rank also reads its NIC's counters around every timed
window (nic_mb: the busier direction, headers included). Memory: for every
variant alone, before the timed rounds, glibc's bytes in use (mallinfo2:
every tensor and sfsync's own buffers) are read before it is built and
after every backward and step of 2 windows; the peak minus the start is its
per-rank memory for parameters + gradients + optimizer state (+ the
variant's buffers). Correctness: after the run every variant's whole
weights (FSDP2: full_tensor(); sfsync sharded: after its gathers) must
agree with ddp_foreach's within --tolerance (max abs difference; the
compute-only variants excluded: they never synchronize); a variant off by
more fails the run (--fault VARIANT gives VARIANT 1.5x the learning rate, to
see the check fail).

Writes, under --out (default bench/results): torch2_bench.json (every
record), torch2_bench.md (the tables README shows), torch2_bench.png (ms per
window vs link rate, python3-matplotlib); --smoke writes torch2_bench_smoke.*
and checks that every column was produced. Exit status 77 when clusters
cannot run here. A benchmark, not a test: the machine is shared, the numbers
are noisy.
"""
import argparse
import ctypes
import gc
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_bench import (RATES, ROOT, draw_panel, run_grid, run_ranks,  # noqa: E402
                           write_results)

TORCH2 = "/root/.cache/sfsync/venv-torch2/bin/python"
VARIANTS = ["compute_only", "compute_only_shard", "ddp_foreach", "ddp_fused", "fsdp2_reshard",
            "fsdp2_keep", "zero_ddp", "sfsync_sharded", "sfsync_final", "sfsync_perbucket"]
COMPUTE = ("compute_only", "compute_only_shard")
SHARDED = ("compute_only_shard", "fsdp2_reshard", "fsdp2_keep", "zero_ddp", "sfsync_sharded")
MODELS = ["mlp", "transformer"]
LR, WD = 1e-3, 0.01


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rates", nargs="+", default=["1gbit", "200mbit", "10gbit", "loopback"])
    p.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    p.add_argument("--variants", nargs="+", default=VARIANTS)
    p.add_argument("--rounds", type=int, default=5, help="rounds of blocks")
    p.add_argument("--block", type=int, default=3, help="windows per block (the first untimed)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="sfsync's and DDP's bucket cap (default: each its own: DDP 25 MiB, "
                        "sfsync 25 MiB unsharded and GradientSync's sharded rule, "
                        "sharded_bucket_cap_mb)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="max abs weight difference from ddp_foreach")
    p.add_argument("--fault", default=None, help="this variant gets 1.5x the learning rate")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="SF_TRACE of each sfsync variant: DIR/<model>-<variant>.rank<r>.json")
    p.add_argument("--python", default=TORCH2, help="the ranks' interpreter (torch 2.x)")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", default=None, help="output file stem (default torch2_bench)")
    p.add_argument("--port", type=int, default=29800)
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds per launch (every model; 200 Mbit/s, 2 hosts: over 900)")
    p.add_argument("--smoke", action="store_true",
                   help="loopback, 2 ranks, both models made small, 1 round of 2-window blocks")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no run: the records of these result files into one table and plot "
                        "(--name, default torch2_bench)")
    p.add_argument("--small", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rate", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        p.error("--variants: unknown %s (choose from %s)" % (", ".join(bad), " ".join(VARIANTS)))
    if "ddp_foreach" not in a.variants:
        p.error("--variants must include ddp_foreach (the reference of the check and ratios)")
    if a.fault is not None and a.fault not in a.variants:
        p.error("--fault: %r is not one of --variants" % a.fault)
    if a.block < 2 or a.rounds < 1:
        p.error("--block must be >= 2 and --rounds >= 1, got %d and %d" % (a.block, a.rounds))
    if a.smoke:
        a.hosts, a.rates, a.rounds, a.block, a.small = [2], ["loopback"], 1, 2, True
        a.micro_batches = 2
    return a


# ---- models and data (the worker imports torch) -------------------------------------


def make_model(kind, small, seed=7):
    import torch
    from torch import nn
    torch.manual_seed(seed)
    if kind == "mlp":
        hidden = 256 if small else 1024
        return nn.Sequential(nn.Linear(256, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                             nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                             nn.Linear(hidden, 10))
    d, ff, vocab = (64, 256, 512) if small else (256, 1024, 4096)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, ff), nn.Linear(ff, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // 4)
            mask = torch.ones(t, t, dtype=torch.bool).triu(1)
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))

    class Transformer(nn.Module):
        """12 blocks of 12 tensors + embedding, final norm (2), head: 148 tensors."""

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(12))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            x = self.emb(idx)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x)).flatten(0, 1)

    return Transformer()


def batch_of(kind, small, rank, window, micro):
    import torch
    g = torch.Generator().manual_seed(((7 * 1000003 + rank) * 10007 + window) * 101 + micro)
    if kind == "mlp":
        return torch.randn(8, 256, generator=g), torch.randint(0, 10, (8,), generator=g)
    vocab, t = (512, 8) if small else (4096, 16)
    idx = torch.randint(0, vocab, (2, t + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].reshape(-1)


def fsdp_units(kind, model):
    """FSDP2's units: every Linear of the MLP, every block of the transformer
    (the root takes the rest)."""
    if kind == "mlp":
        return [m for m in model if hasattr(m, "weight")]
    return list(model.blocks)


# ---- counting what torch's collectives carry ---------------------------------------


class Wire:
    """Per-rank bytes through the NIC (busier direction) of the collectives
    that FSDP2 and ZeRO issue through torch.distributed's Python functions,
    counted by wrapping them (ring algorithms: (W-1)/W of the whole buffer)."""

    def __init__(self, dist, world):
        self.world, self.bytes, self.calls, self.dist, self.saved = world, 0, {}, dist, {}
        f = (world - 1) / world
        out = lambda a, k: _nbytes(_arg(a, k, 0, ("output_tensor", "output")))  # noqa: E731
        inp = lambda a, k: _nbytes(_arg(a, k, 1, ("input_tensor", "input")))  # noqa: E731
        # ProcessGroupGloo reduce-scatters by an all-reduce of the whole input
        # (measured: fsdp2_keep's NIC bytes per window are 1.50 x the
        # parameters at W=2 and 2.25 x at W=4, one gather + one reduce-scatter
        # counted as (W-1)/W each would be 1.00 x and 1.50 x): 2(W-1)/W.
        for name, size, k in (("all_gather_into_tensor", out, 1), ("all_gather_single", out, 1),
                              ("reduce_scatter_tensor", inp, 2), ("reduce_scatter_single", inp, 2),
                              ("broadcast", lambda a, k: _nbytes(_arg(a, k, 0, ("tensor",))), 1)):
            orig = getattr(dist, name, None)
            if orig is None:
                continue

            def wrapped(*args, _orig=orig, _name=name, _size=size, _k=k, **kw):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                self.bytes += _k * f * _size(args, kw)
                return _orig(*args, **kw)

            self.saved[name] = orig
            setattr(dist, name, wrapped)

    def restore(self):
        for name, orig in self.saved.items():
            setattr(self.dist, name, orig)


def _arg(args, kw, i, names):
    if len(args) > i:
        return args[i]
    return next(kw[n] for n in names if n in kw)


def _nbytes(t):
    return t.numel() * t.element_size()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


_libc = ctypes.CDLL(None)
_libc.mallinfo2.restype = _MallInfo2


def heap_in_use():
    """glibc's bytes in use: arenas' allocated chunks + mmapped blocks (all threads)."""
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd


def nic_bytes():
    """(tx, rx) of this host's eth0 inside a scripts/cluster.sh namespace, else None."""
    if not os.environ.get("SF_CLUSTER_ID"):
        return None
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f, \
            open("/sys/class/net/eth0/statistics/rx_bytes") as g:
        return int(f.read()), int(g.read())


# ---- the variants --------------------------------------------------------------------


class Runner:
    def __init__(self, variant, base, a, world, rank):
        import contextlib
        import torch
        import torch.distributed as dist
        self.variant, self.n, self.world, self.kind = variant, a.micro_batches, world, a.model
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.model = _clone(base)
        self.sync = self.ddp = self.fsdp = None
        self.nullctx = contextlib.nullcontext
        lr = LR * (1.5 if a.fault == variant else 1.0)
        kw = dict(lr=lr, weight_decay=WD, foreach=True)
        self.module = self.model
        if variant.startswith("compute_only"):
            params = list(self.model.parameters())
            if variant == "compute_only_shard":
                # 1/W of the elements, as whole tensors (no copy): greedy by size.
                total, take, got = sum(p.numel() for p in params), [], 0
                for p in sorted(params, key=lambda p: -p.numel()):
                    if got + p.numel() <= total / world * 1.02 or not take:
                        take.append(p)
                        got += p.numel()
                self.step_elems = got
                params = take
            self.opt = torch.optim.AdamW(params, **kw)
        elif variant.startswith("sfsync"):
            from sfsync import torch as sft
            if a.trace:
                os.environ["SF_TRACE"] = os.path.join(a.trace, "%s-%s.json" % (a.model, variant))
            self.sync = sft.GradientSync(self.model, accumulation_steps=self.n,
                                         bucket_cap_mb=a.bucket_cap_mb,
                                         find_unused_parameters=False,
                                         shard_optimizer=variant == "sfsync_sharded",
                                         shard_layout="flat")
            os.environ.pop("SF_TRACE", None)
            self.opt = self.sync.optimizer(torch.optim.AdamW, self.model.parameters(),
                                           overlap_step=variant != "sfsync_final", **kw)
        elif variant.startswith("fsdp2"):
            from torch.distributed.fsdp import fully_shard
            keep = variant == "fsdp2_keep"
            for m in fsdp_units(self.kind, self.model):
                fully_shard(m, reshard_after_forward=not keep)
            self.fsdp = fully_shard(self.model, reshard_after_forward=not keep)
            self.opt = torch.optim.AdamW(self.model.parameters(), **kw)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.ddp = DDP(self.model, bucket_cap_mb=a.bucket_cap_mb or 25.0)
            self.module = self.ddp
            if variant == "zero_ddp":
                from torch.distributed.optim import ZeroRedundancyOptimizer
                self.opt = ZeroRedundancyOptimizer(self.ddp.parameters(),
                                                   optimizer_class=torch.optim.AdamW, **kw)
            elif variant == "ddp_fused":
                self.opt = torch.optim.AdamW(self.ddp.parameters(), **dict(kw, foreach=None,
                                                                              fused=True))
            else:
                self.opt = torch.optim.AdamW(self.ddp.parameters(), **kw)
        self.dist = dist

    def run_window(self, batches, probe=None):
        n = self.n
        for i, (x, y) in enumerate(batches):
            last = i == n - 1
            if self.fsdp is not None:
                self.fsdp.set_requires_gradient_sync(last)
                if self.variant == "fsdp2_keep":
                    # the parameters stay whole through the window: one gather
                    self.fsdp.set_reshard_after_backward(last)
            ctx = self.ddp.no_sync() if self.ddp is not None and not last else self.nullctx()
            with ctx:
                (self.loss_fn(self.module(x), y) / n).backward()
            if probe:
                probe()
        if self.sync is not None:
            assert self.sync.is_step()
        t_fb = time.perf_counter()
        self.opt.step()
        if probe:
            probe()
        self.opt.zero_grad()
        return t_fb

    def settle(self):
        """Wait for what this variant still has in flight (sfsync's gathers)."""
        if self.sync is not None and hasattr(self.opt, "wait_parameters"):
            self.opt.wait_parameters()

    def full_weights(self):
        import torch
        self.settle()
        out = []
        for p in self.model.parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            out.append(t.reshape(-1).clone())
        return torch.cat(out)

    def wire_bytes_per_window(self, windows, wire):
        """Per-rank bytes in the busier direction per window (see the module docstring)."""
        f = (self.world - 1) / self.world
        if self.variant in COMPUTE:
            return 0.0
        if self.sync is not None:
            st = self.stats()
            if st["windows_completed"] != windows:
                raise RuntimeError("%s: %d windows completed, %d run" % (
                    self.variant, st["windows_completed"], windows))
            if self.variant == "sfsync_sharded":
                return f * (st["bytes_reduced"] + st["bytes_gathered"]) / windows
            return 2 * f * st["bytes_reduced"] / windows
        if self.fsdp is not None or self.variant == "zero_ddp":
            b = wire[self.variant]
        else:
            b = 0
        if self.ddp is not None:
            b += 2 * f * self.ddp_bucket_bytes() * windows
        return b / windows

    def ddp_bucket_bytes(self):
        data = self.ddp._get_ddp_logging_data()
        sizes = data.get("bucket_sizes")
        if not sizes:
            raise RuntimeError("%s: DDP's logging data has no bucket_sizes: %s" % (
                self.variant, sorted(data)))
        return sum(int(s) for s in str(sizes).split(", "))

    def stats(self):
        from sfsync import shard
        return shard.stats(self.sync.context)

    def close(self):
        self.settle()
        if self.sync is not None:
            self.sync.close()


def _max_all(dist, x):
    import torch
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return round(t.item(), 3)


def _clone(model):
    import copy
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    return twin


def worker(a):
    """Every model of --models in turn on this rank; rank 0 prints one JSON line
    with a record per model (one launch: each torch 2.x import costs seconds)."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "samples", "python"))
    import ddp_common as common
    torch.set_num_threads(1)
    rank, world = common.init_torch_distributed(1)
    records = []
    for model in a.models:
        a.model = model
        records.append(run_model(a, rank, world))
    if rank == 0:
        print("JSON " + json.dumps({"records": records}, sort_keys=True), flush=True)
    common.shutdown()
    return 0


def run_model(a, rank, world):
    import torch
    import torch.distributed as dist
    import ddp_common as common
    import sfsync
    base = make_model(a.model, a.small)
    n = a.micro_batches
    variants = list(a.variants)
    if "ddp_fused" in variants:
        try:
            probe = torch.nn.Linear(2, 2)
            probe(torch.ones(1, 2)).sum().backward()
            torch.optim.AdamW(probe.parameters(), fused=True).step()
        except (RuntimeError, TypeError) as e:
            print("torch2_bench: no fused AdamW on this CPU build (%s): ddp_fused left out" % e,
                  file=sys.stderr)
            variants.remove("ddp_fused")
    data = {}

    def batches(w):
        if w not in data:
            data[w] = [batch_of(a.model, a.small, rank, w, m) for m in range(n)]
        return data[w]

    # Memory: each variant alone, 2 windows, glibc's bytes in use.
    mem = {}
    for v in variants:
        for w in (0, 1):
            batches(1000 + w)
        gc.collect()
        dist.barrier()
        start = heap_in_use()
        peak = [start]
        r = Runner(v, base, a, world, rank)

        def probe():
            peak[0] = max(peak[0], heap_in_use())

        for w in (0, 1):
            r.run_window(batches(1000 + w), probe)
        r.close()
        mem[v] = peak[0] - start
        del r, probe
        gc.collect()
    data.clear()

    wire = {}
    counter = Wire(dist, world)
    runners = []
    for v in variants:
        runners.append(Runner(v, base, a, world, rank))
        wire[v] = 0  # construction's broadcasts are not windows
    times = {r.variant: [] for r in runners}
    fb = {r.variant: [] for r in runners}  # forward+backward part of each timed window
    nic = {r.variant: [] for r in runners}
    windows = {r.variant: 0 for r in runners}
    w = 0
    for rnd in range(a.rounds):
        for r in runners:
            before = counter.bytes
            for k in range(a.block):
                b = batches(w + k)
                dist.barrier()
                n0 = nic_bytes()
                t0 = time.perf_counter()
                t_fb = r.run_window(b)
                t1 = time.perf_counter()
                n1 = nic_bytes()
                if k > 0:
                    times[r.variant].append(t1 - t0)
                    fb[r.variant].append(t_fb - t0)
                    if n0 is not None:
                        nic[r.variant].append(max(n1[0] - n0[0], n1[1] - n0[1]))
            windows[r.variant] += a.block
            wire[r.variant] += counter.bytes - before
            r.settle()
        w += a.block
        data.clear()
    # Correctness: every synchronized variant's weights against ddp_foreach's.
    ref = next(r for r in runners if r.variant == "ddp_foreach").full_weights()
    results = []
    for r in runners:
        t = torch.tensor(times[r.variant], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = [x * 1e3 for x in t.tolist()]
        m = torch.tensor([float(mem[r.variant])], dtype=torch.float64)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        rec = {"variant": r.variant, "ms_per_window_median": round(statistics.median(ms), 3),
               "ms_per_window_min": round(min(ms), 3), "ms_per_window_max": round(max(ms), 3),
               "timed_windows": len(ms), "windows_run": windows[r.variant],
               # this rank's (each rank's own median, the largest): forward+backward
               # up to the last backward's return, and the step (with zero_grad)
               "fwd_bwd_ms_median_max_rank": _max_all(dist, statistics.median(fb[r.variant]) * 1e3),
               "step_ms_median_max_rank": _max_all(dist, statistics.median(
                   [x - y for x, y in zip(times[r.variant], fb[r.variant])]) * 1e3),
               "memory_bytes_max_rank": int(m.item()),
               "wire_bytes_per_rank_window": round(r.wire_bytes_per_window(windows[r.variant],
                                                                           wire), 1)}
        if nic[r.variant]:
            q = torch.tensor([statistics.median(nic[r.variant])], dtype=torch.float64)
            dist.all_reduce(q, op=dist.ReduceOp.MAX)
            rec["nic_bytes_per_window_median_max_rank"] = int(q.item())
        if r.variant in COMPUTE:
            rec["weights_max_abs_diff_vs_ddp"] = None
            if r.variant == "compute_only_shard":
                rec["stepped_elements"] = r.step_elems
        else:
            d = torch.tensor([(r.full_weights() - ref).abs().max().item()], dtype=torch.float64)
            dist.all_reduce(d, op=dist.ReduceOp.MAX)
            rec["weights_max_abs_diff_vs_ddp"] = d.item()
        if r.sync is not None:
            st = r.stats()
            rec["stats"] = {k: st[k] for k in ("collectives_issued", "bytes_reduced",
                                               "reduce_scatters", "all_gathers",
                                               "bytes_gathered", "bucket_count",
                                               "windows_completed")}
        if r.ddp is not None:
            rec["ddp_bucket_bytes"] = r.ddp_bucket_bytes()
        results.append(rec)
    for r in runners:
        r.close()
    counter.restore()
    return {"world_size": world, "micro_batches": n, "model": a.model, "small": a.small,
            "parameters": sum(p.numel() for p in base.parameters()),
            "tensors": len(list(base.parameters())),
            "gradient_bytes": common.gradient_bytes(base), "rounds": a.rounds,
            "block": a.block, "torch": torch.__version__, "sfsync": sfsync.version(),
            "collective_calls": counter.calls, "tolerance": a.tolerance, "bucket_cap_mb": a.bucket_cap_mb,
            "results": results, "load_worker_end": os.getloadavg()}


# ---- the driver ----------------------------------------------------------------------


def rate_bytes_per_s(rate):
    r = rate.lower()
    for suffix, mul in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if r.endswith(suffix):
            return float(r[:-len(suffix)]) * mul / 8
    return None


def res_of(rec, variant):
    return next((r for r in rec["results"] if r["variant"] == variant), None)


def derive(rec):
    """The limit columns and the ratios of one record (in place); returns the
    list of correctness failures."""
    ms = {r["variant"]: r["ms_per_window_median"] for r in rec["results"]}
    bps = rate_bytes_per_s(rec["rate"])
    for r in rec["results"]:
        v = r["variant"]
        comp = "compute_only_shard" if v in SHARDED else "compute_only"
        r["compute_only_ms"] = ms.get(comp)
        r["wire_ms"] = (round(r["wire_bytes_per_rank_window"] / bps * 1e3, 3)
                        if bps and v not in COMPUTE else None)
        r["exposed_ms"] = (round(r["ms_per_window_median"] - ms[comp], 3)
                           if comp in ms and v not in COMPUTE else None)
        r["exposed_over_wire"] = (round(r["exposed_ms"] / r["wire_ms"], 3)
                                  if r["wire_ms"] and r["exposed_ms"] is not None else None)
        r["vs_ddp"] = round(r["ms_per_window_median"] / ms["ddp_foreach"], 3)
        # The least any schedule that communicates once per window can
        # expose: its wire time less what it can overlap, which is one
        # micro-batch's forward+backward (the last backward's reduction, the
        # next forward's gather) and the step (of the compute-only run).
        c = res_of(rec, comp)
        r["exposed_bound_ms"] = r["exposed_bound_over_wire"] = r["window_bound_ms"] = None
        if c is not None and r["wire_ms"] is not None and c.get("fwd_bwd_ms_median_max_rank"):
            hide = c["fwd_bwd_ms_median_max_rank"] / rec["micro_batches"] + \
                c["step_ms_median_max_rank"]
            r["exposed_bound_ms"] = round(max(0.0, r["wire_ms"] - hide), 3)
            r["exposed_bound_over_wire"] = round(r["exposed_bound_ms"] / r["wire_ms"], 3)
            r["window_bound_ms"] = round(ms[comp] + r["exposed_bound_ms"], 3)
    fsdp = [ms[v] for v in ("fsdp2_reshard", "fsdp2_keep") if v in ms]
    rat = {}
    if "sfsync_sharded" in ms:
        if fsdp:
            rat["sharded_vs_best_fsdp2"] = ms["sfsync_sharded"] / min(fsdp)
        rat["sharded_vs_ddp"] = ms["sfsync_sharded"] / ms["ddp_foreach"]
        if "zero_ddp" in ms:
            rat["sharded_vs_zero"] = ms["sfsync_sharded"] / ms["zero_ddp"]
    for v in ("sfsync_perbucket", "sfsync_final"):
        if v in ms:
            rat[v.split("_")[1] + "_vs_ddp"] = ms[v] / ms["ddp_foreach"]
    if "ddp_fused" in ms:
        rat["best_ddp_vs_ddp_foreach"] = min(ms["ddp_fused"], ms["ddp_foreach"]) / ms["ddp_foreach"]
    res = {r["variant"]: r for r in rec["results"]}
    sh = res.get("sfsync_sharded")
    if sh is not None and sh["exposed_over_wire"] is not None:
        rat["sharded_exposed_over_wire"] = sh["exposed_over_wire"]
    if sh is not None and sh.get("exposed_bound_over_wire") is not None:
        rat["sharded_exposed_bound_over_wire"] = sh["exposed_bound_over_wire"]
        rat["sharded_bound_vs_ddp"] = sh["window_bound_ms"] / ms["ddp_foreach"]
    for v in ("fsdp2_reshard", "fsdp2_keep"):
        if sh is not None and v in res:
            rat["sharded_memory_vs_" + v] = sh["memory_bytes_max_rank"] / \
                res[v]["memory_bytes_max_rank"]
    rec["ratios"] = {k: round(x, 3) for k, x in rat.items()}
    fails = []
    for r in rec["results"]:
        d = r["weights_max_abs_diff_vs_ddp"]
        r["weights_agree"] = None if d is None else bool(d <= rec["tolerance"])
        if d is not None and not d <= rec["tolerance"]:
            fails.append("%s N=%d %s %s: weights %.3g off DDP's (tolerance %g)" % (
                rec["model"], rec["hosts"], link_of(rec), r["variant"], d, rec["tolerance"]))
    return fails


COLUMNS = [("ms_per_window_median", "ms/window", "%.0f"), ("vs_ddp", "x DDP", "%.2f"),
           ("fwd_bwd_ms_median_max_rank", "fwd+bwd ms", "%.0f"),
           ("step_ms_median_max_rank", "step ms", "%.0f"),
           ("compute_only_ms", "compute-only ms", "%.0f"),
           ("wire_bytes_per_rank_window", "wire MB/rank", "%.2f"), ("wire_ms", "wire ms", "%.0f"),
           ("exposed_ms", "exposed ms", "%.0f"), ("exposed_over_wire", "exposed/wire", "%.2f"),
           ("exposed_bound_over_wire", "bound exposed/wire", "%.2f"),
           ("memory_bytes_max_rank", "memory MB/rank", "%.1f"),
           ("weights_max_abs_diff_vs_ddp", "max abs diff vs DDP", "%.1e")]
RATIO_COLS = [("sharded_vs_best_fsdp2", "sharded/best FSDP2 (<=0.85)"),
              ("sharded_vs_ddp", "sharded/DDP (<=0.80)"),
              ("perbucket_vs_ddp", "per-bucket/DDP (<=1.00)"), ("final_vs_ddp", "final-grad/DDP"),
              ("sharded_vs_zero", "sharded/ZeRO"),
              ("sharded_bound_vs_ddp", "bound sharded/DDP"),
              ("sharded_exposed_over_wire", "sharded exposed/wire (<=0.5)"),
              ("sharded_exposed_bound_over_wire", "bound exposed/wire"),
              ("sharded_memory_vs_fsdp2_keep", "sharded mem/FSDP2 keep (<=1)"),
              ("sharded_memory_vs_fsdp2_reshard", "sharded mem/FSDP2 reshard")]


def cell(key, fmt, r):
    x = r.get(key)
    if x is None:
        return "-"
    if key in ("wire_bytes_per_rank_window", "memory_bytes_max_rank"):
        x = x / 1e6
    return fmt % x


def link_of(rec):
    """The link column: the rate, and the bucket cap when --bucket-cap-mb set both."""
    cap = rec.get("bucket_cap_mb")
    return rec["rate"] if cap is None else "%s, cap %g MiB" % (rec["rate"], cap)


def ms_table(records):
    """ms per window (median, slowest rank) of every variant, a row per run."""
    variants = [v for v in VARIANTS if any(x["variant"] == v for r in records
                                           for x in r["results"])]
    head = "| model | N | link | " + " | ".join(variants) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in records:
        ms = {r["variant"]: r["ms_per_window_median"] for r in rec["results"]}
        lines.append("| %s | %d | %s | %s |" % (rec["model"], rec["hosts"], link_of(rec), " | ".join(
            "%.0f" % ms[v] if v in ms else "-" for v in variants)))
    return "\n".join(lines)


def tables(records):
    head = "| model | N | link | " + " | ".join(c for _, c in RATIO_COLS) + " | load |"
    lines = [ms_table(records), ""]
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in records:
        lines.append("| %s | %d | %s | %s | %.1f |" % (
            rec["model"], rec["hosts"], link_of(rec), " | ".join(
                "%.2f" % rec["ratios"][k] if k in rec["ratios"] else "-" for k, _ in RATIO_COLS),
            rec["load"][0]))
    lines.append("")
    head = "| model | N | link | variant | " + " | ".join(c for _, c, _ in COLUMNS) + " |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in records:
        for r in rec["results"]:
            lines.append("| %s | %d | %s | %s | %s |" % (
                rec["model"], rec["hosts"], link_of(rec), r["variant"],
                " | ".join(cell(k, f, r) for k, _, f in COLUMNS)))
    return "\n".join(lines)


def plot(records, variants, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # One line per variant at the default caps (a --bucket-cap-mb run is in
    # the tables only), unless every record set a cap.
    default = [r for r in records if r.get("bucket_cap_mb") is None]
    records = default or records
    keys = sorted({(r["model"], r["hosts"]) for r in records})
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.5), squeeze=False)
    order = [x for x in RATES[::-1] + ["loopback"] if any(r["rate"] == x for r in records)]
    style = {"compute_only": ("k", ".", ":"), "compute_only_shard": ("0.5", ".", ":"),
             "ddp_foreach": ("C1", "o", "-"), "ddp_fused": ("C1", "s", "--"),
             "fsdp2_reshard": ("C3", "x", "-"), "fsdp2_keep": ("C3", "+", "--"),
             "zero_ddp": ("C4", "v", "-"), "sfsync_sharded": ("C0", "o", "-"),
             "sfsync_final": ("C2", "^", ":"), "sfsync_perbucket": ("C0", "s", "--")}
    for ax, (model, n) in zip(axes[0], keys):
        recs = {r["rate"]: r for r in records if r["hosts"] == n and r["model"] == model}
        draw_panel(ax, recs, variants, order, style, "%s, %d hosts, AdamW, %d micro-batches"
                   % (model, n, records[0]["micro_batches"]))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def smoke_check(records, variants):
    """--smoke: every column of every variant produced, with values that follow
    from the model (bytes from the collectives issued)."""
    errs = []
    for rec in records:
        got = {r["variant"] for r in rec["results"]}
        missing = [v for v in variants if v not in got and v != "ddp_fused"]
        if missing:
            errs.append("%s: no result for %s" % (rec["model"], ", ".join(missing)))
        w, g = rec["world_size"], rec["gradient_bytes"]
        f = (w - 1) / w
        for r in rec["results"]:
            v = r["variant"]
            empty_ok = set()
            if v in COMPUTE:
                empty_ok |= {"wire_ms", "exposed_ms", "exposed_over_wire",
                             "exposed_bound_over_wire", "weights_max_abs_diff_vs_ddp"}
            if rec["rate"] == "loopback":  # no link rate to divide by
                empty_ok |= {"wire_ms", "exposed_over_wire", "exposed_bound_over_wire"}
            for k, _, _ in COLUMNS:
                if k not in r:
                    errs.append("%s %s: column %s missing" % (rec["model"], v, k))
                elif r[k] is None and k not in empty_ok:
                    errs.append("%s %s: column %s empty" % (rec["model"], v, k))
            if r["timed_windows"] != rec["rounds"] * (rec["block"] - 1):
                errs.append("%s %s: %d timed windows" % (rec["model"], v, r["timed_windows"]))
            if v not in COMPUTE and r["memory_bytes_max_rank"] <= 0:
                errs.append("%s %s: memory %d" % (rec["model"], v, r["memory_bytes_max_rank"]))
            want = {"ddp_foreach": 2 * f * g, "ddp_fused": 2 * f * g, "sfsync_final": 2 * f * g,
                    "sfsync_perbucket": 2 * f * g, "sfsync_sharded": 2 * f * g,
                    "compute_only": 0, "compute_only_shard": 0}.get(v)
            b = r["wire_bytes_per_rank_window"]
            if want is not None and abs(b - want) > 0.01 * max(want, 1):
                errs.append("%s %s: %.0f wire bytes per window, want %.0f" % (
                    rec["model"], v, b, want))
            if v.startswith("fsdp2") or v == "zero_ddp":
                # FSDP2 gathers the parameters in forward (and backward once
                # resharded) and reduce-scatters once: at least 2 x f x g.
                if b < 2 * f * g * 0.99:
                    errs.append("%s %s: %.0f wire bytes per window, want >= %.0f" % (
                        rec["model"], v, b, 2 * f * g))
    return errs


def merge(a):
    docs = []
    for path in a.merge:
        with open(path) as f:
            docs.append(json.load(f))
    records = [r for d in docs for r in d["records"]]
    fails = [f for r in records for f in derive(r)]
    variants = [v for v in VARIANTS if any(x["variant"] == v for r in records
                                           for x in r["results"])]
    order = {(m, n, rate): i for i, (m, n, rate) in enumerate(
        (m, n, rate) for m in MODELS for n in (2, 4, 8) for rate in RATES + ["loopback"])}
    records.sort(key=lambda r: order.get((r["model"], r["hosts"], r["rate"]), 99))
    sources = {}
    for p, d in zip(a.merge, docs):
        if "merged_from" in d:  # a merged file: its runs
            sources.update(d["merged_from"])
        else:
            sources[os.path.basename(p)] = {k: d[k] for k in ("command", "wall_s", "load_before",
                                                               "load_after")}
    doc = {"merged_from": sources,
           "wall_s": round(sum(d["wall_s"] for d in docs), 1), "records": records,
           "check_failures": fails}
    name = a.name or "torch2_bench"
    os.makedirs(a.out, exist_ok=True)
    write_results(a.out, name, doc, tables(records), lambda path: plot(records, variants, path),
                  "torch2_bench")
    print("torch2_bench: merged %d records into %s/%s.{json,md,png}; the runs took %.0f s" % (
        len(records), a.out, name, doc["wall_s"]))
    return 0


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    if a.merge:
        return merge(a)
    fails = []

    def run(n, rate):
        argv = [a.python, os.path.abspath(__file__), "--worker", "--rate", rate,
                "--rounds", str(a.rounds), "--block", str(a.block),
                "--micro-batches", str(a.micro_batches), "--tolerance", str(a.tolerance),
                "--models"] + a.models + ["--variants"] + a.variants
        if a.bucket_cap_mb is not None:
            argv += ["--bucket-cap-mb", str(a.bucket_cap_mb)]
        if a.small:
            argv.append("--small")
        if a.fault:
            argv += ["--fault", a.fault]
        if a.trace:
            os.makedirs(a.trace, exist_ok=True)
            argv += ["--trace", os.path.abspath(a.trace)]
        load_start = os.getloadavg()
        out = run_ranks(a, n, rate, argv, "torch2_bench")
        for rec in out["records"]:
            rec.update(hosts=n, rate=rate, run_s=out["run_s"], load_start=load_start,
                       load=os.getloadavg())
            fails.extend(derive(rec))
            print("%s N=%d %-8s %s  %s  load %.1f -> %.1f  %.0f s" % (
                rec["model"], n, rate, " ".join(
                    "%s=%.0f" % (r["variant"], r["ms_per_window_median"])
                    for r in rec["results"]),
                rec["ratios"], load_start[0], rec["load"][0], out["run_s"]), flush=True)
        return out["records"]

    records, rc = run_grid(a, "torch2_bench", run, tables,
                           lambda recs, path: plot(recs, a.variants, path),
                           extra={"check_failures": fails})
    if rc:
        return rc
    for e in fails:
        print("torch2_bench: CHECK FAIL " + e, file=sys.stderr)
    errs = smoke_check(records, a.variants) if a.smoke else []
    for e in errs:
        print("torch2_bench: SMOKE FAIL " + e, file=sys.stderr)
    if fails or errs:
        return 1
    print("torch2_bench: every variant's weights agree with DDP's (tolerance %g)" % a.tolerance)
    return 0


if __name__ == "__main__":
    sys.exit(main())
