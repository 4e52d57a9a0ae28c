"""A PyTorch trainer as torchrun runs it, with each way to use sfsync
(run by run_torchrun.py under `python3 -m torch.distributed.run`).

    --variant gradsync   dist.init_process_group("gloo"); GradientSync(model, accumulation_steps=N,
                         verify_every=2, verify_buffers=True); ranks != 0 move their BatchNorm
                         statistics away inside each window, and after it every rank must
                         hold rank 0's buffers (compared with torch's all_gather)
    --variant attach     dist.init_process_group("gloo"); DDP(model) + sfsync.torch.attach(ddp, N,
                         verify_every=2, verify_buffers=True) (equal replicas pass every check)
    --variant shim       dist.init_process_group("gloo"); plain DDP stepping every N passes,
                         no no_sync(): the preloaded shim with SF_ACCUMULATION_STEPS=N defers
    --variant nodist     no torch.distributed at all: GradientSync meets through torchrun's store
    --variant reference  only the reference below, saved with --save (for the shim's run, whose
                         process must not run DDP's reference under the shim)
    --variant wrongn     DDP stepping after EVERY pass under the shim with SF_ACCUMULATION_STEPS=2
                         (a wrong N) and sfsync.torch.ReplicaCheck(every=K): must raise within
                         K steps of the first step at which the ranks' weights differ

The model has a BatchNorm, an unused parameter and a frozen one; ranks seed
it differently (so the initial broadcast matters); SGD with momentum and
weight decay (so a zero gradient instead of None would move the unused
parameter). Reference (the same process, before the variant): DDP with
no_sync() around forward and backward of micro-batches 1..N-1,
find_unused_parameters=True.

Bytes are measured outside sfsync: the kernel's count of bytes this process
wrote (/proc/self/io wchar, sockets included) over each window, nothing else
written meanwhile. Results go to stderr (torchrun --tee 2), one
"[rank r] OK ..." line, or "CHECK FAILED" lines and exit status 1.
"""

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sfsync
from sfsync import torch as sft


def say(rank, text):
    sys.stderr.write("[rank %d] %s\n" % (rank, text))
    sys.stderr.flush()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.bn = torch.nn.BatchNorm1d(256)
        self.fc2 = torch.nn.Linear(256, 256)
        self.fc3 = torch.nn.Linear(256, 8)
        self.unused = torch.nn.Parameter(torch.randn(100))
        self.frozen = torch.nn.Parameter(torch.randn(8), requires_grad=False)

    def forward(self, x):
        h = torch.tanh(self.bn(self.fc1(x)))
        return self.fc3(torch.tanh(self.fc2(h))) + self.frozen


def make_net(rank):
    torch.manual_seed(100 + rank)  # ranks start apart
    return Net()


def batch(rank, window, micro):
    g = torch.Generator().manual_seed(((rank * 1009) + window) * 101 + micro)
    return torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def wchar():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def grad_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def loss_of(model, rank, w, i, n):
    x, y = batch(rank, w, i)
    return torch.nn.functional.mse_loss(model(x), y) / n


def run_reference(rank, args):
    """DDP with a correct no_sync(): forward and backward inside it."""
    ddp = DDP(make_net(rank), find_unused_parameters=True)
    opt = optimizer(ddp.parameters())
    per_window = []
    for w in range(args.windows):
        before = wchar()
        for i in range(args.steps):
            with ddp.no_sync() if i < args.steps - 1 else contextlib.nullcontext():
                loss_of(ddp, rank, w, i, args.steps).backward()
        opt.step()
        opt.zero_grad()
        per_window.append(wchar() - before)
    return ddp.module, per_window


def buffers_of(module):
    return torch.cat([b.detach().double().reshape(-1) for b in module.buffers()])


def diverge_buffers(module, rank):
    """Ranks != 0 move their BatchNorm statistics far from rank 0's (they
    also drift apart by themselves: each rank normalizes its own batches)."""
    with torch.no_grad():
        module.bn.running_mean.add_(10.0 * rank)
        module.bn.running_var.mul_(1.0 + rank)
        module.bn.num_batches_tracked.add_(1000 * rank)


def buffers_failures(module, rank, world, window):
    """After a window: every rank holds rank 0's buffers, bit for bit (torch's
    own all_gather, not sfsync's broadcast, is the oracle)."""
    mine = buffers_of(module)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return ["window %d: rank %d's buffers differ from rank 0's by %g" % (
        window, r, (parts[r] - parts[0]).abs().max().item())
        for r in range(1, world) if not torch.equal(parts[r], parts[0])]


