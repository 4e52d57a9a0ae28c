#!/bin/bash
# The NCCL module links neither the CUDA runtime nor NCCL: it dlopens them at
# its first use (the host's copies if loaded). So its DT_NEEDED lists no
# libcudart / libnccl, and no CUDA or NCCL function is an undefined dynamic
# symbol (each goes through its dlsym table).
# Usage: module_needs_no_cuda.sh MODULE
set -eu
module=$1
needed=$(readelf -d "$module" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
echo "NEEDED of $module: $(echo $needed)"
status=0
if echo "$needed" | grep -E '^(libcudart|libnccl)' >/dev/null; then
  echo "FAIL: $module has DT_NEEDED $(echo "$needed" | grep -E '^(libcudart|libnccl)' | tr '\n' ' ')" >&2
  status=1
fi
undefined=$(readelf --dyn-syms -W "$module" | awk '$7 == "UND" {print $8}' | grep -E '^(cuda|nccl)' || true)
if [ -n "$undefined" ]; then
  echo "FAIL: $module imports CUDA / NCCL symbols: $(echo $undefined)" >&2
  status=1
fi
[ $status -eq 0 ] && echo "ok: no libcudart / libnccl needed, no cuda* / nccl* symbol imported"
exit $status
