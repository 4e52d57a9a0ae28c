"""Sharded checkpoints that resume at the same or another world size
(issue 32), 3 processes under torchrun, gloo, sfsync contexts over 2 or 3 of
them (GradientSync's rank/world_size/prefix over torch's store):

    full     consolidate_state_dict() on every rank, rank 0 alone saves
             {model, optimizer, sync} (what Lightning and the sfsync
             integrations of the HF Trainer and Accelerate do), every rank of
             the new world loads the file
    dcp      torch.distributed.checkpoint: dcp.save({"model": ..., "optim": opt})
             (the optimizer as a Stateful: each rank writes its own boxes),
             dcp.load at the new world size (the boxes reshard)
    dsd      dcp with torch's get_state_dict / set_state_dict (names as keys)

Each run trains K windows of the same global batches (G samples, split over
the ranks, N micro-batches each, the loss a sum over samples scaled W / G so
that the average over ranks is the global token mean), stops after S, saves,
and a fresh model, GradientSync and AdamW at the new world size (another
initialisation, so a load that does nothing fails) load and finish. Judged:
the weights against a one-process AdamW reference over the same global
batches (1e-6), the ranks identical, the window count continued. bf16: the
float32 master shards travel (a 2 -> 2 resume bitwise equal to the
uninterrupted run). The bad checkpoints end in their named error on every
rank: another model, a rank's DCP file missing, a save or load inside a
window. torch.distributed.checkpoint's shard protocol
(torch.distributed.checkpoint.protocol) is torch >= 2.15: the dcp cases run
there, the full ones on every torch.
"""

import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

import sfsync.torch as sft

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "support"))  # rank_checks
from rank_checks import Checks, say  # noqa: E402

K, S, N, G, LR = 6, 3, 2, 12, 0.05
try:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import protocol as _protocol  # noqa: F401
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
except ImportError:
    dcp = None


class Net(torch.nn.Module):
    def __init__(self, seed, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(13, 9).to(dtype)
        self.fc2 = torch.nn.Linear(9, 5).to(dtype)
        self.scale = torch.nn.Parameter(torch.ones(5, dtype=dtype))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def data(window, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + window)
    return torch.randn(G, 13, generator=g).to(dtype), torch.randn(G, 5, generator=g).to(dtype)


def loss_sum(model, x, y):
    return ((model(x).float() - y.float()) ** 2).sum()


def reference(dtype=torch.float32):
    """One process over each window's whole global batch."""
    model = Net(0, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for w in range(K):
        x, y = data(w, dtype)
        (loss_sum(model, x, y) / G).backward()
        opt.step()
        opt.zero_grad()
    return model


class World:
    """sfsync over the first W ranks of the launch."""

    count = 0

    def __init__(self, w):
        World.count += 1  # (every rank makes every World)
        self.id, self.made = World.count, 0
        self.w, self.rank = w, dist.get_rank()
        self.pg = dist.new_group(list(range(w)))  # (every rank takes part)
        self.member = self.rank < w

    def trainee(self, seed, layout, dtype=torch.float32, **options):
        self.made += 1  # (the members make the same trainees in the same order)
        model = Net(seed, dtype)
        sync = sft.GradientSync(model, store=dist.distributed_c10d._get_default_store(),
                                prefix="ckpt-test/%d/%d" % (self.id, self.made), rank=self.rank,
                                world_size=self.w,
                                shard_optimizer=True, shard_layout=layout, **options)
        opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=LR, weight_decay=0.1)
        return model, sync, opt

    def train(self, model, sync, opt, windows, dtype=torch.float32, stop_inside=False):
        per = G // self.w
        for w in windows:
            x, y = data(w, dtype)
            x, y = x[self.rank * per:(self.rank + 1) * per], y[self.rank * per:(self.rank + 1) * per]
            micro = per // N
            for i in range(N):
                xs, ys = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
                if i < N - 1:
                    with sync.no_sync():
                        (loss_sum(model, xs, ys) * self.w / G).backward()
                    if stop_inside:
                        return
                else:
                    (loss_sum(model, xs, ys) * self.w / G).backward()
            opt.step()
            opt.zero_grad()
        opt.wait_parameters()


def broadcast_path(rank):
    box = [tempfile.mkdtemp(prefix="sfsync-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(box, 0)
    return box[0]


def save(how, world, model, sync, opt, path):
    if how == "full":
        opt.consolidate_state_dict(0)
        if world.rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                        "sync": sync.state_dict()}, os.path.join(path, "full.pt"))
    elif how == "dcp":
        dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=path,
                 process_group=world.pg)
        if world.rank == 0:
            torch.save(sync.state_dict(), os.path.join(path, "sync.pt"))
    else:  # dsd
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=world.pg)
        if world.rank == 0:
            torch.save(sync.state_dict(), os.path.join(path, "sync.pt"))


