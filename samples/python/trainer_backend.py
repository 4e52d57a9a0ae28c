"""A trainer backend of the shape sfsync exists for, with no sfsync in it.

Its ``backward(loss, is_boundary)`` enters DDP's ``no_sync()`` around
``loss.backward()`` alone when the micro-batch is not the window's last.
DDP decides at *forward* time whether a backward all-reduces, so this
backend still sends every micro-batch: N times the gradient bytes,
silently, with the right weights. The shape recurs in real trainers.

Run it unmodified, with sfsync following its windows and no line changed
(the no-code path, docs/shim.md):

    LD_PRELOAD=build/shim/libsfsync_shim.so build/plugin/tools/sfsync-run -n 2 -- \\
        /usr/bin/python3 samples/python/trainer_backend.py

(or ``SF_FOLLOW_HOST=1 PYTHONPATH=$(python3 -m sfsync boot-path)`` in the
environment of any launcher: torchrun, mpirun). Each rank prints the
gradient bytes it wrote per window, from the kernel's own count
(/proc/self/io), and the window lengths.

``--shape``: ``backward-only`` (the mistake, the default), ``correct``
(no_sync() around forward and backward), ``none`` (no no_sync() at all: the
optimizer step ends a window), ``nested`` (an inner DDP inside an outer one
that leaves the inner's parameters to it, no_sync() on the outer only,
around the backward). ``--windows 4,4,3``: the
micro-batches of each window.
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

SHAPES = ("backward-only", "correct", "none", "nested")


def build_model(seed=0, width=256):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 4))


def micro_batch(rank, window, micro, seed=1):
    g = torch.Generator().manual_seed(seed * 1000003 + rank * 10007 + window * 101 + micro)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


class Backend:
    """The backend: wraps the model in DDP, runs micro-batches, steps."""

    def __init__(self, model, shape="backward-only", lr=1e-2, max_norm=1.0, comm_hook=False):
        if shape not in SHAPES:
            raise ValueError("shape must be one of %s, not %r" % (", ".join(SHAPES), shape))
        self.shape = shape
        if shape == "nested":
            # The first layer as a DDP of its own inside the outer DDP, which
            # leaves the inner one's parameters to it (as wrappers that mix
            # DDPs do: two reducers of one parameter race over its .grad).
            model[0] = DDP(model[0], broadcast_buffers=False)
            DDP._set_params_and_buffers_to_ignore_for_model(
                model, ["0.module." + name for name, _ in model[0].module.named_parameters()])
        self.device = next(model.parameters()).device
        self.model = DDP(model, gradient_as_bucket_view=True, broadcast_buffers=False)
        if comm_hook:  # a backend that registers its own communication hook
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            self.model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.max_norm = max_norm
        self.metric_values = []      # the metric all-reduce's results (global)
        self.local_loss_sums = []    # what this rank put in

    def _context(self, is_boundary):
        if is_boundary or self.shape == "none":
            return contextlib.nullcontext()
        return self.model.no_sync()

    def forward(self, x, is_boundary):
        if self.shape == "correct":
            with self._context(is_boundary):
                return self.model(x)
        return self.model(x)

    def backward(self, loss, is_boundary):
        if self.shape == "correct":
            # (the forward already ran inside no_sync(): the backward must too)
            with self._context(is_boundary):
                loss.backward()
            return
        with self._context(is_boundary):  # the mistake: around the backward alone
            loss.backward()

    def step(self, loss_sum):
        # A metric all-reduce at each boundary: 13 float32 (52 bytes).
        metric = torch.full((13,), float(loss_sum), device=self.device)
        self.local_loss_sums.append(metric[0].item())
        dist.all_reduce(metric)
        self.metric_values.append(metric[0].item())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def train(backend, windows, rank, on_window=None):
    """Windows of the given lengths; on_window(i) after each step."""
    for w, n in enumerate(windows):
        loss_sum = 0.0
        for k in range(n):
            x, y = (t.to(backend.device) for t in micro_batch(rank, w, k))
            is_boundary = k == n - 1
            loss = torch.nn.functional.mse_loss(backend.forward(x, is_boundary), y) / n
            backend.backward(loss, is_boundary)
            loss_sum += loss.item()
        backend.step(loss_sum)
        if on_window is not None:
            on_window(w)


def env_from_mpirun():
    """Open MPI's mpirun sets OMPI_COMM_WORLD_*, not torch's RANK/WORLD_SIZE:
    the host maps them (MASTER_ADDR/MASTER_PORT come from mpirun's -x)."""
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ["LOCAL_RANK"] = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def wchar():
    """Bytes this process wrote (sockets included): the kernel's count."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="backward-only", choices=SHAPES)
    p.add_argument("--windows", default="4,4,4,4")
    args = p.parse_args()
    windows = [int(n) for n in args.windows.split(",")]
    env_from_mpirun()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    backend = Backend(build_model(), args.shape)
    marks = [wchar()]
    train(backend, windows, rank, lambda w: marks.append(wchar()))
    sent = [b - a for a, b in zip(marks, marks[1:])]
    print("[rank %d] shape %s, windows %s: bytes written per window %s"
          % (rank, args.shape, windows, sent), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
