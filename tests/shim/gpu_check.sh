#!/usr/bin/env bash
# The shim against the REAL NCCL, on GPUs, on a machine that can build
# (tests/gpu/run.sh runs the same three cases from its carried folder: the
# shim_nccl_host step).
#
# Runs the C++ NCCL host (tests/shim/nccl_host.cpp), one rank per visible GPU
# (NCCL allows one rank per GPU), without the shim, with the two window calls
# and with SF_ACCUMULATION_STEPS=4, and checks what the host checks: every
# all-reduce result (local for deferred passes: computed by NCCL on a one-rank
# communicator in device memory; global otherwise), the final weights against
# a single-process reference, and the shim's count of deferred calls.
#
#   tests/shim/gpu_check.sh [build-dir]      (default: build-gpu)
# The build dir may be tests/gpu/run.sh's (any configuration: the targets
# needed here do not depend on SF_BUILD_TESTS); it is configured (without
# tests or samples) only if it has no CMakeCache.txt yet.
# SF_GPU_CHECK_STANDIN=1 runs the same on the stand-ins (a check of this
# script on machines without a GPU; the build dir must have built them).
# Exit: 0 passed, 1 a run failed, 2 the build failed.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-gpu}

log=$(mktemp /tmp/sfsync-shim-gpu-build.XXXXXX)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSF_BUILD_TESTS=OFF \
    -DSF_BUILD_SAMPLES=OFF > "$log" 2>&1 || { tail -20 "$log"; exit 2; }
fi
cmake --build "$build" -j "$(nproc)" --target sfsync sfsync_shim sfsync_shim_nccl_host \
  > "$log" 2>&1 || { tail -30 "$log"; echo "gpu_check: build failed ($log)"; exit 2; }
host=$build/shim/sfsync_shim_nccl_host
shim=$build/shim/libsfsync_shim.so

env_common=()
if [ "${SF_GPU_CHECK_STANDIN:-0}" = 1 ]; then
  ranks=2
  env_common=(LD_LIBRARY_PATH="$build/standin/lib")
  echo "gpu_check: STAND-INS (no GPU), $ranks ranks"
else
  ranks=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ "${ranks:-0}" -lt 1 ]; then
    echo "gpu_check: no GPU visible (nvidia-smi -L); nothing to check" >&2
    exit 1
  fi
  echo "gpu_check: real NCCL, $ranks GPU(s), $ranks rank(s)$([ "$ranks" = 1 ] && echo ': world size 1, so a deferred sum is a copy (no x world size)')"
fi

status=0
run() {  # name, extra env..., -- host args
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "== $name"
  if env "${env_common[@]}" "${envs[@]}" timeout 300 "$host" --ranks "$ranks" "$@"; then
    echo "== $name: OK"
  else
    echo "== $name: FAILED"; status=1
  fi
}
run "no shim: every pass synchronized" -- --mode none --steps 4 --windows 6
run "shim, sf_begin/sf_end_accumulation" LD_PRELOAD="$shim" -- --mode calls --steps 4 --windows 6
run "shim, SF_ACCUMULATION_STEPS=4" LD_PRELOAD="$shim" SF_ACCUMULATION_STEPS=4 -- --mode auto --steps 4 --windows 6
exit $status
