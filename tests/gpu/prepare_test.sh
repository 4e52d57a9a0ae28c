#!/bin/bash
# CTest's gpu_prepare_and_run: tests/gpu/prepare.sh against the build tree
# as it is (no rebuild), then tests/gpu/run.sh on the folder it filled, here
# where no GPU is: every step a SKIP line, a summary JSON, within the budget.
# Exit 77 (skipped) only outside CI when the build tree lacks the GPU
# programs (no CUDA toolkit); under CI=true that is a failure.
#   tests/gpu/prepare_test.sh BUILD_DIR WORK_DIR
set -u
here=$(cd "$(dirname "$0")" && pwd)
build=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
fail() { echo "gpu_prepare_and_run: FAIL: $*" >&2; exit 1; }

"$here/prepare.sh" --build-dir "$build" --carried "$work/carry" --no-build > "$work/prepare.log" 2>&1
rc=$?
cat "$work/prepare.log"
if [ "$rc" -eq 2 ]; then
  [ "${CI:-}" = true ] && fail "prepare.sh could not collect the GPU programs (CI=true: not a skip)"
  echo "gpu_prepare_and_run: SKIPPED: the build tree lacks the GPU programs"
  exit 77
fi
[ "$rc" -eq 0 ] || fail "prepare.sh exited $rc"
grep -q 'tests/gpu/run.sh --carried' "$work/prepare.log" || fail "prepare.sh printed no command"

budget=60
t0=$(date +%s)
"$here/run.sh" --carried "$work/carry" --out "$work/out" --budget "$budget" > "$work/run.log" 2>&1
rc=$?
took=$(($(date +%s) - t0))
cat "$work/run.log"
[ "$rc" -eq 0 ] || fail "run.sh exited $rc without a GPU"
[ "$took" -le "$budget" ] || fail "run.sh took ${took}s, over its budget of ${budget}s"
skips=$(grep -c '^SKIP ' "$work/run.log")
[ "$skips" -eq 9 ] || fail "$skips SKIP lines, want 9 (one per step)"
python3 - "$work/out/summary.json" <<'PY' || fail "summary.json is not what run.sh should write"
import json, sys
s = json.load(open(sys.argv[1]))
assert s["verdict"] == "SKIP: no GPU", s["verdict"]
assert s["budget_s"] == 60 and s["gpus"] == 0, s
assert [t["status"] for t in s["steps"]] == ["SKIP"] * 9, s["steps"]
print("summary.json: %d steps, all SKIP, %ss elapsed" % (len(s["steps"]), s["elapsed_s"]))
PY
echo "gpu_prepare_and_run: OK (run.sh ${took}s of ${budget}s)"
