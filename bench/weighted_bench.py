#!/usr/bin/python3
"""Weighted windows on a slow link: the HF Trainer fix's extra collective
against none for sfsync, and the time per window of each way to train.

    sudo /usr/bin/python3 bench/weighted_bench.py           # 2 and 3 hosts at 200 Mbit/s, loopback
    sudo /usr/bin/python3 bench/weighted_bench.py --hosts 2 --rates 200mbit
    /usr/bin/python3 bench/weighted_bench.py --smoke         # loopback, 2 ranks, < 60 s, no root

The driver is any Python; the ranks run pip's torch 2.x with transformers
(--python, default the project's venv /root/.cache/sfsync/venv-torch2/bin/python)
and train samples/python/weighted_lm.py's model and data (GPT-2, 2 layers,
n_embd 64, vocab 256: 120,576 parameters, 482,304 gradient bytes; variable
lengths padded with -100; windows of 4 micro-batches of 4 sequences),
AdamW, every variant on the same data, taking turns window by window (each
window after a barrier; --warmup rounds untimed):

  compute     no collective: forward+backward of the window's micro-batches
              and the step on a plain copy (the floor)
  ddp         plain DDP, per-micro-batch means, no_sync() on 1..N-1
  hf          the HF Trainer's fix: the window's tokens counted ahead, one
              all_reduce of the count (8 bytes) per step, then as ddp with
              loss = sum / global count * world
  sfsync_avg  GradientSync (reduce "average"), per-micro-batch means: sfsync
              without weights (the same buckets and collectives)
  sfsync      GradientSync(reduce="weighted"), sync.weigh(tokens) per
              micro-batch: the weight rides in the buckets' own collectives

DDP runs without a comm hook (its own C++ all-reduce); its bucket cap and
sfsync's are their defaults (the model is one bucket for both).

Measured per run: each variant's window time (the slowest rank's wall time
of the whole window: forward, backward, synchronization, step), median and
range over the timed windows; the hf count all_reduce's own time inside its
windows (timed around the call, the slowest rank's); and that collective
alone: a barrier, then one all_reduce of one int64, --count-reps times in
each of --groups fresh process groups (Gloo's TCP latency on this VM has
two modes that stick to a connection: pooled over fresh connections), median
of the slowest rank. Ratios against baselines of the same process (the
project's rule: ratios, never timed asserts): every variant over ddp, hf's
count over ddp's window, sfsync over sfsync_avg (what weighing costs), and
over compute.

Hosts are scripts/cluster.sh namespaces (veth + tc tbf, root; removed at the
end of each run, and whatever is left of this benchmark's clusters at
exit); loopback is N processes here under sfsync-run. Writes
--out/weighted_<date>.json (default bench/results; --smoke: a temporary
directory unless --out is given) and prints the table. Exit status 77 when
clusters cannot run here.
"""
import argparse
import atexit
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cluster_bench import CLUSTER, ROOT, cluster_ready, run_ranks  # noqa: E402

TORCH2 = "/root/.cache/sfsync/venv-torch2/bin/python"
VARIANTS = ["compute", "ddp", "hf", "sfsync_avg", "sfsync"]
SAMPLE = os.path.join(ROOT, "samples", "python")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 3])
    p.add_argument("--rates", nargs="+", default=["200mbit", "loopback"])
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (one window per variant)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--count-reps", type=int, default=100,
                   help="lone count all_reduces per fresh group")
    p.add_argument("--groups", type=int, default=4, help="fresh process groups for them")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--python", default=TORCH2, help="the ranks' interpreter (torch 2.x)")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=None,
                   help="results folder (default bench/results; --smoke: a temporary one)")
    p.add_argument("--name", default=None, help="file stem (default weighted_<date>)")
    p.add_argument("--port", type=int, default=29700)
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    p.add_argument("--smoke", action="store_true",
                   help="loopback, 2 ranks, 1+4 rounds, 20 lone count all_reduces: < 60 s")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.hosts, a.rates, a.rounds, a.warmup = [2], ["loopback"], 4, 1
        a.count_reps, a.groups = 20, 1
    if a.rounds < 1 or a.count_reps < 1 or a.groups < 1:
        p.error("--rounds, --count-reps and --groups must be at least 1")
    return a


# ---- the worker (one per rank, torch 2.x) --------------------------------------------


class Compute:
    """No collective: the window's forward+backward (per-micro-batch means)
    and the step on a plain copy."""

    name = "compute"

    def __init__(self, wl, a, base):
        import torch
        self.wl = wl
        self.model = wl.common.clone_model(base)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=a.lr,
                                     weight_decay=a.weight_decay)

    def run_window(self, batches):
        n = len(batches)
        for b in batches:
            s, tokens = self.wl.loss_sum(self.model, b)
            (s / tokens / n).backward()
        self.opt.step()
        self.opt.zero_grad()

    def close(self):
        pass


