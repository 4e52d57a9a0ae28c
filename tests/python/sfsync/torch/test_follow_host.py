"""The host as it is: samples/python/trainer_backend.py, unmodified, on 2
ranks over gloo, with sfsync following its windows (the no-code path:
SF_FOLLOW_HOST=1 and sfsync's boot folder on PYTHONPATH, or the shim, which
sets both; or ``--attach``: ``sfsync.torch.attach(ddp)`` without a count).

Each rank checks, and prints one RESULT line when every check holds:
* bytes: what the process wrote per window (the kernel's count,
  /proc/self/io wchar, between optimizer steps), less the metric
  all-reduce's own bytes, over the bytes of one synchronization of every
  DDP's parameters (each measured alone before training, the same calls
  DDP makes) must be within --ratio-max of 1 for every window from
  --judge-from on;
* values: the weights within 1e-6 of a single-process reference that
  averages both ranks' micro-batch sums per window (what DDP with a correct
  no_sync() computes), and bitwise equal across the ranks; the metric
  all-reduce's result is the sum over the ranks (untouched);
* --expect-catch-ups N: the steps that reduced what a wrong guess left local.
"""

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "samples", "python"))
sys.path.insert(0, HERE)  # the GPU check carries both files into one folder
import trainer_backend as tb  # noqa: E402


def one_sync_bytes(numels):
    """Bytes written by one all-reduce of each of these element counts."""
    dist.barrier()
    before = tb.wchar()
    for n in numels:
        dist.all_reduce(torch.zeros(n))
    return tb.wchar() - before


def check_counts(syncs, numels, windows, ratio_max):
    """On cuda: the bytes sfsync's hook and catch-ups reduced over the windows'
    synchronizations (4-byte elements), within ratio_max."""
    sent = sum(s.counts()["bytes_reduced"] + s.counts()["catch_up_bytes"] for s in syncs)
    once = 4 * sum(numels) * len(windows)
    assert 1 / ratio_max <= sent / once <= ratio_max, "reduced %d bytes, %d expected" % (sent, once)
    print("[rank %d] %s bytes reduced / the windows' synchronizations %.3f (sfsync's counts)"
          % (dist.get_rank(), windows, sent / once), flush=True)


