"""sfsync.torch on a CUDA model against DDP on the NCCL backend (tests/gpu/run.sh).

Public API only: ``sfsync.torch.GradientSync(model, flat_buffer=...,
shard_optimizer=..., shard_layout=...)``, ``sync.optimizer(torch.optim.AdamW,
...)``, ``sfsync.torch.attach(ddp)``. One process per rank (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from run.sh's step); every
rank trains the same windows of its own micro-batches:

    ddp                the reference: DDP(NCCL), no_sync() around micro-batches
                       1..N-1, torch AdamW
    flat               GradientSync(model)                     + torch AdamW
    grads              GradientSync(model, flat_buffer=False)  + torch AdamW
    sharded-flat       GradientSync(model, shard_optimizer=True, shard_layout="flat")
                       + sync.optimizer(torch.optim.AdamW, ...)
    sharded-parameter  the same with shard_layout="parameter"
    attach             sfsync.torch.attach(DDP(model)) + torch AdamW, DDP's no_sync()

Per case one line ``RESULT <case> ... OK|FAIL``:
  weights   max |w - w_ddp| over all parameters after the run, <= WEIGHT_TOL
            (AdamW, lr 1e-3: a tenth of one step's move);
  bytes     per window, from sfsync's stats (bytes_reduced, bytes_gathered)
            and from NCCL's own count: NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL
            lines ("AllReduce: opCount .. count N datatype D .. [nranks=W]")
            in NCCL_DEBUG_FILE, between the first and the last window of the
            case (any communicator in this process), as wire-equivalent bytes
            (all-reduce 2x its buffer, reduce-scatter / all-gather 1x), against
            DDP's. Judged when both counts are non-zero: unsharded and attach
            1.0x DDP's (0.95..1.10), sharded 1.5x (1.40..1.65: reduce-scatter +
            gradient gather + parameter gather, docs/sharded.md).
            Where NCCL printed no COLL line the line says nccl=unavailable
            and only sfsync's stats are printed;
  memory    torch.cuda.max_memory_allocated() over the case's windows and the
            device memory in use (torch.cuda.mem_get_info, sampled at each
            window's end, minus the case's start), against DDP's: printed;
            judged only for the sharded cases at world size >= 2: the torch
            peak below DDP's (the 1/W optimizer state).
Exit 0 when every case is OK, 1 otherwise; 77 without a usable GPU.

  torch_cuda.py [--cases flat,grads,...] [--windows 6] [--steps 4] [--nccl-log FILE]
"""

import argparse
import os
import re
import socket
import sys

CASES = ["flat", "grads", "sharded-flat", "sharded-parameter", "attach"]
WEIGHT_TOL = 1e-4
# NCCL's ncclDataType_t -> bytes
NCCL_SIZES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}
COLL = re.compile(r"NCCL INFO (\w+): opCount \S+ sendbuff \S+ recvbuff \S+ count (\d+) "
                  r"datatype (\d+) op \S+ root \S+ comm (\S+) \[nranks=(\d+)\]")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--nccl-log", default=os.environ.get("SF_NCCL_LOG"))
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="the same cases on CPU with gloo (checks this script where no GPU "
                        "is: no NCCL count, no device memory)")
    return p.parse_args()


ARGS = parse_args()
if ARGS.nccl_log:  # before NCCL initializes (it reads these once)
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_SUBSYS"] = "COLL"
    os.environ["NCCL_DEBUG_FILE"] = ARGS.nccl_log

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import sfsync  # noqa: E402
import sfsync.torch  # noqa: E402


def model(dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(),
                               torch.nn.Linear(1024, 1024), torch.nn.Tanh(),
                               torch.nn.Linear(1024, 64)).to(dev)


def batch(rank, w, m, dev):
    g = torch.Generator().manual_seed(1000 * w + 10 * m + rank)
    return (torch.randn(32, 256, generator=g).to(dev), torch.randn(32, 64, generator=g).to(dev))


class NcclCount:
    """Wire-equivalent bytes of the COLL lines NCCL wrote since mark()."""

    def __init__(self, path):
        # NCCL_DEBUG_FILE's own substitutions: %h host, %p pid
        self.path = (path.replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
                     if path else None)
        self.offset = 0

    def mark(self):
        self.offset = os.path.getsize(self.path) if self.path and os.path.exists(self.path) else 0

    def since(self):
        if not self.path or not os.path.exists(self.path):
            return None
        with open(self.path, errors="replace") as f:
            f.seek(self.offset)
            text = f.read()
        total, lines = 0, 0
        for kind, count, dtype, _comm, nranks in COLL.findall(text):
            size = int(count) * NCCL_SIZES.get(int(dtype), 4)
            if kind in ("ReduceScatter", "AllGather"):
                size *= int(nranks)  # count is per rank there
            total += 2 * size if kind == "AllReduce" else size
            lines += 1
        return total if lines else None