def slowest(dist, torch, xs):
    """Elementwise max over the ranks of a list of floats."""
    t = torch.tensor(xs, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def summary(ms):
    return {"median": round(statistics.median(ms), 3), "min": round(min(ms), 3),
            "max": round(max(ms), 3), "n": len(ms)}


def lone_counts(dist, torch, reps, groups, fresh=True):
    """Each rank's time of one int64 all_reduce after a barrier, reps times
    in each of `groups` fresh Gloo groups (fresh=False: in the default group,
    the one DDP and the hf count use); the slowest rank per call (ms)."""
    out = []
    for _ in range(groups):
        g = dist.new_group(backend="gloo") if fresh else None
        mine = []
        for _ in range(reps):
            count = torch.tensor([1234], dtype=torch.int64)
            dist.barrier(group=g)
            t0 = time.perf_counter()
            dist.all_reduce(count, group=g)
            mine.append((time.perf_counter() - t0) * 1e3)
        out += slowest(dist, torch, mine)
        dist.barrier(group=g)
        if fresh:
            dist.destroy_process_group(g)
    return out


def worker(a):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, SAMPLE)
    import weighted_lm as wl
    import sfsync
    torch.set_num_threads(1)
    la = wl.parse_args(["--micro-batches", str(a.micro_batches), "--batch-size",
                        str(a.batch_size), "--seq-len", str(a.seq_len), "--n-embd", str(a.n_embd),
                        "--n-layer", str(a.n_layer), "--model", "gpt2"])
    rank, world = wl.common.init_torch_distributed(la.torch_port_offset)
    base = wl.build_lm(la, torch.float32)
    runners = []
    for v in VARIANTS:
        if v == "compute":
            runners.append(Compute(wl, la, base))
        elif v in ("ddp", "hf"):
            runners.append(wl.DDPVariant(v, la, base, world, count_hook=False))
        else:
            r = wl.SfsyncVariant(la, base, world,
                                 reduce="weighted" if v == "sfsync" else "average")
            r.name = v
            runners.append(r)
    times = {r.name: [] for r in runners}
    hf = next(r for r in runners if r.name == "hf")
    for rnd in range(a.warmup + a.rounds):
        data = wl.window_batches(la, world, rnd)[rank]
        for r in runners:
            dist.barrier()
            t0 = time.perf_counter()
            if r is hf:
                r.run_window(data, clock=time.perf_counter)
            else:
                r.run_window(data)
            times[r.name].append((time.perf_counter() - t0) * 1e3)
    timed = slice(a.warmup, None)
    results = {}
    for r in runners:
        results[r.name] = summary(slowest(dist, torch, times[r.name][timed]))
    in_window = summary(slowest(dist, torch, [x * 1e3 for x in hf.count_s[timed]]))
    lone = summary(lone_counts(dist, torch, a.count_reps, a.groups))
    lone_default = summary(lone_counts(dist, torch, a.count_reps, 1, fresh=False))
    stats = {}
    for r in runners:
        if hasattr(r, "sync"):
            st = r.stats()
            stats[r.name] = {"collectives_per_window": st["collectives_issued"] /
                             st["windows_completed"],
                             "bytes_reduced_per_window": st["bytes_reduced"] //
                             st["windows_completed"], "buckets": st["bucket_count"]}
    for r in runners:
        r.close()
    if rank == 0:
        ms = {k: v["median"] for k, v in results.items()}
        ratios = {"hf_vs_ddp": ms["hf"] / ms["ddp"], "sfsync_vs_ddp": ms["sfsync"] / ms["ddp"],
                  "sfsync_avg_vs_ddp": ms["sfsync_avg"] / ms["ddp"],
                  "sfsync_vs_sfsync_avg": ms["sfsync"] / ms["sfsync_avg"],
                  "hf_count_in_window_vs_ddp_window": in_window["median"] / ms["ddp"],
                  "lone_count_vs_ddp_window": lone["median"] / ms["ddp"]}
        ratios.update({"%s_vs_compute" % k: ms[k] / ms["compute"] for k in ms if k != "compute"})
        rec = {"world_size": world, "torch": torch.__version__, "sfsync": sfsync.version(),
               "parameters": sum(p.numel() for p in base.parameters()),
               "gradient_bytes": sum(p.numel() * p.element_size() for p in base.parameters()),
               "micro_batches": la.micro_batches, "batch_size": la.batch_size,
               "seq_len": la.seq_len, "rounds": a.rounds, "warmup": a.warmup,
               "ms_per_window": results, "hf_count_allreduce_ms_in_window": in_window,
               "lone_count_allreduce_ms": lone,
               "lone_count_allreduce_ms_default_group": lone_default, "count_reps": a.count_reps,
               "groups": a.groups, "sfsync_stats": stats,
               "ratios": {k: round(v, 4) for k, v in ratios.items()},
               "load_worker_end": os.getloadavg()}
        print("JSON " + json.dumps(rec, sort_keys=True), flush=True)
    wl.common.shutdown()
    return 0


