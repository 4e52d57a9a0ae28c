#!/bin/bash
# CTest's gpu_prepare_and_run: tests/gpu/prepare.sh against the build tree
# as it is (no rebuild), then tests/gpu/run.sh on the folder it filled, here
# where no GPU is: every step a SKIP line, a summary JSON, within the budget.
# Also: the sfsync.torch steps' pieces are carried (the package, the
# scripts), each new step is a SKIP line with its reason, and, given a torch
# environment (TORCH_VENV, e.g. the pip torch's venv), torch_facts.sh reads
# its two facts there (printed: this machine's answer).
# Exit 77 (skipped) only outside CI when the build tree lacks the GPU
# programs (no CUDA toolkit); under CI=true that is a failure.
#   tests/gpu/prepare_test.sh BUILD_DIR WORK_DIR [TORCH_VENV]
set -u
here=$(cd "$(dirname "$0")" && pwd)
build=$1
work=$2
venv=${3:-}
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
for f in python/sfsync/__init__.py python/sfsync/torch/device.py \
         python/sfsync/integrations/accelerate.py \
         scripts/torch_cuda.py scripts/torch_facts.sh scripts/frameworks_world1.sh \
         scripts/run_torchrun.py scripts/frameworks/_common.py scripts/frameworks/test_accelerate.py \
         scripts/frameworks/test_lightning.py; do
  [ -f "$work/carry/$f" ] || fail "prepare.sh did not carry $f"
done
[ -z "$(find "$work/carry/python" -name '__pycache__' -o -name '*.so*')" ] ||
  fail "the carried package holds caches or libraries: $(find "$work/carry/python" -name '__pycache__' -o -name '*.so*')"

budget=60
t0=$(date +%s)
"$here/run.sh" --carried "$work/carry" --out "$work/out" --budget "$budget" > "$work/run.log" 2>&1
rc=$?
took=$(($(date +%s) - t0))
cat "$work/run.log"
[ "$rc" -eq 0 ] || fail "run.sh exited $rc without a GPU"
[ "$took" -le "$budget" ] || fail "run.sh took ${took}s, over its budget of ${budget}s"
skips=$(grep -c '^SKIP ' "$work/run.log")
[ "$skips" -eq 14 ] || fail "$skips SKIP lines, want 14 (one per step)"
for s in torch_facts torch_world1 torch_two_ranks follow_host_nccl frameworks_world1; do
  grep -qE "^SKIP $s: no GPU visible \(nvidia-smi lists none\) \([0-9]+s\)$" "$work/run.log" ||
    fail "no SKIP line with its reason for the step $s"
done
python3 - "$work/out/summary.json" <<'PY' || fail "summary.json is not what run.sh should write"
import json, sys
s = json.load(open(sys.argv[1]))
assert s["verdict"] == "SKIP: no GPU", s["verdict"]
assert s["budget_s"] == 60 and s["gpus"] == 0, s
assert [t["status"] for t in s["steps"]] == ["SKIP"] * 14, s["steps"]
assert {"torch_facts", "torch_world1", "torch_two_ranks", "follow_host_nccl", "frameworks_world1"} <= {
    t["name"] for t in s["steps"]}, s["steps"]
print("summary.json: %d steps, all SKIP, %ss elapsed" % (len(s["steps"]), s["elapsed_s"]))
PY
if [ -n "$venv" ]; then
  "$work/carry/scripts/torch_facts.sh" "$venv" > "$work/facts.log" 2>&1 || {
    cat "$work/facts.log"; fail "torch_facts.sh failed on $venv"; }
  cat "$work/facts.log"
  for fact in torch_gloo_exported torch_nccl_needed; do
    grep -qE "^INFO $fact: (yes|no) \(" "$work/facts.log" || fail "torch_facts.sh printed no $fact line"
  done
  grep -q '^RESULT torch_facts: .* OK$' "$work/facts.log" || fail "torch_facts.sh printed no RESULT OK"
fi
echo "gpu_prepare_and_run: OK (run.sh ${took}s of ${budget}s)"
