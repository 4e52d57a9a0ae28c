"""One rank of ddp_accumulation.py (which spawns WORLD of them and checks
what they report): PyTorch DDP over Gloo, N micro-batches per optimizer
step, in the mode ddp_accumulation.py's --mode names."""

import contextlib
import ctypes
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_gloo
from ddp_accumulation import WORLD  # the parent's (it imports no torch)


def model():
    torch.manual_seed(1234)
    # After DDP's bucket rebuild: a first bucket of ~1.07 MB (fc3, fc2) and a
    # second of ~0.53 MB (fc1); before it, one bucket of everything.
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.Tanh(),
        torch.nn.Linear(512, 512), torch.nn.Tanh(),
        torch.nn.Linear(512, 10))


def batch(rank, window, micro):
    g = torch.Generator().manual_seed(100000 * rank + 100 * window + micro)
    x = torch.randn(32, 256, generator=g)
    y = torch.randn(32, 10, generator=g)
    return x, y


def grads_differ(ddp):
    """True if the two ranks hold different gradients (all_gather: not an all-reduce)."""
    flat = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
    parts = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(parts, flat)
    return (parts[0] - parts[1]).abs().max().item() > 1e-4


def worker(rank, args, store_file):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        assert k not in os.environ, k
    dist.init_process_group("gloo", init_method="file://" + store_file,
                            rank=rank, world_size=WORLD)
    net = model()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    sf = ctx = None

    def mark(text):
        if args.mark:
            sf.sf_log(2, b"host", text.encode())  # SF_LOG_INFO
    if args.mode in ("calls", "unsynced", "permicro", "forgot") or args.mark:
        # The two lines a Python host adds (plus the handle): the shim is
        # preloaded, so this is the libsfsync.so instance it consults.
        sf = ctypes.CDLL("libsfsync.so.1")
        ctx = ctypes.c_void_p()
        assert sf.sf_default_context(ctypes.byref(ctx)) == 0
    n = args.steps
    failures = []
    for w in range(1, args.windows + 1):
        if args.foreign_at == w:
            # A host all-reduce the pass pattern does not contain (e.g. a metric
            # vector): automatic mode must give up and pass everything.
            metric = torch.ones(40000) * (rank + 1)
            dist.all_reduce(metric)
            assert metric[0].item() == 3.0
        unsynced = args.mode == "unsynced" and w >= args.unsynced_from
        for i in range(n):
            if args.mode in ("calls", "unsynced", "forgot") and n > 1:
                if i == 0:
                    mark(f"begin window {w}")
                    status = sf.sf_begin_accumulation(ctx)
                    # A forgotten end: the host ignores the refusal (as ctypes hosts do).
                    assert status == 0 or (args.mode == "forgot" and w == args.forgot_at + 1)
                if i == n - 1 and not unsynced and not (args.mode == "forgot" and
                                                        w == args.forgot_at):
                    assert sf.sf_end_accumulation(ctx) == 0
            if args.mode == "permicro" and i < n - 1:
                mark(f"begin window {w}.{i}")
                assert sf.sf_begin_accumulation(ctx) == 0
            skip = args.mode == "nosync" and i < n - 1
            with ddp.no_sync() if skip else contextlib.nullcontext():
                x, y = batch(rank, w, i)
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                mark(f"backward window {w} micro-batch {i}")
                loss.backward()
                mark(f"backward done window {w} micro-batch {i}")
            if args.mode == "permicro" and i < n - 1:
                assert sf.sf_end_accumulation(ctx) == 0
            if args.check_grads:
                differ = grads_differ(ddp)
                deferred = (i < n - 1) and (
                    args.mode == "nosync" or
                    (args.local_from is not None and (w - 1) * n + i + 1 >= args.local_from and
                     (args.foreign_at is None or w < args.foreign_at)))
                if differ != deferred:
                    failures.append(f"window {w} micro-batch {i}: ranks hold "
                                    f"{'different' if differ else 'equal'} gradients, expected "
                                    f"{'different (local)' if deferred else 'equal (synchronized)'}")
        if unsynced and n > 1:
            assert sf.sf_end_accumulation(ctx) == 0
        opt.step()
        opt.zero_grad(set_to_none=False)
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    if rank == 0 and args.save:
        torch.save({k: v.clone() for k, v in net.state_dict().items()}, args.save)
    if rank == 0 and args.reference:
        ref = torch.load(args.reference)
        diff = max((net.state_dict()[k] - ref[k]).abs().max().item() for k in ref)
        scale = max(ref[k].abs().max().item() for k in ref)
        print(f"max |weight - reference| = {diff:.3g} (largest weight {scale:.3g})")
        if diff > 1e-5 * scale:
            failures.append(f"weights differ from the no_sync reference by {diff}")
    with open(os.path.join(args.tmp, f"grad_bytes-{rank}"), "w") as f:
        f.write(str(grad_bytes))
    torch_gloo.shutdown()
    if failures:
        print(f"rank {rank}: " + "\n  ".join(failures), file=sys.stderr)
        sys.exit(1)
