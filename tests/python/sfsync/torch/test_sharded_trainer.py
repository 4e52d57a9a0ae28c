"""Sharded windows from PyTorch (issue 17), run by run_torchrun.py under
torchrun: one launch of 4 processes runs the cases of each ``--plan W:CASES``
on its first W ranks (a process group and sfsync contexts of W ranks), so 2,
3 and 4 ranks cost one start.

Every case trains the same small model (sizes no W divides, an unused
parameter, a LayerNorm) over windows of 3, 2 and 4 micro-batches
(set_accumulation_steps) with AdamW in two param groups (weight_decay 0 for
biases and norms) and an LR scheduler, and compares, within 1e-6, with the
reference: DDP used correctly (no_sync() around forward and backward of
micro-batches 1..N-1, find_unused_parameters=True) with the same full AdamW,
the same scheduler and torch.nn.utils.clip_grad_norm_ on the full model.

    flat / parameter       sync.optimizer over shards, clip_grad_norm_, an unused parameter:
                           weights, the full state dict (full_state_dict() == DDP's AdamW
                           state), optimizer state per rank <= 1/W of DDP's + 1 % (flat; the
                           parameter layout: + its largest parameter), per window exactly one
                           reduce-scatter and one all-gather per bucket and 0 collectives inside
                           windows, the sharded state dict round trip, the full form loaded back
    memory / memory-parameter  optimizer state per rank at default caps (flat: <= 1/W + 1 %),
                           and over many small buckets (parameter: <= 1/W + its largest parameter)
    flat-perbucket         find_unused_parameters=False, no clipping: per-bucket steps, gathers
                           waited by the forward pre-hooks
    unsharded              sync.optimizer without sharding: per-bucket steps, the unused
                           parameter skipped (its bucket waits for the mask)
    bf16                   bf16 parameters, float32 master shards, against a single-process
                           reference (every rank's micro-batches replayed here)
    attach                 attach(ddp) (DDP kept) with set_accumulation_steps: DDP's weights
    shards / shards-parameter  whole_gradients=False (no gradient gather) with
                           opt.clip_grad_norm_ (clipping windows 1 and 3, not 2) against the
                           default (the gather, torch's clip over the model): the same norms and
                           weights bit for bit, and per window one all-gather per bucket
                           (parameters only) where no gradient straddles two ranks or nothing
                           clips; flat: the clipping windows gather gradients first when some
                           gradient straddles ranks (they do here), exact all the same
    bad input              step before synchronization, a parameter not in the module, a second
                           optimizer, an unknown layout

Results go to stderr (torchrun --tee 2): "[rank r] OK ..." or CHECK FAILED
lines and exit status 1.
"""

import argparse
import contextlib
import copy
import itertools
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sfsync
from sfsync import shard
from sfsync import torch as sft

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "support"))  # rank_checks
import rank_checks  # noqa: E402

WINDOWS = (3, 2, 4)  # micro-batches per window: set_accumulation_steps between them
TOL = 1e-6


say = rank_checks.say


class Gate(torch.nn.Module):
    """Adds a bias when called: registered last, so its gradient is in the
    first bucket, not in the used mask's (the last)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(5))

    def forward(self, out):
        return out + self.weight


class Net(torch.nn.Module):
    def __init__(self, unused=True, dtype=torch.float32):
        super().__init__()
        self.fc1 = torch.nn.Linear(13, 37)
        self.norm = torch.nn.LayerNorm(37)
        self.fc2 = torch.nn.Linear(37, 29)
        self.fc3 = torch.nn.Linear(29, 5)
        self.unused_weight = torch.nn.Parameter(torch.randn(11)) if unused else None
        # used when the data say so: on 2 ranks by rank 0 only in window 0, by
        # none in window 1 (it has AdamW state by then: DDP's grad None skips
        # it), by both in window 2 (3 and 4 ranks: likewise mixed)
        self.gate = Gate() if unused else None
        self.to(dtype)

    def forward(self, x):
        h = torch.tanh(self.norm(self.fc1(x)))
        out = self.fc3(torch.tanh(self.fc2(h)))
        if self.gate is not None and float(x[0, 12]) > 1.0:
            out = self.gate(out)
        return out


# The ranks of the world size under test: a process group (DDP's) and the
# sfsync contexts' options (rank, world size, a prefix per context in torch's
# store), so that one launch of 4 processes tests 2, 3 and 4 ranks.
GROUP = {"pg": None, "world": None, "rank": None, "count": None}


def gsync(model, **kw):
    """GradientSync over GROUP's ranks."""
    prefix = "sharded-test/w%d/%d" % (GROUP["world"], next(GROUP["count"]))
    return sft.GradientSync(model, store=dist.distributed_c10d._get_default_store(),
                            prefix=prefix, rank=GROUP["rank"], world_size=GROUP["world"], **kw)


