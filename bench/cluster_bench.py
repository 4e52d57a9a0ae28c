#!/usr/bin/python3
"""End-to-end benchmark on simulated hosts: sfsync vs DDP, one command.

    sudo /usr/bin/python3 bench/cluster_bench.py            # the full run (~5 min idle)
    /usr/bin/python3 bench/cluster_bench.py --smoke          # 2 hosts, 1 rate, seconds

For every host count N (2, 4) and link rate (10gbit, 1gbit, 200mbit, and
loopback: N processes on this machine without a cluster), runs
samples/python/bench_ddp.py with its variants taking turns window by window
(sfsync, DDP with correct no_sync(), the DDP trap, DDP + fp16_compress_hook,
sfsync with a bf16 / fp16 wire) and writes, under --out (default bench/results):
  cluster_bench.json   every run's JSON record, plus the ratios
  cluster_bench.md     the table README shows
  cluster_bench.png    ms/window per variant vs link rate (python3-matplotlib)
Ratios (same run): sfsync / ddp_fwd_bwd, best 16-bit sfsync / ddp_fp16,
ddp_bwd_only / sfsync. Hosts are scripts/cluster.sh namespaces (root); one
rank per host. Exit status 77 when clusters cannot run here.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(ROOT, "scripts", "cluster.sh")
BENCH = os.path.join(ROOT, "samples", "python", "bench_ddp.py")
PY = "/usr/bin/python3"
VARIANTS = ["sfsync", "ddp_fwd_bwd", "ddp_bwd_only", "ddp_fp16", "sfsync_bf16", "sfsync_fp16"]
RATES = ["10gbit", "1gbit", "200mbit"]


def bench_parser(doc, variants):
    """The options every benchmark here takes: hosts, rates, variants, windows."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rates", nargs="+", default=RATES + ["loopback"])
    p.add_argument("--variants", nargs="+", default=variants)
    p.add_argument("--windows", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    return p


def parse_args(argv=None):
    p = bench_parser(__doc__, VARIANTS)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--sfsync-bucket-cap-mb", type=float, default=None,
                   help="sfsync's bucket cap (default: its own, 25 MiB as DDP's)")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--port", type=int, default=29600)
    p.add_argument("--smoke", action="store_true",
                   help="2 hosts at 1gbit, sfsync / ddp_fwd_bwd / ddp_bwd_only, small model")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    a = p.parse_args(argv)
    if a.smoke:
        a.hosts, a.rates = [2], ["1gbit"]
        a.variants = ["sfsync", "ddp_fwd_bwd", "ddp_bwd_only"]
        a.windows, a.warmup, a.hidden = 3, 1, 512
    return a


def run_one(a, n, rate, store_dir):
    bench = [PY, BENCH, "--windows", str(a.windows), "--warmup", str(a.warmup),
             "--micro-batches", str(a.micro_batches), "--hidden", str(a.hidden),
             "--sfsync-store-dir", store_dir, "--variants"] + a.variants
    if a.sfsync_bucket_cap_mb:
        bench += ["--sfsync-bucket-cap-mb", str(a.sfsync_bucket_cap_mb)]
    return run_ranks(a, n, rate, bench, "cluster_bench")


