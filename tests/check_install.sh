#!/bin/bash
# Installs the build tree into a temporary prefix, checks the installed
# files, and builds a consumer with find_package(sfsync) and with pkg-config.
# Usage: check_install.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 src=$2
prefix=$(mktemp -d /tmp/sfsync-install-XXXXXX)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" > "$prefix.log" 2>&1 || { cat "$prefix.log"; exit 1; }
lib=$(ls -d "$prefix"/lib*/ | head -1)
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
echo "install OK: $soname, find_package and pkg-config consumers ran"
