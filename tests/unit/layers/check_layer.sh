#!/bin/sh
# check_layer.sh CXX LAYER PROBES... -- INCLUDE_DIRS...
#
# Preprocesses (-E: where an #include is resolved) one line, `#include "plugin/<layer>/<header>"`, for
# every PROBE (layer/header, lowest layer first) with the include
# directories of the static library of LAYER (what its own sources compile
# with, transitive usage requirements included): a probe of LAYER or of a
# layer below it must compile (the control), a probe of a layer above must
# fail with the compiler's "No such file" (GCC) or "file not found" (clang)
# for exactly that header (the upward include). Exit 0 when every probe did what it should, else 1 with
# each one that did not.
set -u
cxx=$1 layer=$2
shift 2
probes=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do probes="$probes $1"; shift; done
[ $# -gt 0 ] && shift
incs=""
for d in "$@"; do incs="$incs -I$d"; done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bad=0 above=0 ok=0 refused=0
for p in $probes; do
  l=${p%%/*}
  printf '#include "plugin/%s"\nint main() { return 0; }\n' "$p" > "$work/probe.cpp"
  # shellcheck disable=SC2086
  if "$cxx" -std=c++17 -E -o /dev/null $incs "$work/probe.cpp" > "$work/out" 2>&1; then
    if [ $above -eq 1 ]; then
      echo "FAIL: layer $layer compiled an upward include of plugin/$p"; bad=1
    else
      ok=$((ok + 1))
    fi
  else
    if [ $above -eq 0 ]; then
      echo "FAIL: layer $layer could not include plugin/$p (at or below it):"; cat "$work/out"; bad=1
    elif grep -q -e "plugin/$p: No such file" -e "'plugin/$p' file not found" "$work/out"; then
      refused=$((refused + 1))
    else
      echo "FAIL: layer $layer failed on plugin/$p for another reason than the layer rule:"
      cat "$work/out"; bad=1
    fi
  fi
  [ "$l" = "$layer" ] && above=1
done
echo "layer $layer: $ok includes at or below it resolved, $refused upward includes refused (No such file)"
exit $bad