def make_net(unused=True, dtype=torch.float32):
    torch.manual_seed(7)
    return Net(unused, dtype)


def groups_of(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and
                                                           "norm" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def batch(rank, window, micro, dtype=torch.float32):
    g = torch.Generator().manual_seed((rank * 1009 + window) * 101 + micro)
    return (torch.randn(6, 13, generator=g).to(dtype), torch.randn(6, 5, generator=g).to(dtype))


def loss_of(model, rank, w, i, n, dtype=torch.float32):
    x, y = batch(rank, w, i, dtype)
    return torch.nn.functional.mse_loss(model(x).float(), y.float()) / n  # (no bf16 mse on CPU)


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))


def state_bytes(opt):
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def reference(rank, clip, unused):
    """DDP, no_sync() around forward+backward, the full AdamW."""
    ddp = DDP(make_net(unused), find_unused_parameters=unused, process_group=GROUP["pg"])
    opt = torch.optim.AdamW(groups_of(ddp.module), lr=0.01)
    sched = schedule(opt)
    norms = []
    for w, n in enumerate(WINDOWS):
        for i in range(n):
            with ddp.no_sync() if i < n - 1 else contextlib.nullcontext():
                loss_of(ddp, rank, w, i, n).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=unused)  # (DDP skips a globally unused one only if None)
    return ddp.module, opt, norms


class _Refs(dict):
    """The DDP references by (clip, unused), computed when first needed."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def __missing__(self, key):
        self[key] = reference(self.rank, 0.05 if key[0] else 0.0, key[1])
        return self[key]


Checks = rank_checks.Checks


def run_sync(rank, world, c, case, layout, clip, unused):
    """The case's run; returns (model, opt, norms)."""
    model = make_net(unused)
    sync = gsync(model, accumulation_steps=WINDOWS[0], shard_optimizer=layout
                            is not None, shard_layout=layout or "flat", bucket_cap_mb=0.002,
                            first_bucket_cap_mb=0.001, find_unused_parameters=unused)
    # overlap_step: the 0.3 windows these cases measure (per-bucket steps,
    # sharded: 1x the bytes, only this rank's range of .grad final; clipping
    # through opt.clip_grad_norm_). The default (every .grad final at
    # is_step()) is test_framework_loop_vs_ddp.py's.
    opt = sync.optimizer(torch.optim.AdamW, groups_of(model), lr=0.01, overlap_step=True)
    c.that(isinstance(opt, torch.optim.Optimizer), "%s: not a torch.optim.Optimizer" % case)
    sched = schedule(opt)
    buckets = sync.context.stats()["bucket_count"]
    c.that(buckets >= 2, "%s: %d buckets (want several)" % (case, buckets))
    norms = []
    for w, n in enumerate(WINDOWS):
        sync.set_accumulation_steps(n)
        for i in range(n):
            before = shard.stats(sync.context)
            loss_of(model, rank, w, i, n).backward()
            after = shard.stats(sync.context)
            if i < n - 1:
                c.that(after["collectives_issued"] == before["collectives_issued"],
                       "%s: window %d pass %d (inside the window) issued %d collectives"
                       % (case, w, i, after["collectives_issued"] - before["collectives_issued"]))
            c.that(sync.is_step() == (i == n - 1), "%s: is_step() %s at pass %d of %d"
                   % (case, sync.is_step(), i + 1, n))
        if clip:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        unused_none = unused and model.unused_weight.grad is None  # (zero_grad re-attaches it)
        sched.step()
        opt.zero_grad(set_to_none=unused)
        end = shard.stats(sync.context)
        if layout is not None:
            c.that(end["reduce_scatters"] - before["reduce_scatters"] == buckets and
                   end["all_gathers"] - before["all_gathers"] == buckets,
                   "%s: window %d: %d reduce-scatters and %d all-gathers, %d buckets" % (
                       case, w, end["reduce_scatters"] - before["reduce_scatters"],
                       end["all_gathers"] - before["all_gathers"], buckets))
        else:
            c.that(end["collectives_issued"] - before["collectives_issued"] == buckets,
                   "%s: window %d: %d collectives for %d buckets" % (
                       case, w, end["collectives_issued"] - before["collectives_issued"],
                       buckets))
        check_wire(c, case, w, before, end, buckets, layout, unused, model)
    c.that(not unused or unused_none, "%s: the unused parameter's .grad is not None after the "
           "step" % case)
    opt.wait_parameters()
    return model, opt, norms, sync


