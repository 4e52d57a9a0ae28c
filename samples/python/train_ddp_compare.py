"""Train the same MLP with sfsync and with PyTorch DDP, side by side, and
check that they agree.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 \
      build/plugin/tools/sfsync-run -n 2 -- /usr/bin/python3 samples/python/train_ddp_compare.py

(from the root of a checkout built in build/: the package from the source
tree, the build's library as its development override; with the package
installed by ``pip install`` or ``cmake --install``, drop both variables.)

Every rank runs W windows of N micro-batches (forward + backward each) on its
own data, three times over, from the same initial weights:

* sfsync: ``with sync.accumulate():`` around micro-batches 1..N-1, then the
  last one, ``sync.synchronize()``, SGD step.
* DDP (gloo): ``with ddp.no_sync():`` around forward AND backward of
  micro-batches 1..N-1, then the last one, SGD step. A comm hook counts the
  bytes DDP all-reduces.
* a reference without any communication: every rank replays all ranks'
  micro-batches locally (loss / world size), so it computes exactly what an
  averaging all-reduce must produce.

Per window it prints bytes and time of sfsync and DDP, and checks sfsync's
counters: zero collectives inside the window, exactly one per bucket per
window, gradient_bytes reduced per window, every bucket launched early by the
autograd hooks. At the end it checks that sfsync's weights equal DDP's and the
reference's (max |difference| <= --tolerance), are identical on every rank,
and moved away from the initial weights. Exits 1 on any failure.
"""

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_common as common
import sfsync
from sfsync import torch as sfsync_torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=5, help="accumulation windows (W)")
    p.add_argument("--micro-batches", nargs="+", default=["4"], metavar="N",
                   help="micro-batches per window, or several used in turn (e.g. 3 1 4)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per micro-batch")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--depth", type=int, default=2, help="hidden layers")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest allowed |weight difference| (sfsync vs DDP and reference)")
    # Small caps by default so that this small model spans several buckets.
    p.add_argument("--bucket-cap-mb", type=float, default=0.05,
                   help="sfsync and DDP bucket cap in MiB")
    p.add_argument("--first-bucket-cap-mb", type=float, default=0.01,
                   help="sfsync first bucket cap in MiB (DDP's is fixed at 1)")
    p.add_argument("--register", action="store_true",
                   help="register the params' own .grad tensors (sf_register_gradient) instead "
                        "of views into the plugin's flat buffer")
    p.add_argument("--no-hooks", action="store_true",
                   help="report no grad-ready: synchronize() reduces every bucket")
    p.add_argument("--torch-port-offset", type=int, default=1,
                   help="torch.distributed uses MASTER_PORT + this (sfsync uses MASTER_PORT)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    args = p.parse_args(argv)
    args.schedule = common.parse_schedule(args.micro_batches)
    if args.windows < 1:
        p.error("--windows must be at least 1")
    return args


class Checker:
    """Collects failed checks; never stops at the first one."""

    def __init__(self, rank):
        self.rank = rank
        self.failures = []

    def expect(self, ok, what):
        if not ok:
            self.failures.append(what)
            print("CHECK FAILED (rank %d): %s" % (self.rank, what), flush=True)
        return ok


def micro_batches(args, rank, window, n):
    return [common.micro_batch(args.seed, rank, window, m, args.batch_size, args.features,
                               args.classes) for m in range(n)]


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rank, world = common.init_torch_distributed(args.torch_port_offset)
    check = Checker(rank)
    loss_fn = torch.nn.CrossEntropyLoss()

    base = common.make_mlp(args.features, args.hidden, args.classes, args.depth, args.seed)
    initial = common.flat_params(base)
    sf_model, ddp_inner, ref_model = (common.clone_model(base) for _ in range(3))
    n_params = sum(1 for _ in base.parameters())
    grad_bytes = common.gradient_bytes(base)

    # sfsync meets through torch.distributed's store (initialized above). Every
    # parameter is used: no "used" mask, so the bytes are the gradient's alone.
    sync = sfsync_torch.GradientSync(sf_model, flat_buffer=not args.register,
                                     hooks=not args.no_hooks, bucket_cap_mb=args.bucket_cap_mb,
                                     first_bucket_cap_mb=args.first_bucket_cap_mb,
                                     find_unused_parameters=False)
    buckets = sync.buckets()
    n_buckets = len(buckets)
    opts = sync.context.options()
    check.expect(opts["world_size"] == world and opts["rank"] == rank,
                 "sfsync options rank/world %d/%d, torch says %d/%d"
                 % (opts["rank"], opts["world_size"], rank, world))

    ddp = DDP(ddp_inner, bucket_cap_mb=args.bucket_cap_mb)
    counter = common.CommCounter()
    ddp.register_comm_hook(counter, common.counting_allreduce_hook)

    sf_opt = torch.optim.SGD(sf_model.parameters(), lr=args.lr, momentum=args.momentum)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=args.lr, momentum=args.momentum)

    if rank == 0:
        print("sfsync %s (%s), torch %s, %d ranks, %d windows of %s micro-batches x %d samples"
              % (sfsync.version(), sfsync.library_path(), torch.__version__, world, args.windows,
                 ",".join(map(str, args.schedule)), args.batch_size))
        print("model: %d parameters, %d gradient bytes; sfsync %s, hooks %s, %d buckets (bytes: %s)"
              % (sum(p.numel() for p in base.parameters()), grad_bytes,
                 "registered .grad" if args.register else "flat buffer views",
                 "off" if args.no_hooks else "on", n_buckets,
                 ", ".join(str(b["bytes"]) for b in buckets)), flush=True)

    totals = {"sf_bytes": 0, "sf_ms": 0.0, "ddp_bytes": 0, "ddp_ms": 0.0}
    steady = {"sf": [], "ddp": []}  # window times after the first (connection setup)
    for w in range(args.windows):
        n = args.schedule[w % len(args.schedule)]
        local = micro_batches(args, rank, w, n)

        # ---- sfsync: the window brackets forward and backward of 1..N-1.
        dist.barrier()  # both timings start with the ranks aligned
        s0 = sync.stats()
        t0 = time.perf_counter()
        with sync.accumulate():
            for x, y in local[:-1]:
                (loss_fn(sf_model(x), y) / n).backward()
            s_in = sync.stats()
        x, y = local[-1]
        (loss_fn(sf_model(x), y) / n).backward()
        sync.synchronize()
        sf_opt.step()
        sync.zero_grad()
        sf_ms = (time.perf_counter() - t0) * 1e3
        s1 = sync.stats()

        d = {k: s1[k] - s0[k] for k in s1}
        inside_coll = s_in["collectives_issued"] - s0["collectives_issued"]
        inside_bytes = s_in["bytes_reduced"] - s0["bytes_reduced"]
        check.expect(inside_coll == 0 and inside_bytes == 0,
                     "window %d: sfsync issued %d collectives (%d bytes) inside the window"
                     % (w, inside_coll, inside_bytes))
        check.expect(d["collectives_issued"] == n_buckets,
                     "window %d: sfsync issued %d collectives, expected one per bucket = %d"
                     % (w, d["collectives_issued"], n_buckets))
        check.expect(d["bytes_reduced"] == grad_bytes,
                     "window %d: sfsync reduced %d bytes, expected the gradient bytes %d"
                     % (w, d["bytes_reduced"], grad_bytes))
        check.expect(d["windows_begun"] == 1 and d["windows_completed"] == 1,
                     "window %d: windows begun/completed moved by %d/%d, expected 1/1"
                     % (w, d["windows_begun"], d["windows_completed"]))
        want_early = 0 if args.no_hooks else n_buckets
        check.expect(d["early_launches"] == want_early,
                     "window %d: %d buckets launched early by grad-ready hooks, expected %d"
                     % (w, d["early_launches"], want_early))
        want_ready = 0 if args.no_hooks else (n - 1) * n_params
        check.expect(d["deferred_ready_calls"] == want_ready,
                     "window %d: %d grad-ready reports inside the window, expected %d"
                     % (w, d["deferred_ready_calls"], want_ready))
        if not args.no_hooks:
            check.expect(d["deferred_passes"] == n - 1,
                         "window %d: %d deferred backward passes, expected %d"
                         % (w, d["deferred_passes"], n - 1))

        # ---- DDP: no_sync() around forward AND backward of 1..N-1.
        dist.barrier()
        c0 = counter.snapshot()
        t0 = time.perf_counter()
        with ddp.no_sync():
            for x, y in local[:-1]:
                (loss_fn(ddp(x), y) / n).backward()
        c_in = counter.snapshot()
        x, y = local[-1]
        (loss_fn(ddp(x), y) / n).backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
        ddp_ms = (time.perf_counter() - t0) * 1e3
        c1 = counter.snapshot()
        ddp_calls, ddp_bytes = c1[0] - c0[0], c1[1] - c0[1]
        check.expect(c_in == c0, "window %d: DDP all-reduced %d bytes inside no_sync()"
                     % (w, c_in[1] - c0[1]))
        check.expect(ddp_bytes == grad_bytes, "window %d: DDP all-reduced %d bytes, expected %d"
                     % (w, ddp_bytes, grad_bytes))

        # ---- Reference: all ranks' micro-batches, locally, no communication.
        for r in range(world):
            for x, y in micro_batches(args, r, w, n):
                (loss_fn(ref_model(x), y) / (n * world)).backward()
        ref_opt.step()
        ref_opt.zero_grad()

        totals["sf_bytes"] += d["bytes_reduced"]
        totals["sf_ms"] += sf_ms
        totals["ddp_bytes"] += ddp_bytes
        totals["ddp_ms"] += ddp_ms
        if w > 0:
            steady["sf"].append(sf_ms)
            steady["ddp"].append(ddp_ms)
        if rank == 0:
            print("window %d (%d micro-batches): sfsync %d collectives %8d B %7.2f ms "
                  "(sync %.2f ms, 0 inside: %s) | DDP %d all-reduces %8d B %7.2f ms"
                  % (w, n, d["collectives_issued"], d["bytes_reduced"], sf_ms,
                     d["sync_ns_total"] / 1e6, "yes" if inside_coll == 0 else "NO",
                     ddp_calls, ddp_bytes, ddp_ms), flush=True)

    # ---- Parity.
    diff_ddp = common.max_abs_diff(sf_model, ddp.module)
    diff_ref = common.max_abs_diff(sf_model, ref_model)
    moved = (common.flat_params(sf_model) - initial).abs().max().item()
    mine = common.flat_params(sf_model)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    diff_ranks = max((g - gathered[0]).abs().max().item() for g in gathered)
    check.expect(diff_ddp <= args.tolerance, "max |sfsync - DDP| = %.3g > tolerance %.3g"
                 % (diff_ddp, args.tolerance))
    check.expect(diff_ref <= args.tolerance, "max |sfsync - reference| = %.3g > tolerance %.3g"
                 % (diff_ref, args.tolerance))
    check.expect(diff_ranks <= args.tolerance, "sfsync weights differ across ranks by %.3g"
                 % diff_ranks)
    check.expect(moved > 100 * args.tolerance,
                 "training moved the weights by only %.3g: the parity check would prove nothing"
                 % moved)
    final = sync.stats()
    check.expect(final["windows_completed"] == args.windows
                 and final["collectives_issued"] == args.windows * n_buckets,
                 "after %d windows: %d completed, %d collectives (expected %d)"
                 % (args.windows, final["windows_completed"], final["collectives_issued"],
                    args.windows * n_buckets))

    worst = torch.tensor([diff_ddp, diff_ref, diff_ranks], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    failed = torch.tensor([len(check.failures)], dtype=torch.int64)
    dist.all_reduce(failed)
    ok = failed.item() == 0
    print("RESULT rank=%d windows=%d sfsync_bytes=%d ddp_bytes=%d max_diff_ddp=%.3g "
          "max_diff_reference=%.3g %s" % (rank, args.windows, totals["sf_bytes"],
                                          totals["ddp_bytes"], diff_ddp, diff_ref,
                                          "OK" if not check.failures else "FAILED"), flush=True)
    if rank == 0:
        print("total: sfsync %d B in %.1f ms, DDP %d B in %.1f ms; max |sfsync - DDP| = %.3g, "
              "max |sfsync - reference| = %.3g, across ranks %.3g (tolerance %.3g)"
              % (totals["sf_bytes"], totals["sf_ms"], totals["ddp_bytes"], totals["ddp_ms"],
                 worst[0].item(), worst[1].item(), worst[2].item(), args.tolerance))
        if steady["sf"]:
            print("median window after the first (which connects): sfsync %.2f ms, DDP %.2f ms"
                  % (statistics.median(steady["sf"]), statistics.median(steady["ddp"])))
        print("ALL RANKS OK" if ok else "FAILED: %d check(s) failed across ranks" % failed.item(),
              flush=True)

    sync.close()
    common.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
