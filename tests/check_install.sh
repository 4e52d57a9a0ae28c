#!/bin/bash
# Installs the build tree into a temporary prefix, checks the installed
# files, and builds a consumer with find_package(sfsync) and with pkg-config.
# Then runs the installed tree itself, from another directory, with no
# LD_LIBRARY_PATH, SFSYNC_LIBRARY or build tree in sight: the shim preloaded
# into Python, the tools, the NCCL module's loader, and (given PY_DIR, the
# package's directory relative to the prefix, and PYTHON) `import sfsync`.
# Usage: check_install.sh BUILD_DIR SOURCE_DIR [PY_DIR PYTHON]
set -euo pipefail
build=$1 src=$2 pydir=${3:-} python=${4:-/usr/bin/python3}
unset LD_LIBRARY_PATH SFSYNC_LIBRARY LD_PRELOAD SF_NCCL_MODULE
prefix=$(mktemp -d /tmp/sfsync-install-XXXXXX)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" > "$prefix.log" 2>&1 || { cat "$prefix.log"; exit 1; }
lib=$(ls -d "$prefix"/lib*/ | head -1); lib=${lib%/}
for f in include/sfsync.h bin/sfsync-run bin/sfsync-bench; do
  [ -e "$prefix/$f" ] || { echo "missing $f"; exit 1; }
done
for f in libsfsync.so libsfsync.so.1 cmake/sfsync/sfsyncConfig.cmake pkgconfig/sfsync.pc; do
  [ -e "$lib/$f" ] || { echo "missing lib/$f"; exit 1; }
done
soname=$(objdump -p "$lib/libsfsync.so" | awk '/SONAME/ {print $2}')
[ "$soname" = "libsfsync.so.1" ] || { echo "SONAME is '$soname', expected libsfsync.so.1"; exit 1; }

cmake -S "$src/tests/install_consumer" -B "$prefix/consumer" -DCMAKE_PREFIX_PATH="$prefix" > /dev/null
cmake --build "$prefix/consumer" > /dev/null
LD_LIBRARY_PATH="$lib" "$prefix/consumer/consumer"

PKG_CONFIG_PATH="$lib/pkgconfig" cc -std=c99 "$src/tests/install_consumer/main.c" -o "$prefix/pc" \
  $(PKG_CONFIG_PATH="$lib/pkgconfig" pkg-config --cflags --libs sfsync)
LD_LIBRARY_PATH="$lib" "$prefix/pc"

# Every installed ELF file finds its siblings through an $ORIGIN RUNPATH.
cd /tmp
for f in "$lib"/libsfsync*.so* "$prefix"/bin/*; do
  [ -L "$f" ] && continue
  # (CUDA and NCCL come from the loader path, as for any CUDA program.)
  if ldd "$f" 2>/dev/null | grep "not found" | grep -q sfsync; then
    echo "$f: unresolved sfsync libraries:"; ldd "$f" | grep "not found"; exit 1
  fi
  found=$(ldd "$f" | awk '$1 == "libsfsync.so.1" {print $3}')
  if [ -n "$found" ] && [ "$(readlink -f "$found")" != "$(readlink -f "$lib/libsfsync.so.1")" ]; then
    echo "$f: resolves libsfsync.so.1 outside the installed tree: $found"; exit 1
  fi
done
"$prefix/bin/sfsync-run" -n 2 -- /bin/sh -c 'test -n "$RANK"' \
  || { echo "installed sfsync-run failed"; exit 1; }
"$prefix/bin/sfsync-bench" --help > /dev/null || { echo "installed sfsync-bench failed"; exit 1; }
if [ -e "$lib/libsfsync_shim.so" ]; then
  # Exit 127 ("libsfsync.so.1: cannot open shared object file") before the
  # shim had a RUNPATH of its own.
  rc=0; LD_PRELOAD="$lib/libsfsync_shim.so" "$python" -c 1 || rc=$?
  [ $rc -eq 0 ] || { echo "LD_PRELOAD=$lib/libsfsync_shim.so $python -c 1: exit $rc"; exit 1; }
  echo "installed shim preloads into $python"
fi
if [ -n "$pydir" ]; then
  [ -e "$prefix/$pydir/sfsync/__init__.py" ] || { echo "missing $pydir/sfsync"; exit 1; }
  # every module of the source package, subpackages (sfsync/torch/...) too
  n=0
  while IFS= read -r m; do
    n=$((n + 1))
    [ -e "$prefix/$pydir/$m" ] || { echo "the installed package lacks $m"; exit 1; }
  done < <(cd "$src/python" && find sfsync -name '*.py' -not -path '*/__pycache__/*')
  [ "$n" -gt 20 ] || { echo "only $n modules found under $src/python/sfsync"; exit 1; }
  echo "installed package: all $n modules of python/sfsync"
  out=$(PYTHONPATH="$prefix/$pydir" "$python" -c \
    'import sfsync; print(sfsync.version(), sfsync.library_path())')
  read -r version path <<< "$out"
  case "$(readlink -f "$path")" in
    "$(readlink -f "$lib")"/*) ;;
    *) echo "installed package loaded $path, not the installed library in $lib"; exit 1 ;;
  esac
  echo "installed package: sfsync $version from $path"
fi
echo "install OK: $soname, find_package and pkg-config consumers ran, installed tree runs"
