"""Hosts that decide their own windows, and gradients and parameters final
whenever user code can read them (issue 22), under torchrun with 2 ranks
(run by run_torchrun.py). Every case trains the same model over windows of
4, 4 and 2 micro-batches (an epoch whose last window is short) the way the
trainer frameworks loop (Accelerate's accumulate(), Lightning, the HF
Trainer): ``no_sync()`` around forward and backward of micro-batches 1..N-1,
clipping with ``torch.nn.utils.clip_grad_norm_(model.parameters())`` between
the window's last backward and ``optimizer.step()``, and compares with DDP
used the same way (max |diff| <= 1e-6, ranks equal).

    ddp-nosync       attach(ddp, accumulation_steps=4) + DDP's own no_sync(): sfsync
                     follows the host (it deferred 3 of every 4 real synchronizations)
    ddp-contradict   attach(ddp, accumulation_steps=4) + no_sync() windows of 2: a
                     RuntimeError at the first window naming both, no silent divergence
    gs-nosync        GradientSync(model) driven as DDP: sync(x), sync.no_sync(); the first
                     pass outside synchronizes inside backward(); torch SGD
    gs-nosync-n      the same with accumulation_steps=4 given too (agrees with the host)
    gs-contradict    GradientSync(accumulation_steps=4) + no_sync() windows of 3: error
    perbucket-clip   sync.optimizer(AdamW) (per-bucket) + torch's clip after is_step():
                     every .grad is the reduced one when is_step() turns True (it raced
                     with the buckets still being reduced)
    sharded-state    shard_optimizer=True + AdamW: model.state_dict() and
                     named_parameters() after the last step are the gathered weights on
                     every rank (they were stale outside this rank's shard)
    sharded-clip     shard_optimizer=True + torch's clip after is_step(): the whole .grad
                     is final on every rank (only this rank's shard was)
    torch-api        step pre/post hooks fire on a SyncOptimizer; zero_grad() follows
                     torch's set_to_none default; GradScaler unscale_/step/update
    amp / amp-sharded  (torch 2.x) bf16 autocast + torch.amp.GradScaler("cpu"): scale,
                     unscale_, torch's clip, scaler.step, update, an LR scheduler, against
                     DDP doing the same; sharded: the scaler finds the shard tensors'
                     gradients (it asserted "No inf checks were recorded")
    compile          (torch 2.x) torch.compile(model) under GradientSync, framework loop:
                     DDP's weights (graph breaks are allowed, wrong results are not)

Results go to stderr: "[rank r] OK ..." or CHECK FAILED lines and exit 1.
"""

import argparse
import contextlib
import inspect
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sfsync import torch as sft

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "support"))  # rank_checks
import rank_checks  # noqa: E402

WINDOWS = (4, 4, 2)
TOL = 1e-6
CLIP = 0.05


say = rank_checks.say


class Net(torch.nn.Module):
    """Wide enough that a bucket's all-reduce takes milliseconds (a read of
    .grad right after backward() would race with it), several buckets."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 512)
        self.fc2 = torch.nn.Linear(512, 512)
        self.norm = torch.nn.LayerNorm(512)
        self.fc3 = torch.nn.Linear(512, 512)
        self.fc4 = torch.nn.Linear(512, 8)

    def forward(self, x):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.fc4(torch.tanh(self.fc3(self.norm(h))))


def make_net():
    torch.manual_seed(11)
    return Net()


def batch(rank, window, micro):
    g = torch.Generator().manual_seed((rank * 1009 + window) * 101 + micro)
    return torch.randn(8, 64, generator=g), torch.randn(8, 8, generator=g)


def loss_of(model, rank, w, i, n):
    x, y = batch(rank, w, i)
    return torch.nn.functional.mse_loss(model(x), y) / n


def framework_loop(model, opt, rank, no_sync, clip, after_backward=None, windows=WINDOWS,
                   sync=None):
    """A framework's loop: no_sync() around forward+backward of 1..N-1, clip
    with torch's function, step, zero_grad. ``no_sync=None``: a counting
    GradientSync ``sync`` told each window's length instead."""
    norms = []
    for w, n in enumerate(windows):
        if no_sync is None:
            sync.set_accumulation_steps(n)
        for i in range(n):
            with no_sync() if no_sync is not None and i < n - 1 else contextlib.nullcontext():
                loss_of(model, rank, w, i, n).backward()
        if after_backward is not None:
            after_backward(w)
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return norms


