#!/usr/bin/python3
"""Renders SF_TRACE files (Chrome / Perfetto JSON, one per rank) as a PNG
timeline, and merges them into one file that Perfetto or chrome://tracing
opens with one process per rank.

    /usr/bin/python3 scripts/trace_plot.py trace.rank*.json -o timeline.png
    /usr/bin/python3 scripts/trace_plot.py trace.rank*.json --merge all.json
    ... --windows 2     only the last 2 windows (default 2; 0 = all)

Rows per rank: "host" (windows in grey, backward passes seen through
grad-ready in blue, the synchronize wait in orange, bucket launches ^ and
finishes |) and one row per transport lane (each bucket piece on the wire,
coloured by bucket). Needs python3-matplotlib (Debian).
"""
import argparse
import json
import sys


def load(paths):
    events, meta = [], []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        for e in doc["traceEvents"]:
            (meta if e.get("ph") == "M" else events).append(e)
    return events, meta


def select_windows(events, last):
    """Events of the last `last` windows (by rank 0's... every rank's own)."""
    if last <= 0:
        return events
    starts = {}
    for e in events:
        if e["name"] == "window":
            starts.setdefault(e["pid"], []).append(e["ts"])
    keep = []
    for e in events:
        s = sorted(starts.get(e["pid"], []))
        if not s:
            keep.append(e)
            continue
        t0 = s[-last] if len(s) >= last else s[0]
        if e["ts"] >= t0 - 1:
            keep.append(e)
    return keep


def plot(events, meta, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not events:
        sys.exit("trace_plot: no events")
    t0 = min(e["ts"] for e in events)
    ranks = sorted({e["pid"] for e in events})
    lanes = {r: sorted({e["tid"] for e in events if e["pid"] == r and e["tid"] > 0}) for r in ranks}
    rows = []  # (rank, tid, label)
    for r in ranks:
        rows.append((r, 0, "rank %d host" % r))
        rows += [(r, t, "rank %d lane %d" % (r, t - 1)) for t in lanes[r]]
    y = {(r, t): len(rows) - 1 - i for i, (r, t, _) in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(rows) + 1.6))
    palette = ["#54a24b", "#b279a2", "#72b7b2", "#9d755d", "#e45756", "#eeca3b", "#bab0ac",
               "#ff9da6", "#8cd17d", "#499894"]  # none is a host colour
    cmap = lambda b: palette[b % len(palette)]
    ms = lambda us: (us - t0) / 1000.0
    colors = {"window": "#dddddd", "pass": "#4c78a8", "synchronize": "#f58518"}
    heights = {"window": 0.9, "pass": 0.5, "synchronize": 0.5}
    for e in sorted(events, key=lambda e: e["name"] != "window"):
        row = y.get((e["pid"], e["tid"]))
        if row is None:
            continue
        if e["ph"] == "X" and e["tid"] == 0 and e["name"] in colors:
            h = heights[e["name"]]
            ax.barh(row, e["dur"] / 1000.0, left=ms(e["ts"]), height=h, color=colors[e["name"]],
                    edgecolor="none")
        elif e["ph"] == "X" and e["name"] == "wire":
            b = e["args"].get("bucket", 0)
            ax.barh(row, e["dur"] / 1000.0, left=ms(e["ts"]), height=0.6, color=cmap(b),
                    edgecolor="black", linewidth=0.3)
        elif e["ph"] == "i" and e["name"] in ("launch", "finish"):
            ax.plot(ms(e["ts"]), row + 0.38, marker="^" if e["name"] == "launch" else "|",
                    color="black", markersize=5)
    ax.set_yticks([y[(r, t)] for r, t, _ in rows])
    ax.set_yticklabels([label for _, _, label in rows])
    ax.set_xlabel("ms")
    ax.set_title(title)
    from matplotlib.patches import Patch
    handles = [Patch(color=c, label=n) for n, c in colors.items()]
    handles.append(Patch(facecolor=cmap(0), edgecolor="black", label="bucket on the wire"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("trace_plot: wrote %s (%d events, %d ranks)" % (out, len(events), len(ranks)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("-o", "--output", help="PNG to write")
    p.add_argument("--merge", help="also write the merged trace here")
    p.add_argument("--windows", type=int, default=2, help="last N windows (0: all)")
    p.add_argument("--title", default="sfsync trace")
    a = p.parse_args(argv)
    events, meta = load(a.traces)
    if a.merge:
        with open(a.merge, "w") as f:
            json.dump({"displayTimeUnit": "ms", "traceEvents": meta + events}, f)
        print("trace_plot: merged %d files into %s" % (len(a.traces), a.merge))
    if a.output:
        plot(select_windows(events, a.windows), meta, a.output, a.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