def run_ranks(a, n, rate, argv, tag):
    """Runs argv on n ranks (loopback: sfsync-run here; else scripts/cluster.sh
    hosts at `rate`) with this tree's package and a.build's library; returns the
    JSON record a rank printed, with hosts, rate and run_s added. Exit status 77
    when clusters cannot run; any other failure ends the benchmark (`tag` names it)."""
    lib = os.path.join(a.build, "plugin", "libsfsync.so")
    env = dict(os.environ, SFSYNC_LIBRARY=lib, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    # The package from this source tree, with the build's library.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH")) if p)
    env["MASTER_PORT"] = str(a.port)
    a.port += 10  # a fresh port pair per run (TIME_WAIT)
    if rate == "loopback":
        cmd = [os.path.join(a.build, "plugin", "tools", "sfsync-run"), "-n", str(n),
               "--master-port", str(a.port - 10), "--"] + argv
    else:
        cmd = ["bash", CLUSTER, "run", str(n), rate, "--"] + argv
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    out = p.stdout + p.stderr
    m = re.search(r"^(?:\[[^\]]*\] )?JSON (\{.*\})$", out, re.M)
    if p.returncode != 0 or not m:
        if p.returncode == 77:
            print(out.strip(), file=sys.stderr)
            sys.exit(77)
        sys.stderr.write(out[-4000:])
        raise SystemExit("%s: N=%d %s failed (status %d)" % (tag, n, rate, p.returncode))
    rec = json.loads(m.group(1))
    rec["hosts"], rec["rate"], rec["run_s"] = n, rate, round(time.time() - t0, 1)
    return rec


def ratios(rec):
    ms = {r["variant"]: r["ms_per_window_median"] for r in rec["results"]}
    out = {}
    if "sfsync" in ms and "ddp_fwd_bwd" in ms:
        out["sfsync_vs_ddp"] = ms["sfsync"] / ms["ddp_fwd_bwd"]
    if "sfsync" in ms and "ddp_bwd_only" in ms:
        out["trap_vs_sfsync"] = ms["ddp_bwd_only"] / ms["sfsync"]
    wire16 = [v for v in ("sfsync_bf16", "sfsync_fp16") if v in ms]
    if wire16 and "ddp_fp16" in ms:
        for v in wire16:
            out["%s_vs_ddp_fp16" % v] = ms[v] / ms["ddp_fp16"]
    return {k: round(v, 3) for k, v in out.items()}


def table(records, variants):
    head = "| N | link | " + " | ".join(variants) + " | sfsync/DDP | bf16/DDP-fp16 | fp16/DDP-fp16 | trap/sfsync |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rec in records:
        ms = {r["variant"]: r["ms_per_window_median"] for r in rec["results"]}
        r = rec["ratios"]
        cells = ["%.0f" % ms[v] if v in ms else "-" for v in variants]
        fmt = lambda k: "%.2f" % r[k] if k in r else "-"
        lines.append("| %d | %s | %s | %s | %s | %s | %s |" % (
            rec["hosts"], rec["rate"], " | ".join(cells), fmt("sfsync_vs_ddp"),
            fmt("sfsync_bf16_vs_ddp_fp16"), fmt("sfsync_fp16_vs_ddp_fp16"),
            fmt("trap_vs_sfsync")))
    return "\n".join(lines)


def plot(records, variants, path):
    style = {"sfsync": ("C0", "o", "-"), "sfsync_bf16": ("C0", "s", "--"),
             "sfsync_fp16": ("C0", "^", ":"), "ddp_fwd_bwd": ("C1", "o", "-"),
             "ddp_fp16": ("C1", "s", "--"), "ddp_bwd_only": ("C3", "x", "-")}
    plot_ms(records, variants, path, style, "%d hosts, %d micro-batches per window")


def series(recs, variant, order):
    """(x indices, ms/window medians) of one variant over the link rates in
    ``order``; recs maps a rate to its record."""
    xs, ys = [], []
    for i, rate in enumerate(order):
        for res in recs.get(rate, {}).get("results", []):
            if res["variant"] == variant:
                xs.append(i)
                ys.append(res["ms_per_window_median"])
    return xs, ys


def cluster_ready(rates):
    """0 when the rates need no simulated host or scripts/cluster.sh can make
    them; else cluster.sh check's status (its reason on stderr)."""
    if all(r == "loopback" for r in rates):
        return 0
    chk = subprocess.run(["bash", CLUSTER, "check"], capture_output=True, text=True)
    if chk.returncode != 0:
        print(chk.stderr.strip(), file=sys.stderr)
    return chk.returncode


def draw_panel(ax, recs, variants, order, style, title, band=None, bound=None):
    """One panel: ms/window of each variant (that has points) over the link
    rates in ``order``, log scale; style maps a variant to (colour, marker,
    line style). band: a result key holding [median, lo, hi] drawn as a
    shaded band around the variant's line; bound: (variant, result key,
    label) drawn as a black line (e.g. a variant's window bound)."""
    for v in variants:
        xs, ys = series(recs, v, order)
        if not xs:
            continue
        c, m, ls = style.get(v, ("k", ".", "-"))
        ax.plot(xs, ys, color=c, marker=m, linestyle=ls, label=v)
        if band:
            iv = [res[band] for rate in order for res in recs.get(rate, {}).get("results", [])
                  if res["variant"] == v and res.get(band)]
            if len(iv) == len(xs):
                ax.fill_between(xs, [x[1] for x in iv], [x[2] for x in iv], color=c, alpha=0.15)
    if bound:
        v, key, label = bound
        pts = [(i, res[key]) for i, rate in enumerate(order)
               for res in recs.get(rate, {}).get("results", [])
               if res["variant"] == v and res.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color="k", linewidth=2, label=label)
    ax.set_xticks(range(len(order)))
    ax.set_xticklabels(order)
    ax.set_yscale("log")
    ax.set_xlabel("link rate per host")
    ax.set_ylabel("ms per window (median, slowest rank)")
    ax.set_title(title)


def plot_ms(records, variants, path, style, title):
    """ms/window per variant vs link rate, one panel per host count; style maps a
    variant to (colour, marker, line style); title is formatted with (hosts,
    micro-batches). ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    hosts = sorted({r["hosts"] for r in records})
    fig, axes = plt.subplots(1, len(hosts), figsize=(6 * len(hosts), 4.5), squeeze=False)
    order = [x for x in RATES[::-1] + ["loopback"] if any(r["rate"] == x for r in records)]
    for ax, n in zip(axes[0], hosts):
        recs = {r["rate"]: r for r in records if r["hosts"] == n}
        draw_panel(ax, recs, variants, order, style, title % (n, records[0]["micro_batches"]))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_results(out, name, doc, md, plot_to, tag):
    """Writes out/name.json (doc), out/name.md (md, also printed) and, with
    matplotlib, out/name.png (plot_to(path))."""
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(md + "\n")
    print(md)
    try:
        plot_to(os.path.join(out, name + ".png"))
    except ImportError:
        print("%s: no matplotlib (apt-get install python3-matplotlib): no plot" % tag,
              file=sys.stderr)


LOAD0 = os.getloadavg()


def run_grid(a, tool, run, md_of, plot_of, extra=None, load0=None):
    """The driver the grid benchmarks share (this one, sharded_bench,
    torch2_bench): the cluster check, ``run(n, rate)`` (a list of records,
    which it prints) for every host count and rate, then
    out/<name>.{json,md,png}: the records, the command, the loads, the wall
    time and ``extra`` (read after the runs). Returns (records, 0), or
    (None, status) when clusters cannot run here."""
    load0 = load0 or os.getloadavg()
    rc = cluster_ready(a.rates)
    if rc:
        return None, rc
    os.makedirs(a.out, exist_ok=True)
    records, started = [], time.time()
    for n in a.hosts:
        for rate in a.rates:
            records += run(n, rate)
    name = getattr(a, "name", None) or (tool + "_smoke" if a.smoke else tool)
    doc = {"command": " ".join([sys.executable] + sys.argv), "records": records,
           "load_before": load0, "load_after": os.getloadavg(),
           "wall_s": round(time.time() - started, 1)}
    doc.update(extra or {})
    write_results(a.out, name, doc, md_of(records), lambda path: plot_of(records, path), tool)
    print("%s: wrote %s/%s.{json,md,png} in %.0f s (load %.1f -> %.1f)" % (
        tool, a.out, name, time.time() - started, load0[0], os.getloadavg()[0]))
    return records, 0


def main(argv=None):
    a = parse_args(argv)

    def run(n, rate):
        with tempfile.TemporaryDirectory(prefix="sfsync-bench-") as store:
            rec = run_one(a, n, rate, store)
        rec["ratios"] = ratios(rec)
        print("N=%d %-8s %s  %s" % (n, rate, " ".join(
            "%s=%.0f" % (r["variant"], r["ms_per_window_median"]) for r in rec["results"]),
            rec["ratios"]), flush=True)
        return [rec]

    _, rc = run_grid(a, "cluster_bench", run, lambda recs: table(recs, a.variants),
                     lambda recs, path: plot(recs, a.variants, path),
                     extra={"sfsync_bucket_cap_mb": a.sfsync_bucket_cap_mb}, load0=LOAD0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
