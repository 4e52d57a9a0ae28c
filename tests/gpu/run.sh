#!/bin/bash
# The GPU check of the NCCL path, as ONE call on a GPU machine that cannot
# build (no Gloo, hiredis, OpenSSL headers or cxxopts there): everything it
# runs was built and collected by tests/gpu/prepare.sh into one carried
# folder; NCCL and the CUDA runtime come from that machine's own PyTorch
# environment (the nvidia-nccl-cu13 wheel's libnccl.so.2 and libcudart.so.13,
# found under $SF_TORCH_VENV, default /opt/torch/.venv).
#
#   tests/gpu/run.sh [--carried DIR] [--out DIR] [--budget SECONDS]
#     --carried  the folder prepare.sh filled (default: build-gpu-carry)
#     --out      logs and summary.json (default: $OUT, else ./gpu-check-out)
#     --budget   overall wall-clock budget, default 420 s; each step has its
#                own budget (timeout), cut to what is left; a step that no
#                longer fits is SKIP, never started
#
# Steps, each one line "PASS|FAIL|SKIP <step>: <numbers>":
#   world1_parity      average, sum, pre-scaled sum, weighted (issue 31) x float32,
#                      bfloat16, float16
#   world1_stream      spin kernels before sf_grad_ready / after sf_synchronize
#   world1_trainer     samples/cuda's MLP against its CPU reference
#   shim_nccl_host     the shim under a C++ NCCL host (tests/shim/gpu_check.sh's cases)
#   ddp_shim           the shim under the machine's PyTorch DDP (NCCL backend),
#                      SF_ACCUMULATION_STEPS=4: bytes deferred and weight parity
#   busbw_world1       sf_synchronize against raw ncclAllReduce, same bytes
#   two_ranks_parity   two ranks on the one GPU (distinct NCCL_HOSTID, socket
#                      transport over loopback), the parity cases: if NCCL
#                      refuses ("duplicate GPU") one SKIP line says so
#   two_ranks_leave, two_ranks_busbw   a lost peer / mid-run destroy, and
#                      busbw at world size 2: only if NCCL accepted
# sfsync.torch on CUDA (issue 23; public Python API, the carried package and
# libsfsync on this machine's torch, tests/gpu/torch_cuda.py):
#   torch_facts        INFO lines: is Gloo exported from libtorch_cpu.so (nm -D),
#                      is libnccl.so.2 NEEDED by libtorch_cuda.so (readelf -d)
#   torch_world1       GradientSync flat / flat_buffer=False / sharded flat /
#                      sharded parameter, attach(DDP): each against DDP (NCCL)
#                      + AdamW: weights, bytes per window (sfsync's stats and
#                      NCCL's COLL lines), torch.cuda.max_memory_allocated
#   torch_two_ranks    the same at two ranks on the one GPU: only if NCCL
#                      accepted two_ranks_parity
#   follow_host_nccl   samples/python/trainer_backend.py unmodified on CUDA + NCCL, 2 ranks (issue 43)
#   frameworks_world1  tests/python/sfsync/torch/integrations' Accelerate and Lightning tests
#                      on CUDA at world size 1 (SKIP where the image lacks them)
# Where no GPU is visible every step is SKIP and the exit status is 0.
#
# Exit: 0 nothing failed, 1 a step failed, 2 bad arguments or carried folder.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
carried=$root/build-gpu-carry
out=${OUT:-$PWD/gpu-check-out}
budget=420
while [ $# -gt 0 ]; do
  case $1 in
    --carried) carried=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    *) echo "run.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out" || exit 2
carried=$(cd "$carried" 2>/dev/null && pwd) || {
  echo "run.sh: no carried folder '$carried' (run tests/gpu/prepare.sh on the build machine)" >&2
  exit 2
}
start=$(date +%s)
summary=$out/summary.json
steps_json=()
failed=0

elapsed() { echo $(($(date +%s) - start)); }
json_string() { printf '"%s"' "$(printf '%s' "$1" | tr -d '\000-\037' | sed 's/\\/\\\\/g; s/"/\\"/g')"; }
record() {  # status name seconds detail
  echo "$1 $2: $4 (${3}s)"
  steps_json+=("{\"name\": $(json_string "$2"), \"status\": \"$1\", \"seconds\": $3, \"detail\": $(json_string "$4")}")
  [ "$1" = FAIL ] && failed=1
  return 0
}
write_summary() {  # verdict
  {
    printf '{"budget_s": %s, "elapsed_s": %s, "gpus": %s, "carried": %s, "nccl": %s, "cudart": %s,\n' \
      "$budget" "$(elapsed)" "${gpus:-0}" "$(json_string "$carried")" "$(json_string "${nccl_lib:-}")" \
      "$(json_string "${cudart_lib:-}")"
    printf ' "verdict": %s,\n "steps": [\n' "$(json_string "$1")"
    local i
    for i in "${!steps_json[@]}"; do
      printf '  %s%s\n' "${steps_json[$i]}" "$([ "$i" -lt $((${#steps_json[@]} - 1)) ] && echo ,)"
    done
    printf ' ]}\n'
  } > "$summary"
}

