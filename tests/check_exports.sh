#!/bin/bash
# Compares the dynamic symbols libsfsync.so defines with the checked-in list.
# Usage: check_exports.sh LIBRARY EXPECTED_LIST
set -eu
lib=$1 expected=$2
actual=$(nm -D --defined-only "$lib" | awk '{print $3}' | sed 's/@.*//' | grep -v '^SFSYNC_' | sort)
if [ "$actual" = "$(sort "$expected")" ]; then
  echo "exported symbols match $expected ($(echo "$actual" | wc -l) symbols)"
  exit 0
fi
echo "exported symbols differ from $expected (< expected, > actual):"
diff <(sort "$expected") <(echo "$actual") || true
exit 1
