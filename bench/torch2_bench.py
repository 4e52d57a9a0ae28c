#!/usr/bin/python3
"""sfsync against torch 2.x's anchors (DDP, FSDP2, ZeRO), two models, with the limit.

    sudo /usr/bin/python3 bench/torch2_bench.py                  # the full grid
    sudo /usr/bin/python3 bench/torch2_bench.py --hosts 2 4 --rates 1gbit
    /usr/bin/python3 bench/torch2_bench.py --smoke                # loopback, 2 ranks, seconds
    sudo /usr/bin/python3 bench/torch2_bench.py --grid           # issue 35's grid (GRID below)
    /usr/bin/python3 bench/torch2_bench.py --grid --estimate      # its plan and wall-time estimate
    sudo /usr/bin/python3 bench/torch2_bench.py --grid fast      # issue 46's rows (FAST_GRID)

Since issue 35 (docs/speed.md, "The rules since issue 35", is the reference;
where the text below differs, it wins): DDP variants use torch's default
caps (+ ddp_fused_cap25, ddp_fused_capsf), gradient_as_bucket_view, fused
AdamW (all but ddp_foreach), ddp_overlap is DDP._register_fused_optim;
fsdp2_keep_ring reduce-scatters at ring bytes through
set_custom_reduce_scatter; sfsync_sharded_final is the default sharded mode
where user code reads .grad (the gradient gather), sfsync_sharded_owned the
default where sfsync owns every reader (the HF Trainer's and Lightning's
integrations: no gather; whole_gradients=False);
blocks are --windows back-to-back windows (no barrier) over --rounds runs,
with bootstrap intervals; ranks are pinned to cores.

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
  sfsync_sharded_final  GradientSync(shard_optimizer=True, flat) + sync.optimizer(AdamW):
                     every .grad whole when the last backward returns (the
                     gradient gather), then one step
  sfsync_sharded_owned  the same with whole_gradients=False (what the HF
                     Trainer's and Lightning's integrations choose when
                     nothing but sfsync reads .grad): no gradient gather
  sfsync_final       GradientSync + sync.optimizer(AdamW): every .grad final when
                     the last backward returns, then one step
  sfsync_perbucket   GradientSync + sync.optimizer(AdamW, overlap_step=True)

Half the bytes (issue 46, item 3; opt-in: --variants, --smoke and --grid
fast run them; each judged against the float32 run, ddp_foreach):

  sfsync_bf16_perbucket  sfsync_perbucket with wire_dtype="bf16" (sfsync's
                     16-bit wire: float32 partial sums, bf16 on the wire),
                     with ddp_bf16_hook's cap: the pair compared on the
                     same buckets (at the default 25 MiB the transformer has
                     3, and its last one's wire time shows at 1 Gbit/s)
  sfsync_bf16_sharded    sfsync_sharded with wire_dtype="bf16"; sharded
                     buckets travel in their own dtype (include/sfsync.h,
                     "Sharded windows"): its bytes and error show float32's
                     (gradient_wire_bytes_per_element says which: 4 or 2)
  ddp_bf16_hook      DDP (ddp_fused_capsf's cap: the DDP best in most of
                     issue 35's rows) + register_comm_hook(bf16_compress_hook)
  fsdp2_bf16_reduce  fully_shard as fsdp2_reshard's units, with
                     MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) and
                     reshard_after_forward left to torch (None: True for the
                     units, False for the root)

Timing: rounds; in each round every variant in turn runs a block of
--block consecutive windows (each after a barrier; the block's first window
is not timed: nothing of an earlier window of the same variant was in flight
before it), then waits for whatever it still has in flight (sfsync's
gathers) untimed. A window is the slowest rank's wall time of forward,
backward, synchronization and step; the median of the timed windows.

CPU (issue 46): around the same timed windows, at the same instants as the
wall clock, each rank reads its process's user+sys CPU time
(getrusage(RUSAGE_SELF): the kernel's accounting of every thread of the
process: the training thread, torch's and Gloo's threads, sfsync's lanes;
the kernel's own network work counts where it runs in a rank's context,
not in ksoftirqd). A window's CPU-ms per rank is the mean over the ranks
(what a rank's cores pay); cpu_ms_per_window_median is the median of the
timed windows, with the same bootstrap interval as the wall time, and
ratios against the row's best DDP (best by wall time).

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
see the check fail). The update's error against that float32 run, for every
synchronized variant: update_rel_err_vs_fp32 = the largest |w - w_fp32|
over the float32 update's largest |w_fp32 - w0| (w0: the initial weights;
after every window the bench ran: the memory phase's and every round's),
update_rel_l2_err_vs_fp32 = ||w - w_fp32|| / ||w_fp32 - w0||, and
update_rel_p999_err_vs_fp32 = the 99.9th percentile of |w - w_fp32| over
the same largest update (all weights but the 0.1 % farthest off). The 16-bit
variants are checked on the first against --tolerance-16 instead (AdamW
moves a weight whose gradient is near zero by ~lr whatever the sign, so
one weight can be far off where the whole is close; fused against foreach
AdamW alone gives 1e-5 .. 1e-2 on it).

Writes, under --out (default bench/results): torch2_bench.json (every
record), torch2_bench.md (the tables docs/speed.md shows),
torch2_bench_<model>.png (ms per window vs link rate, and below it the
CPU-ms per window per rank, python3-matplotlib);
--grid writes one torch2_grid_<model>_<hosts>_<rate>.{json,md} per launch
and merges them into those; --grid fast one torch2_fast_<...>.{json,md} per
launch, merged into torch2_fast.{json,md,png} (the tables of docs/speed.md's
issue-46 section; its "grid" entry: the estimate and the time taken, per
launch and in all); --smoke writes torch2_bench_smoke.*
and checks that every column was produced (the CPU-ms of every variant's
every timed window > 0 among them). Exit status 77 when clusters
cannot run here. A benchmark, not a test: the machine is shared, the numbers
are noisy.
"""
import argparse
import ctypes
import gc
import json
import math
import os
import random
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_bench import (RATES, ROOT, draw_panel, run_grid, run_ranks,  # noqa: E402
                           write_results)

TORCH2 = "/root/.cache/sfsync/venv-torch2/bin/python"
VARIANTS = ["compute_only", "compute_only_shard", "ddp_foreach", "ddp_fused", "ddp_fused_cap25",
            "ddp_fused_capsf", "ddp_overlap", "fsdp2_reshard", "fsdp2_keep", "fsdp2_keep_ring",
            "zero_ddp", "sfsync_sharded", "sfsync_sharded_final", "sfsync_sharded_owned",
            "sfsync_perbucket", "sfsync_final"]
COMPUTE = ("compute_only", "compute_only_shard")
SHARDED = ("compute_only_shard", "fsdp2_reshard", "fsdp2_keep", "fsdp2_keep_ring", "zero_ddp",
           "sfsync_sharded", "sfsync_sharded_final", "sfsync_sharded_owned",
           "sfsync_bf16_sharded", "fsdp2_bf16_reduce")
SFSYNC_SHARDED = ("sfsync_sharded", "sfsync_sharded_final", "sfsync_sharded_owned",
                  "sfsync_bf16_sharded")
DDPS = ("ddp_foreach", "ddp_fused", "ddp_fused_cap25", "ddp_fused_capsf")  # "best DDP" of these
NOT_FUSED = ("ddp_foreach",)  # the foreach reference (the weight check's)
# Issue 46, item 3: half the bytes on the wire, sfsync's 16-bit wire against
# torch's own (opt-in: --variants, --smoke and --grid fast run them).
BF16_VARIANTS = ["sfsync_bf16_perbucket", "sfsync_bf16_sharded", "ddp_bf16_hook",
                 "fsdp2_bf16_reduce"]
ALL_VARIANTS = VARIANTS + BF16_VARIANTS
# The float32 variant each 16-bit one halves the bytes of (the 16-bit table
# shows them side by side; --grid fast's estimate takes the counterpart's
# cost where no 16-bit run was recorded).
BF16_OF = {"sfsync_bf16_perbucket": "sfsync_perbucket", "sfsync_bf16_sharded": "sfsync_sharded",
           "ddp_bf16_hook": "ddp_fused_capsf", "fsdp2_bf16_reduce": "fsdp2_reshard"}
MODELS = ["mlp", "transformer"]
LR, WD = 1e-3, 0.01


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rates", nargs="+", default=["1gbit", "200mbit", "10gbit", "loopback"])
    p.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    p.add_argument("--variants", nargs="+", default=None,
                   help="default: every variant but the 16-bit ones (%s; --smoke: all)"
                        % " ".join(BF16_VARIANTS))
    p.add_argument("--rounds", type=int, default=3,
                   help="runs: rounds of blocks, the variants' order rotated each round")
    p.add_argument("--windows", type=int, default=50,
                   help="timed windows per block, back to back (one untimed before them)")
    p.add_argument("--no-fused", dest="fused", action="store_false",
                   help="AdamW(foreach=True) everywhere (default: fused=True but ddp_foreach)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin rank r to core r %% cores")
    p.add_argument("--seed", type=int, default=35, help="the bootstrap's seed")
    p.add_argument("--grid", nargs="?", const="issue35", choices=sorted(GRIDS),
                   help="a grid of launches (see the module docstring): issue35 (the "
                        "default) or fast (issue 46's rows); prints its plan and estimate, "
                        "then runs it")
    p.add_argument("--estimate", action="store_true", help="with --grid: the plan only")
    p.add_argument("--resume", action="store_true",
                   help="with --grid: keep the launches whose JSON is already under --out")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="sfsync's bucket cap (default: its own: 25 MiB unsharded, "
                        "the plugin's sharded default sharded); DDP's caps are per variant")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="max abs weight difference from ddp_foreach")
    p.add_argument("--tolerance-16", type=float, default=1.0,
                   help="the 16-bit variants' check instead: the largest |w - w_ddp_foreach| "
                        "over the float32 update's largest |w_ddp_foreach - w0| (a sanity "
                        "bound: AdamW's steps on near-zero gradients move by ~lr whatever "
                        "their sign, so single weights may differ by a good part of it)")
    p.add_argument("--fault", default=None, help="this variant gets 1.5x the learning rate")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="SF_TRACE of each sfsync variant: DIR/<model>-<variant>.rank<r>.json")
    p.add_argument("--python", default=TORCH2, help="the ranks' interpreter (torch 2.x)")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", default=None, help="output file stem (default torch2_bench)")
    p.add_argument("--tag", default=None,
                   help="a label for this launch's rows in the tables (the grid's later parts)")
    p.add_argument("--port", type=int, default=29800)
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds per launch (every model; 200 Mbit/s, 2 hosts: over 900)")
    p.add_argument("--smoke", action="store_true",
                   help="loopback, 2 ranks, both models made small, 2 rounds of 1-window blocks, "
                        "every variant (the 16-bit ones too) unless --variants")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no run: the records of these result files into one table and plot "
                        "(--name, default torch2_bench)")
    p.add_argument("--small", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rate", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.variants is None:
        a.variants = ALL_VARIANTS if a.smoke else VARIANTS
    bad = [v for v in a.variants if v not in ALL_VARIANTS]
    if bad:
        p.error("--variants: unknown %s (choose from %s)" % (", ".join(bad),
                                                            " ".join(ALL_VARIANTS)))
    if "ddp_foreach" not in a.variants:
        p.error("--variants must include ddp_foreach (the reference of the check and ratios)")
    if a.fault is not None and a.fault not in a.variants:
        p.error("--fault: %r is not one of --variants" % a.fault)
    if a.windows < 1 or a.rounds < 1:
        p.error("--windows and --rounds must be >= 1, got %d and %d" % (a.windows, a.rounds))
    if a.smoke:
        a.hosts, a.rates, a.rounds, a.windows, a.small = [2], ["loopback"], 2, 1, True
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
    that FSDP2, ZeRO and DDP's Python comm hooks issue through
    torch.distributed's Python functions, counted by wrapping them, in the
    dtype they carry (ring algorithms: (W-1)/W of the whole buffer, an
    all-reduce 2(W-1)/W)."""

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
                              # DDP's Python comm hooks (ddp_overlap's, bf16_compress_hook)
                              ("all_reduce", lambda a, k: _nbytes(_arg(a, k, 0, ("tensor",))), 2),
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


def cpu_s():
    """This process's user+sys CPU seconds, every thread (the kernel's
    accounting; microsecond resolution)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


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