all_steps=(world1_parity world1_stream world1_trainer shim_nccl_host ddp_shim busbw_world1
           torch_facts torch_world1 two_ranks_parity two_ranks_leave two_ranks_busbw
           torch_two_ranks follow_host_nccl frameworks_world1)
bin=$carried/bin
pkg=$carried/python
scripts=$carried/scripts
for f in "$bin/sfsync-gpu-check" "$bin/sfsync-cuda-trainer" "$bin/sfsync_shim_nccl_host" \
         "$carried/lib/libsfsync.so.1" "$carried/lib/libsfsync_nccl.so" "$carried/lib/libsfsync_shim.so" \
         "$pkg/sfsync/__init__.py" "$scripts/torch_cuda.py" "$scripts/torch_facts.sh" \
         "$scripts/frameworks_world1.sh" "$scripts/run_torchrun.py" "$scripts/frameworks/test_accelerate.py" \
         "$scripts/frameworks/test_lightning.py" "$scripts/frameworks/_common.py" \
         "$scripts/test_follow_host.py" "$scripts/trainer_backend.py"; do
  if [ ! -e "$f" ]; then
    echo "run.sh: the carried folder lacks $f (run tests/gpu/prepare.sh again)" >&2
    exit 2
  fi
done

# ---- The GPU and the machine's own NCCL / CUDA runtime -----------------------
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ "${gpus:-0}" -eq 0 ]; then
  for s in "${all_steps[@]}"; do record SKIP "$s" 0 "no GPU visible (nvidia-smi lists none)"; done
  write_summary "SKIP: no GPU"
  echo "GPU CHECK SKIPPED: no GPU visible; summary in $summary ($(elapsed)s of ${budget}s)"
  exit 0
fi
venv=${SF_TORCH_VENV:-/opt/torch/.venv}
nccl_lib=$(find "$venv" -name 'libnccl.so.2' -path '*nvidia*' 2>/dev/null | head -1)
cudart_lib=$(find "$venv" -name 'libcudart.so.13' -path '*nvidia*' 2>/dev/null | head -1)
if [ -z "$nccl_lib" ] || [ -z "$cudart_lib" ]; then
  why="NCCL / CUDA runtime not found under $venv: libnccl.so.2 '${nccl_lib:-absent}' (wheel nvidia-nccl-cu13), libcudart.so.13 '${cudart_lib:-absent}' (set SF_TORCH_VENV)"
  record FAIL environment 0 "$why"
  for s in "${all_steps[@]}"; do record SKIP "$s" 0 "no NCCL to run on"; done
  write_summary "FAIL: $why"
  echo "GPU CHECK FAILED: $why"
  exit 1
