"""A trainer that torchrun restarts (run by run_restarts.py with
`--max_restarts 2`): it checkpoints after every window and resumes from
rank 0's last checkpoint, while rank 1 is SIGKILLed twice:

* attempt 0: in the middle of window --kill-window (after its first
  micro-batch's backward, before the window synchronizes);
* attempt 1: during sfsync's rendezvous (right after it published its claim
  in the store, before reading rank 0's roster);
* attempt 2 runs to the end and compares the weights with an uninterrupted
  DDP-correct run made in the same process.

    --variant gradsync  GradientSync(model, accumulation_steps=N, verify_every=2)
    --variant attach    DDP(model) + sfsync.torch.attach(ddp, N, verify_every=2)
    --variant sharded   GradientSync(..., shard_optimizer=True) + sync.optimizer(SGD):
                        the README's recipe with sfsync.torch.consolidate_state_dict(opt)
                        on every rank before rank 0 saves (issue 32)
    --variant both      the two side by side on two models in one process (one
                        torchrun run for both: the rendezvous kill hits
                        GradientSync's, the first context)
    --dist              dist.init_process_group("gloo") first (attach needs it);
                        without it sfsync meets through torchrun's agent store

The checkpoint holds the model, the optimizer and sync.state_dict(): the
resumed run continues the window count and the verify_every cadence, which
is checked here (the windows whose forward compared the replicas must be
those of an uninterrupted run from the resume point on). The data of each
micro-batch depends only on (rank, window, micro-batch), so the resumed run
must end where an uninterrupted one does. Results go to stderr: one
"[rank r] OK ..." line in the last attempt, or "CHECK FAILED" lines.
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchrun_trainer as tt  # noqa: E402  (the model, data and references)

import sfsync  # noqa: E402
from sfsync import torch as sft  # noqa: E402

VERIFY_EVERY = 2


def say(rank, text):
    tt.say(rank, "attempt %s: %s" % (os.environ.get("TORCHELASTIC_RESTART_COUNT", "?"), text))


def die(rank, where):
    say(rank, "SIGKILL myself %s" % where)
    os.kill(os.getpid(), signal.SIGKILL)


def init_process_group(rank, world, attempt):
    """dist.init_process_group("gloo"), its store scoped by attempt.

    torch 1.13's env:// under torchrun wraps the agent store in
    PrefixStore("/worker/attempt_<N>") itself. torch 2.x (2.15 checked) does
    not ("a new TCPStore for every retry"), but torchrun's static rendezvous
    (--master_addr/--master_port, as here) keeps one store across restarts:
    attempt N's Gloo may then read a dead attempt's addresses and fail in
    connectFullMesh ("Connection refused"; reproduced with plain torch, no
    sfsync). Under 2.x the same prefix as 1.13's is given explicitly, so that
    both torches run this trainer with the store sfsync meets through."""
    if int(torch.__version__.split(".")[0]) < 2:
        dist.init_process_group("gloo")
        return
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("/worker/attempt_%d" % attempt, agent),
                            rank=rank, world_size=world)


def kill_in_rendezvous(rank, attempt):
    """Attempt 1, rank 1: SIGKILL right after this rank's claim reached the
    store (sfsync writes it through make_context's store callbacks, which
    it takes from sfsync.torch.rendezvous; sfsync.torch._torch_store_callbacks
    until 0.3)."""
    if attempt != 1 or rank != 1:
        return
    from sfsync.torch import rendezvous
    real = rendezvous.torch_store_callbacks

    def callbacks(store):
        set_fn, get_fn = real(store)

        def set_and_die(key, value):
            set_fn(key, value)
            if key.endswith("/join/1"):
                die(rank, "in the rendezvous, after publishing %s" % key)
        return set_and_die, get_fn
    rendezvous.torch_store_callbacks = callbacks


def save(path, runs, windows):
    tmp = path + ".tmp"
    torch.save({"runs": {t.variant: t.state() for t in runs}, "windows": windows}, tmp)
    os.replace(tmp, path)  # a kill leaves the old checkpoint or the new one


class Trainee:
    """One model trained with one way of using sfsync, restored from its
    part of the checkpoint (`saved`) when there is one."""

    def __init__(self, variant, rank, n, saved):
        self.variant = variant
        self.model = tt.make_net(rank)
        if saved:
            self.model.load_state_dict(saved["model"])
        if variant in ("gradsync", "sharded"):
            self.module = self.model
            self.sync = sft.GradientSync(self.model, accumulation_steps=n,
                                         verify_every=VERIFY_EVERY,
                                         shard_optimizer=variant == "sharded")
        else:
            self.module = DDP(self.model, find_unused_parameters=True)
            self.sync = sft.attach(self.module, accumulation_steps=n, verify_every=VERIFY_EVERY)
        if variant == "sharded":  # tt.optimizer's class and settings, sharded
            self.opt = self.sync.optimizer(torch.optim.SGD, [p for p in self.module.parameters()
                                                                if p.requires_grad], lr=0.05,
                                           momentum=0.9, weight_decay=0.01)
        else:
            self.opt = tt.optimizer(self.module.parameters())
        if saved:
            self.opt.load_state_dict(saved["opt"])
            self.sync.load_state_dict(saved["sync"])
        self.checked = []
        real_check = self.sync._verifier.check
        self.sync._verifier.check = lambda step: (self.checked.append(step), real_check(step))

    def state(self):
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "sync": self.sync.state_dict()}

    def finish(self, args, start, ref):
        """The failures of this run's checks (and closes it)."""
        failures = []
        state = self.sync.state_dict()
        if state["windows"] != args.windows:
            failures.append("%s: state_dict()['windows'] = %d, expected %d"
                            % (self.variant, state["windows"], args.windows))
        # The forward of window w (w >= 1, outside a window) checks the
        # weights after w steps when w - (the last checked) >= VERIFY_EVERY.
        expected = [w for w in range(VERIFY_EVERY, args.windows, VERIFY_EVERY) if w >= start]
        self.cadence = list(self.checked)  # (verify() below is not part of the cadence)
        if self.cadence != expected:
            failures.append("%s: verify_every=%d: replicas compared at windows %s after "
                            "resuming at %d, expected %s (the cadence of an uninterrupted run)"
                            % (self.variant, VERIFY_EVERY, self.cadence, start, expected))
        self.sync.verify()  # the ranks hold the same weights (through sfsync)
        self.diff = (tt.flat(self.model) - tt.flat(ref)).abs().max().item()
        if not self.diff <= args.tolerance:
            failures.append("%s: max |resumed - uninterrupted DDP-correct| = %g > %g"
                            % (self.variant, self.diff, args.tolerance))
        self.sync.close()
        return failures


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", required=True, choices=["gradsync", "attach", "sharded", "both"])
    p.add_argument("--dist", action="store_true")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (shared by the ranks)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--kill-window", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=1e-6)
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    path = os.path.join(args.ckpt, "ckpt.pt")
    n = args.steps
    if args.dist:
        init_process_group(rank, world, attempt)
    elif args.variant != "gradsync":
        p.error("--variant %s needs --dist (DDP needs a process group)" % args.variant)
    saved = torch.load(path) if os.path.exists(path) else None
    start = saved["windows"] if saved else 0
    say(rank, "resuming at window %d" % start if saved else "starting")

    kill_in_rendezvous(rank, attempt)
    variants = ["gradsync", "attach"] if args.variant == "both" else [args.variant]
    runs = [Trainee(v, rank, n, saved["runs"][v] if saved else None) for v in variants]

    for w in range(start, args.windows):
        for i in range(n):
            for t in runs:
                tt.loss_of(t.module, rank, w, i, n).backward()
            if attempt == 0 and rank == 1 and w == args.kill_window and i == 0:
                die(rank, "in window %d, after micro-batch 0" % w)
            for t in runs:
                if t.sync.is_step():
                    t.opt.step()
                    t.opt.zero_grad()
        for t in runs:  # every rank: a sharded optimizer's full form on rank 0
            sft.consolidate_state_dict(t.opt)
        if rank == 0:
            save(path, runs, w + 1)

    failures = []
    if attempt != 2:
        failures.append("reached the end in attempt %d, expected 2 (both kills)" % attempt)
    if args.dist:
        ref, _ = tt.run_reference(rank, argparse.Namespace(windows=args.windows, steps=n))
    else:
        ref = tt.local_reference(argparse.Namespace(windows=args.windows, steps=n), world)
        args.tolerance = max(args.tolerance, 1e-5)  # another summation order
    for t in runs:
        failures += t.finish(args, start, ref)
    for f in failures:
        say(rank, "CHECK FAILED " + f)
    if not failures:
        for t in runs:
            tt.say(rank, "OK %s%s resumed at window %d after 2 kills: max |resumed - "
                   "uninterrupted| = %.3g, replicas compared at windows %s, library %s" % (
                       t.variant, " with init_process_group" if args.dist else
                       " without torch.distributed", start, t.diff, t.cadence,
                       sfsync.library_path()))
    if args.dist:
        dist.barrier()
        time.sleep(0.2)  # PyTorch 1.13 + Gloo teardown (TOOLCHAIN.md)
        dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