def check_wire(c, case, w, before, end, buckets, layout, unused, model):
    """The wire counts (stats()["wire_*"], since 0.5) of the window's last
    pass and step: every bucket's collective by its kind; the used mask
    (find_unused_parameters) in them: sharded, one sf_allreduce_float64 of
    a float64 per parameter (the count agreed first: 2 control
    collectives, clipping's sum besides); unsharded, riding in a bucket as
    a float32 per parameter."""
    d = {k: end[k] - before[k] for k in end if k.startswith("wire_")}
    params = len(list(model.parameters()))
    c.that(d["wire_bytes"] == sum(d[k] for k in ("wire_gradient_bytes", "wire_parameter_bytes",
                                                 "wire_mask_bytes", "wire_check_bytes",
                                                 "wire_weight_bytes", "wire_host_bytes")),
           "%s: window %d: the wire bytes by purpose do not add up: %s" % (case, w, d))
    if layout is not None:
        ok = (d["wire_reduce_scatters"] == buckets and d["wire_all_gathers"] >= buckets and
              d["wire_allreduces"] == 0 and d["wire_parameter_bytes"] > 0)
        if unused:
            ok = ok and d["wire_controls"] >= 2 and d["wire_host_bytes"] >= 8 * params
    else:
        ok = d["wire_allreduces"] == buckets and d["wire_reduce_scatters"] == 0
        if unused:
            ok = ok and d["wire_mask_bytes"] == 4 * params
    c.that(ok, "%s: window %d: wire counts %s for %d buckets, %d parameters" % (
        case, w, d, buckets, params))