def train(net, opt, rank, dev, no_sync, nccl):
    """The windows; returns (nccl wire bytes or None, torch peak, device-use peak)."""
    gpu = dev.type == "cuda"
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        free0, _ = torch.cuda.mem_get_info(dev)
    used_peak = 0
    nccl.mark()
    for w in range(ARGS.windows):
        for m in range(ARGS.steps):
            x, y = batch(rank, w, m, dev)
            ctx = no_sync() if m < ARGS.steps - 1 else _null()
            with ctx:
                loss = torch.nn.functional.mse_loss(net(x), y) / ARGS.steps
                loss.backward()
        opt.step()
        opt.zero_grad()
        if gpu:
            free, _ = torch.cuda.mem_get_info(dev)
            used_peak = max(used_peak, free0 - free)
    if hasattr(opt, "wait_parameters"):
        opt.wait_parameters()
    if not gpu:
        return None, 0, 0
    torch.cuda.synchronize()
    return nccl.since(), torch.cuda.max_memory_allocated(dev), used_peak


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def weights(module):
    return [p.detach().double().cpu() for p in module.parameters()]


def main():
    if not torch.cuda.is_available() and not ARGS.cpu_dry_run:
        print("SKIPPED torch_cuda: torch.cuda.is_available() is False")
        return 77
    cases = [c for c in ARGS.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        print("torch_cuda.py: unknown --cases %s (known: %s)" % (",".join(bad), ",".join(CASES)))
        return 2
    dist.init_process_group("gloo" if ARGS.cpu_dry_run else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if ARGS.cpu_dry_run:
        dev, ids, nccl = torch.device("cpu"), None, NcclCount(None)
        print("INFO CPU dry run (gloo): torch %s, rank %d/%d" % (torch.__version__, rank, world))
    else:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        ids, nccl = [dev.index], NcclCount(ARGS.nccl_log)
        v = torch.cuda.nccl.version()  # a tuple in torch 2.x, an int before
        print("INFO torch %s, NCCL %s, %s, rank %d/%d, sfsync %s" % (
            torch.__version__, ".".join(map(str, v)) if isinstance(v, tuple) else v,
            torch.cuda.get_device_name(dev), rank, world, sfsync.version()), flush=True)

    ref = DDP(model(dev), device_ids=ids)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ddp_bytes, ddp_peak, ddp_used = train(ref, opt, rank, dev, ref.no_sync, nccl)
    ref_w = weights(ref.module)
    gbytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    print("RESULT ddp world=%d grad_bytes=%d nccl_bytes_per_window=%s peak=%d device_used=%d OK" % (
        world, gbytes, "%d" % (ddp_bytes // ARGS.windows) if ddp_bytes else "unavailable",
        ddp_peak, ddp_used), flush=True)
    del ref, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    failed = 0
    for case in cases:
        notes, ok, sync = [], True, None
        try:
            net = model(dev)
            if case == "attach":
                ddp = DDP(net, device_ids=ids)
                sync = sfsync.torch.attach(ddp)
                front, opt = ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)
                module = ddp.module
            else:
                sharded = case.startswith("sharded")
                sync = sfsync.torch.GradientSync(
                    net, flat_buffer=case != "grads", shard_optimizer=sharded,
                    shard_layout=case.split("-")[1] if sharded else "flat")
                front, module = sync, net
                opt = (sync.optimizer(torch.optim.AdamW, net.parameters(), lr=1e-3) if sharded
                       else torch.optim.AdamW(net.parameters(), lr=1e-3))
            nbytes, peak, used = train(front, opt, rank, dev, front.no_sync, nccl)
            err = max((a - b).abs().max().item() for a, b in zip(weights(module), ref_w))
            st = sync.stats() if hasattr(sync, "stats") else sync.context.stats()  # attach: DDPSync
            if err > WEIGHT_TOL:
                ok = False
            notes.append("max_abs_err=%.3g" % err)
            windows = max(1, sync.windows)
            notes.append("sfsync_bytes_per_window=%d gathered=%d windows=%d" % (
                st["bytes_reduced"] // windows, st.get("bytes_gathered", 0) // windows,
                sync.windows))
            if sync.windows != ARGS.windows:
                ok = False
            if nbytes is None or not ddp_bytes:
                notes.append("nccl=unavailable")
            else:
                ratio = nbytes / ddp_bytes
                lo, hi = (1.40, 1.65) if case.startswith("sharded") else (0.95, 1.10)
                notes.append("nccl_bytes_per_window=%d ratio_to_ddp=%.3f [%.2f,%.2f]" % (
                    nbytes // ARGS.windows, ratio, lo, hi))
                if world > 1 and not lo <= ratio <= hi:
                    ok = False
            notes.append("peak=%d ddp_peak=%d device_used=%d ddp_device_used=%d" % (
                peak, ddp_peak, used, ddp_used))
            if case.startswith("sharded") and world > 1 and dev.type == "cuda" and peak >= ddp_peak:
                ok = False
                notes.append("sharded peak not below DDP's")
            sync.close()
        except Exception as e:  # a case's failure is its RESULT line; the next case runs
            ok = False
            notes.append("%s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0][:300]))
            if sync is not None:
                try:
                    sync.close()
                except Exception:  # already reported above
                    pass
        failed += not ok
        print("RESULT %s world=%d rank=%d %s %s" % (case, world, rank, " ".join(notes),
                                                    "OK" if ok else "FAIL"), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
