#!/bin/sh
# after_build.sh LOCK SECONDS CMD [ARGS...]: runs CMD once the build that
# holds LOCK is done (flock: scripts/test.sh's background builds of the
# sanitizer trees hold TREE.lock, exclusive, until their tree is built), and
# fails with a message if that takes more than SECONDS.
# (tests/support/pool_ctest_trees.py --after-build wraps each test so.)
lock=$1 seconds=$2
shift 2
exec 9>> "$lock"
if ! flock -s -w "$seconds" 9; then
  echo "after_build.sh: the build that holds $lock did not finish within $seconds s" \
       "(scripts/test.sh: build/background-builds.log)" >&2
  exit 1
fi
exec 9>&-
exec "$@"