def case_parity(rank, world, c, layout, clip=0.05, unused=True, refs=None):
    case = "%s%s" % (layout or "unsharded", "" if clip else "-perbucket")
    ref_model, ref_opt, ref_norms = refs[(bool(clip), unused)]
    model, opt, norms, sync = run_sync(rank, world, c, case, layout, clip, unused)
    diff = c.close("%s weights vs DDP" % case, model.parameters(), ref_model.parameters())
    if clip:
        c.that(max(abs(a - b) for a, b in zip(norms, ref_norms)) <= 1e-5,
               "%s: clip_grad_norm_ %s vs torch's %s" % (case, norms, ref_norms))
    if unused:
        c.that(torch.equal(model.unused_weight.data, make_net().unused_weight.data),
               "%s: the unused parameter moved" % case)
    c.that([g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups],
           "%s: lr %s vs %s" % (case, [g["lr"] for g in opt.param_groups],
                                [g["lr"] for g in ref_opt.param_groups]))
    # the full form equals DDP's AdamW state
    full = opt.full_state_dict()
    want = ref_opt.state_dict()
    c.that(sorted(full["state"]) == sorted(want["state"]),
           "%s: full state for parameters %s, DDP's %s" % (case, sorted(full["state"]),
                                                          sorted(want["state"])))
    sdiff = 0.0
    for k, st in want["state"].items():
        for key, v in st.items():
            got = full["state"].get(k, {}).get(key)
            if got is None or got.shape != v.shape:
                c.that(False, "%s: full state %d %s missing or shaped %s" % (
                    case, k, key, None if got is None else list(got.shape)))
                continue
            sdiff = max(sdiff, float((got.double() - v.double()).abs().max()))
    c.that(sdiff <= TOL, "%s: full state vs DDP's AdamW: max |diff| %.3g" % (case, sdiff))
    ratio = None
    if layout is not None:
        mine, ddp_bytes = state_bytes(opt), state_bytes(ref_opt)
        # + the padding: a 64-byte alignment per bucket (these buckets are
        # tiny; case_memory checks 1 % on buckets of a realistic size); whole
        # parameters per rank: + the largest parameter of each bucket
        slack = buckets_of(sync) * 16 * 8
        if layout == "parameter":
            largest = {}
            for s in opt.shard_map.slots:
                largest[s.bucket] = max(largest.get(s.bucket, 0), s.param.numel())
            slack += sum(largest.values()) * 8
        ratio = mine / (ddp_bytes / world)
        c.that(mine <= ddp_bytes / world + slack,
               "%s: optimizer state %d bytes on this rank, DDP's %d / %d = %.0f" % (
                   case, mine, ddp_bytes, world, ddp_bytes / world))
        # sharded round trip: save, spoil, load
        sd = copy.deepcopy(opt.state_dict())  # (torch's state_dict holds the live tensors)
        saved = {k: {kk: vv.clone() for kk, vv in st.items()} for k, st in opt.state.items()}
        for st in opt.state.values():
            st["exp_avg"].fill_(123.0)
        opt.load_state_dict(sd)
        same = all(torch.equal(saved_v, opt.state[k][kk]) for k, st in saved.items()
                   for kk, saved_v in st.items()) and len(saved) == len(opt.state)
        c.that(same, "%s: sharded state_dict round trip differs" % case)
        # the full form loaded back: each rank slices its ranges
        for st in opt.state.values():
            st["exp_avg_sq"].fill_(7.0)
        opt.load_state_dict(full)
        same = all(torch.equal(saved_v, opt.state[k][kk]) for k, st in saved.items()
                   for kk, saved_v in st.items())
        c.that(same, "%s: the full state dict loaded back differs" % case)
        # another rank's per-rank form (what a framework that saves from rank
        # 0 alone hands every rank): a ValueError naming both ranks and what
        # to call instead, never a silent load (issue 32)
        every = [None] * world
        dist.all_gather_object(every, opt.state_dict(), group=GROUP["pg"])
        other = every[(rank + 1) % world]
        touched = any(st for st in other["state"].values()) and any(
            st for st in opt.state_dict()["state"].values())
        try:
            opt.load_state_dict(other)
            c.that(not touched, "%s: rank %d's sharded state dict was loaded on rank %d"
                   % (case, (rank + 1) % world, rank))
        except ValueError as e:
            c.that("rank %d of %d" % ((rank + 1) % world, world) in str(e) and
                   "consolidate_state_dict" in str(e),
                   "%s: the error does not name the saving rank and the remedy: %s" % (case, e))
    sync.close()
    return "%s %.1e%s" % (case, diff, "" if ratio is None else " state %.3f/W" % ratio)


