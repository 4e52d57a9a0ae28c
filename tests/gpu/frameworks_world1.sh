#!/bin/bash
# tests/gpu/run.sh's frameworks_world1 step: the trainer-framework tests of
# tests/python/sfsync/torch/integrations (Accelerate, Lightning) on CUDA at
# world size 1, SF_FRAMEWORK_DEVICE=cuda (their NCCL process group; bytes not judged:
# wchar does not see NCCL's traffic, and one rank sends nothing), each under
# torchrun with one process (tests/python/support/run_torchrun.py --nproc 1, as CI
# runs them with 2), TIMEOUT seconds each at most.
# One RESULT line per framework: OK, FAIL with the failed checks (count and
# the first three), or SKIPPED where the image lacks the framework.
#   tests/gpu/frameworks_world1.sh PYTHON FRAMEWORKS_DIR RUN_TORCHRUN LOG_DIR [TIMEOUT]
# Exit 0 if every framework present passed, 1 otherwise, 77 if none is there.
set -u
py=$1
dir=$2
runner=$3
logs=$4
timeout=${5:-120}
export SF_FRAMEWORK_DEVICE=${SF_FRAMEWORK_DEVICE:-cuda}  # cpu: to check this script here
dev=$SF_FRAMEWORK_DEVICE
status=0 ran=0
for fw in accelerate lightning; do
  if ! "$py" -c "import $fw" >/dev/null 2>&1; then
    echo "RESULT $fw: SKIPPED (import $fw fails in $py)"
    continue
  fi
  ran=1
  version=$("$py" -c "import $fw; print($fw.__version__)" 2>/dev/null)
  log=$logs/framework-$fw.log
  "$py" "$runner" --nproc 1 --timeout "$timeout" --expect "test_$fw: OK" -- "$dir/test_$fw.py" > "$log" 2>&1
  rc=$?
  failed=$(grep -c 'CHECK FAILED' "$log")
  if [ "$rc" -eq 0 ] && grep -q "test_$fw: OK" "$log"; then
    echo "RESULT $fw $version $dev world=1: $(grep -c '] ok ' "$log") checks OK"
  else
    status=1
    first=$(grep -h 'CHECK FAILED' "$log" | sed 's/.*CHECK FAILED //' | head -3 | paste -sd ';' -)
    [ -z "$first" ] && first=$(tail -2 "$log" | paste -sd ' ' -)
    echo "RESULT $fw $version $dev world=1: exit $rc, $failed checks failed: $first FAIL"
  fi
done
if [ "$ran" -eq 0 ]; then
  echo "SKIPPED frameworks_world1: neither accelerate nor lightning imports in $py"
  exit 77
fi
exit "$status"