fi
export LD_LIBRARY_PATH=$carried/lib:$(dirname "$nccl_lib"):$(dirname "$cudart_lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export SF_TIMEOUT_MS=${SF_TIMEOUT_MS:-60000}  # a hang becomes an error, not a stuck check
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
python=$venv/bin/python3
echo "== $gpus GPU(s); NCCL $nccl_lib; CUDA runtime $cudart_lib; logs in $out"

# ---- Steps --------------------------------------------------------------------
# step NAME BUDGET WORLD [ENV=V ...] -- COMMAND ARGS: WORLD processes, rank r
# with RANK/WORLD_SIZE/LOCAL_RANK, meeting through file://, logs NAME.r.log.
# PASS: every rank exited 0; SKIP: exit 77 (no usable GPU), or a failure
# whose logs match $refused (a configuration NCCL refuses); else FAIL.
# Rank r's environment also gets $SF_RANK_ENV_r (space-separated V=X).
refused=''
result_re='^(\[rank [0-9]+\] )?RESULT '
step() {
  local name=$1 want=$2 world=$3
  shift 3
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local left=$((budget - $(elapsed) - 5))
  if [ "$left" -lt 10 ]; then
    record SKIP "$name" 0 "no budget left (${left}s of ${budget}s)"
    return 1
  fi
  local limit=$((want < left ? want : left)) t0=$(date +%s) pids=() r rc=0 codes=()
  local port=$((29500 + RANDOM % 1000))  # one for all ranks (torch's env:// meets there)
  rm -rf "$out/rdv-$name" "$out/rdv-$name"-*
  for ((r = 0; r < world; ++r)); do
    local extra_var="SF_RANK_ENV_$r"
    # shellcheck disable=SC2086
    env "${envs[@]}" ${!extra_var:-} RANK=$r WORLD_SIZE=$world LOCAL_RANK=$r \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      SF_RENDEZVOUS="file://$out/rdv-$name" SF_GPU_ID_FILE="$out/id-$name" \
      timeout -k 5 "$limit" "$@" >"$out/$name.$r.log" 2>&1 &
    pids+=($!)
  done
  for ((r = 0; r < world; ++r)); do
    wait "${pids[$r]}"
    codes+=($?)
  done
  local took=$(($(date +%s) - t0)) detail
  # A RESULT line may carry a "[rank N] " prefix (the torch scripts' own).
  detail=$(grep -hE "$result_re" "$out/$name".*.log | sed -E "s/$result_re//" | head -12 | paste -sd ';' -)
  for c in "${codes[@]}"; do [ "$c" -ne 0 ] && rc=$c && [ "$c" -ne 77 ] && break; done
  local silent=""
  for ((r = 0; r < world; ++r)); do
    grep -qE "$result_re" "$out/$name.$r.log" || silent+=" $r"
  done
  if [ "$rc" -eq 0 ] && { [ -n "$silent" ] || grep -qhE "$result_re.* FAIL" "$out/$name".*.log; }; then
    # Exit 0 alone is not a pass: every rank prints its RESULT line, none FAIL.
    record FAIL "$name" "$took" "exit 0, but rank(s)${silent:- none} printed no RESULT line or a RESULT says FAIL; $detail"
    return 1
  elif [ "$rc" -eq 0 ]; then
    record PASS "$name" "$took" "${detail:-exit 0}"
  elif [ "$rc" -eq 77 ]; then
    record SKIP "$name" "$took" "$(grep -h '^SKIPPED' "$out/$name".*.log | head -1)"
    return 1
  elif [ -n "$refused" ] && grep -qhiE "$refused" "$out/$name".*.log; then
    record SKIP "$name" "$took" "NCCL refused: $(grep -hioE "$refused.{0,80}" "$out/$name".*.log | head -1)"
    return 1
  else
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && detail="timed out after ${limit}s; $detail"
    record FAIL "$name" "$took" "exit ${codes[*]}; ${detail:-$(tail -3 "$out/$name".0.log | paste -sd ' ' -)}"
    return 1
  fi
}

check=$bin/sfsync-gpu-check
shim=$carried/lib/libsfsync_shim.so
step world1_parity 90 1 -- "$check" parity
step world1_stream 30 1 -- "$check" stream
step world1_trainer 30 1 -- "$bin/sfsync-cuda-trainer" --windows 8
# The host prints its weight check ("OK") and the shim's report; each mode is
# one RESULT line: the host's exit status and OK, and with the shim loaded,
# the calls it deferred (none deferred is a FAIL: the shim did nothing).
step shim_nccl_host 45 1 SF_HOST="$bin/sfsync_shim_nccl_host" SF_SHIM="$shim" -- bash -c '
  host() {  # host MODE PRELOAD [ENV=V ...]
    local mode=$1 pre=$2 log rc=0 deferred
    shift 2
    log=$(env ${pre:+LD_PRELOAD=$pre} "$@" "$SF_HOST" --ranks 1 --mode "$mode" --steps 4 --windows 6 2>&1) || rc=$?
    printf "%s\n" "$log"
    deferred=$(printf "%s\n" "$log" | grep -o "\"deferred\": [0-9]*" | tail -1 | grep -o "[0-9]*$")
    if [ "$rc" -ne 0 ] || ! printf "%s\n" "$log" | grep -qx OK; then
      echo "RESULT shim_host mode=$mode exit=$rc FAIL"; return 1
    elif [ -n "$pre" ] && [ "${deferred:-0}" -eq 0 ]; then
      echo "RESULT shim_host mode=$mode deferred=${deferred:-none} FAIL"; return 1
    fi
    echo "RESULT shim_host mode=$mode deferred=${deferred:--} OK"
  }
  host none "" && host calls "$SF_SHIM" && host auto "$SF_SHIM" SF_ACCUMULATION_STEPS=4'
if [ -x "$python" ]; then
  # DDP all-reduces every pass (24). A Python host: the shim hands the
  # windows to sfsync's in-process layer and passes DDP's calls through, 6
  # of them (one per window). SF_FOLLOW_HOST=0: the shim's own windows,
  # deferring 3 passes in 4. Both: one pass's bytes per window, the weights
  # of the reference.
  step ddp_shim 90 1 PY="$python" SCRIPT="$here/ddp_nccl.py" SHIM="$shim" REPORT="$out/ddp-report" -- bash -c '
    set -e
    LD_PRELOAD="$SHIM" SF_ACCUMULATION_STEPS=4 SF_SHIM_REPORT="$REPORT-follow.json" "$PY" "$SCRIPT" --steps 4 --windows 6
    "$PY" "$SCRIPT" --judge follow --report "$REPORT-follow.json" --steps 4 --windows 6
    LD_PRELOAD="$SHIM" SF_FOLLOW_HOST=0 SF_ACCUMULATION_STEPS=4 SF_SHIM_REPORT="$REPORT-own.json" "$PY" "$SCRIPT" --steps 4 --windows 6
    "$PY" "$SCRIPT" --judge own --report "$REPORT-own.json" --steps 4 --windows 6'
else
  record SKIP ddp_shim 0 "no PyTorch at $python"
fi
step busbw_world1 30 1 -- "$check" busbw --mib 64

# sfsync.torch on CUDA: the carried package and library on this machine's
# torch. Until the CUDA Python path lands these FAIL with GradientSync's
# "needs CPU parameters" TypeError: that is the expected result then.
pyenv=(PYTHONPATH="$pkg" SFSYNC_LIBRARY="$carried/lib/libsfsync.so.1" OMP_NUM_THREADS=1)
step torch_facts 10 1 -- "$scripts/torch_facts.sh" "$venv"
grep -h '^INFO torch_' "$out"/torch_facts.*.log 2>/dev/null
if [ -x "$python" ]; then
  step torch_world1 75 1 "${pyenv[@]}" -- "$python" "$scripts/torch_cuda.py" \
    --nccl-log "$out/nccl-torch_world1.%p.log"
else
  record SKIP torch_world1 0 "no PyTorch at $python"
fi

# Two ranks on the one GPU: NCCL refuses two ranks of one communicator on
# one device ("duplicate GPU") unless they look like two hosts.
two=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1)
export SF_RANK_ENV_0="NCCL_HOSTID=sfsync-gpu-check-host-0" SF_RANK_ENV_1="NCCL_HOSTID=sfsync-gpu-check-host-1"
if [ "$gpus" -ge 2 ]; then
  unset SF_RANK_ENV_0 SF_RANK_ENV_1  # one GPU each: no trick needed