class RingReduceScatter:
    """FSDP2's reduce-scatter at ring bytes on Gloo, through its public hook
    (FSDPModule.set_custom_reduce_scatter): one all_to_all_single of the W
    chunks, then a local sum ((W-1)/W of the buffer each way, as a ring;
    torch's Gloo reduce_scatter_tensor is an all-reduce of the whole buffer).
    Counts its bytes into WIRE[0] when set."""

    def allocate(self, size, *, dtype, device):
        import torch
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch
        import torch.distributed as dist
        w = group.size()
        buf = torch.empty_like(input_tensor)
        dist.all_to_all_single(buf, input_tensor, group=group)
        torch.sum(buf.view(w, -1), 0, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(w)
        elif op != dist.ReduceOp.SUM:
            raise RuntimeError("RingReduceScatter: op %r (FSDP2 asks SUM or AVG for fp32)" % (op,))
        if WIRE[0] is not None:
            WIRE[0].bytes += (w - 1) / w * _nbytes(input_tensor)
            WIRE[0].calls["ring_reduce_scatter"] = WIRE[0].calls.get("ring_reduce_scatter", 0) + 1
        return None


WIRE = [None]  # the run's Wire counter (RingReduceScatter adds its bytes)


class _OverlapStep:
    """ddp_overlap's optimizer: DDP steps each parameter in its bucket's comm
    hook (_register_fused_optim); step() has nothing left, zero_grad() drops
    the gradients as AdamW's default does."""

    def __init__(self, module):
        self.module = module

    def step(self):
        pass

    def zero_grad(self):
        self.module.zero_grad(set_to_none=True)


def ddp_cap_mb(variant, model):
    """The bucket_cap_mb a DDP variant passes (None: torch's default, with
    its small first bucket)."""
    if variant == "ddp_fused_cap25":
        return 25.0
    if variant in ("ddp_fused_capsf", "ddp_bf16_hook"):
        # ddp_bf16_hook: the cap of the DDP that was best in most of issue
        # 35's rows (docs/speed.md: every transformer row, the MLP at 1 Gbit/s)
        return sharded_cap_mb(model)
    return None


def sharded_cap_mb(model):
    """The plugin's sharded default cap (since 0.5 the plugin's rule,
    sf_set_shard_layout) for the model's gradients: asked of a throwaway
    world-size-1 sharded context once its buckets are built."""
    import sfsync
    from sfsync import shard
    from sfsync.torch.store import sf_dtype
    with sfsync.Context(rank=0, world_size=1, rendezvous="") as ctx:
        shard.set_layout(ctx, "flat")
        for p in model.parameters():
            if p.requires_grad and p.numel():
                gid = ctx.add_gradient(p.numel(), sf_dtype(p.dtype))
                shard.register_parameter(ctx, gid, p.numel(), sf_dtype(p.dtype),
                                         sfsync.DEVICE_HOST)
        ctx.build_buckets()
        return ctx.options()["bucket_cap_mb"]


class Runner:
    def __init__(self, variant, base, a, world, rank):
        import contextlib
        import torch
        import torch.distributed as dist
        self.variant, self.n, self.world, self.kind = variant, a.micro_batches, world, a.model
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.model = _clone(base)
        self.sync = self.ddp = self.fsdp = None
        self.hooked = False
        self.nullctx = contextlib.nullcontext
        lr = LR * (1.5 if a.fault == variant else 1.0)
        self.fused = a.fused and variant not in NOT_FUSED
        kw = dict(lr=lr, weight_decay=WD, foreach=None if self.fused else True,
                  fused=True if self.fused else None)
        self.module = self.model
        self.config = {"optimizer": "AdamW(fused=True)" if self.fused else "AdamW(foreach=True)"}
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
            sharded = variant in SFSYNC_SHARDED
            # sfsync_bf16_*: the 16-bit wire (the context's wire_dtype)
            wire = {"wire_dtype": "bf16"} if variant.startswith("sfsync_bf16") else {}
            cap = a.bucket_cap_mb
            if cap is None and variant == "sfsync_bf16_perbucket":
                cap = ddp_cap_mb("ddp_bf16_hook", self.model)  # its peer's buckets
            self.sync = sft.GradientSync(self.model, accumulation_steps=self.n,
                                         bucket_cap_mb=cap,
                                         find_unused_parameters=False,
                                         shard_optimizer=sharded, shard_layout="flat", **wire)
            os.environ.pop("SF_TRACE", None)
            overlap = variant in ("sfsync_sharded", "sfsync_perbucket", "sfsync_bf16_perbucket",
                                  "sfsync_bf16_sharded")
            whole = variant != "sfsync_sharded_owned"
            self.opt = self.sync.optimizer(torch.optim.AdamW, self.model.parameters(),
                                           overlap_step=overlap, whole_gradients=whole, **kw)
            self.config.update(bucket_cap_mb=cap, shard_optimizer=sharded, overlap_step=overlap,
                               whole_gradients=whole, wire_dtype=wire.get("wire_dtype"))
        elif variant.startswith("fsdp2"):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            keep = variant.startswith("fsdp2_keep")
            units = fsdp_units(self.kind, self.model)
            fkw = {"reshard_after_forward": not keep}
            if variant == "fsdp2_bf16_reduce":
                # reduce_dtype bf16 (the gradients reduce-scattered in bf16,
                # float32 parameters), reshard_after_forward left to torch
                # (None: True for the units, False for the root)
                fkw = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)}
            for m in units:
                fully_shard(m, **fkw)
            self.fsdp = fully_shard(self.model, **fkw)
            self.ring = variant.endswith("_ring")
            if self.ring:
                rs = RingReduceScatter()
                for m in units + [self.model]:
                    m.set_custom_reduce_scatter(rs)
            self.opt = torch.optim.AdamW(self.model.parameters(), **kw)
            self.config.update(reshard_after_forward=fkw.get("reshard_after_forward"),
                               units=len(units) + 1,
                               reduce_scatter="ring (all_to_all)" if self.ring else "torch's",
                               reduce_dtype=str(fkw["mp_policy"].reduce_dtype)
                               if "mp_policy" in fkw else None)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP
            cap = ddp_cap_mb(variant, self.model)
            # static_graph=True is left off: in torch 2.15 DDP(static_graph=True)
            # with no_sync() on the first window fails in backward
            # ("expect_autograd_hooks_ INTERNAL ASSERT FAILED", reducer.cpp).
            self.ddp = DDP(self.model, gradient_as_bucket_view=True,
                           **({} if cap is None else {"bucket_cap_mb": cap}))
            self.module = self.ddp
            self.config.update(bucket_cap_mb=cap, gradient_as_bucket_view=True,
                               static_graph=False, comm_hook=None)
            # a DDP whose buckets go through a Python comm hook: its bytes are
            # the hook's all_reduce calls (Wire), not DDP's bucket sizes
            self.hooked = variant in ("ddp_overlap", "ddp_bf16_hook")
            if variant == "ddp_bf16_hook":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
                self.ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
                self.config["comm_hook"] = "bf16_compress_hook"
            if variant == "zero_ddp":
                from torch.distributed.optim import ZeroRedundancyOptimizer
                self.opt = ZeroRedundancyOptimizer(self.ddp.parameters(),
                                                   optimizer_class=torch.optim.AdamW, **kw)
            elif variant == "ddp_overlap":
                # DDP's own overlapped optimizer: each bucket's parameters
                # step in its comm hook when its all-reduce completes.
                self.ddp._register_fused_optim(torch.optim.AdamW, **kw)
                self.opt = _OverlapStep(self.ddp)
                self.config["optimizer"] += " per parameter in DDP's comm hook"
            else:
                self.opt = torch.optim.AdamW(self.ddp.parameters(), **kw)
        self.dist = dist

    def run_window(self, batches, probe=None):
        n = self.n
        for i, (x, y) in enumerate(batches):
            last = i == n - 1
            if self.fsdp is not None:
                self.fsdp.set_requires_gradient_sync(last)
                if self.variant.startswith("fsdp2_keep"):
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

    def wire_bytes_per_window(self, windows, wire, counted):
        """Per-rank bytes in the busier direction per window (see the module
        docstring); windows: all it ran, counted: those the Wire counter saw."""
        f = (self.world - 1) / self.world
        if self.variant in COMPUTE:
            return 0.0
        if self.sync is not None:
            st = self.stats()
            if st["windows_completed"] != windows:
                raise RuntimeError("%s: %d windows completed, %d run" % (
                    self.variant, st["windows_completed"], windows))
            # the payload in the dtype it travelled in (sf_stats' wire
            # counts: a 16-bit wire's buckets 2 bytes an element)
            moved = st["wire_gradient_bytes"] + st["wire_parameter_bytes"]
            if self.variant in SFSYNC_SHARDED:
                return f * moved / windows
            return 2 * f * moved / windows
        b = 0.0
        if self.fsdp is not None or self.variant == "zero_ddp" or self.hooked:
            b = wire[self.variant] / counted
        if self.ddp is not None and not self.hooked:
            b += 2 * f * self.ddp_bucket_bytes()
        return b

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