def run_shards(rank, c, case, layout, whole):
    """Windows 1 and 3 clip, 2 does not; returns (model, norms, the
    all-gathers of each window, straddling)."""
    model = make_net(True)
    sync = gsync(model, accumulation_steps=WINDOWS[0], shard_optimizer=True,
                 shard_layout=layout, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    opt = sync.optimizer(torch.optim.AdamW, groups_of(model), lr=0.01, whole_gradients=whole)
    sched = schedule(opt)
    norms, gathers = [], []
    for w, n in enumerate(WINDOWS):
        sync.set_accumulation_steps(n)
        before = shard.stats(sync.context)
        for i in range(n):
            loss_of(model, rank, w, i, n).backward()
        c.that(opt.gradients_whole == whole, "%s: gradients_whole %s at the window's end"
               % (case, opt.gradients_whole))
        if w != 1:
            if whole:  # the default: torch's own clip over the model, as users write it
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            else:
                norms.append(opt.clip_grad_norm_(0.05))
        ranges = not opt.gradients_whole  # (a clip over straddling gradients gathered)
        opt.step()
        if ranges:  # the ranges were consumed: no partial gradient left to read
            c.that(all(p.grad is None for p in model.parameters()),
                   "%s: window %d: a .grad is left after the step over ranges" % (case, w))
        sched.step()
        opt.zero_grad(set_to_none=True)
        opt.wait_parameters()
        gathers.append(shard.stats(sync.context)["all_gathers"] - before["all_gathers"])
    straddling = any(opt._straddling()) if not whole else None
    buckets = buckets_of(sync)
    sync.close()
    return model, norms, gathers, straddling, buckets


def case_shards(rank, world, c, layout):
    """whole_gradients=False against the default: the same bits (the module
    docstring)."""
    case = "shards" if layout == "flat" else "shards-parameter"
    ref, ref_norms, ref_gathers, _, buckets = run_shards(rank, c, case, layout, True)
    model, norms, gathers, straddling, _ = run_shards(rank, c, case, layout, False)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    c.that(same, "%s: weights differ from the default's (gradient gather, torch's clip)" % case)
    c.that(len(norms) == len(ref_norms) and all(torch.equal(a, b) for a, b in
                                                zip(norms, ref_norms)),
           "%s: norms %s, torch's over the gathered gradients %s"
           % (case, [float(x) for x in norms], [float(x) for x in ref_norms]))
    c.that(ref_gathers == [2 * buckets] * len(WINDOWS),
           "%s: the default gathered %s per window, want gradients + parameters (2 x %d)"
           % (case, ref_gathers, buckets))
    want = [buckets if (w == 1 or not straddling) else 2 * buckets for w in range(len(WINDOWS))]
    c.that(gathers == want, "%s: all-gathers per window %s, want %s (straddling: %s)"
           % (case, gathers, want, straddling))
    # the flat case must take the gather-first path (the model's sizes no W
    # divides), the parameter case never
    c.that(straddling == (layout == "flat"), "%s: straddling gradients %s in the %s layout"
           % (case, straddling, layout))
    return "%s gathers %s (default %s)" % (case, gathers, ref_gathers)


def buckets_of(sync):
    return sync.context.stats()["bucket_count"]


def case_memory(rank, world, c, layout="flat"):
    """Optimizer state per rank <= 1/W of the full AdamW's + 1 % (flat),
    at the default bucket caps, after one step. The parameter layout
    (whole tensors per rank): <= 1/W + its largest parameter, on a model of
    many small buckets (where rank 0 held the first group of every bucket
    before the groups were spread across buckets)."""
    torch.manual_seed(3)
    if layout == "flat":
        model = torch.nn.Sequential(torch.nn.Linear(300, 301), torch.nn.Tanh(),
                                    torch.nn.Linear(301, 7))
        caps = {}
    else:
        model = torch.nn.Sequential(*[torch.nn.Linear(64 + i, 65 + i) for i in range(12)])
        caps = {"bucket_cap_mb": 0.02, "first_bucket_cap_mb": 0.02}
    sync = gsync(model, accumulation_steps=1, shard_optimizer=True,
                 shard_layout=layout, find_unused_parameters=False, **caps)
    opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    x = torch.randn(4, 64 if caps else 300, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()
    full = sum(p.numel() for p in model.parameters()) * 8  # exp_avg + exp_avg_sq, float32
    mine = state_bytes(opt)
    slack = 0.01 * full / world
    if layout == "parameter":
        slack = max(p.numel() for p in model.parameters()) * 8
        c.that(buckets_of(sync) >= 2 * world, "memory: %d buckets, wanted >= %d" % (
            buckets_of(sync), 2 * world))
    c.that(mine <= full / world + slack, "memory (%s): optimizer state %d bytes on this rank, "
           "the full AdamW's %d / %d = %.0f (+ %.0f)" % (layout, mine, full, world,
                                                        full / world, slack))
    gathered = shard.stats(sync.context)["bytes_gathered"]
    grads = sum(p.numel() * 4 for p in model.parameters())
    # the default optimizer: the reduced gradients gathered (final .grad at
    # is_step()), then the parameters: twice the parameter bytes
    c.that(2 * grads <= gathered <= 2.04 * grads, "memory: %d bytes gathered for %d parameter "
           "bytes (gradients and parameters)" % (gathered, grads))
    sync.close()
    return "memory %s %.4f/W" % (layout, mine / (full / world))


def case_bf16(rank, world, c):
    """bf16 parameters: float32 master shards, against every rank's
    micro-batches replayed in this process (DDP over Gloo rejects bf16)."""
    model = make_net(True, torch.bfloat16)
    sync = gsync(model, accumulation_steps=2, shard_optimizer=True,
                            shard_layout="flat", bucket_cap_mb=0.002)
    opt = sync.optimizer(torch.optim.AdamW, groups_of(model), lr=1e-3)
    for w in range(3):
        for i in range(2):
            loss_of(model, rank, w, i, 2, torch.bfloat16).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_parameters()
    masters = [s.tensor for s in opt.shard_map.stepped]
    c.that(all(t.dtype == torch.float32 for t in masters) and masters,
           "bf16: the shards stepped are not float32 masters")
    # reference: a bf16 replica per rank, gradients averaged in float32, a
    # float32 master AdamW over the whole model, written back rounded
    ref = make_net(True, torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_(False) for p in ref.parameters()]
    names = [n for n, _ in ref.named_parameters()]
    groups = [{"params": [m for m, n in zip(master, names) if n.endswith("weight") and
                          "norm" not in n], "weight_decay": 0.1},
              {"params": [m for m, n in zip(master, names) if not (n.endswith("weight") and
                                                                  "norm" not in n)],
               "weight_decay": 0.0}]
    ropt = torch.optim.AdamW(groups, lr=1e-3)
    for w in range(3):
        total = [torch.zeros_like(m) for m in master]
        for r in range(world):
            ref.zero_grad(set_to_none=True)
            for i in range(2):
                loss_of(ref, r, w, i, 2, torch.bfloat16).backward()
            for t, p in zip(total, ref.parameters()):
                if p.grad is not None:
                    t += p.grad.float()
        for m, t, n in zip(master, total, names):
            m.grad = None if n == "unused_weight" else t / world
        ropt.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), master):
                p.copy_(m)
    # bf16 sums in another order round differently: one bf16 ulp of the
    # largest weight, and most weights equal
    diffs = torch.cat([(a.double() - b.double()).abs().reshape(-1)
                       for a, b in zip(model.parameters(), ref.parameters())])
    scale = max(float(p.detach().abs().max()) for p in ref.parameters())
    moved = sum(int((a != b).sum()) for a, b in zip(model.parameters(), make_net(
        True, torch.bfloat16).parameters()))
    c.that(float(diffs.max()) <= scale * 2 ** -7 and float((diffs == 0).double().mean()) > 0.9,
           "bf16: max |diff| %.3g (scale %.3g), %.3f equal" % (
               float(diffs.max()), scale, float((diffs == 0).double().mean())))
    c.that(moved > 0, "bf16: no weight moved")
    sync.close()
    return "bf16 max %.1e equal %.3f" % (float(diffs.max()), float((diffs == 0).double().mean()))


