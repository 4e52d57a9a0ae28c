"""What train_ddp_compare.py and bench_ddp.py share: the rank environment,
torch.distributed next to sfsync, the model, the data, and a DDP comm hook
that counts what DDP all-reduces."""

import copy
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def rank_env():
    """(rank, world_size) from the torchrun variables sfsync-run sets."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise SystemExit("missing %s: start this with sfsync-run -n 2 -- /usr/bin/python3 %s"
                         % (", ".join(missing), os.path.basename(sys.argv[0])))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def init_torch_distributed(port_offset=1, timeout_s=120):
    """torch.distributed (gloo) on MASTER_PORT + port_offset: sfsync's own
    rendezvous (env://) serves a TCP store on MASTER_PORT itself."""
    rank, world = rank_env()
    addr = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"]) + port_offset
    if addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="tcp://%s:%d" % (addr, port), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world


def parse_schedule(items):
    """Window lengths used in turn: ["4"] -> [4]; ["3", "1", "4"] or
    ["3,1,4"] -> [3, 1, 4] (each >= 1). Space-separated values are the form
    that survives every launcher (sfsync-run splits arguments at commas)."""
    if isinstance(items, (str, int)):
        items = [items]
    try:
        schedule = [int(x) for item in items for x in str(item).split(",") if x.strip()]
    except ValueError:
        schedule = []
    if not schedule or min(schedule) < 1:
        raise SystemExit("--micro-batches wants positive integers, e.g. 4 or 3 1 4; got %r"
                         % " ".join(map(str, items)))
    return schedule


def make_mlp(features, hidden, classes, depth, seed):
    """An MLP with `depth` hidden layers, initialized from `seed` (so every
    rank and every copy starts from the same weights)."""
    torch.manual_seed(seed)
    layers, width = [], features
    for _ in range(depth):
        layers += [torch.nn.Linear(width, hidden), torch.nn.Tanh()]
        width = hidden
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


def clone_model(model):
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    return twin


def micro_batch(seed, rank, window, micro, batch, features, classes):
    """Deterministic data of (rank, window, micro-batch): every rank can
    regenerate every other rank's data (the reference uses that), and ranks
    see different data (so a missing synchronization shows)."""
    g = torch.Generator().manual_seed(((seed * 1000003 + rank) * 10007 + window) * 101 + micro)
    x = torch.randn(batch, features, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    return x, y


def gradient_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def max_abs_diff(a, b):
    return (flat_params(a) - flat_params(b)).abs().max().item()


class CommCounter:
    """State of counting_allreduce_hook: all-reduce calls and bytes."""

    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.calls = 0
        self.bytes = 0

    def snapshot(self):
        return self.calls, self.bytes


def counting_allreduce_hook(state, bucket):
    """DDP comm hook: what DDP's default does (average by all-reduce), counting
    each bucket's bytes. With a comm hook DDP no longer divides by the world
    size itself, so the hook does, as torch's own allreduce_hook."""
    buf = bucket.buffer()
    state.calls += 1
    state.bytes += buf.numel() * buf.element_size()
    buf.div_(state.world)
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def shutdown():
    """Leave torch.distributed without PyTorch 1.13's teardown deadlock.

    The last reference to a ProcessGroupGloo (held by DDP's Reducer) can be
    dropped on the main thread, whose destructor joins the group's worker
    threads while holding the GIL; a worker may still be releasing the last
    reference to a Python-owned tensor, which needs the GIL (seen about once
    in 75 runs). Sleeping with the GIL released after the last collective lets
    the workers drain first. Call after the last collective, before the DDP
    models go away.
    """
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()
