"""The shim under real PyTorch DDP on the NCCL backend (tests/gpu/run.sh).

Run with libsfsync_shim.so preloaded and SF_ACCUMULATION_STEPS=N: DDP
all-reduces every backward pass, the shim sends only the last of each N.
Checks (one RESULT line): the final weights equal a single-process reference
that accumulates the same micro-batches of every rank (rel. error 1e-5).
`--judge follow|own --report R` then reads the shim's report (SF_SHIM_REPORT)
and checks that one pass's gradient bytes per window crossed NCCL (DDP alone:
`--steps`), in the mode the shim ran: a Python host's windows handed to
sfsync's in-process layer (the default), or the shim's own (SF_FOLLOW_HOST=0,
deferring bytes). Rank and world from torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 32))


def batch(rank, w, m):
    g = torch.Generator().manual_seed(1000 * w + 10 * m + rank)
    return torch.randn(16, 64, generator=g), torch.randn(16, 32, generator=g)


def judge(report, windows, steps, mode):
    """The shim's report after a run: the gradient bytes that crossed NCCL
    per window, in passes' worth (DDP alone: `steps`; a correct window: 1).
    mode "follow" (a Python host: the shim hands the windows to sfsync's
    in-process layer, SF_FOLLOW_HOST=1, and passes the calls through) or
    "own" (SF_FOLLOW_HOST=0: the shim's own windows, deferring the calls)."""
    with open(report) as f:
        r = json.load(f)
    pass_bytes = sum(p.numel() * 4 for p in model().parameters())
    ratio = r["gradient_bytes_sent"] / float(windows * pass_bytes)
    ok = abs(ratio - 1.0) < 1e-3
    if mode == "follow":
        ok = ok and r["mode"] == "python"
    else:
        ok = ok and r["mode"] != "python" and r["bytes_deferred"] > 0
    print(f"RESULT shim host={mode} shim_mode={r['mode']} calls_nccl={r['calls_nccl']} "
          f"deferred={r['deferred']} bytes_deferred={r['bytes_deferred']} "
          f"gradient_bytes_sent={r['gradient_bytes_sent']} passes_per_window={ratio:.3f} "
          f"(DDP alone {steps}) {'OK' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--report")
    p.add_argument("--judge", choices=("follow", "own"),
                   help="read --report (the shim's SF_SHIM_REPORT) and judge it; no training")
    a = p.parse_args()
    if a.judge:
        return judge(a.report, a.windows, a.steps, a.judge)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    net = DDP(model().cuda(dev), device_ids=[dev], bucket_cap_mb=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for w in range(a.windows):
        for m in range(a.steps):
            x, y = batch(rank, w, m)
            loss = torch.nn.functional.mse_loss(net(x.cuda(dev)), y.cuda(dev)) / a.steps
            loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()

    ref = model().double()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for w in range(a.windows):
        for r in range(world):
            for m in range(a.steps):
                x, y = batch(r, w, m)
                (torch.nn.functional.mse_loss(ref(x.double()), y.double()) / a.steps / world).backward()
        ropt.step()
        ropt.zero_grad()
    err = max(((p.detach().cpu().double() - q.detach()).abs().max() / q.detach().abs().max().clamp(min=1)).item()
              for p, q in zip(net.module.parameters(), ref.parameters()))
    grad_bytes = sum(p.numel() * 4 for p in net.parameters())
    dist.barrier()
    dist.destroy_process_group()
    ok = err < 1e-5
    print(f"RESULT ddp rank={rank} world={world} steps={a.steps} windows={a.windows} "
          f"grad_bytes_per_pass={grad_bytes} max_rel_err={err:.3g} {'OK' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
