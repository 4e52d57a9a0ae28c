#!/usr/bin/env bash
# Runs every test: the full suite (plugin, tools, samples; the Python suites
# under Debian's torch 1.13 and pip's newest torch 2.x) in a normal build,
# then the plugin suites again under AddressSanitizer + UBSan and under
# ThreadSanitizer. Installs what is missing first.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

bash scripts/install-deps.sh

# ccache (installed by install-deps.sh) makes rebuilds of an unchanged tree
# fast; paths are hashed relative to the checkout, so clones share hits.
launcher=()
if command -v ccache > /dev/null; then
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi

build() {  # build DIR [cmake args...]
  local dir=$1; shift
  echo "== configure and build $dir $*"
  mkdir -p "$dir"
  cmake -S . -B "$dir" "${launcher[@]}" "$@" > "$dir/build.log" 2>&1 || { cat "$dir/build.log"; exit 1; }
  cmake --build "$dir" -j "$jobs" >> "$dir/build.log" 2>&1 || { tail -80 "$dir/build.log"; exit 1; }
}

# The torch 2.x half of the Python suites runs under pip's newest torch in a
# venv outside the checkout (scripts/torch2-venv.sh: ~5.6 GB, about 2 min to
# make the first time, reused after). If it cannot be made, SF_PYTHON_TORCH2
# stays empty and python_tests_torch2 says so: a failure with CI=true.
torch2=$(bash scripts/torch2-venv.sh | tail -1) || {
  echo "== scripts/torch2-venv.sh failed: the torch2 Python suites cannot run"; torch2=; }

build build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSF_PYTHON_TORCH2="$torch2"
echo "== tests: everything"
(cd build && ctest -j "$jobs" --output-on-failure)

build build-asan -DSF_SANITIZE=address -DCMAKE_BUILD_TYPE=Debug
echo "== tests: AddressSanitizer + UBSan"
(cd build-asan && ctest -j "$jobs" -L unit --output-on-failure)

build build-tsan -DSF_SANITIZE=thread -DCMAKE_BUILD_TYPE=Debug
echo "== tests: ThreadSanitizer"
(cd build-tsan && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/../tests/tsan.supp" ctest -L unit --output-on-failure)
