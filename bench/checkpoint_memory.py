"""Peak memory per rank while a sharded sfsync run saves its optimizer
(issue 32), the three ways against each other:

    dcp          dcp.save({"optim": opt}): each rank writes its own boxes
    consolidate  opt.consolidate_state_dict() then rank 0 torch.save()s the
                 full form (what the framework integrations do)
    full         opt.full_state_dict() on every rank (the full form everywhere)

Run with torchrun (2 processes by default: ``--nproc``):

    ~/.cache/sfsync/venv-torch2/bin/python bench/checkpoint_memory.py [--nproc 2] [--mb 64]

(torch >= 2.15 for the dcp way; this tree's package and build/'s library
unless SFSYNC_LIBRARY says otherwise).

One fresh process pair per way (the allocator keeps freed pages, so one
process cannot measure three peaks); within each, a sampler thread reads
this process's RSS every 0.5 ms during the save, and the peak above the RSS
just before it is the save's cost. Printed per rank: that cost in MB, the
optimizer state this rank holds (its shard), and each way's cost as a ratio
of the full gather's, measured in the same launch of this script.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    def __init__(self):
        self.base, self.top, self.stop = rss_bytes(), 0, False
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop:
            self.top = max(self.top, rss_bytes())
            time.sleep(0.0005)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.top = max(self.top, rss_bytes())


def worker(way, mb, out):
    import torch
    import torch.distributed as dist
    import sfsync.torch as sft
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    side = int((mb * 2 ** 20 / 4 / 4) ** 0.5)  # 4 weights of side x side float32: mb MB
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(4)])
    sync = sft.GradientSync(model, shard_optimizer=True)
    opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    model(torch.randn(2, side)).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.wait_parameters()
    held = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))
    path = tempfile.mkdtemp(prefix="sfsync-ckpt-mem-") if rank == 0 else None
    box = [path]
    dist.broadcast_object_list(box, 0)
    path = box[0]
    dist.barrier()
    with Peak() as peak:
        if way == "dcp":
            import torch.distributed.checkpoint as dcp
            dcp.save({"optim": opt}, checkpoint_id=path)
        elif way == "consolidate":
            opt.consolidate_state_dict(0)
            if rank == 0:
                torch.save(opt.state_dict(), os.path.join(path, "optim.pt"))
        else:
            full = opt.full_state_dict()
            if rank == 0:
                torch.save(full, os.path.join(path, "optim.pt"))
            del full
    dist.barrier()
    with open(out % rank, "w") as f:
        json.dump({"cost": peak.top - peak.base, "held": held}, f)
    sync.close()
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--mb", type=float, default=64.0, help="parameter megabytes (float32)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.mb, args.out)
    results = {}
    tmp = tempfile.mkdtemp(prefix="sfsync-ckpt-mem-out-")
    for way in ("full", "consolidate", "dcp"):
        out = os.path.join(tmp, way + "-%d.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               str(args.nproc), "--redirects", "2", "--tee", "2", "--monitor_interval", "0.1",
               os.path.abspath(__file__), "--worker", way, "--mb", str(args.mb), "--out", out]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        env.setdefault("SFSYNC_LIBRARY", os.path.join(root, "build", "plugin", "libsfsync.so"))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.join(root, "python"), os.environ.get("PYTHONPATH")) if p)
        run = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        if run.returncode:
            sys.stdout.write(run.stdout[-3000:])
            raise SystemExit("checkpoint_memory: the %s run failed" % way)
        results[way] = [json.load(open(out % r)) for r in range(args.nproc)]
    mb = 2 ** 20
    print("%d ranks, %.0f MB of float32 parameters, AdamW (full state %.0f MB)"
          % (args.nproc, args.mb, 2 * args.mb))
    print("%-12s %s" % ("way", "  ".join("rank %d: save MB (x full)" % r
                                          for r in range(args.nproc))))
    for way in ("full", "consolidate", "dcp"):
        cells = []
        for r in range(args.nproc):
            cost, base = results[way][r]["cost"], results["full"][r]["cost"]
            cells.append("%12.1f (%.2f)" % (cost / mb, cost / base if base else float("nan")))
        print("%-12s %s" % (way, "  ".join(cells)))
    print("state held per rank: %s MB" % ", ".join("%.1f" % (results["dcp"][r]["held"] / mb)
                                                   for r in range(args.nproc)))


if __name__ == "__main__":
    main()