def load(how, world, model, sync, opt, path):
    if how == "full":
        saved = torch.load(os.path.join(path, "full.pt"))
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        sync.load_state_dict(saved["sync"])
        return
    if how == "dcp":
        state = {"model": model.state_dict(), "optim": opt}
        dcp.load(state, checkpoint_id=path, process_group=world.pg)
        model.load_state_dict(state["model"])
    else:
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, process_group=world.pg)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    sync.load_state_dict(torch.load(os.path.join(path, "sync.pt")))


def flat(model):
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def same_on_ranks(c, what, t, pg):
    mine = t.clone()
    top = t.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=pg)
    c.that(torch.equal(mine, top), "%s: the ranks differ" % what)


def case_resize(c, a, b, how, layout, ref):
    """Train S windows at world a, save `how`, resume at world b, finish."""
    what = "%s %d->%d %s" % (how, a, b, layout)
    rank = dist.get_rank()
    path = broadcast_path(rank)
    wa, wb = World(a), World(b)
    if wa.member:
        model, sync, opt = wa.trainee(0, layout)
        wa.train(model, sync, opt, range(S))
        save(how, wa, model, sync, opt, path)
        sync.close()
    dist.barrier()
    out = None
    if wb.member:
        model, sync, opt = wb.trainee(5, layout)  # another init: the load must replace it
        load(how, wb, model, sync, opt, path)
        c.that(sync.windows == S, "%s: windows %d after the load, expected %d"
               % (what, sync.windows, S))
        wb.train(model, sync, opt, range(S, K))
        diff = float((flat(model) - flat(ref)).abs().max())
        c.that(diff <= 1e-6, "%s: weights vs the reference: max |diff| %.3g" % (what, diff))
        same_on_ranks(c, what, flat(model), wb.pg)
        c.that(sync.windows == K, "%s: windows %d at the end, expected %d"
               % (what, sync.windows, K))
        plugin = sync.stats()["windows_completed"]  # (sf_restore_windows at the load)
        c.that(plugin == K, "%s: the plugin's windows_completed %d at the end, expected %d"
               % (what, plugin, K))
        out = "%s %.1e" % (what, diff)
        sync.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return out


def case_bf16_masters(c, how, **options):
    """bf16 parameters, 2 -> 2 through `how`: the float32 master shards
    travel, so the resumed run equals the uninterrupted one bitwise (without
    them the masters would restart from the rounded parameters).
    (GradientSync(accumulate_dtype=...) is unsharded only: its float32 window
    sums are empty at a window boundary, where checkpoints are taken.)"""
    rank = dist.get_rank()
    path = broadcast_path(rank)
    w = World(2)
    what = "bf16 %s 2->2%s" % (how, "".join(" %s=%s" % kv for kv in options.items()))
    if w.member:
        model, sync, opt = w.trainee(0, "flat", torch.bfloat16, **options)
        w.train(model, sync, opt, range(K), torch.bfloat16)
        uninterrupted = flat(model)
        sync.close()
        model, sync, opt = w.trainee(0, "flat", torch.bfloat16, **options)
        w.train(model, sync, opt, range(S), torch.bfloat16)
        save(how, w, model, sync, opt, path)
        sync.close()
        dist.barrier(group=w.pg)
        model, sync, opt = w.trainee(5, "flat", torch.bfloat16, **options)
        load(how, w, model, sync, opt, path)
        w.train(model, sync, opt, range(S, K), torch.bfloat16)
        diff = float((flat(model) - uninterrupted).abs().max())
        c.that(diff == 0.0, "%s: resumed vs uninterrupted max |diff| %.3g" % (what, diff))
        sync.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return what + " bitwise" if w.member else None


def expect_error(c, what, fn, kind, *words):
    try:
        fn()
    except kind as e:
        text = str(e)
        ok = all(word in text for word in words)
        c.that(ok, "%s: the error does not say %s: %s" % (what, words, text[:600]))
        return ok
    c.that(False, "%s: no %s" % (what, kind.__name__))
    return False


