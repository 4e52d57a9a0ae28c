#!/usr/bin/env bash
# Makes (or reuses) the virtual environment with pip's newest torch 2.x and
# the trainer frameworks the Python suites test against: Accelerate,
# Lightning, Transformers; plus setuptools, wheel and build for the pip
# install test (tests/python/packaging/test_pip_install.py). Prints the venv's python
# on its last line (scripts/test.sh passes it as -DSF_PYTHON_TORCH2).
#
#   SF_TORCH2_VENV   where it lives (default ~/.cache/sfsync/venv-torch2,
#                    outside the checkout: clones share it)
#
# The venv is built from Debian's /usr/bin/python3 (3.11, python3-venv) and
# reused while its stamp (this file's package list) matches and its python
# imports the frameworks. A changed list is installed into the existing venv
# (pip skips what is already satisfied) instead of downloading torch again.
# PyPI's Linux torch wheel is a CUDA build with its nvidia-* dependencies: the
# venv is about 5.6 GB; it runs on the CPU. Made from scratch (download
# included): 108 s measured on the 2-core CI-like machine (torch 2.15).
# Two runs at once (two clones' scripts/test.sh) take turns on a lock.
set -euo pipefail
venv=${SF_TORCH2_VENV:-$HOME/.cache/sfsync/venv-torch2}
# ">=" so that a fresh machine gets the newest 2.x and the suites keep meeting it.
packages=("torch>=2.1,<3" numpy "accelerate>=1.0" "lightning>=2.4" "transformers>=4.46"
          "setuptools>=61" wheel build)
source "$(dirname "$0")/cached-venv.sh"

# A changed list is installed into a venv that still imports the frameworks.
make_torch2() {  # VENV OLD_VERSIONS
  if [ -n "$2" ]; then
    echo "torch2-venv: $1: package list changed, installing into it" >&2
  else
    rm -rf "$1"
    /usr/bin/python3 -m venv "$1" >&2
    "$1/bin/python" -m pip install -q --upgrade pip >&2
  fi
  "$1/bin/python" -m pip install -q "${packages[@]}" >&2
}
cached_venv torch2-venv "$venv" "${packages[*]}" \
  'import torch, accelerate, lightning, transformers as t; print("torch", torch.__version__, "accelerate", accelerate.__version__, "lightning", lightning.__version__, "transformers", t.__version__)' \
  make_torch2