def pin_rank(pin):
    """Pins this process to core RANK % (cores it may use) (taskset's
    sched_setaffinity; rank from the launcher's environment); returns the
    cores it runs on."""
    cores = sorted(os.sched_getaffinity(0))
    if pin and len(cores) > 1:
        core = cores[int(os.environ.get("RANK", "0")) % len(cores)]
        os.sched_setaffinity(0, {core})
    return sorted(os.sched_getaffinity(0))


def gather_placement(rank, world, cores):
    """Every rank's host and cores (all_gather_object)."""
    import torch.distributed as dist
    mine = {"rank": rank, "host": os.environ.get("SF_CLUSTER_HOST", "loopback"),
            "cores": cores}
    out = [None] * world
    dist.all_gather_object(out, mine)
    return out


def ddp_layout(r):
    """DDP's bucket layout from its logging data, and the layout torch's
    rule gives for the variant's caps in the order DDP rebuilt in
    (torch's own _compute_bucket_assignment_by_size)."""
    import torch.distributed as dist
    d = r.ddp._get_ddp_logging_data()
    got = {k: d.get(k) for k in ("bucket_cap_bytes", "rebuilt_bucket_sizes",
                                 "rebuilt_per_bucket_param_indices", "gradient_as_bucket_view",
                                 "static_graph", "has_rebuilt_buckets", "bucket_sizes")}
    params = list(r.model.parameters())
    order = [int(i) for b in str(got["rebuilt_per_bucket_param_indices"] or "").split(", ")
             for i in b.split()]
    cap = ddp_cap_mb(r.variant, r.model)
    cap_b = int((25.0 if cap is None else cap) * 1024 * 1024)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if cap is None else cap_b
    want = None
    if order:
        buckets, _ = dist._compute_bucket_assignment_by_size(
            [params[i] for i in order], [min(first, cap_b), cap_b], [False] * len(order), order)
        want = ", ".join(str(sum(params[i].numel() * params[i].element_size() for i in b))
                         for b in buckets)
    got["torch_rule_bucket_sizes"] = want
    got["torch_rule_bucket_cap_bytes"] = cap_b
    return got