def run_variant(rank, args, failures=None):
    """The variant's model after training, bytes written per window, and
    which passes said is_step(). gradsync: the buffers' checks go to
    `failures`."""
    n = args.steps
    model = make_net(rank)
    sync, module, steps_seen = None, model, []
    check_buffers = args.variant == "gradsync" and failures is not None and n > 1
    if args.variant in ("gradsync", "nodist"):
        # verify_buffers: the check at a window's first forward (after the
        # previous window's broadcast) compares the buffers too.
        sync = sft.GradientSync(model, accumulation_steps=n, verify_every=2,
                                verify_buffers=args.variant == "gradsync")
    elif args.variant == "attach":
        module = DDP(model, find_unused_parameters=True)
        sync = sft.attach(module, accumulation_steps=n, verify_every=2, verify_buffers=True)
    elif args.variant == "shim":
        module = DDP(model, find_unused_parameters=True)
    opt = optimizer(module.parameters())
    per_window = []
    for w in range(args.windows):
        before = wchar()
        for i in range(n):
            loss_of(module, rank, w, i, n).backward()
            if check_buffers and i == 0 and n > 1:
                diverge_buffers(model, rank)  # after the forward that verified them
            if sync is None:
                if i == n - 1:
                    opt.step()
                    opt.zero_grad()
            elif sync.is_step():
                steps_seen.append(w * n + i)
                opt.step()
                opt.zero_grad()
        per_window.append(wchar() - before)
        if check_buffers:  # outside the bytes measured
            failures += buffers_failures(model, rank, int(os.environ["WORLD_SIZE"]), w)
    if sync is not None and sync._verifier.checks != (args.windows - 1) // 2:
        raise AssertionError("verify_every=2: %d replica checks in %d windows, expected %d"
                             % (sync._verifier.checks, args.windows, (args.windows - 1) // 2))
    if sync is not None:
        steps_expected = [w * n + n - 1 for w in range(args.windows)]
        if steps_seen != steps_expected:
            raise AssertionError("is_step() at passes %s, expected %s" % (steps_seen,
                                                                          steps_expected))
    return model, per_window, sync


def local_reference(args, world):
    """No communication: rank 0's initial weights, every rank's micro-batches
    replayed here (loss / world), which is what averaging must produce; unused
    parameters keep .grad None."""
    model = make_net(0)
    opt = optimizer(model.parameters())
    bn_states = []
    for w in range(args.windows):
        for r in range(world):
            # BatchNorm normalizes each rank's micro-batch on its own.
            for i in range(args.steps):
                (loss_of(model, r, w, i, args.steps) / world).backward()
        opt.step()
        opt.zero_grad()
    del bn_states
    return model


def run_wrong_n(rank, args):
    """DDP stepping after every pass under the shim with SF_ACCUMULATION_STEPS
    = 2: the shim defers every other pass, ranks step on local gradients and
    drift. ReplicaCheck(every=K) must raise within K steps of the drift."""
    ddp = DDP(make_net(rank), find_unused_parameters=True)
    opt = optimizer(ddp.parameters())
    check = sft.ReplicaCheck(ddp.module, every=args.verify_every)
    first_diff = None
    try:
        for step in range(1, args.max_steps + 1):
            # The forward of this step checks the weights after step - 1.
            loss_of(ddp, rank, 0, step, 1).backward()
            opt.step()
            opt.zero_grad()
            parts = [torch.empty_like(flat(ddp.module)) for _ in range(2)]
            dist.all_gather(parts, flat(ddp.module))  # not an all-reduce: the shim passes it
            if first_diff is None and not torch.equal(parts[0], parts[1]):
                first_diff = step
    except sft.ReplicaMismatchError as e:
        checked_after = step - 1  # the weights compared are those after step - 1
        if e.step != checked_after:
            return ["ReplicaMismatchError.step = %s, expected %d" % (e.step, checked_after)]
        say(rank, "ReplicaMismatchError at step %d (weights first differed after step %s): %s"
            % (step, first_diff, e))
        if first_diff is None or not first_diff <= checked_after < first_diff + args.verify_every:
            return ["the check raised after step %d, but the weights first differed after step "
                    "%s (K = %d)" % (checked_after, first_diff, args.verify_every)]
        if not e.name:
            return ["the error names no parameter"]
        say(rank, "OK wrong N caught %d step(s) after the drift began, naming %r"
            % (checked_after - first_diff, e.name))
        return []
    finally:
        check.close()
    return ["no ReplicaMismatchError in %d steps (weights first differed after step %s)"
            % (args.max_steps, first_diff)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", required=True,
                   choices=["gradsync", "attach", "shim", "nodist", "wrongn", "reference"])
    p.add_argument("--save", help="reference: save each rank's weights to SAVE.<rank>")
    p.add_argument("--reference", help="load the reference from REFERENCE.<rank>")
    p.add_argument("--steps", type=int, default=4, help="micro-batches per window (N)")
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--tolerance", type=float, default=1e-6)
    p.add_argument("--bytes-from", type=int, default=0,
                   help="first window whose bytes must be 1x (the shim learns passes first)")
    p.add_argument("--verify-every", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    failures = []
    if args.variant == "nodist":
        model, per_window, sync = run_variant(rank, args)
        ref = local_reference(args, world)
        # Ranks identical, through sfsync itself (no torch.distributed here).
        sync.verify()
        diff = (flat(model) - flat(ref)).abs().max().item()
        if diff > 1e-5:
            failures.append("max |sfsync - local reference| = %g" % diff)
        if model.unused.grad is not None:
            failures.append("unused.grad is not None")
        gbytes = grad_bytes(model)
        ratios = [b / gbytes for b in per_window]
        if not all(0.5 <= r <= 1.6 for r in ratios):
            failures.append("bytes per window / gradient bytes = %s, expected 1x" % ratios)
        sync.close()
        for f in failures:
            say(rank, "CHECK FAILED " + f)
        if not failures:
            say(rank, "OK nodist: max |sfsync - reference| = %.3g, bytes/window = %s x gradient"
                % (diff, ["%.2f" % r for r in ratios]))
        sys.exit(1 if failures else 0)

    dist.init_process_group("gloo")
    if args.variant == "wrongn":
        failures = run_wrong_n(rank, args)
    elif args.variant == "reference":
        ref, ref_bytes = run_reference(rank, args)
        torch.save({"state": ref.state_dict(), "bytes": ref_bytes,
                    "unused_grad_none": ref.unused.grad is None}, "%s.%d" % (args.save, rank))
        say(rank, "OK reference saved")
    else:
        if args.reference:
            saved = torch.load("%s.%d" % (args.reference, rank))
            ref = make_net(rank)
            ref.load_state_dict(saved["state"])
            ref_bytes = saved["bytes"]
            if not saved["unused_grad_none"]:
                failures.append("the reference's unused.grad is not None")
        else:
            ref, ref_bytes = run_reference(rank, args)
        dist.barrier()
        model, per_window, sync = run_variant(rank, args, failures)
        gbytes = grad_bytes(model)
        diff = (flat(model) - flat(ref)).abs().max().item()
        if not diff <= args.tolerance:
            failures.append("max |%s - DDP no_sync()| = %g > %g" % (args.variant, diff,
                                                                    args.tolerance))
        parts = [torch.empty_like(flat(model)) for _ in range(world)]
        dist.all_gather(parts, flat(model))
        if not all(torch.equal(parts[0], q) for q in parts[1:]):
            failures.append("ranks hold different weights")
        if model.unused.grad is not None or ref.unused.grad is not None:
            failures.append("unused.grad is not None")
        if rank == 0:  # rank 0's BatchNorm statistics evolve locally in both
            bdiff = max((a - b).abs().max().item() for a, b in
                        zip(model.bn.running_mean, ref.bn.running_mean))
            if bdiff > 1e-5:
                failures.append("rank 0 running_mean differs from DDP's by %g" % bdiff)
        ratios = [b / gbytes for b in per_window]
        ref_ratios = [b / gbytes for b in ref_bytes]
        checked = ratios[args.bytes_from:]
        if not all(0.5 <= r <= 1.6 for r in checked):
            failures.append("bytes written per window / gradient bytes = %s (from window %d), "
                            "expected 1x; DDP no_sync(): %s" % (
                                ["%.2f" % r for r in ratios], args.bytes_from,
                                ["%.2f" % r for r in ref_ratios]))
        if sync is not None and hasattr(sync, "close"):
            sync.close()
        if not failures:
            say(rank, "OK %s: max |%s - DDP no_sync()| = %.3g, ranks identical%s, gradient %d B, "
                "bytes written per window = %s x gradient (DDP no_sync(): %s)" % (
                    args.variant, args.variant, diff,
                    " (buffers too, after each of %d windows)" % args.windows
                    if args.variant == "gradsync" else "", gbytes, ["%.2f" % r for r in ratios],
                    ["%.2f" % r for r in ref_ratios]))
    for f in failures:
        say(rank, "CHECK FAILED " + f)
    # PyTorch 1.13 + Gloo teardown: let the workers drain with the GIL released.
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