def case_bad(c):
    """The bad checkpoints: each an error on every rank, named."""
    rank = dist.get_rank()
    w = World(3)
    path = broadcast_path(rank)
    done = []
    model, sync, opt = w.trainee(0, "flat")
    w.train(model, sync, opt, range(2))
    # a checkpoint of another model: its full form loaded here
    other = torch.nn.Linear(13, 4)
    other_opt = torch.optim.AdamW(list(other.parameters()) + [torch.nn.Parameter(torch.ones(3))],
                                  lr=LR)
    for p in other_opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    other_opt.step()
    bad = other_opt.state_dict()
    ok = expect_error(c, "another model's optimizer", lambda: opt.load_state_dict(bad),
                      ValueError, "param group 0", "has 3 parameters",
                      "this optimizer's 5")
    done.append("another model" if ok else None)
    # same parameter count, other shapes
    twin = Net(0)
    twin.fc1 = torch.nn.Linear(13, 10)
    twin.fc2 = torch.nn.Linear(10, 5)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=LR)
    (loss_sum(twin, *data(0)) / G).backward()
    twin_opt.step()
    ok = expect_error(c, "a model with other shapes", lambda: opt.load_state_dict(
        twin_opt.state_dict()), ValueError, "fc1.weight", "[10, 13]", "[9, 13]")
    done.append("other shapes" if ok else None)
    # rank 0's per-rank state dict loaded on every rank (what a framework
    # that saves from rank 0 alone does): the named error on every rank,
    # rank 0's included (its part fits, but the others' do not)
    box = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, 0)
    if rank == 0:
        ok = expect_error(c, "rank 0's state dict on rank 0", lambda: opt.load_state_dict(box[0]),
                          ValueError, "did not fit on rank(s) 1, 2", "nothing was loaded")
    else:
        ok = expect_error(c, "rank 0's state dict on rank %d" % rank,
                          lambda: opt.load_state_dict(box[0]), ValueError,
                          "sharded state dict of rank 0 of 3", "rank %d of 3" % rank,
                          "consolidate_state_dict")
    done.append("rank 0's state on every rank" if ok else None)
    # a rank's DCP file missing: every rank raises (none hangs)
    if dcp is not None:
        save("dcp", w, model, sync, opt, path)
        dist.barrier()
        if rank == 0:
            os.remove(os.path.join(path, "__1_0.distcp"))
        dist.barrier()
        model2, sync2, opt2 = w.trainee(5, "flat")
        ok = expect_error(c, "a DCP checkpoint without rank 1's file",
                          lambda: load("dcp", w, model2, sync2, opt2, path),
                          BaseException, "__1_0.distcp")  # (DCP's CheckpointException)
        done.append("missing rank file" if ok else None)
        sync2.close()
    # inside a window: save and load refused
    w.train(model, sync, opt, [2], stop_inside=True)
    for name, fn in (("state_dict", opt.state_dict), ("consolidate_state_dict",
                                                      opt.consolidate_state_dict),
                     ("load_state_dict", lambda: opt.load_state_dict(bad))):
        ok = expect_error(c, "%s inside a window" % name, fn, RuntimeError,
                          "inside window 3", "window boundaries")
        done.append("%s inside a window" % name if ok else None)
    sync.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return "bad: " + ", ".join(d for d in done if d)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 3:
        raise SystemExit("test_checkpoint.py needs 3 processes")
    c = Checks(rank)
    ref = reference()
    done = []
    cases = [("full", 2, 3, "flat"), ("full", 3, 2, "parameter")]
    if dcp is not None:
        cases += [("dcp", 2, 3, "flat"), ("dcp", 3, 2, "parameter"), ("dsd", 2, 3, "parameter"),
                  ("dsd", 3, 2, "flat")]
    else:
        say(rank, "torch %s has no torch.distributed.checkpoint.protocol: the dcp cases "
            "need torch >= 2.15" % torch.__version__)
    for how, a, b, layout in cases:
        done.append(case_resize(c, a, b, how, layout, ref))
    done.append(case_bf16_masters(c, "full"))
    if dcp is not None:
        done.append(case_bf16_masters(c, "dcp"))
    done.append(case_bad(c))
    return c.finish([d for d in done if d])


if __name__ == "__main__":
    sys.exit(main())