fi
refused='duplicate GPU'
if step two_ranks_parity 75 2 "${two[@]}" -- "$check" parity; then
  refused=''
  step two_ranks_leave 40 2 "${two[@]}" -- "$check" leave
  step two_ranks_busbw 40 2 "${two[@]}" -- "$check" busbw --mib 64
  if [ -x "$python" ]; then
    step torch_two_ranks 90 2 "${two[@]}" "${pyenv[@]}" -- "$python" "$scripts/torch_cuda.py" \
      --nccl-log "$out/nccl-torch_two_ranks.%p.log"
    # The host as it is (issue 43) on pip torch + CUDA + NCCL, unmodified, no
    # code change (SF_FOLLOW_HOST=1 + the boot folder): no_sync() around the
    # backward alone, windows 4, 4, 3; 1.00x the gradient bytes (sfsync's
    # counts: NCCL's traffic is not the process's wchar), weights within 1e-6
    # of a correct no_sync(), ranks bitwise equal.
    step follow_host_nccl 90 2 "${two[@]}" "${pyenv[@]}" SF_FOLLOW_HOST=1 \
      PYTHONPATH="$pkg/sfsync/_boot:$pkg" -- "$python" "$scripts/test_follow_host.py" \
      --device cuda --shape backward-only --windows 4,4,3
  else
    record SKIP torch_two_ranks 0 "no PyTorch at $python"
    record SKIP follow_host_nccl 0 "no PyTorch at $python"
  fi
else
  refused=''
  echo "two ranks on one GPU: not run further (see two_ranks_parity above); going on"
  record SKIP two_ranks_leave 0 "needs two ranks (two_ranks_parity did not pass)"
  record SKIP two_ranks_busbw 0 "needs two ranks (two_ranks_parity did not pass)"
  record SKIP torch_two_ranks 0 "needs two ranks (two_ranks_parity did not pass)"
  record SKIP follow_host_nccl 0 "needs two ranks (two_ranks_parity did not pass)"
fi
unset SF_RANK_ENV_0 SF_RANK_ENV_1

# The frameworks last: the longest step (two torchrun launches).
if [ -x "$python" ]; then
  step frameworks_world1 130 1 "${pyenv[@]}" -- "$scripts/frameworks_world1.sh" "$python" \
    "$scripts/frameworks" "$scripts/run_torchrun.py" "$out" 60
else
  record SKIP frameworks_world1 0 "no PyTorch at $python"
fi

verdict=PASS
[ "$failed" -ne 0 ] && verdict=FAIL
write_summary "$verdict"
echo "GPU CHECK $verdict: $(grep -c '"PASS"' "$summary") passed, $(grep -c '"FAIL"' "$summary") failed, $(grep -c '"SKIP"' "$summary") skipped on $gpus GPU(s) in $(elapsed)s of ${budget}s; summary $summary"
exit "$failed"
