#!/bin/bash
# The facts about a torch installation that decide the shim's fate there
# (tests/gpu/run.sh's torch_facts step; also run by CTest against this
# machine's pip torch), one INFO line each, then one RESULT line:
#   INFO torch_gloo_exported: yes|no (N dynamic symbols of namespace gloo defined in .../libtorch_cpu.so)
#   INFO torch_nccl_needed: yes|no (libnccl.so.2 [not] a NEEDED entry of .../libtorch_cuda.so)
# Exported Gloo: the shim could interpose on it; not exported (static and
# hidden): only the in-process integration serves that torch. NCCL NEEDED:
# the shim's NCCL interposition binds where the loader resolves it.
#   tests/gpu/torch_facts.sh VENV_OR_TORCH_LIB_DIR
# Exit 0 with both facts read, 1 if a library or tool is missing.
set -u
where=${1:?usage: torch_facts.sh VENV_OR_TORCH_LIB_DIR}
find_lib() { find "$where" -name "$1" -path '*torch/lib/*' 2>/dev/null | head -1; }
cpu=$(find_lib libtorch_cpu.so)
cuda=$(find_lib libtorch_cuda.so)
if [ -z "$cpu" ]; then
  echo "RESULT torch_facts: no torch/lib/libtorch_cpu.so under $where FAIL"
  exit 1
fi
if command -v nm >/dev/null 2>&1; then
  n=$(nm -D --defined-only "$cpu" 2>/dev/null | grep -c ' _ZN4gloo')
elif command -v readelf >/dev/null 2>&1; then
  n=$(readelf --dyn-syms -W "$cpu" 2>/dev/null | awk '$7 != "UND" && $8 ~ /^_ZN4gloo/' | grep -c .)
else
  echo "RESULT torch_facts: neither nm nor readelf on this machine FAIL"
  exit 1
fi
gloo=no
[ "$n" -gt 0 ] && gloo=yes
echo "INFO torch_gloo_exported: $gloo ($n dynamic symbols of namespace gloo defined in $cpu)"
if [ -z "$cuda" ]; then
  nccl="no libtorch_cuda.so (a CPU-only torch)"
  echo "INFO torch_nccl_needed: no (no libtorch_cuda.so under $where: a CPU-only torch)"
elif ! command -v readelf >/dev/null 2>&1; then
  echo "RESULT torch_facts: no readelf to read $cuda's NEEDED entries FAIL"
  exit 1
elif readelf -d "$cuda" | grep -q 'NEEDED.*\[libnccl\.so\.2\]'; then
  nccl=yes
  echo "INFO torch_nccl_needed: yes (libnccl.so.2 is a NEEDED entry of $cuda)"
else
  nccl=no
  echo "INFO torch_nccl_needed: no (libnccl.so.2 is not a NEEDED entry of $cuda)"
fi
echo "RESULT torch_facts: gloo_exported=$gloo gloo_symbols=$n nccl_needed=${nccl%% *} OK"