def case_attach(rank, world, c, refs):
    """attach(ddp) with set_accumulation_steps: windows of 3, 2, 4 passes
    without no_sync(), the weights of the DDP reference."""
    ref_model, _, _ = refs[(False, True)]
    ddp = DDP(make_net(), find_unused_parameters=True, process_group=GROUP["pg"])
    sync = sft.attach(ddp, accumulation_steps=WINDOWS[0], store=dist.distributed_c10d.
                      _get_default_store(), prefix="sharded-test/attach/w%d" % world,
                      rank=rank, world_size=world)
    opt = torch.optim.AdamW(groups_of(ddp.module), lr=0.01)
    sched = schedule(opt)
    for w, n in enumerate(WINDOWS):
        sync.set_accumulation_steps(n)
        for i in range(n):
            loss_of(ddp, rank, w, i, n).backward()
            c.that(sync.is_step() == (i == n - 1), "attach: is_step() %s at pass %d of %d"
                   % (sync.is_step(), i + 1, n))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    diff = c.close("attach weights vs DDP", ddp.module.parameters(), ref_model.parameters())
    sync.close()
    return "attach %.1e" % diff


def case_bad_input(rank, world, c):
    model = make_net()
    try:
        gsync(model, shard_optimizer=True, shard_layout="rows")
        c.that(False, "an unknown shard_layout was accepted")
    except ValueError as e:
        c.that("shard_layout" in str(e) and "rows" in str(e), "unknown layout: %s" % e)
    sync = gsync(model, accumulation_steps=2, shard_optimizer=True)
    opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    try:
        opt.step()  # before any synchronization
        c.that(False, "a sharded step before synchronization was accepted")
    except (RuntimeError, sfsync.SfError) as e:
        c.that("synchroniz" in str(e), "step before synchronization: %s" % e)
    try:
        sync.optimizer(torch.optim.AdamW, model.parameters())
        c.that(False, "a second optimizer was accepted")
    except RuntimeError as e:
        c.that("already" in str(e), "second optimizer: %s" % e)
    sync.close()
    sync = gsync(make_net(), accumulation_steps=2)
    try:
        sync.optimizer(torch.optim.AdamW, [torch.nn.Parameter(torch.zeros(3))])
        c.that(False, "a parameter outside the module was accepted")
    except ValueError as e:
        c.that("not one of" in str(e), "foreign parameter: %s" % e)
    sync.close()
    return "bad input"