def reference(rank, optimizer, clip, grads=None):
    """DDP used as the frameworks use it; ``grads``: a list that receives
    each window's reduced gradients (before clipping)."""
    ddp = DDP(make_net())
    opt = optimizer(ddp.parameters())
    keep = (lambda w: grads.append([p.grad.clone() for p in ddp.parameters()])) \
        if grads is not None else None
    norms = framework_loop(ddp, opt, rank, ddp.no_sync, clip, keep)
    return ddp.module, norms


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01)


class Checks(rank_checks.Checks):
    def ranks_equal(self, what, tensors):
        """Every rank holds bitwise the same tensors (all_gather)."""
        flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
        every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(every, flat)
        diff = max(float((e - flat).abs().max()) for e in every)
        self.that(diff == 0, "%s: ranks differ by %.3g" % (what, diff))
        return diff



def case_ddp_nosync(rank, c):
    ref, ref_norms = reference(rank, sgd, CLIP)
    ddp = DDP(make_net())
    sync = sft.attach(ddp, accumulation_steps=4)
    opt = sgd(ddp.parameters())
    norms = framework_loop(ddp, opt, rank, ddp.no_sync, CLIP)
    d = c.close("ddp-nosync weights vs DDP", ddp.module.parameters(), ref.parameters())
    c.close("ddp-nosync clip norms", [torch.tensor(norms)], [torch.tensor(ref_norms)])
    c.ranks_equal("ddp-nosync weights", list(ddp.module.parameters()))
    c.that(sync.windows == len(WINDOWS), "ddp-nosync: %d windows counted, want %d"
           % (sync.windows, len(WINDOWS)))
    sync.close()
    return "ddp-nosync %.2g" % d


def expect_contradiction(c, name, sync, model, opt, rank, n):
    """Host windows of n micro-batches under accumulation_steps=4: the
    RuntimeError at the first window names both (no silent divergence)."""
    try:
        framework_loop(model, opt, rank, model.no_sync, 0.0, windows=(n, n))
        c.that(False, "%s: windows of %d under accumulation_steps=4 ran silently" % (name, n))
    except RuntimeError as e:
        c.that("accumulation_steps=4, but the host synchronizes after %d micro-batches" % n
               in str(e), "%s: the error does not name both: %s" % (name, e))
    sync.close()
    return name


def case_ddp_contradict(rank, c):
    ddp = DDP(make_net())
    sync = sft.attach(ddp, accumulation_steps=4)
    return expect_contradiction(c, "ddp-contradict", sync, ddp, sgd(ddp.parameters()), rank, 2)


def case_gs_nosync(rank, c, n=None):
    ref, ref_norms = reference(rank, sgd, CLIP)
    model = make_net()
    sync = sft.GradientSync(model, accumulation_steps=n, bucket_cap_mb=0.5,
                            first_bucket_cap_mb=0.1)
    c.that(sync.module is model, "gs-nosync: sync.module is not the module")
    opt = sgd(model.parameters())
    steps = []
    norms = framework_loop(sync, opt, rank, sync.no_sync, CLIP,
                           after_backward=lambda w: steps.append(sync.is_step()))
    name = "gs-nosync%s" % ("-n" if n else "")
    d = c.close("%s weights vs DDP" % name, model.parameters(), ref.parameters())
    c.close("%s clip norms" % name, [torch.tensor(norms)], [torch.tensor(ref_norms)])
    c.ranks_equal("%s weights" % name, list(model.parameters()))
    c.that(steps == [True] * len(WINDOWS), "%s: is_step() after each window: %s" % (name, steps))
    st = sync.stats()
    c.that(st["windows_completed"] == len(WINDOWS) and sync.windows == len(WINDOWS),
           "%s: %d windows synchronized (%d counted here), want %d"
           % (name, st["windows_completed"], sync.windows, len(WINDOWS)))
    # one collective per bucket per window (the frameworks' own DDP: also 1x)
    c.that(st["collectives_issued"] == len(WINDOWS) * st["bucket_count"],
           "%s: %d collectives for %d windows of %d buckets" % (
               name, st["collectives_issued"], len(WINDOWS), st["bucket_count"]))
    sync.close()
    return "%s %.2g" % (name, d)


def case_gs_contradict(rank, c):
    model = make_net()
    sync = sft.GradientSync(model, accumulation_steps=4)
    return expect_contradiction(c, "gs-contradict", sync, sync, sgd(model.parameters()), rank, 3)


