#!/usr/bin/env bash
# The main job: install, build, and train the C sample on 2 processes with
# windows of 4 micro-batches. Each window prints the collectives issued
# inside it (0) and at synchronization (one per bucket); the end compares the
# weights with a single-process reference.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
source scripts/build-env.sh  # launcher (ccache), normal_tree
mkdir -p build
# The tree and build type scripts/test.sh uses (through ccache): only what
# the demo runs is built here, and the test command's build then compiles
# only the rest.
cmake -S . -B build "${normal_tree[@]}" "${launcher[@]}" > build/build.log 2>&1 \
  || { cat build/build.log; exit 1; }
cmake --build build -j "$(nproc)" --target sfsync-run sfsync-c-trainer >> build/build.log 2>&1 \
  || { tail -50 build/build.log; exit 1; }

build/plugin/tools/sfsync-run -n 2 -- build/samples/c/sfsync-c-trainer \
  --windows 6 --micro 4 --cap-mb 0.004 --first-cap-mb 0.002