def reference(windows, world, shape, device=None):
    model = tb.build_model().to(device or "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for w, n in enumerate(windows):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(world):
            for k in range(n):
                x, y = (t.to(device or "cpu") for t in tb.micro_batch(r, w, k))
                loss = torch.nn.functional.mse_loss(model(x), y) / n
                grads = torch.autograd.grad(loss, list(model.parameters()))
                for t, g in zip(total, grads):
                    t.add_(g)
        for p, t in zip(model.parameters(), total):
            p.grad = t / world
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_case(a, case, device, rank, world):
    """One host of `shape` trained over `windows`; asserts, prints its RESULT."""
    shape, windows, ratio_max, expect_catch_ups, hook = case
    backend = tb.Backend(tb.build_model().to(device), shape, comm_hook=hook)
    ddps = [m for m in backend.model.modules()
            if isinstance(m, torch.nn.parallel.DistributedDataParallel)]
    if a.attach:
        import sfsync.torch
        syncs = [sfsync.torch.attach(d) for d in ddps]
    else:
        from sfsync.torch.follow import following
        syncs = [following(d) for d in ddps]
    if a.expect_unfollowed:
        assert all(s is None for s in syncs), "a DDP is followed: %r" % syncs
    else:
        assert all(s is not None for s in syncs), (
            "a DDP is not followed (SF_FOLLOW_HOST / --attach): %r" % syncs)
    cuda = device.type == "cuda"
    marks = [tb.wchar()]
    tb.train(backend, windows, rank, lambda w: marks.append(tb.wchar()))
    # Measured after training: a float all-reduce of gradient size before it
    # would be a foreign call to the shim's own automatic mode (SF_FOLLOW_HOST=0).
    numels = [sum(q.numel() for name, q in d.module.named_parameters()
                  if name not in getattr(d, "parameters_to_ignore", ())) for d in ddps]
    if cuda:
        check_counts(syncs, numels, windows, ratio_max)
        marks = [0] * (len(windows) + 1)
    sync_bytes = 1 if cuda else one_sync_bytes(numels)
    metric_bytes = 0 if cuda else one_sync_bytes([13])
    ratios = [1.0 if cuda else (b - a_ - metric_bytes) / sync_bytes
              for a_, b in zip(marks, marks[1:])]
    print("[rank %d] %s windows %s: bytes per window / one synchronization %s"
          % (rank, shape, windows, " ".join("%.3f" % r for r in ratios)), flush=True)
    bad = [(i + 1, r) for i, r in enumerate(ratios)
           if i + 1 >= a.judge_from and not 1 / ratio_max <= r <= ratio_max]
    assert not bad, "windows outside [1/%g, %g] x the gradient bytes: %s" % (
        ratio_max, ratio_max, bad)
    # The metric all-reduce, untouched: the sum of every rank's own loss sums.
    local = torch.tensor(backend.local_loss_sums, dtype=torch.float32, device=device)
    every = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(every, local)
    expected = torch.stack(every).sum(0).tolist()
    assert backend.metric_values == expected, "the metric all-reduce gave %r, not %r" % (
        backend.metric_values, expected)
    weights = torch.cat([q.detach().reshape(-1) for q in backend.model.module.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    assert all(torch.equal(gathered[0], g) for g in gathered), "ranks' weights differ"
    ref = reference(windows, world, shape, device)
    diff = (weights - ref).abs().max().item()
    assert diff <= 1e-6, "weights %.3g off the reference (a correct no_sync())" % diff
    counts = [s.counts() for s in syncs if s is not None]
    catch_ups = max([c["catch_ups"] for c in counts] or [0])
    if expect_catch_ups is not None:
        assert catch_ups == expect_catch_ups, "catch-ups %d, expected %d: %r" % (
            catch_ups, expect_catch_ups, counts)
    print("[rank %d] RESULT shape=%s windows=%s max_abs_diff=%.3g ranks_equal=1 metric_calls=%d "
          "catch_ups=%d catch_up_bytes=%d OK"
          % (rank, shape, ",".join(map(str, windows)), diff, len(backend.metric_values),
             catch_ups, sum(c["catch_up_bytes"] for c in counts)), flush=True)


def parse_case(spec, a):
    """SHAPE/WINDOWS[/catch=N][/ratio=X][/hook=1] -> (shape, windows,
    ratio_max, catch-ups, the host registers its own comm hook)."""
    parts = spec.split("/")
    if len(parts) < 2 or parts[0] not in tb.SHAPES:
        raise SystemExit("--case %r: expected SHAPE/WINDOWS[/catch=N][/ratio=X][/hook=1]" % spec)
    extra = dict(p.split("=", 1) for p in parts[2:])
    return (parts[0], [int(n) for n in parts[1].split(",")],
            float(extra.get("ratio", a.ratio_max)),
            int(extra["catch"]) if "catch" in extra else a.expect_catch_ups,
            extra.get("hook") == "1")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="backward-only", choices=tb.SHAPES)
    p.add_argument("--windows", default="4,4,4")
    p.add_argument("--case", action="append", default=[],
                   help="SHAPE/WINDOWS[/catch=N][/ratio=X][/hook=1], repeatable: hosts one after "
                        "the other in these processes (instead of --shape/--windows)")
    p.add_argument("--attach", action="store_true", help="attach(ddp) in code, no count")
    p.add_argument("--judge-from", type=int, default=1, help="the first window judged (1-based)")
    p.add_argument("--ratio-max", type=float, default=1.03)
    p.add_argument("--expect-catch-ups", type=int, default=None)
    p.add_argument("--expect-unfollowed", action="store_true",
                   help="the DDP is not followed (a host sfsync cannot serve)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: NCCL, the bytes judged by sfsync's own counts (wchar does "
                        "not see NCCL)")
    p.add_argument("--unservable", action="store_true",
                   help="torch._dynamo.config.optimize_ddp = 'python_reducer' (torch 2.x)")
    a = p.parse_args()
    cases = [parse_case(c, a) for c in a.case] or [
        (a.shape, [int(n) for n in a.windows.split(",")], a.ratio_max, a.expect_catch_ups, False)]
    if a.unservable:
        import importlib
        importlib.import_module("torch._dynamo").config.optimize_ddp = "python_reducer"
    tb.env_from_mpirun()
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    for case in cases:
        run_case(a, case, device, rank, world)
        gc.collect()  # the case's DDPs (and the hooks that follow them) go
    print("[rank %d] ALL %d cases OK" % (rank, len(cases)), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
