#!/usr/bin/env bash
# SF_TRACE end to end with real processes: the C trainer on 2 ranks writes one
# trace per rank; scripts/trace_plot.py merges them (both ranks' events, each
# rank's windows) and renders a PNG. Exit 77 (SKIP) without matplotlib.
#   trace_plot_test.sh ROOT LAUNCHER TRAINER
set -u
ROOT=$1 LAUNCHER=$2 TRAINER=$3
/usr/bin/python3 -c "import matplotlib" 2> /dev/null || { echo "SKIP: no python3-matplotlib"; exit 77; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
SF_TRACE="$dir/t.json" "$LAUNCHER" -n 2 -- "$TRAINER" --windows 3 --quiet || exit 1
/usr/bin/python3 "$ROOT/scripts/trace_plot.py" "$dir/t.rank0.json" "$dir/t.rank1.json" \
  -o "$dir/t.png" --merge "$dir/all.json" --windows 0 || exit 1
/usr/bin/python3 - "$dir/all.json" "$dir/t.png" <<'PY'
import json, os, sys
ev = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e["ph"] != "M"]
count = lambda pid, name: sum(1 for e in ev if e["pid"] == pid and e["name"] == name)
bad = [(p, n, count(p, n)) for p in (0, 1) for n in ("window", "synchronize")
       if count(p, n) != 3]
bad += [(p, "wire", count(p, "wire")) for p in (0, 1) if count(p, "wire") < 3]
size = os.path.getsize(sys.argv[2])
print("events per rank:", {p: sum(1 for e in ev if e["pid"] == p) for p in (0, 1)}, "png bytes", size)
if bad or size < 10000:
    print("FAIL:", bad, size)
    sys.exit(1)
PY
