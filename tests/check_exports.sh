#!/bin/bash
# Compares the dynamic symbols a library defines, with their version nodes,
# against checked-in lists: every symbol exported must be in exactly one list,
# at that list's node, and every listed symbol must be exported there.
# Usage: check_exports.sh LIBRARY NODE=LIST [NODE=LIST ...]
#   NODE "-" means unversioned (a library without a version script node).
# Example: check_exports.sh libsfsync.so SFSYNC_1=exported_symbols.txt \
#            SFSYNC_PRIVATE_0.2=exported_symbols_private.txt
set -eu
lib=$1
shift
# "name node" per defined symbol; version definitions themselves (type A) are
# checked separately: each listed node must exist, and no other.
actual=$(nm -D --defined-only "$lib" | awk '$2 != "A" {print $3}' |
         sed -E 's/^([^@]+)@@?(.+)$/\1 \2/; t; s/$/ -/' | sort)
nodes=$(nm -D --defined-only "$lib" | awk '$2 == "A" {print $3}' | sort)
expected=
want_nodes=
for pair in "$@"; do
  node=${pair%%=*} list=${pair#*=}
  [ "$node" != "-" ] && want_nodes+="$node"$'\n'
  expected+=$(grep -v '^\s*\(#\|$\)' "$list" | sed "s/\$/ $node/")$'\n'
done
expected=$(printf '%s' "$expected" | sed '/^$/d' | sort)
want_nodes=$(printf '%s' "$want_nodes" | sed '/^$/d' | sort)
status=0
if [ "$actual" != "$expected" ]; then
  echo "exported symbols of $lib differ from the lists (< expected, > actual; 'name node'):"
  diff <(echo "$expected") <(echo "$actual") || true
  status=1
fi
if [ "$nodes" != "$want_nodes" ]; then
  echo "version nodes of $lib: '$(echo $nodes)', want '$(echo $want_nodes)'"
  status=1
fi
if [ $status = 0 ]; then
  echo "exported symbols of $(basename "$lib") match $(echo "$@") ($(echo "$actual" | wc -l) symbols, nodes: $(echo $nodes))"
fi
exit $status