CASES = ("flat,parameter,flat-perbucket,unsharded,unsharded-perbucket,memory,memory-parameter,"
         "shards,shards-parameter,"
         "bf16,attach,bad")


def run_cases(rank, world, cases, c):
    refs = _Refs(rank)
    done = []
    for name in cases:
        if name == "flat":
            done.append(case_parity(rank, world, c, "flat", refs=refs))
        elif name == "parameter":
            done.append(case_parity(rank, world, c, "parameter", refs=refs))
        elif name == "flat-perbucket":
            done.append(case_parity(rank, world, c, "flat", clip=0.0, unused=False, refs=refs))
        elif name == "unsharded":
            done.append(case_parity(rank, world, c, None, refs=refs))
        elif name == "unsharded-perbucket":
            done.append(case_parity(rank, world, c, None, clip=0.0, unused=True, refs=refs))
        elif name == "memory":
            done.append(case_memory(rank, world, c))
        elif name == "memory-parameter":
            done.append(case_memory(rank, world, c, "parameter"))
        elif name == "bf16":
            done.append(case_bf16(rank, world, c))
        elif name == "attach":
            done.append(case_attach(rank, world, c, refs))
        elif name == "shards":
            done.append(case_shards(rank, world, c, "flat"))
        elif name == "shards-parameter":
            done.append(case_shards(rank, world, c, "parameter"))
        elif name == "bad":
            done.append(case_bad_input(rank, world, c))
        else:
            raise SystemExit("unknown case %r" % name)
    return done


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--plan", action="append", default=[], metavar="W:CASES",
                   help="run CASES (comma-separated, default all) on the first W ranks; "
                   "repeatable (default: every case on all ranks)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plans = []
    for item in args.plan or ["%d:%s" % (world, CASES)]:
        w, _, cases = item.partition(":")
        if not 2 <= int(w) <= world:
            raise SystemExit("--plan %s: W must be 2..%d" % (item, world))
        plans.append((int(w), (cases or CASES).split(",")))
    c = Checks(rank)
    done = []
    for w, cases in plans:
        pg = dist.new_group(list(range(w)))  # (every rank takes part in making it)
        if rank < w:
            GROUP.update(pg=pg, world=w, rank=rank, count=itertools.count())
            done.append("W=%d: %s" % (w, "; ".join(run_cases(rank, w, cases, c))))
        dist.barrier()
    return c.finish(done)


if __name__ == "__main__":
    sys.exit(main())