def case_perbucket_clip(rank, c):
    ref_grads = []
    ref, ref_norms = reference(rank, adamw, CLIP, ref_grads)
    model = make_net()
    sync = sft.GradientSync(model, accumulation_steps=WINDOWS[0], bucket_cap_mb=0.5,
                            first_bucket_cap_mb=0.1, find_unused_parameters=False)
    opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    c.that(sync.stats()["bucket_count"] >= 3, "perbucket-clip: want several buckets")
    seen = []

    def read_now(w):  # what a framework's grad-norm logging reads, at once
        c.that(sync.is_step(), "perbucket-clip: is_step() False after window %d" % w)
        seen.append([p.grad.clone() for p in model.parameters()])
    norms = framework_loop(model, opt, rank, None, CLIP, after_backward=read_now, sync=sync)
    for w, (got, want) in enumerate(zip(seen, ref_grads)):
        c.close("perbucket-clip window %d .grad at is_step()" % w, got, want)
    d = c.close("perbucket-clip weights vs DDP", model.parameters(), ref.parameters())
    c.close("perbucket-clip clip norms", [torch.tensor(norms)], [torch.tensor(ref_norms)])
    c.ranks_equal("perbucket-clip weights", list(model.parameters()))
    sync.close()
    return "perbucket-clip %.2g" % d


def case_sharded(rank, c, clip):
    name = "sharded-clip" if clip else "sharded-state"
    ref_grads = []
    ref, ref_norms = reference(rank, adamw, clip, ref_grads)
    model = make_net()
    sync = sft.GradientSync(model, accumulation_steps=WINDOWS[0], shard_optimizer=True,
                            bucket_cap_mb=0.5,
                            first_bucket_cap_mb=0.1, find_unused_parameters=False)
    opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    seen = []
    norms = framework_loop(model, opt, rank, None, clip, sync=sync, after_backward=lambda w:
                           seen.append([p.grad.clone() for p in model.parameters()]))
    if clip:
        for w, (got, want) in enumerate(zip(seen, ref_grads)):
            c.close("%s window %d .grad at is_step()" % (name, w), got, want)
        c.close("%s clip norms" % name, [torch.tensor(norms)], [torch.tensor(ref_norms)])
    # How a checkpoint is saved, and how evaluation code reads weights.
    state = model.state_dict()
    d = c.close("%s state_dict() vs DDP" % name, list(state.values()),
                list(ref.state_dict().values()))
    c.ranks_equal("%s state_dict()" % name, list(state.values()))
    c.close("%s named_parameters() vs DDP" % name, [p for _, p in model.named_parameters()],
            list(ref.parameters()))
    sync.close()
    return "%s %.2g" % (name, d)


