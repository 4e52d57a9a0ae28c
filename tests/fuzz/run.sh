#!/usr/bin/env bash
# Builds the libFuzzer targets with clang-14 in their own tree and runs them.
#
#   tests/fuzz/run.sh [--build-dir DIR] --build          configure + build every target
#   tests/fuzz/run.sh [--build-dir DIR] TARGET SECONDS    fuzz TARGET (builds first if needed)
#   tests/fuzz/run.sh [--build-dir DIR] --ctest TARGET RUNS SEED
#                      what ctest -L fuzz runs: the checked-in corpus and a
#                      fixed-seed run of RUNS inputs from a fresh copy of it,
#                      the same inputs every time (no time budget)
#
# A run starts from the checked-in corpus (tests/fuzz/corpus/TARGET), adds
# what it finds to a scratch copy, and exits non-zero on a crash, leaving the
# reproducer in DIR/artifacts/TARGET/ (check it in under
# tests/fuzz/regressions/TARGET/ once the bug is fixed: fuzz_TARGET_replay
# runs it in every build). Exit 77 (skipped) without clang++-14; with
# CI=true in the environment that is a failure (exit 1): CI fuzzes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
dir=$repo/build-fuzz
if [ "${1:-}" = "--build-dir" ]; then dir=$(realpath -m "$2"); shift 2; fi
if ! command -v clang++-14 > /dev/null || ! command -v clang-14 > /dev/null; then
  if [ "${CI:-}" = "true" ]; then
    echo "fuzz: FAIL (CI=true): clang-14 is not installed (apt-get install clang-14)"
    exit 1
  fi
  echo "fuzz: clang-14 is not installed (apt-get install clang-14): skipped"
  exit 77
fi
targets="fuzz_options fuzz_shim fuzz_abi"
[ -f "$repo/plugin/rendezvous/store_protocol.h" ] && targets="$targets fuzz_store_protocol"

build() {
  mkdir -p "$dir"
  # One build of a tree at a time (scripts/test.sh starts one in the
  # background; ctest's fuzz tests then wait for it and find it built).
  exec 8> "$dir.lock"
  flock 8
  launcher=()
  if command -v ccache > /dev/null; then
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  fi
  if [ -f "$dir/CMakeCache.txt" ]; then
    cmake "$dir" > "$dir/configure.log" 2>&1 || { cat "$dir/configure.log"; exit 1; }
  else
    cmake -S "$repo" -B "$dir" -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
      -DSF_SANITIZE=fuzzer -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSF_BUILD_TESTS=OFF \
      -DSF_LINE_TABLES=ON \
      -DSF_BUILD_SAMPLES=OFF "${launcher[@]}" > "$dir/configure.log" 2>&1 \
      || { cat "$dir/configure.log"; exit 1; }
  fi
  cmake --build "$dir" -j "$(nproc)" --target $targets > "$dir/build.log" 2>&1 \
    || { tail -60 "$dir/build.log"; exit 1; }
  echo "fuzz: built $targets in $dir"
  flock -u 8
}

if [ "${1:-}" = "--build" ]; then build; exit 0; fi
ctest_mode=0
if [ "${1:-}" = "--ctest" ]; then
  [ $# -eq 4 ] || { echo "usage: run.sh [--build-dir DIR] --ctest TARGET RUNS SEED"; exit 2; }
  ctest_mode=1 target=$2 runs=$3 seed=$4
else
  [ $# -eq 2 ] || { echo "usage: run.sh [--build-dir DIR] (--build | TARGET SECONDS | --ctest TARGET RUNS SEED)"; exit 2; }
  target=$1 seconds=$2
fi
if [ "$ctest_mode" = 1 ]; then
  # A build of this tree under way (scripts/test.sh's background build of
  # build-asan holds the lock until it is done): wait for it, so that the
  # target below is the finished one.
  exec 8> "$dir.lock"
  flock -s 8
  exec 8>&-
fi
[ -x "$dir/tests/fuzz/$target" ] || build
work=$dir/corpus/$target
if [ "$ctest_mode" = 1 ]; then
  work=$dir/corpus-ctest/$target
  rm -rf "$work"  # a fresh copy: what an earlier run found must not change this one
  limit=(-runs="$runs" -seed="$seed")
else
  limit=(-max_total_time="$seconds")
fi
mkdir -p "$work" "$dir/artifacts/$target"
cp -n "$here/corpus/$target"/* "$work"/ 2> /dev/null || true
export ASAN_OPTIONS=${ASAN_OPTIONS:-allocator_may_return_null=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
cd "$dir"
rc=0
"$dir/tests/fuzz/$target" "${limit[@]}" -timeout=20 -rss_limit_mb=4096 -malloc_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$dir/artifacts/$target/" "$work" > "$dir/$target.log" 2>&1 || rc=$?
grep -E '^#[0-9]+ *(INITED|DONE)|stat::number_of_executed_units|stat::peak_rss|ERROR|SUMMARY|Test unit written|invariant broken|runtime error' \
  "$dir/$target.log" | head -40 || true
[ "$rc" = 0 ] || { echo "fuzz: $target failed (exit $rc); log $dir/$target.log"; tail -60 "$dir/$target.log"; }
exit "$rc"
