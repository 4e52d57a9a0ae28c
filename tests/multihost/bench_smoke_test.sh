#!/usr/bin/env bash
# bench/cluster_bench.py --smoke on 2 simulated hosts at 1gbit: the benchmark
# runs end to end (sfsync, DDP correct, DDP trap over real NICs) and the bytes
# that left host 0's NIC per window are what each variant implies: about one
# gradient for sfsync and correct DDP, about N (= 4 micro-batches) for the
# trap. Exit 77 (SKIP) where clusters cannot run (not root) or torch is missing.
#   bench_smoke_test.sh ROOT BUILD
set -u
ROOT=$1 BUILD=$2
bash "$ROOT/scripts/cluster.sh" check || exit $?
/usr/bin/python3 -c "import torch" 2> /dev/null || { echo "SKIP: no torch for /usr/bin/python3"; exit 77; }
/usr/bin/python3 "$ROOT/bench/cluster_bench.py" --smoke --build "$BUILD" --out "$PWD" --timeout 50 || exit 1
/usr/bin/python3 - "$PWD/cluster_bench_smoke.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
rec = doc["records"][0]
res = {r["variant"]: r for r in rec["results"]}
g, n = rec["gradient_bytes"], rec["micro_batches"]
bad = []
if set(res) != {"sfsync", "ddp_fwd_bwd", "ddp_bwd_only"}:
    bad.append("variants %s" % sorted(res))
nic = {v: r["nic_tx_bytes_per_window"] for v, r in res.items()}
print("gradient bytes %d, NIC bytes per window %s, ms %s, ratios %s" % (
    g, nic, {v: r["ms_per_window_median"] for v, r in res.items()}, rec["ratios"]))
for v in ("sfsync", "ddp_fwd_bwd"):
    if not 0.9 * g <= nic[v] <= 1.3 * g:
        bad.append("%s sent %d bytes per window, expected about %d" % (v, nic[v], g))
if not 0.85 * n * g <= nic["ddp_bwd_only"] <= 1.3 * n * g:
    bad.append("the trap sent %d bytes per window, expected about %d x %d" % (nic["ddp_bwd_only"], n, g))
if res["sfsync"]["bytes_per_window"] != g:
    bad.append("sfsync reduced %s bytes" % res["sfsync"]["bytes_per_window"])
for b in bad:
    print("FAIL:", b)
sys.exit(1 if bad else 0)
PY