def worker(a):
    """Every model of --models in turn on this rank; rank 0 prints one JSON line
    with a record per model (one launch: each torch 2.x import costs seconds)."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "samples", "python"))
    import ddp_common as common
    torch.set_num_threads(1)
    pinned = pin_rank(a.pin)
    rank, world = common.init_torch_distributed(1)
    records = []
    for model in a.models:
        a.model = model
        records.append(run_model(a, rank, world))
        records[-1]["ranks"] = gather_placement(rank, world, pinned)
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
    a.fused_reason = None
    if a.fused:
        try:
            probe = torch.nn.Linear(2, 2)
            probe(torch.ones(1, 2)).sum().backward()
            torch.optim.AdamW(probe.parameters(), fused=True).step()
        except (RuntimeError, TypeError) as e:
            a.fused_reason = "no fused AdamW on this CPU build (%s): foreach everywhere" % e
            print("torch2_bench: " + a.fused_reason, file=sys.stderr)
            a.fused = False
    data = {}

    def batches(w):
        if w not in data:
            data[w] = [batch_of(a.model, a.small, rank, w, m) for m in range(n)]
        return data[w]

    # Memory: each variant built and run alone (the ones built before it
    # idle), 2 windows, glibc's bytes in use; then it stays for the timing.
    mem, runners = {}, []
    mem_windows = (0,) if a.small else (0, 1)  # --smoke: one (its check is memory > 0)
    for v in variants:
        for w in mem_windows:
            batches(1000 + w)
        gc.collect()
        dist.barrier()
        start = heap_in_use()
        peak = [start]
        r = Runner(v, base, a, world, rank)

        def probe():
            peak[0] = max(peak[0], heap_in_use())

        for w in mem_windows:
            r.run_window(batches(1000 + w), probe)
        r.settle()
        mem[v] = peak[0] - start
        runners.append(r)
        del r, probe
        gc.collect()
    data.clear()

    wire = {v: 0 for v in variants}  # construction's broadcasts are not windows
    counter = Wire(dist, world)
    WIRE[0] = counter
    times = {r.variant: [[] for _ in range(a.rounds)] for r in runners}
    fb = {r.variant: [] for r in runners}  # forward+backward part of each timed window
    nic = {r.variant: [] for r in runners}
    cpu = {r.variant: [[] for _ in range(a.rounds)] for r in runners}  # this rank's CPU-s
    windows = {r.variant: len(mem_windows) for r in runners}  # sfsync counts them too
    for rnd in range(a.rounds):
        # Round rnd: every variant a block, in the order rotated by rnd; the
        # same windows (data) for every variant.
        todo = [b for b in (batches(w) for w in range(1 + a.windows))]
        order = runners[rnd % len(runners):] + runners[:rnd % len(runners)]
        for r in order:
            before = counter.bytes
            dist.barrier()
            r.run_window(todo[0])  # untimed: nothing of this variant in flight before it
            t_prev = time.perf_counter()
            c_prev = cpu_s()
            n_prev = nic_bytes()
            for k in range(a.windows):
                t_fb = r.run_window(todo[1 + k])
                t = time.perf_counter()
                c = cpu_s()
                nb = nic_bytes()
                times[r.variant][rnd].append(t - t_prev)
                cpu[r.variant][rnd].append(c - c_prev)
                fb[r.variant].append(t_fb - t_prev)
                if nb is not None:
                    nic[r.variant].append(max(nb[0] - n_prev[0], nb[1] - n_prev[1]))
                t_prev, c_prev, n_prev = t, c, nb
            # Untimed, as the untimed first window: every timed window
            # carries the wait for one window's gathers (the one before it,
            # the untimed first's in the first), as in a run of any length.
            # Until 2026-12-06 the block's last window also waited for its
            # own: a sharded block of n windows carried n + 1 gathers (at
            # 10 windows a block, the transformer's last window 25-40 ms
            # slower, its median 1 % higher).
            r.settle()
            windows[r.variant] += 1 + a.windows
            wire[r.variant] += counter.bytes - before
        data.clear()
    WIRE[0] = None
    # Correctness: every synchronized variant's weights against ddp_foreach's
    # (the float32 run), also relative to its update (16-bit variants).
    ref = next(r for r in runners if r.variant == "ddp_foreach").full_weights()
    w0 = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    update = (ref - w0).abs().max().item()  # the float32 update's largest |dw|
    update_l2 = (ref - w0).norm().item()
    results = []
    for r in runners:
        t = torch.tensor(times[r.variant], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a window: its slowest rank
        by_round = [[round(x * 1e3, 3) for x in row] for row in t.tolist()]
        ms = [x for row in by_round for x in row]
        ct = torch.tensor(cpu[r.variant], dtype=torch.float64)
        dist.all_reduce(ct, op=dist.ReduceOp.SUM)  # a window's CPU: the ranks' mean
        cpu_by_round = [[round(x * 1e3 / world, 3) for x in row] for row in ct.tolist()]
        m = torch.tensor([float(mem[r.variant])], dtype=torch.float64)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        flat = [x for row in times[r.variant] for x in row]
        rec = {"variant": r.variant, "ms_per_window_median": round(statistics.median(ms), 3),
               "ms_per_window_min": round(min(ms), 3), "ms_per_window_max": round(max(ms), 3),
               "ms_windows_by_round": by_round, "config": r.config,
               "cpu_ms_windows_by_round": cpu_by_round,
               "cpu_ms_per_window_median": round(statistics.median(
                   [x for row in cpu_by_round for x in row]), 3),
               "timed_windows": len(ms), "windows_run": windows[r.variant],
               # this rank's (each rank's own median, the largest): forward+backward
               # up to the last backward's return, and the step (with zero_grad)
               "fwd_bwd_ms_median_max_rank": _max_all(dist, statistics.median(fb[r.variant]) * 1e3),
               "step_ms_median_max_rank": _max_all(dist, statistics.median(
                   [x - y for x, y in zip(flat, fb[r.variant])]) * 1e3),
               "memory_bytes_max_rank": int(m.item()),
               "wire_bytes_per_rank_window": round(r.wire_bytes_per_window(
                   windows[r.variant], wire, windows[r.variant] - len(mem_windows)), 1)}
        if nic[r.variant]:
            q = torch.tensor([statistics.median(nic[r.variant])], dtype=torch.float64)
            dist.all_reduce(q, op=dist.ReduceOp.MAX)
            rec["nic_bytes_per_window_median_max_rank"] = int(q.item())
        if r.variant in COMPUTE:
            rec["weights_max_abs_diff_vs_ddp"] = rec["update_rel_err_vs_fp32"] = None
            rec["update_rel_l2_err_vs_fp32"] = rec["update_rel_p999_err_vs_fp32"] = None
            if r.variant == "compute_only_shard":
                rec["stepped_elements"] = r.step_elems
        else:
            diff = r.full_weights() - ref
            a_diff = diff.abs().flatten()
            # the 99.9th percentile of |dw|: the error of all but the
            # unluckiest thousandth of the weights
            p999 = a_diff.kthvalue(max(1, math.ceil(0.999 * a_diff.numel()))).values.item()
            d = torch.tensor([a_diff.max().item(), diff.norm().item(), p999],
                             dtype=torch.float64)
            dist.all_reduce(d, op=dist.ReduceOp.MAX)
            rec["weights_max_abs_diff_vs_ddp"] = d[0].item()
            # the update's error against the float32 run: its largest
            # element (issue 46), and as a whole (L2: the typical error)
            rec["update_rel_err_vs_fp32"] = d[0].item() / update if update > 0 else None
            rec["update_rel_l2_err_vs_fp32"] = d[1].item() / update_l2 if update_l2 > 0 else None
            rec["update_rel_p999_err_vs_fp32"] = d[2].item() / update if update > 0 else None
        if r.sync is not None:
            st = r.stats()
            rec["stats"] = {k: st[k] for k in ("collectives_issued", "bytes_reduced",
                                               "reduce_scatters", "all_gathers",
                                               "bytes_gathered", "bucket_count",
                                               "windows_completed", "wire_gradient_bytes",
                                               "wire_parameter_bytes")}
            # what the reductions travelled as: 2 bytes an element on a
            # 16-bit wire (sf_stats' payload, less the gradient gathers',
            # over the float32 bytes reduced)
            grad_gathers = st["bytes_gathered"] - st["wire_parameter_bytes"]
            rec["gradient_wire_bytes_per_element"] = round(
                4.0 * (st["wire_gradient_bytes"] - grad_gathers) / st["bytes_reduced"], 3) \
                if st["bytes_reduced"] else None
        if r.ddp is not None:
            rec["ddp_bucket_bytes"] = r.ddp_bucket_bytes()
            rec["ddp_layout"] = ddp_layout(r)
        results.append(rec)
    for r in runners:
        r.close()
    counter.restore()
    return {"world_size": world, "micro_batches": n, "model": a.model, "small": a.small,
            "parameters": sum(p.numel() for p in base.parameters()),
            "tensors": len(list(base.parameters())),
            "gradient_bytes": common.gradient_bytes(base), "rounds": a.rounds,
            "windows": a.windows, "fused": a.fused, "fused_reason": a.fused_reason,
            "torch": torch.__version__, "sfsync": sfsync.version(),
            "collective_calls": counter.calls, "tolerance": a.tolerance,
            "tolerance_16": a.tolerance_16, "float32_update_max_abs": update,
            "bucket_cap_mb": a.bucket_cap_mb,
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


BOOT = 1000  # bootstrap resamples
CPU_SERIES = "cpu_ms_windows_by_round"  # a window's user+sys CPU-ms, the ranks' mean


def _boot(rows_v, rows_b, key, seed, n=BOOT):
    """Median and 95 % interval of median(variant windows) / median(base
    windows) (rows_b None: of the variant's median ms): a bootstrap that
    resamples the runs (rounds, the same for both: they ran interleaved),
    then the windows within each; random.Random seeded by (seed, key): the
    same records give the same numbers."""
    rng = random.Random("%d/%s" % (seed, key))
    med = statistics.median

    def stat(v, b):
        return med(v) / med(b) if b is not None else med(v)

    flat_b = [x for row in rows_b for x in row] if rows_b is not None else None
    point = stat([x for row in rows_v for x in row], flat_b)
    k = len(rows_v)
    draws = []
    for _ in range(n):
        idx = [rng.randrange(k) for _ in range(k)]
        v = [x for i in idx for x in rng.choices(rows_v[i], k=len(rows_v[i]))]
        b = None if rows_b is None else [
            x for i in idx for x in rng.choices(rows_b[i], k=len(rows_b[i]))]
        draws.append(stat(v, b))
    draws.sort()
    return [round(point, 4), round(draws[int(0.025 * n)], 4), round(draws[int(0.975 * n) - 1], 4)]


def compare(rec, v, base, key, seed, series="ms_windows_by_round"):
    """{"all": [median, lo, hi] across runs, "per_run": [...] within each};
    series: the windows compared (wall ms, or cpu_ms_windows_by_round)."""
    rv = res_of(rec, v)[series]
    rb = None if base is None else res_of(rec, base)[series]
    out = {"all": _boot(rv, rb, key, seed)}
    if len(rv) > 1:
        out["per_run"] = [_boot([rv[i]], None if rb is None else [rb[i]], "%s/%d" % (key, i), seed)
                          for i in range(len(rv))]
    return out


def verdict(iv, words=("faster", "slower")):
    """'faster' / 'slower' (words: CPU's "less CPU" / "more CPU") only where
    the 95 % interval excludes 1.0."""
    if iv[2] < 1.0:
        return words[0]
    if iv[1] > 1.0:
        return words[1]
    return "same within noise"


def best_ddp(ms):
    got = [v for v in DDPS if v in ms]
    return min(got, key=lambda v: ms[v]) if got else None


def derive(rec, seed=35):
    """The limit columns, the intervals and the ratios of one record (in
    place); returns the list of correctness failures."""
    ms = {r["variant"]: r["ms_per_window_median"] for r in rec["results"]}
    cpu = {r["variant"]: r["cpu_ms_per_window_median"] for r in rec["results"]
           if r.get("cpu_ms_per_window_median") is not None}
    bps = rate_bytes_per_s(rec["rate"])
    base = best_ddp(ms)
    # a ratio's base: every window's CPU > 0 (none in a record without CPU)
    cpu_base = base is not None and base in cpu and min(
        x for row in res_of(rec, base)[CPU_SERIES] for x in row) > 0
    rec["best_ddp"] = base
    tag = "%s/%d/%s" % (rec["model"], rec["hosts"], rec["rate"])
    for r in rec["results"]:
        v = r["variant"]
        comp = "compute_only_shard" if v in SHARDED else "compute_only"
        r["compute_only_ms"] = ms.get(comp)
        r["ms_per_window_ci"] = compare(rec, v, None, tag + "/ms/" + v, seed)["all"]
        r["wire_ms"] = (round(r["wire_bytes_per_rank_window"] / bps * 1e3, 3)
                        if bps and v not in COMPUTE else None)
        r["exposed_ms"] = (round(r["ms_per_window_median"] - ms[comp], 3)
                           if comp in ms and v not in COMPUTE else None)
        r["exposed_over_wire"] = (round(r["exposed_ms"] / r["wire_ms"], 3)
                                  if r["wire_ms"] and r["exposed_ms"] is not None else None)
        r["vs_best_ddp"] = None if base is None else round(ms[v] / ms[base], 3)
        if v in cpu:  # records before issue 46 have no CPU
            r["cpu_ms_per_window_ci"] = compare(rec, v, None, tag + "/cpu/" + v, seed,
                                                CPU_SERIES)["all"]
            r["cpu_vs_best_ddp"] = round(cpu[v] / cpu[base], 3) if cpu_base else None
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
    rat, cpu_rat = {}, {}
    if base is not None:
        for v in ms:
            if v not in COMPUTE and v != base:
                rat[v + "_vs_best_ddp"] = compare(rec, v, base, tag + "/" + v, seed)
                if v in cpu and cpu_base:
                    cpu_rat[v + "_vs_best_ddp"] = compare(rec, v, base, tag + "/cpu/" + v, seed,
                                                          CPU_SERIES)
    pairs = [("sfsync_perbucket", "ddp_overlap", "perbucket_vs_ddp_overlap"),
             ("sfsync_sharded_final", "sfsync_sharded", "sharded_final_vs_sharded"),
             ("sfsync_sharded_owned", "sfsync_sharded", "sharded_owned_vs_sharded"),
             ("sfsync_sharded", "zero_ddp", "sharded_vs_zero")]
    # issue 46's 16-bit rows: sfsync's wire against torch's two
    pairs += [(v, b, "%s_vs_%s" % (v, b)) for v in BF16_VARIANTS[:2]
              for b in ("ddp_bf16_hook", "fsdp2_bf16_reduce")]
    fsdp = [v for v in ("fsdp2_reshard", "fsdp2_keep", "fsdp2_keep_ring") if v in ms]
    if fsdp:
        pairs.append(("sfsync_sharded", min(fsdp, key=lambda v: ms[v]), "sharded_vs_best_fsdp2"))
    for v, b, k in pairs:
        if v in ms and b in ms:
            rat[k] = compare(rec, v, b, tag + "/" + k, seed)
            rat[k]["base"] = b
    res = {r["variant"]: r for r in rec["results"]}
    sh, shf = res.get("sfsync_sharded"), res.get("sfsync_sharded_final")
    extra = {}
    if sh is not None and shf is not None:
        # the default sharded mode's gradient gather: its bytes and its time
        extra["gradient_gather_bytes_per_rank_window"] = round(
            shf["wire_bytes_per_rank_window"] - sh["wire_bytes_per_rank_window"], 1)
        extra["gradient_gather_ms"] = round(shf["ms_per_window_median"] -
                                            sh["ms_per_window_median"], 3)
    if sh is not None and sh.get("window_bound_ms") is not None and base is not None:
        # The bound's lead at W=2 (bytes equal DDP's): the step on 1/W and
        # the compute-only split, not fewer bytes.
        extra["sharded_bound_vs_best_ddp"] = round(sh["window_bound_ms"] / ms[base], 3)
    for v in COMPUTE:
        if v in ms:
            extra[v + "_ms"] = ms[v]
    for v in ("fsdp2_reshard", "fsdp2_keep", "fsdp2_keep_ring"):
        if sh is not None and v in res:
            extra["sharded_memory_vs_" + v] = round(sh["memory_bytes_max_rank"] /
                                                    res[v]["memory_bytes_max_rank"], 3)
    rec["ratios"] = rat
    rec["cpu_ratios"] = cpu_rat
    rec["extra"] = extra
    rec["targets"] = targets(rec)
    rec["bf16_targets"] = bf16_targets(rec)
    fails = []
    for r in rec["results"]:
        d = r["weights_max_abs_diff_vs_ddp"]
        if r["variant"] in BF16_VARIANTS:
            # half the bytes, a stated error: judged relative to the update
            e, tol = r.get("update_rel_err_vs_fp32"), rec.get("tolerance_16")
            r["weights_agree"] = None if e is None else bool(e <= tol)
            if e is not None and not e <= tol:
                fails.append("%s N=%d %s %s: update %.3g off the float32 run's "
                             "(tolerance %g relative)" % (rec["model"], rec["hosts"],
                                                         link_of(rec), r["variant"], e, tol))
            continue
        r["weights_agree"] = None if d is None else bool(d <= rec["tolerance"])
        if d is not None and not d <= rec["tolerance"]:
            fails.append("%s N=%d %s %s: weights %.3g off DDP's (tolerance %g)" % (
                rec["model"], rec["hosts"], link_of(rec), r["variant"], d, rec["tolerance"]))
    return fails


TARGETS = [("sfsync_sharded_vs_best_ddp", 0.90, "sharded <= 0.90 x best DDP, interval below 1"),
           ("sfsync_sharded_final_vs_best_ddp", 1.00, "default sharded <= 1.00 x best DDP"),
           ("sfsync_sharded_owned_vs_best_ddp", 1.00,
            "default sharded, readers owned (no gather) <= 1.00 x best DDP"),
           ("perbucket_vs_ddp_overlap", 1.00, "per-bucket <= 1.00 x DDP's overlapped optimizer")]


def bf16_targets(rec):
    """Issue 46 item 3's target, per sfsync 16-bit variant: ahead of both
    torch 16-bit variants in wall time (interval below 1.0) with an update
    error no larger than theirs (met only where both peers ran)."""
    res = {r["variant"]: r for r in rec["results"]}
    peers = ("ddp_bf16_hook", "fsdp2_bf16_reduce")
    out = []
    for v in BF16_VARIANTS[:2]:
        if v not in res or not all(p in res for p in peers):
            continue
        cs = [rec["ratios"]["%s_vs_%s" % (v, p)]["all"] for p in peers]
        err = res[v].get("update_rel_err_vs_fp32")
        errs = [res[p].get("update_rel_err_vs_fp32") for p in peers]
        err_ok = err is not None and None not in errs and err <= min(errs)
        # where the gradients travelled as float32 (sfsync_bf16_sharded:
        # no 16-bit reduce-scatter) the row is not a 16-bit one: said so
        per = res[v].get("gradient_wire_bytes_per_element")
        out.append({"variant": v, "ratios": dict(zip(peers, cs)), "update_rel_err": err,
                    "peer_update_rel_err": dict(zip(peers, errs)), "error_ok": err_ok,
                    "gradient_wire_bytes_per_element": per,
                    "met": err_ok and all(c[2] < 1.0 for c in cs) and per == 2.0})
    return out


def targets(rec):
    """Issue 35's targets of this record: met or not, with the interval."""
    out = []
    for key, limit, text in TARGETS:
        c = rec["ratios"].get(key)
        if c is None:
            continue
        m, lo, hi = c["all"]
        met = m <= limit and (hi < 1.0 if limit < 1.0 else True)
        out.append({"target": text, "ratio": c["all"], "met": met, "verdict": verdict(c["all"])})
    return out


COLUMNS = [("ms_per_window_median", "ms/window", "%.0f"), ("vs_best_ddp", "x best DDP", "%.2f"),
           ("cpu_ms_per_window_median", "CPU ms/window/rank", "%.1f"),
           ("cpu_vs_best_ddp", "CPU x best DDP", "%.2f"),
           ("fwd_bwd_ms_median_max_rank", "fwd+bwd ms", "%.0f"),
           ("step_ms_median_max_rank", "step ms", "%.0f"),
           ("compute_only_ms", "compute-only ms", "%.0f"),
           ("wire_bytes_per_rank_window", "wire MB/rank", "%.2f"), ("wire_ms", "wire ms", "%.0f"),
           ("exposed_ms", "exposed ms", "%.0f"), ("exposed_over_wire", "exposed/wire", "%.2f"),
           ("exposed_bound_over_wire", "bound exposed/wire", "%.2f"),
           ("memory_bytes_max_rank", "memory MB/rank", "%.1f"),
           ("weights_max_abs_diff_vs_ddp", "max abs diff vs DDP", "%.1e"),
           ("update_rel_err_vs_fp32", "update err vs fp32", "%.1e")]


def cell(key, fmt, r):
    x = r.get(key)
    if x is None:
        return "-"
    if key in ("wire_bytes_per_rank_window", "memory_bytes_max_rank"):
        x = x / 1e6
    return fmt % x


def link_of(rec):
    """The link column: the rate, and sfsync's bucket cap when --bucket-cap-mb set it."""
    cap = rec.get("bucket_cap_mb")
    link = rec["rate"] if cap is None else "%s, sfsync cap %g MiB" % (rec["rate"], cap)
    return link if not rec.get("tag") else "%s (%s)" % (link, rec["tag"])


def iv_text(iv):
    return "%.2f [%.2f, %.2f]" % tuple(iv)


def present(records):
    return [v for v in ALL_VARIANTS
            if any(x["variant"] == v for r in records for x in r["results"])]


def ms_table(records, key="ms_per_window_ci", fmt="%.0f [%.0f, %.0f]"):
    """ms per window (median over every run's windows, slowest rank) of every
    variant with its 95 % interval, a row per model, host count and link
    (key: cpu_ms_per_window_ci for the CPU-ms)."""
    variants = present(records)
    head = "| model | N | link | " + " | ".join(variants) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in records:
        res = {r["variant"]: r for r in rec["results"]}
        lines.append("| %s | %d | %s | %s |" % (rec["model"], rec["hosts"], link_of(rec), " | ".join(
            fmt % tuple(res[v][key]) if res.get(v, {}).get(key) else "-"
            for v in variants)))
    return "\n".join(lines)


def vs_ddp_table(records, ratios, variants, words=("faster", "slower")):
    """rec[ratios] (ratios or cpu_ratios) against the best DDP of each row."""
    head = "| model | N | link | best DDP | " + " | ".join(variants) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in records:
        cells = []
        for v in variants:
            c = rec.get(ratios, {}).get(v + "_vs_best_ddp")
            cells.append("1 (base)" if v == rec["best_ddp"] else "-" if c is None else
                         "%s %s" % (iv_text(c["all"]), verdict(c["all"], words)))
        lines.append("| %s | %d | %s | %s | %s |" % (rec["model"], rec["hosts"], link_of(rec),
                                                    rec["best_ddp"], " | ".join(cells)))
    return lines


def tables(records):
    lines = ["ms per window, median [95 % interval] (bootstrap over runs, then windows):", "",
             ms_table(records), ""]
    variants = [v for v in present(records) if v not in COMPUTE]
    lines.append("Against the best DDP of the row (%s), median [95 %% interval]; "
                 "'faster' only where the interval is below 1:" % ", ".join(DDPS))
    lines.append("")
    lines += vs_ddp_table(records, "ratios", variants)
    if any(r.get("cpu_ms_per_window_ci") for rec in records for r in rec["results"]):
        lines += ["", "CPU-ms per window per rank (user+sys of the rank's process, every "
                  "thread; the ranks' mean), median [95 % interval], the same windows:", "",
                  ms_table(records, "cpu_ms_per_window_ci", "%.1f [%.1f, %.1f]"), "",
                  "CPU-ms against the best DDP of the row (best by wall time), median "
                  "[95 % interval]; 'less CPU' only where the interval is below 1:", ""]
        lines += vs_ddp_table(records, "cpu_ratios", variants, ("less CPU", "more CPU"))
    lines += ["", "Other pairs, within a run (each run's interval) and across runs:", "",
              "| model | N | link | pair | across runs | per run |", "|---|---|---|---|---|---|"]
    for rec in records:
        for k, c in sorted(rec["ratios"].items()):
            if "base" in c:
                lines.append("| %s | %d | %s | %s / %s | %s %s | %s |" % (
                    rec["model"], rec["hosts"], link_of(rec), k.split("_vs_")[0], c["base"],
                    iv_text(c["all"]), verdict(c["all"]),
                    "; ".join(iv_text(x) for x in c.get("per_run", []))))
    lines += bf16_table(records)
    lines += ["", "Issue 35's targets:", "", "| model | N | link | target | ratio | met |",
              "|---|---|---|---|---|---|"]
    for rec in records:
        for t in rec["targets"]:
            lines.append("| %s | %d | %s | %s | %s | %s |" % (
                rec["model"], rec["hosts"], link_of(rec), t["target"], iv_text(t["ratio"]),
                "met" if t["met"] else "not met"))
    lines += ["", "The bound and its split (at W=2 the bytes equal DDP's: the bound's lead is "
              "the step on 1/W and the compute-only split); the default sharded mode's "
              "gradient gather:", "",
              "| model | N | link | compute-only ms | compute-only-shard ms | bound/best DDP | "
              "gradient gather MB/rank | gradient gather ms |", "|---|---|---|---|---|---|---|---|"]
    for rec in records:
        e = rec["extra"]
        f = lambda k, fmt, d=1: "-" if e.get(k) is None else fmt % (e[k] / d)  # noqa: E731
        lines.append("| %s | %d | %s | %s | %s | %s | %s | %s |" % (
            rec["model"], rec["hosts"], link_of(rec), f("compute_only_ms", "%.0f"),
            f("compute_only_shard_ms", "%.0f"), f("sharded_bound_vs_best_ddp", "%.2f"),
            f("gradient_gather_bytes_per_rank_window", "%.2f", 1e6),
            f("gradient_gather_ms", "%.0f")))
    lines.append("")
    head = "| model | N | link | variant | " + " | ".join(c for _, c, _ in COLUMNS) + " |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in records:
        for r in rec["results"]:
            lines.append("| %s | %d | %s | %s | %s |" % (
                rec["model"], rec["hosts"], link_of(rec), r["variant"],
                " | ".join(cell(k, f, r) for k, _, f in COLUMNS)))
    lines += ["", "Where the ranks ran (pinned: rank r on core r mod cores; the kernel's "
              "network work is not pinned):", ""]
    for rec in records:
        lines.append("- %s N=%d %s: %s" % (rec["model"], rec["hosts"], link_of(rec), ", ".join(
            "rank %d host %s cores %s" % (p["rank"], p["host"], p["cores"])
            for p in rec.get("ranks", []))))
    return "\n".join(lines)


def bf16_table(records):
    """Issue 46's 16-bit rows (where a record has them): wall, CPU, bytes and
    the update's error, and sfsync's wire against torch's two."""
    recs = [r for r in records if any(x["variant"] in BF16_VARIANTS for x in r["results"])]
    if not recs:
        return []
    lines = ["", "The 16-bit wire (issue 46): ms and CPU-ms per window [95 % interval], "
             "wire MB per rank and window (in the dtype carried), the update's error against "
             "the float32 run (ddp_foreach): max = largest |w - w_fp32| over the float32 "
             "update's largest |w_fp32 - w0|, p99.9 = the 99.9th percentile of |w - w_fp32| "
             "over the same, L2 = ||w - w_fp32|| / ||w_fp32 - w0||:", "",
             "| model | N | link | variant | ms/window | CPU ms/window/rank | wire MB/rank | "
             "update err max | update err p99.9 | update err L2 | / ddp_bf16_hook | "
             "/ fsdp2_bf16_reduce |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rec in recs:
        for r in rec["results"]:
            v = r["variant"]
            if v not in BF16_VARIANTS and v not in BF16_OF.values():
                continue
            ci = lambda k, f: f % tuple(r[k]) if r.get(k) else "-"  # noqa: E731
            vs = [rec["ratios"].get("%s_vs_%s" % (v, b)) for b in ("ddp_bf16_hook",
                                                                  "fsdp2_bf16_reduce")]
            lines.append("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                rec["model"], rec["hosts"], link_of(rec), v,
                ci("ms_per_window_ci", "%.0f [%.0f, %.0f]"),
                ci("cpu_ms_per_window_ci", "%.1f [%.1f, %.1f]"),
                cell("wire_bytes_per_rank_window", "%.2f", r),
                cell("update_rel_err_vs_fp32", "%.1e", r),
                cell("update_rel_p999_err_vs_fp32", "%.1e", r),
                cell("update_rel_l2_err_vs_fp32", "%.1e", r), " | ".join(
                    "-" if c is None else "%s %s" % (iv_text(c["all"]), verdict(c["all"]))
                    for c in vs)))
    lines += ["", "Issue 46's 16-bit target (ahead of both in wall time, interval below 1, "
              "with an update error no larger than theirs):", "",
              "| model | N | link | variant | / ddp_bf16_hook | / fsdp2_bf16_reduce | "
              "error no larger | met |", "|---|---|---|---|---|---|---|---|"]
    for rec in recs:
        for t in rec.get("bf16_targets", []):
            lines.append("| %s | %d | %s | %s | %s | %s | %s | %s |" % (
                rec["model"], rec["hosts"], link_of(rec), t["variant"] + (
                    "" if t.get("gradient_wire_bytes_per_element") == 2.0 else
                    " (float32 on the wire)"),
                iv_text(t["ratios"]["ddp_bf16_hook"]), iv_text(t["ratios"]["fsdp2_bf16_reduce"]),
                "yes" if t["error_ok"] else "no", "met" if t["met"] else "not met"))
    return lines


STYLE = {"compute_only": ("k", ".", ":"), "compute_only_shard": ("0.5", ".", ":"),
         "ddp_foreach": ("C1", "o", ":"), "ddp_fused": ("C1", "o", "-"),
         "ddp_fused_cap25": ("C1", "s", "--"), "ddp_fused_capsf": ("C1", "^", "-."),
         "ddp_overlap": ("C5", "D", "-"), "fsdp2_reshard": ("C3", "x", "-"),
         "fsdp2_keep": ("C3", "+", "--"), "fsdp2_keep_ring": ("C3", "*", ":"),
         "zero_ddp": ("C4", "v", "-"), "sfsync_sharded": ("C0", "o", "-"),
         "sfsync_sharded_final": ("C0", "^", ":"), "sfsync_sharded_owned": ("C0", "s", "--"),
         "sfsync_perbucket": ("C2", "s", "--"),
         "sfsync_final": ("C2", "^", ":"),
         # 16-bit: their float32 counterpart's colour, a marker of their own
         "sfsync_bf16_perbucket": ("C2", "P", "-"), "sfsync_bf16_sharded": ("C0", "P", "-"),
         "ddp_bf16_hook": ("C1", "P", "-"), "fsdp2_bf16_reduce": ("C3", "P", "-")}


def plot(records, variants, path):
    """One file per model (path's stem + _<model>.png): a panel per host
    count, ms/window against link rate for every variant, the 95 % interval
    as a band, sfsync_sharded's window bound as a black line; below it, where
    the records have them, the CPU-ms per window per rank the same way."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    default = [r for r in records if r.get("bucket_cap_mb") is None]
    records = default or records
    order = [x for x in RATES[::-1] + ["loopback"] if any(r["rate"] == x for r in records)]
    stem = path[:-len(".png")] if path.endswith(".png") else path
    for model in [m for m in MODELS if any(r["model"] == m for r in records)]:
        hosts = sorted({r["hosts"] for r in records if r["model"] == model})
        cpu = any(x.get("cpu_ms_per_window_ci") for r in records if r["model"] == model
                  for x in r["results"])
        fig, axes = plt.subplots(2 if cpu else 1, len(hosts), figsize=(7 * len(hosts),
                                                                      10 if cpu else 5),
                                 squeeze=False)
        for i, n in enumerate(hosts):
            recs = panel_records(records, n, model)
            title = "%s, %d hosts, AdamW, %d micro-batches" % (model, n,
                                                                records[0]["micro_batches"])
            draw_panel(axes[0][i], recs, variants, order, STYLE, title, band="ms_per_window_ci",
                       bound=("sfsync_sharded", "window_bound_ms", "bound (sfsync_sharded)"))
            if cpu:
                # draw_panel plots ms_per_window_median: the CPU-ms put in its place
                as_cpu = {rate: dict(rec, results=[
                    dict(x, ms_per_window_median=x["cpu_ms_per_window_median"])
                    for x in rec["results"] if x.get("cpu_ms_per_window_ci")])
                    for rate, rec in recs.items()}
                draw_panel(axes[1][i], as_cpu, variants, order, STYLE, title + ", CPU",
                           band="cpu_ms_per_window_ci")
                axes[1][i].set_ylabel("CPU-ms per window per rank (user+sys, ranks' mean)")
            for ax in axes[:, i]:
                ax.grid(alpha=0.3, which="both")
                ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig("%s_%s.png" % (stem, model), dpi=100)
        plt.close(fig)


def panel_records(records, hosts, model):
    """One record per link rate for a plot panel: an untagged launch's rows,
    with the variants that only a tagged launch of the same rate ran (the
    grid's "owned" part) added."""
    out = {}
    for r in sorted((r for r in records if r["hosts"] == hosts and r["model"] == model),
                    key=lambda r: bool(r.get("tag"))):
        if r["rate"] not in out:
            out[r["rate"]] = dict(r, results=list(r["results"]))
            continue
        have = {x["variant"] for x in out[r["rate"]]["results"]}
        out[r["rate"]]["results"] += [x for x in r["results"] if x["variant"] not in have]
    return out


def smoke_check(records, variants):
    """--smoke: every column of every variant produced, with values that follow
    from the model (bytes from the collectives issued), and the peers
    configured as the module docstring says (DDP's layout from its logging
    data against torch's rule, FSDP2's settings)."""
    errs = []
    for rec in records:
        got = {r["variant"] for r in rec["results"]}
        missing = [v for v in variants if v not in got]
        if missing:
            errs.append("%s: no result for %s" % (rec["model"], ", ".join(missing)))
        w, g = rec["world_size"], rec["gradient_bytes"]
        f = (w - 1) / w
        for r in rec["results"]:
            v = r["variant"]
            empty_ok = set()
            if v in COMPUTE:
                empty_ok |= {"wire_ms", "exposed_ms", "exposed_over_wire",
                             "exposed_bound_over_wire", "weights_max_abs_diff_vs_ddp",
                             "update_rel_err_vs_fp32"}
            if rec["rate"] == "loopback":  # no link rate to divide by
                empty_ok |= {"wire_ms", "exposed_over_wire", "exposed_bound_over_wire"}
            for k, _, _ in COLUMNS:
                if k not in r:
                    errs.append("%s %s: column %s missing" % (rec["model"], v, k))
                elif r[k] is None and k not in empty_ok:
                    errs.append("%s %s: column %s empty" % (rec["model"], v, k))
            if r["timed_windows"] != rec["rounds"] * rec["windows"] or \
                    [len(x) for x in r["ms_windows_by_round"]] != [rec["windows"]] * rec["rounds"]:
                errs.append("%s %s: %d timed windows" % (rec["model"], v, r["timed_windows"]))
            errs += cpu_errors(rec, r)
            if v not in COMPUTE and r["memory_bytes_max_rank"] <= 0:
                errs.append("%s %s: memory %d" % (rec["model"], v, r["memory_bytes_max_rank"]))
            want = {"sfsync_final": 2 * f * g, "sfsync_perbucket": 2 * f * g,
                    "sfsync_sharded": 2 * f * g, "sfsync_sharded_owned": 2 * f * g,
                    "fsdp2_keep_ring": 2 * f * g,
                    # an all-reduce of the gradients in bf16: half DDP's bytes
                    "sfsync_bf16_perbucket": f * g, "ddp_bf16_hook": f * g,
                    "compute_only": 0, "compute_only_shard": 0}.get(v)
            if v in DDPS or v == "ddp_overlap":
                want = 2 * f * g
            b = r["wire_bytes_per_rank_window"]
            if want is not None and abs(b - want) > 0.01 * max(want, 1):
                errs.append("%s %s: %.0f wire bytes per window, want %.0f" % (
                    rec["model"], v, b, want))
            if v == "sfsync_bf16_sharded":
                # sharded buckets travel in their own dtype (include/sfsync.h,
                # "Sharded windows": wire_dtype does not apply): float32's
                # bytes, or half where a 16-bit reduce-scatter exists
                per = r.get("gradient_wire_bytes_per_element")
                if per not in (2.0, 4.0) or abs(b - per / 4 * 2 * f * g) > 0.01 * f * g:
                    errs.append("%s %s: %.0f wire bytes per window at %s bytes an element" % (
                        rec["model"], v, b, per))
            if v == "sfsync_bf16_perbucket" and r.get("gradient_wire_bytes_per_element") != 2.0:
                errs.append("%s %s: the gradients travelled at %s bytes an element, want 2" % (
                    rec["model"], v, r.get("gradient_wire_bytes_per_element")))
            if v in BF16_VARIANTS and r.get("gradient_wire_bytes_per_element") != 4.0:
                # a 16-bit error, not none (each rank's bf16 rounding shows)
                # and within --tolerance-16 (derive's check)
                for k in ("update_rel_err_vs_fp32", "update_rel_l2_err_vs_fp32"):
                    e = r.get(k)
                    if e is None or not e > 0:
                        errs.append("%s %s: %s %s, want > 0" % (rec["model"], v, k, e))
            if v.startswith("fsdp2") or v in ("zero_ddp", "sfsync_sharded_final"):
                # FSDP2 gathers the parameters in forward (and backward once
                # resharded) and reduce-scatters once: at least 2 x f x g.
                if b < 2 * f * g * 0.99:
                    errs.append("%s %s: %.0f wire bytes per window, want >= %.0f" % (
                        rec["model"], v, b, 2 * f * g))
            errs += config_errors(rec, r)
    return errs


def cpu_errors(rec, r):
    """The CPU figure of a variant present and positive: every timed window's
    CPU-ms (getrusage around it: forward and backward alone cost some), the
    median and its interval."""
    where = "%s %s: " % (rec["model"], r["variant"])
    rows = r.get(CPU_SERIES)
    if not rows or [len(x) for x in rows] != [rec["windows"]] * rec["rounds"]:
        return [where + "CPU-ms per window missing (%s)" % rows]
    if min(x for row in rows for x in row) <= 0:
        return [where + "a window's CPU-ms <= 0: %s" % rows]
    ci = r.get("cpu_ms_per_window_ci")
    if not (r.get("cpu_ms_per_window_median") or 0) > 0 or not ci or not ci[1] > 0:
        return [where + "CPU-ms per window median %s, interval %s: want > 0" % (
            r.get("cpu_ms_per_window_median"), ci)]
    return []


def config_errors(rec, r):
    """The peer configured as stated (see smoke_check)."""
    v, c, errs = r["variant"], r["config"], []
    where = "%s %s: " % (rec["model"], v)
    fused = rec["fused"] and v not in NOT_FUSED
    if c["optimizer"].split(" ")[0] != ("AdamW(fused=True)" if fused else "AdamW(foreach=True)"):
        errs.append(where + "optimizer %s" % c["optimizer"])
    lay = r.get("ddp_layout")
    if (c.get("comm_hook") == "bf16_compress_hook") != (v == "ddp_bf16_hook"):
        errs.append(where + "comm hook %s" % c.get("comm_hook"))
    if v in DDPS or v in ("ddp_overlap", "zero_ddp", "ddp_bf16_hook"):
        if lay is None:
            return errs + [where + "no DDP layout"]
        if not lay["has_rebuilt_buckets"] or not lay["rebuilt_bucket_sizes"]:
            errs.append(where + "DDP did not rebuild its buckets: %s" % lay)
        elif lay["rebuilt_bucket_sizes"] != lay["torch_rule_bucket_sizes"]:
            errs.append(where + "DDP's buckets %s, torch's rule for cap %s gives %s" % (
                lay["rebuilt_bucket_sizes"], c["bucket_cap_mb"], lay["torch_rule_bucket_sizes"]))
        if lay["bucket_cap_bytes"] != lay["torch_rule_bucket_cap_bytes"]:
            errs.append(where + "bucket_cap_bytes %s, want %s" % (
                lay["bucket_cap_bytes"], lay["torch_rule_bucket_cap_bytes"]))
        if int(lay["gradient_as_bucket_view"]) != 1:
            errs.append(where + "gradient_as_bucket_view %s" % lay["gradient_as_bucket_view"])
        if lay["static_graph"] not in (None, 0, "0", False):
            errs.append(where + "static_graph %s (left off: see Runner)" % lay["static_graph"])
        nb = len(lay["rebuilt_bucket_sizes"].split(", "))
        if v in ("ddp_foreach", "ddp_fused") and rec["gradient_bytes"] > 2 ** 20 and nb < 2:
            errs.append(where + "one bucket: torch's small first bucket is missing")
    if v.startswith("fsdp2"):
        want = (not v.startswith("fsdp2_keep"), "ring (all_to_all)" if v.endswith("_ring")
                else "torch's")
        if v == "fsdp2_bf16_reduce":  # torch's default (None), reduce_dtype bf16
            want = (None, "torch's")
        if c["reduce_dtype"] != ("torch.bfloat16" if v == "fsdp2_bf16_reduce" else None):
            errs.append(where + "reduce_dtype %s" % c["reduce_dtype"])
        if (c["reshard_after_forward"], c["reduce_scatter"]) != want:
            errs.append(where + "reshard_after_forward %s, reduce-scatter %s, want %s" % (
                c["reshard_after_forward"], c["reduce_scatter"], want))
        calls = rec["collective_calls"].get("ring_reduce_scatter", 0)
        if v.endswith("_ring") and calls == 0:
            errs.append(where + "the custom reduce-scatter was never called")
    if v.startswith("sfsync"):
        want = (v in SFSYNC_SHARDED, v in ("sfsync_sharded", "sfsync_perbucket") or
                v.startswith("sfsync_bf16"), v != "sfsync_sharded_owned",
                "bf16" if v.startswith("sfsync_bf16") else None)
        if (c["shard_optimizer"], c["overlap_step"], c["whole_gradients"],
                c["wire_dtype"]) != want:
            errs.append(where + "shard_optimizer %s overlap_step %s whole_gradients %s "
                        "wire_dtype %s" % (c["shard_optimizer"], c["overlap_step"],
                                           c["whole_gradients"], c["wire_dtype"]))
    return errs


def previous_merge(path):
    """The merged JSON at path, or None."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def merge(a):
    docs = []
    for path in a.merge:
        with open(path) as f:
            docs.append(json.load(f))
    records = [r for d in docs for r in d["records"]]
    fails = [f for r in records for f in derive(r)]
    variants = present(records)
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
    # A grid's times (--grid: "grid") stay when the same runs are merged
    # again (e.g. by an interpreter with matplotlib, for the plots).
    for d in docs + [previous_merge(os.path.join(a.out, name + ".json"))]:
        if d and "grid" in d and set(d.get("merged_from", {})) == set(sources):
            doc["grid"] = d["grid"]
            break
    write_results(a.out, name, doc, tables(records), lambda path: plot(records, variants, path),
                  "torch2_bench")
    print("torch2_bench: merged %d records into %s/%s.{json,md,png}; the runs took %.0f s" % (
        len(records), a.out, name, doc["wall_s"]))
    return 0


# The issue-35 grid: (hosts, rates, variants, windows, rounds) per part; every
# part for both models. The done-when rows first, then the link-rate sweep
# for the plot (its 1gbit point is the first part's).
SWEEP_VARIANTS = ["compute_only", "compute_only_shard", "ddp_foreach", "ddp_fused", "ddp_overlap",
                  "fsdp2_keep_ring", "sfsync_sharded", "sfsync_sharded_final",
                  "sfsync_perbucket"]
# The transformer's rows (a window ~0.5-1.3 s on 2 cores: every variant at
# 50 x 3 would take ~2 h at 1 Gbit/s; the estimate below is ~1.5x short):
# the variants the targets need, the DDPs that were best in the MLP's rows
# (default caps, sfsync's cap), DDP's overlapped optimizer, sfsync's three
# modes; at 2 hosts the compute-only pair for the bound. FSDP2 at ring
# bytes and ZeRO are in the MLP's rows.
TARGET_VARIANTS = ["ddp_foreach", "ddp_fused", "ddp_fused_capsf", "ddp_overlap",
                   "sfsync_sharded", "sfsync_sharded_final", "sfsync_perbucket"]
# The rows of the default sharded mode without the gradient gather (where
# the integrations own every reader of .grad), a part of its own with the
# peers it is judged against (a launch each: ratios within one launch).
OWNED_VARIANTS = ["ddp_foreach", "ddp_fused", "ddp_fused_capsf", "sfsync_sharded",
                  "sfsync_sharded_final", "sfsync_sharded_owned"]
# (hosts, rates, models, variants, windows per block, runs[, tag: the
# launch's name suffix and its rows' label])
GRID = [([2, 4], ["1gbit"], ["mlp"], [v for v in VARIANTS if v != "sfsync_sharded_owned"],
         50, 3),
        ([2], ["1gbit"], ["transformer"], ["compute_only", "compute_only_shard"] + TARGET_VARIANTS,
         50, 3),
        ([4], ["1gbit"], ["transformer"], TARGET_VARIANTS, 50, 3),
        ([2], ["200mbit", "10gbit", "loopback"], ["mlp"], SWEEP_VARIANTS, 20, 3),
        ([2, 4], ["1gbit"], ["mlp"], OWNED_VARIANTS, 50, 3, "owned"),
        ([2, 4], ["1gbit"], ["transformer"], [v for v in OWNED_VARIANTS if v != "ddp_fused"],
         50, 3, "owned"),
        # the transformer's link-rate sweep for its plot (the DDP that was
        # best in its 1 Gbit/s rows stands for the DDPs)
        ([2], ["200mbit", "10gbit", "loopback"], ["transformer"],
         ["compute_only", "compute_only_shard", "ddp_foreach", "ddp_fused_capsf", "ddp_overlap",
          "sfsync_sharded", "sfsync_sharded_final", "sfsync_sharded_owned", "sfsync_perbucket"],
         20, 3)]
# For the estimate: a window's compute at 2 ranks on this 2-core machine
# (ms; the issue's runs: MLP 38, transformer ~450), doubled at 4 ranks; the
# gradient bytes; exposed wire taken as 0.6 of the wire time (FSDP2 and
# ZeRO 1.5x the bytes), and per launch 25 s of start-up and per block the
# untimed window and the memory phase's 2.
EST = {"mlp": (38.0, 9.49e6), "transformer": (450.0, 46.4e6)}


def window_ms(hosts, rate, model, v):
    """The issue-35 estimate's ms per window of variant v (EST above)."""
    comp, g = EST[model]
    comp *= max(1.0, hosts / 2.0)
    bps = rate_bytes_per_s(rate)
    wire = 0.0 if bps is None or v in COMPUTE else 2 * (hosts - 1) / hosts * g / bps * 1e3
    if v.startswith("fsdp2") or v in ("zero_ddp", "sfsync_sharded_final"):
        wire *= 1.5
    if v in BF16_VARIANTS and not v.startswith("fsdp2"):
        wire *= 0.5
    return comp + 0.6 * wire


def estimate_s(hosts, rate, model, variants, windows, rounds):
    return 25.0 + sum(window_ms(hosts, rate, model, v) * (rounds * (windows + 1) + 2) / 1e3
                      for v in variants)


# Issue 46's rows, one command (--grid fast): item 2's fast-wire rows (2
# hosts, 10 Gbit/s and loopback, both models: the sfsync modes that move
# DDP's bytes against every DDP of the best-DDP set) and item 3's 16-bit rows
# (2 hosts, 1 and 10 Gbit/s, both models: sfsync's bf16 wire per-bucket and
# sharded, DDP's bf16_compress_hook, FSDP2's reduce_dtype bf16; ddp_foreach
# is the float32 run the update's error is taken against, and the float32
# counterparts of sfsync's and the hook's DDP stand beside them).
FAST_VARIANTS = list(DDPS) + ["sfsync_perbucket", "sfsync_sharded", "sfsync_sharded_owned"]
FAST_BF16_VARIANTS = ["ddp_foreach", "ddp_fused_capsf", "sfsync_perbucket",
                      "sfsync_sharded"] + BF16_VARIANTS
# Item 2's rows judge medians within a few percent of 1.00: their windows
# run as 15 runs of 10 (each variant's block then falls in 15 stretches of
# the machine's time, not 3: a 2-core VM's speed drifts by 5-10 % over
# seconds, and a block of 50 windows, about 15 s of the transformer, took
# one stretch's speed whole; the bootstrap resamples the runs). Item 3's
# keep 50 x 3.
FAST_GRID = [([2], ["10gbit", "loopback"], ["mlp"], FAST_VARIANTS, 10, 15),
             ([2], ["10gbit", "loopback"], ["transformer"], FAST_VARIANTS, 10, 15),
             ([2], ["1gbit", "10gbit"], ["mlp"], FAST_BF16_VARIANTS, 50, 3, "bf16"),
             ([2], ["1gbit", "10gbit"], ["transformer"], FAST_BF16_VARIANTS, 50, 3, "bf16")]
# name: (parts, the launches' file stem, the merged file's name)
GRIDS = {"issue35": (GRID, "torch2_grid", "torch2_bench"),
         "fast": (FAST_GRID, "torch2_fast", "torch2_fast")}
# The fast grid's estimate is taken from recorded launches (Costs below); a
# launch's driver work outside its ranks' run (derive's bootstraps, the
# tables, the plot) adds DRIVER_S, and so does each launch again in the final
# merge (measured: --merge of one issue-35 launch, 1.2 s MLP, 1.5 s
# transformer, at load ~2).
DRIVER_S = 2.0


class Costs:
    """Per-row costs from recorded results, for the fast grid's estimate.

    A launch's seconds = its fixed cost + the sum over its variants of
    (windows it runs: 2 of the memory phase + runs x (windows + 1)) x the
    variant's ms per window in that row (model, hosts, rate), + DRIVER_S.
    The ms per window, first found of:
      1. the variant's median in a recorded launch of the row (the newest
         source first: --out's torch2_fast.json, then bench/results'
         torch2_bench.json, issue 35's grid);
      2. a 16-bit variant without one: its float32 counterpart's (BF16_OF),
         less half the counterpart's exposed wire time (half the bytes);
      3. ddp_foreach's ms in the row x the variant's ratio to ddp_foreach in
         the nearest recorded row (same model and hosts, then the other model;
         same rate first);
      4. estimate_s's model (the issue-35 grid's estimate).
    The fixed cost: the median over recorded launches of the same model of
    their wall time less their windows' (start-up, imports, the memory
    phase's barriers, the weight check)."""

    def __init__(self, paths):
        self.rows, fixed = {}, {}
        for path in paths:
            if not os.path.exists(path):
                continue
            with open(path) as f:
                doc = json.load(f)
            for rec in doc["records"]:
                if rec.get("small"):
                    continue
                key = (rec["model"], rec["hosts"], rec["rate"])
                row = self.rows.setdefault(key, {})
                for r in rec["results"]:
                    row.setdefault(r["variant"], r)
                used = sum(r["windows_run"] * r["ms_per_window_median"] / 1e3
                           for r in rec["results"])
                if rec.get("run_s"):
                    fixed.setdefault(rec["model"], []).append(rec["run_s"] - used)
        self.fixed = {m: statistics.median(x) for m, x in fixed.items()}
        self.sources = [p for p in paths if os.path.exists(p)]

    def ms(self, v, model, hosts, rate):
        """(ms per window, how it was found: 1-4 as in the class docstring)."""
        got = self.rows.get((model, hosts, rate), {}).get(v)
        if got is not None:
            return got["ms_per_window_median"], 1
        if v in BF16_OF:
            cp = self.rows.get((model, hosts, rate), {}).get(BF16_OF[v])
            m, _ = self.ms(BF16_OF[v], model, hosts, rate)
            if cp is not None and cp.get("wire_ms") and cp.get("exposed_ms") is not None:
                m -= 0.5 * min(max(cp["exposed_ms"], 0.0), cp["wire_ms"])
            return m, 2
        ref = self.rows.get((model, hosts, rate), {}).get("ddp_foreach")
        if ref is not None:
            other = [x for x in MODELS if x != model]
            for m2 in [model] + other:
                for r2 in [rate] + RATES + ["loopback"]:
                    row = self.rows.get((m2, hosts, r2), {})
                    if v in row and "ddp_foreach" in row:
                        k = row[v]["ms_per_window_median"] / row["ddp_foreach"][
                            "ms_per_window_median"]
                        return ref["ms_per_window_median"] * k, 3
        return window_ms(hosts, rate, model, v), 4

    def launch_s(self, hosts, rate, model, variants, windows, rounds):
        """(seconds, {variant: how its ms was found})."""
        total, how = self.fixed.get(model, 25.0) + DRIVER_S, {}
        for v in variants:
            m, how[v] = self.ms(v, model, hosts, rate)
            total += (2 + rounds * (windows + 1)) * m / 1e3
        return total, how


def grid(a):
    """Runs the grid a.grid names (GRIDS: one launch per part, model, host
    count and rate: a JSON each under --out), then merges them into one
    {json,md,png} (issue35: torch2_bench; fast: torch2_fast). Prints the
    plan and its estimate first (--estimate stops there) and, at the end,
    the time it took against the estimate (also in the merged JSON's
    "grid")."""
    parts, stem, merged = GRIDS[a.grid]
    costs = None
    if a.grid == "fast":
        costs = Costs([os.path.join(a.out, merged + ".json"),
                       os.path.join(ROOT, "bench", "results", "torch2_bench.json")])
        print("plan: per-row costs from %s (a launch: fixed %s s + windows x ms per window "
              "+ %.0f s; see Costs)" % (", ".join(costs.sources) or "no recorded results",
                                        ", ".join("%s %.0f" % kv for kv in sorted(
                                            costs.fixed.items())) or "25", DRIVER_S))
    plan, total = [], 0.0
    for hosts, rates, models, variants, windows, rounds, *tag in parts:
        for n in hosts:
            for rate in rates:
                for model in models:
                    how = None
                    if costs is None:
                        t = estimate_s(n, rate, model, variants, windows, rounds)
                    else:
                        t, how = costs.launch_s(n, rate, model, variants, windows, rounds)
                    total += t
                    plan.append((n, rate, model, variants, windows, rounds, t,
                                 tag[0] if tag else None))
                    print("plan: %s N=%d %-8s %2d variants x %d windows x %d runs  ~%4.0f s%s" % (
                        model, n, rate, len(variants), windows, rounds, t, "" if how is None else
                        "  (ms per window found by rule %s)" % "".join(
                            str(how[v]) for v in variants)))
    if costs is not None:
        total += DRIVER_S * len(plan)  # the final merge
    print("plan: %d launches, estimated %.0f min on this machine" % (len(plan), total / 60),
          flush=True)
    if a.estimate:
        return 0
    names, failed, took, started = [], [], [], time.monotonic()
    for n, rate, model, variants, windows, rounds, est, tag in plan:
        name = "%s_%s_%d_%s%s" % (stem, model, n, rate, "_" + tag if tag else "")
        names.append(os.path.join(a.out, name + ".json"))
        if a.resume and os.path.exists(names[-1]):
            print("grid: %s exists (--resume): kept" % names[-1], flush=True)
            continue
        argv = ["--hosts", str(n), "--rates", rate, "--models", model, "--windows", str(windows),
                "--rounds", str(rounds), "--port", str(a.port), "--python", a.python,
                "--build", a.build, "--out", a.out, "--name", name, "--variants"] + variants
        if tag:
            argv += ["--tag", tag]
        a.port += 40
        start = time.monotonic()
        rc = main(argv)
        took.append({"launch": name, "estimate_s": round(est, 1),
                     "actual_s": round(time.monotonic() - start, 1), "rc": rc})
        print("grid: %s rc %d in %.0f s (estimated %.0f s)" % (
            name, rc, took[-1]["actual_s"], est), flush=True)
        if rc:
            failed.append(name)
    names = [x for x in names if os.path.exists(x)]
    rc = main(["--merge"] + names + ["--out", a.out, "--name", merged]) if names else 1
    actual = time.monotonic() - started
    print("grid %s: took %.1f min, estimated %.1f min (actual / estimate %.2f)" % (
        a.grid, actual / 60, total / 60, actual / total if total else float("nan")), flush=True)
    path = os.path.join(a.out, merged + ".json")
    if names and os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
        doc["grid"] = {"name": a.grid, "estimate_s": round(total, 1),
                       "actual_s": round(actual, 1), "launches": took}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
    if failed:
        print("grid: FAILED launches: %s" % ", ".join(failed), flush=True)
    return 1 if failed else rc


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    if a.merge:
        return merge(a)
    if a.grid:
        return grid(a)
    fails = []

    def run(n, rate):
        argv = [a.python, os.path.abspath(__file__), "--worker", "--rate", rate,
                "--rounds", str(a.rounds), "--windows", str(a.windows),
                "--micro-batches", str(a.micro_batches), "--tolerance", str(a.tolerance),
                "--tolerance-16", str(a.tolerance_16),
                "--models"] + a.models + ["--variants"] + a.variants
        if a.bucket_cap_mb is not None:
            argv += ["--bucket-cap-mb", str(a.bucket_cap_mb)]
        if a.small:
            argv.append("--small")
        if not a.fused:
            argv.append("--no-fused")
        if not a.pin:
            argv.append("--no-pin")
        if a.fault:
            argv += ["--fault", a.fault]
        if a.trace:
            os.makedirs(a.trace, exist_ok=True)
            argv += ["--trace", os.path.abspath(a.trace)]
        load_start = os.getloadavg()
        out = run_ranks(a, n, rate, argv, "torch2_bench")
        for rec in out["records"]:
            rec.update(hosts=n, rate=rate, run_s=out["run_s"], load_start=load_start,
                       load=os.getloadavg(), tag=a.tag)
            fails.extend(derive(rec))
            print("%s N=%d %-8s %s  best DDP %s  %s  load %.1f -> %.1f  %.0f s" % (
                rec["model"], n, rate, " ".join(
                    "%s=%.0f" % (r["variant"], r["ms_per_window_median"])
                    for r in rec["results"]), rec["best_ddp"], " ".join(
                    "%s=%s" % (k, iv_text(c["all"])) for k, c in sorted(rec["ratios"].items())),
                load_start[0], rec["load"][0], out["run_s"]), flush=True)
            print("%s N=%d %-8s CPU-ms/window/rank %s  %s" % (
                rec["model"], n, rate, " ".join(
                    "%s=%.1f" % (r["variant"], r["cpu_ms_per_window_median"])
                    for r in rec["results"]), " ".join(
                    "%s=%s" % (k, iv_text(c["all"]))
                    for k, c in sorted(rec["cpu_ratios"].items()))), flush=True)
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
