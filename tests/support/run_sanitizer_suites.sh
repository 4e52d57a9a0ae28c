#!/usr/bin/env bash
# run_sanitizer_suites.sh TREE
#
# The unit suites (ctest -L unit) of a clang sanitizer tree that
# scripts/test.sh builds in the background (build-asan: ASan + UBSan with the
# fuzzers' coverage; build-tsan: TSan), run as one test of the normal tree
# (sanitizer_unit_<tree>, registered when the normal tree is configured with
# -DSF_SANITIZER_TREES=...). It waits for the tree's build (test.sh holds
# TREE.lock until it is built), checks that the build holds what the suites
# use, then runs them one at a time (-j1: this test is one of the normal
# ctest's -j slots, so the machine runs no more tests at once than it would).
set -euo pipefail
tree=$(realpath -m "$1")
repo=$(cd "$(dirname "$0")/../.." && pwd)
exec 8> "$tree.lock"
flock 8
exec 8>&-  # built: the lock is not kept (tests/fuzz/run.sh takes it too)
[ -f "$tree/CMakeCache.txt" ] || { echo "run_sanitizer_suites: $tree was never configured (see build/background-builds.log)"; exit 1; }
python3 "$repo/tests/support/check_unit_targets.py" "$tree"
env=()
if grep -q '^SF_SANITIZE:STRING=thread$' "$tree/CMakeCache.txt"; then
  env=(TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$repo/tests/tsan.supp")
fi
cd "$tree"
# Every line (its log too: $tree/unit-suites.log), not only a failure's.
env "${env[@]}" ctest -j 1 -L unit --no-tests=error --output-on-failure 2>&1 | tee "$tree/unit-suites.log"
exit "${PIPESTATUS[0]}"
