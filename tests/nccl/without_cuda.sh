#!/bin/bash
# Runs a program as on a machine without CUDA: the dynamic loader ignores its
# cache (/etc/ld.so.cache, which lists /usr/local/cuda here) and searches only
# LIBDIR plus the system directories, so libcudart.so.13 and libnccl.so.2
# cannot be found unless they sit in a system directory.
# Usage: without_cuda.sh LIBDIR PROGRAM [ARGS...]
set -eu
libdir=$1
shift
program=$1
interp=$(readelf -l "$program" | sed -n 's/.*Requesting program interpreter: \(.*\)\]/\1/p')
if [ -z "$interp" ]; then
  echo "without_cuda.sh: no program interpreter in $program" >&2
  exit 1
fi
exec "$interp" --inhibit-cache --library-path "$libdir" "$@"
