#!/bin/bash
# GPU check of the NCCL backend: builds libsfsync.so, its NCCL module and the
# CUDA sample trainer (samples/cuda: an MLP whose forward and backward are
# CUDA kernels), then runs the trainer with real NCCL at world size 1 and,
# where two GPUs exist, with 2 ranks as 2 processes. The trainer checks its
# weights against a single-process CPU reference and the collective counts
# (one per bucket per window, none inside a window, all launched by
# grad-ready); this script prints a one-line verdict. Under 5 minutes on one
# H200 (the build dominates).
#
# Where no GPU is present it says so and exits 0 without running anything.
#
#   tests/gpu/run.sh                # build in ./build-gpu
#   SF_GPU_BUILD_DIR=dir tests/gpu/run.sh
#
# Exit: 0 passed or no GPU, 1 a run failed, 2 the build failed.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${SF_GPU_BUILD_DIR:-$root/build-gpu}
log=$(mktemp -d /tmp/sfsync-gpu-check.XXXXXX)
start=$(date +%s)

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
elif ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
  gpus=$(ls -d /dev/nvidia[0-9]* | wc -l)
fi
if [ "${gpus:-0}" -eq 0 ] && [ -z "${SF_GPU_CHECK_FORCE:-}" ]; then
  echo "GPU CHECK SKIPPED: no GPU visible on this machine (nvidia-smi lists none); nothing was built or run"
  exit 0
fi

nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
echo "== configure and build in $build (log: $log/build.log)"
if ! { cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSF_BUILD_TESTS=OFF \
         -DSF_BUILD_SAMPLES=ON -DCMAKE_CUDA_COMPILER="$nvcc" &&
       cmake --build "$build" -j "$(nproc)" --target sfsync sfsync_nccl sfsync-cuda-trainer; } \
       >"$log/build.log" 2>&1; then
  tail -30 "$log/build.log"
  echo "GPU CHECK FAILED: the build failed (see $log/build.log)"
  exit 2
fi
trainer=$build/samples/cuda/sfsync-cuda-trainer

export SF_TIMEOUT_MS=${SF_TIMEOUT_MS:-60000}  # a hang becomes an error, not a stuck check
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

passed=()
failed=()
skipped=0
errs=()

# run NAME WORLD ARGS...: WORLD processes, one per GPU, meeting through file://.
run() {
  local name=$1 world=$2
  shift 2
  local rdv="file://$log/rdv-$name" pids=() r rc=0
  for ((r = 0; r < world; ++r)); do
    RANK=$r WORLD_SIZE=$world LOCAL_RANK=$r SF_RENDEZVOUS=$rdv \
      timeout 120 "$trainer" "$@" >"$log/$name.$r.out" 2>&1 &
    pids+=($!)
  done
  for ((r = 0; r < world; ++r)); do
    wait "${pids[$r]}" || rc=$?
    [ "$rc" -eq 0 ] || break
  done
  for ((r = 0; r < world; ++r)); do wait "${pids[$r]}" 2>/dev/null; done
  echo "== $name: world $world, $*"
  cat "$log/$name".*.out | grep -E '^(RESULT|SKIPPED)|rank [0-9]+:|NCCL WARN' | head -20
  if grep -q '^SKIPPED' "$log/$name".*.out; then
    skipped=1
  elif [ "$rc" -eq 0 ] && [ "$(grep -c 'RESULT .* OK$' "$log/$name".*.out)" -eq "$world" ]; then
    passed+=("$name")
    errs+=($(sed -n 's/^RESULT .*max_err=\([^ ]*\) OK$/\1/p' "$log/$name".*.out))
  else
    failed+=("$name")
  fi
}

run world1_flat 1 --windows 8
run world1_own_buffers 1 --windows 8 --own-buffers
if [ "$skipped" -eq 0 ] && [ "${gpus:-0}" -ge 2 ]; then
  run world2_flat 2 --windows 8
  run world2_own_buffers 2 --windows 8 --own-buffers
fi

# The LD_PRELOAD shim against the real NCCL: a host calling NCCL itself,
# without and under libsfsync_shim.so (tests/shim/gpu_check.sh builds its
# targets in the same build dir).
if [ "$skipped" -eq 0 ]; then
  echo "== shim: tests/shim/gpu_check.sh"
  if "$root/tests/shim/gpu_check.sh" "$build" >"$log/shim.out" 2>&1; then
    passed+=("shim")
  else
    failed+=("shim")
  fi
  grep -E '^(==|gpu_check|rank [0-9]+:)' "$log/shim.out" | head -40
fi

took=$(($(date +%s) - start))
if [ "$skipped" -ne 0 ]; then
  echo "GPU CHECK SKIPPED: the trainer found no usable GPU (see above); nothing was checked (${took}s)"
  exit 0
fi
worst=$(printf '%s\n' "${errs[@]:-0}" | sort -g | tail -1)
two="world size 2 not run (${gpus} GPU)"
[ "${gpus:-0}" -ge 2 ] && two="world size 2 included"
if [ "${#failed[@]}" -eq 0 ]; then
  echo "GPU CHECK PASSED: ${#passed[@]} runs (${passed[*]}) on $gpus GPU(s), $two; parity max_err=$worst, one collective per bucket per window, none inside; ${took}s"
  exit 0
fi
echo "GPU CHECK FAILED: ${failed[*]} (passed: ${passed[*]:-none}; logs in $log); ${took}s"
exit 1