def case_torch_api(rank, c):
    model = make_net()
    sync = sft.GradientSync(model, accumulation_steps=2, find_unused_parameters=False)
    opt = sync.optimizer(torch.optim.SGD, model.parameters(), lr=0.01)
    fired = []
    if hasattr(opt, "register_step_pre_hook"):
        opt.register_step_pre_hook(lambda o, a, k: fired.append("pre"))
        opt.register_step_post_hook(lambda o, a, k: fired.append("post"))
    framework_loop(model, opt, rank, None, 0.0, windows=(2,), sync=sync)
    if hasattr(torch.optim.Optimizer, "register_step_pre_hook"):
        c.that(fired == ["pre", "post"], "torch-api: step hooks fired %s" % fired)
    default = inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default
    sync.set_accumulation_steps(1)
    loss_of(model, rank, 9, 0, 1).backward()
    opt.step()
    opt.zero_grad()
    grads = [p.grad for p in model.parameters()]
    if default:
        c.that(all(g is None for g in grads), "torch-api: zero_grad() left .grad set although "
               "torch's default is set_to_none=True")
    else:
        c.that(all(g is not None and float(g.abs().max()) == 0 for g in grads),
               "torch-api: zero_grad() did not zero in place (torch's default)")
    scaler_cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler_cls is not None and "device" in inspect.signature(scaler_cls).parameters:
        scaler = scaler_cls("cpu")
        sync.set_accumulation_steps(2)
        for i in range(2):
            scaler.scale(loss_of(model, rank, 10, i, 2)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        c.ranks_equal("torch-api GradScaler weights", list(model.parameters()))
    sync.close()
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    if config is not None and hasattr(config, "optimize_ddp"):
        # compiled DDP's python reducer calls comm hooks per parameter: refused
        old, config.optimize_ddp = config.optimize_ddp, "python_reducer"
        try:
            sft.attach(DDP(make_net()))
            c.that(False, "torch-api: attach under optimize_ddp='python_reducer' was accepted")
        except RuntimeError as e:
            c.that("python_reducer" in str(e) and "GradientSync" in str(e),
                   "torch-api: the python reducer refusal says %s" % e)
        finally:
            config.optimize_ddp = old
    return "torch-api"


def amp_loop(model, opt, rank, no_sync):
    """The frameworks' mixed-precision loop: bf16 autocast forward, a
    GradScaler around backward and step, torch's clip after unscale_."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    for w, n in enumerate(WINDOWS):
        for i in range(n):
            with no_sync() if i < n - 1 else contextlib.nullcontext():
                x, y = batch(rank, w, i)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                loss = torch.nn.functional.mse_loss(out.float(), y) / n
                scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    return scaler.get_scale()


def case_amp(rank, c, sharded):
    name = "amp-sharded" if sharded else "amp"
    scaler_cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler_cls is None or "device" not in inspect.signature(scaler_cls).parameters:
        return "%s (torch %s has no torch.amp.GradScaler('cpu'))" % (name, torch.__version__)
    ddp = DDP(make_net())
    ref_scale = amp_loop(ddp, adamw(ddp.parameters()), rank, ddp.no_sync)
    model = make_net()
    sync = sft.GradientSync(model, shard_optimizer=sharded, bucket_cap_mb=0.5,
                            first_bucket_cap_mb=0.1, find_unused_parameters=False)
    opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    scale = amp_loop(sync, opt, rank, sync.no_sync)
    c.that(scale == ref_scale, "%s: loss scale %g, DDP's %g" % (name, scale, ref_scale))
    state = model.state_dict()
    d = c.close("%s weights vs DDP" % name, list(state.values()),
                list(ddp.module.state_dict().values()))
    c.ranks_equal("%s weights" % name, list(state.values()))
    sync.close()
    return "%s %.2g" % (name, d)


def case_compile(rank, c):
    if not hasattr(torch, "compile"):
        return "compile (torch %s has no torch.compile)" % torch.__version__
    ref, ref_norms = reference(rank, sgd, CLIP)
    model = make_net()
    sync = sft.GradientSync(model, bucket_cap_mb=0.5, first_bucket_cap_mb=0.1)
    compiled = torch.compile(model)
    opt = sgd(model.parameters())
    norms = framework_loop(compiled, opt, rank, sync.no_sync, CLIP)
    # compiled kernels may sum in another order than eager DDP's: float32
    # rounding, nothing more (a skipped or doubled reduction is >= 1e-3)
    d = c.close("compile weights vs DDP", model.parameters(), ref.parameters(), tol=1e-5)
    c.close("compile clip norms", [torch.tensor(norms)], [torch.tensor(ref_norms)], tol=1e-5)
    c.ranks_equal("compile weights", list(model.parameters()))
    c.that(sync.windows == len(WINDOWS), "compile: %d windows, want %d"
           % (sync.windows, len(WINDOWS)))
    sync.close()
    return "compile %.2g" % d


CASES = {
    "ddp-nosync": case_ddp_nosync,
    "ddp-contradict": case_ddp_contradict,
    "gs-nosync": case_gs_nosync,
    "gs-nosync-n": lambda rank, c: case_gs_nosync(rank, c, 4),
    "gs-contradict": case_gs_contradict,
    "perbucket-clip": case_perbucket_clip,
    "sharded-state": lambda rank, c: case_sharded(rank, c, 0.0),
    "sharded-clip": lambda rank, c: case_sharded(rank, c, CLIP),
    "torch-api": case_torch_api,
    "amp": lambda rank, c: case_amp(rank, c, False),
    "amp-sharded": lambda rank, c: case_amp(rank, c, True),
    "compile": case_compile,
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(k for k in CASES if k != "compile"))
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    c = Checks(rank)
    done = []
    for name in args.cases.split(","):
        try:
            done.append(CASES[name](rank, c))
        except Exception as e:  # a case that crashes fails, the others still run
            c.that(False, "%s raised %s: %s" % (name, type(e).__name__, e))
        dist.barrier()
    return c.finish(done)


if __name__ == "__main__":
    sys.exit(main())
