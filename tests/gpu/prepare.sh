#!/bin/bash
# Prepares tests/gpu/run.sh for a GPU machine that cannot build: builds here
# (CUDA 13 and NCCL headers under /usr/local/cuda; no GPU needed), collects
# into ONE folder what run.sh runs (bin/: the GPU check program, the CUDA
# sample trainer, the shim's NCCL host; python/: the sfsync package;
# scripts/: the sfsync.torch steps' scripts; lib/: libsfsync, its NCCL module,
# the shim, and every shared library they link that a CUDA/PyTorch image
# lacks, as ldd resolves them here: Gloo, hiredis, OpenSSL's libcrypto,
# ibverbs, ...), strips debug info, checks the folder (under 64 MiB; ldd of
# every file resolves inside it, to the C/C++ runtime, or to libcudart.so.13 /
# libnccl.so.2, which run.sh takes from the machine's PyTorch environment),
# and prints the one-line command to run there.
#
#   tests/gpu/prepare.sh [--build-dir DIR] [--carried DIR] [--no-build]
#     --build-dir  the build tree (default: build); configured if it has no
#                  CMakeCache.txt
#     --carried    the folder to fill (default: build-gpu-carry, at the
#                  repository root, where git ignores it)
#     --no-build   collect from the build tree as it is (CTest does this)
#
# Exit: 0 ready, 1 a check failed, 2 the build failed or a piece is missing.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$root/build
carried=$root/build-gpu-carry
do_build=1
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --carried) carried=$2; shift 2 ;;
    --no-build) do_build=0; shift ;;
    *) echo "prepare.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
limit=$((64 * 1024 * 1024))
targets=(sfsync sfsync_nccl sfsync_shim sfsync_shim_nccl_host sfsync-cuda-trainer sfsync-gpu-check)

if [ "$do_build" = 1 ]; then
  if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo || exit 2
  fi
  cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" || exit 2
fi
build=$(cd "$build" && pwd)

# The pieces, from the build tree.
find_one() { find "$build" -name "$1" -not -path '*/CMakeFiles/*' \( -type f -o -type l \) 2>/dev/null | head -1; }
declare -A pieces=(
  [bin/sfsync-gpu-check]=sfsync-gpu-check
  [bin/sfsync-cuda-trainer]=sfsync-cuda-trainer
  [bin/sfsync_shim_nccl_host]=sfsync_shim_nccl_host
  [lib/libsfsync.so.1]=libsfsync.so.1
  [lib/libsfsync_nccl.so]=libsfsync_nccl.so
  [lib/libsfsync_shim.so]=libsfsync_shim.so
)
missing=()
rm -rf "$carried"
mkdir -p "$carried/bin" "$carried/lib" || exit 2
carried=$(cd "$carried" && pwd)
for dest in "${!pieces[@]}"; do
  src=$(find_one "${pieces[$dest]}")
  if [ -z "$src" ]; then
    missing+=("${pieces[$dest]}")
    continue
  fi
  cp -L "$src" "$carried/$dest"
done
if [ "${#missing[@]}" -ne 0 ]; then
  echo "prepare.sh: not in $build: ${missing[*]} (build targets: ${targets[*]})" >&2
  exit 2
fi
ln -sf libsfsync.so.1 "$carried/lib/libsfsync.so"

# For run.sh's sfsync.torch steps: the pure-Python package (the GPU machine's
# Python 3.12 runs it; libsfsync.so.1 above is its library) and the scripts
# they run (tests/gpu's, the torchrun harness, the framework tests).
mkdir -p "$carried/python" "$carried/scripts/frameworks" || exit 2
(cd "$root/python" && find sfsync -name '*.py' -not -path '*/__pycache__/*' -print0 |
  xargs -0 cp --parents -t "$carried/python") || exit 2
for f in tests/gpu/torch_cuda.py tests/gpu/torch_facts.sh tests/gpu/frameworks_world1.sh \
         tests/python/support/run_torchrun.py tests/python/sfsync/torch/test_follow_host.py \
         samples/python/trainer_backend.py; do
  cp "$root/$f" "$carried/scripts/" || exit 2
done
for f in _common.py test_accelerate.py test_lightning.py; do
  cp "$root/tests/python/sfsync/torch/integrations/$f" "$carried/scripts/frameworks/" || exit 2
done

# What a CUDA / PyTorch image has anyway, and what run.sh brings at run time.
base='^(linux-vdso\.so|ld-linux-x86-64\.so|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libstdc\+\+\.so|libgcc_s\.so|libutil\.so)'
runtime='^(libcudart\.so\.13|libnccl\.so\.2)$'
# Copies every other library ldd resolves, until nothing new appears.
for _ in 1 2 3 4 5 6; do
  added=0
  for f in "$carried"/bin/* "$carried"/lib/*; do
    while read -r name path; do
      [[ $name =~ $base || $name =~ $runtime ]] && continue
      [ -e "$carried/lib/$name" ] && continue
      [ -f "$path" ] || continue
      cp -L "$path" "$carried/lib/$name"
      added=1
    done < <(LD_LIBRARY_PATH=$carried/lib ldd "$f" 2>/dev/null | sed -n 's/^\s*\(\S*\) => \(\/\S*\).*/\1 \2/p')
  done
  [ "$added" = 0 ] && break
done
chmod u+w "$carried"/lib/* "$carried"/bin/*
strip --strip-debug "$carried"/lib/*.so* "$carried"/bin/* 2>/dev/null

# Checks: size, and ldd of every file.
status=0
bytes=$(du -sbL "$carried" | cut -f1)
echo "carried folder $carried: $(find "$carried" -type f | wc -l) files, $bytes bytes (limit $limit)"
if [ "$bytes" -ge "$limit" ]; then
  echo "prepare.sh: FAIL: the carried folder is $bytes bytes, over 64 MiB" >&2
  status=1
fi
for f in "$carried"/bin/* "$carried"/lib/*; do
  [ -L "$f" ] && continue
  while read -r line; do
    name=$(echo "$line" | awk '{print $1}')
    path=$(echo "$line" | sed -n 's/.*=> \(\S*\).*/\1/p')
    [[ $name =~ $base ]] && continue
    if [[ $name =~ $runtime ]]; then continue; fi
    case $path in
      "$carried"/lib/*) ;;
      "")
        [[ $line == */* ]] && continue  # ld-linux by its absolute path
        echo "prepare.sh: FAIL: $(basename "$f") needs $name, which is not carried" >&2; status=1 ;;
      *) echo "prepare.sh: FAIL: $(basename "$f") needs $name from $path, outside the carried folder" >&2; status=1 ;;
    esac
  done < <(LD_LIBRARY_PATH=$carried/lib ldd "$f" 2>/dev/null | sed 's/^\s*//')
done
ls -l "$carried"/lib | awk 'NR > 1 {print "  lib/" $9 " " $5}'
echo "  python/: $(find "$carried/python" -type f | wc -l) files, $(du -sb "$carried/python" | cut -f1) bytes;" \
  "scripts/: $(find "$carried/scripts" -type f | wc -l) files, $(du -sb "$carried/scripts" | cut -f1) bytes"
[ "$status" -ne 0 ] && exit 1
rel=${carried#"$root"/}
echo "ldd: every binary resolves inside the carried folder, to the C/C++ runtime, or to libcudart.so.13 / libnccl.so.2 (from the GPU machine's PyTorch environment)"
echo "command (device run tool, from the repository root; carry [\"$rel\"]):"
echo "  tests/gpu/run.sh --carried $rel --out \"\$OUT\""
exit 0
