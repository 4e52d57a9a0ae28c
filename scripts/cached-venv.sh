# Sourced by scripts/torch2-venv.sh and scripts/docs-venv.sh: a virtual
# environment cached outside the checkout (clones share it), made once and
# reused while its stamp matches and its python imports what it must. Two
# runs at once (two clones' scripts/test.sh) take turns on a lock.
#
#   cached_venv TAG VENV STAMP IMPORTS MAKE
#     TAG      the name in messages (torch2-venv, docs-venv)
#     VENV     the venv's directory
#     STAMP    what it was made from (the package list); a change remakes it
#     IMPORTS  python code that imports the packages and prints their versions
#     MAKE     a function called as MAKE VENV OLD_VERSIONS (OLD_VERSIONS: what
#              the existing venv imports, empty if nothing): makes or updates it
#   Prints VENV/bin/python on its last line; 1 when the made venv cannot import.

cached_venv() {
  local tag=$1 venv=$2 stamp=$3 imports=$4 make=$5 versions="" start
  mkdir -p "$(dirname "$venv")"
  exec 9> "$venv.lock"
  flock 9
  if [ -x "$venv/bin/python" ] && versions=$("$venv/bin/python" -c "$imports" 2> /dev/null) &&
     [ "$(cat "$venv/.sfsync-stamp" 2> /dev/null)" = "$stamp" ]; then
    echo "$tag: reusing $venv ($versions)" >&2
    echo "$venv/bin/python"
    return 0
  fi
  start=$(date +%s)
  "$make" "$venv" "$versions"
  versions=$("$venv/bin/python" -c "$imports" 2> /dev/null) || {
    echo "$tag: $venv/bin/python cannot import what it must: $imports" >&2; return 1; }
  echo "$stamp" > "$venv/.sfsync-stamp"
  echo "$tag: $venv ready in $(( $(date +%s) - start )) s: $versions" >&2
  echo "$venv/bin/python"
}