# ---- the driver ----------------------------------------------------------------------


def table(records):
    head = ("| N | link | " + " | ".join("%s ms/window" % v for v in VARIANTS) +
            " | hf count in window ms | lone count ms (fresh groups; default group) | hf/ddp "
            "| sfsync/ddp | sfsync/sfsync_avg | count/ddp window |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in records:
        ms = rec["ms_per_window"]
        r = rec["ratios"]
        lines.append("| %d | %s | %s | %.2f | %.2f; %.2f | %.3f | %.3f | %.3f | %.4f |" % (
            rec["hosts"], rec["rate"],
            " | ".join("%.1f (%.1f-%.1f)" % (ms[v]["median"], ms[v]["min"], ms[v]["max"])
                       for v in VARIANTS),
            rec["hf_count_allreduce_ms_in_window"]["median"],
            rec["lone_count_allreduce_ms"]["median"],
            rec["lone_count_allreduce_ms_default_group"]["median"], r["hf_vs_ddp"],
            r["sfsync_vs_ddp"],
            r["sfsync_vs_sfsync_avg"], r["hf_count_in_window_vs_ddp_window"]))
    return "\n".join(lines)


def leftover_clusters(state):
    """Removes what is left of this benchmark's clusters (cluster.sh run removes
    its own on every exit path it sees; a SIGKILL from a timeout is not one)."""
    if not os.path.isdir(state):
        return
    for cid in os.listdir(state):
        subprocess.run(["bash", CLUSTER, "down", cid], env=dict(os.environ, SF_CLUSTER_STATE=state),
                       capture_output=True)
    shutil.rmtree(state, ignore_errors=True)


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    load0 = os.getloadavg()
    rc = cluster_ready(a.rates)
    if rc:
        return rc
    if any(r != "loopback" for r in a.rates):
        state = tempfile.mkdtemp(prefix="sfsync-weighted-clusters-")
        os.environ["SF_CLUSTER_STATE"] = state
        atexit.register(leftover_clusters, state)
    out = a.out or (tempfile.mkdtemp(prefix="sfsync-weighted-bench-") if a.smoke
                    else os.path.join(ROOT, "bench", "results"))
    os.makedirs(out, exist_ok=True)
    date = datetime.date.today().isoformat()
    name = a.name or ("weighted_smoke_%s" % date if a.smoke else "weighted_%s" % date)
    started = time.time()
    records = []
    for n in a.hosts:
        for rate in a.rates:
            argv = [a.python, os.path.abspath(__file__), "--worker",
                    "--rounds", str(a.rounds), "--warmup", str(a.warmup),
                    "--count-reps", str(a.count_reps), "--groups", str(a.groups),
                    "--micro-batches", str(a.micro_batches), "--batch-size", str(a.batch_size),
                    "--seq-len", str(a.seq_len), "--n-embd", str(a.n_embd),
                    "--n-layer", str(a.n_layer)]
            load = os.getloadavg()
            rec = run_ranks(a, n, rate, argv, "weighted_bench")
            rec.update(load_start=load, load=os.getloadavg())
            records.append(rec)
            ms = rec["ms_per_window"]
            print("N=%d %-8s %s  hf count %.2f ms in window, %.2f ms alone  %s  %.0f s" % (
                n, rate, " ".join("%s=%.1f" % (v, ms[v]["median"]) for v in VARIANTS),
                rec["hf_count_allreduce_ms_in_window"]["median"],
                rec["lone_count_allreduce_ms"]["median"],
                {k: rec["ratios"][k] for k in ("hf_vs_ddp", "sfsync_vs_ddp",
                                               "sfsync_vs_sfsync_avg")}, rec["run_s"]),
                flush=True)
    doc = {"command": " ".join([sys.executable] + sys.argv), "records": records,
           "load_before": load0, "load_after": os.getloadavg(),
           "wall_s": round(time.time() - started, 1), "variants": VARIANTS}
    path = os.path.join(out, name + ".json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    print(table(records))
    print("weighted_bench: wrote %s in %.0f s (load %.1f -> %.1f)" % (
        path, time.time() - started, load0[0], os.getloadavg()[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
