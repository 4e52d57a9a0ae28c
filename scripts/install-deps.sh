#!/usr/bin/env bash
# Installs what sfsync needs on Debian 12 (idempotent: skips apt when every
# package is already there). Runs apt through sudo when not root.
set -euo pipefail

packages=(
  build-essential cmake pkg-config    # toolchain
  ccache                              # faster rebuilds (scripts/test.sh uses it when present)
  libgloo-dev libhiredis-dev          # the Gloo backend (TCP, Redis store)
  libboost-test-dev                   # Boost.Test suites
  libssl-dev                          # OpenSSL: the oracle of sha256_tests (the job token is sfsync's own HMAC-SHA256)
  libcxxopts-dev                      # command-line tools
  redis-server                        # the redis:// rendezvous tests
  python3-torch python3-numpy         # the Python + PyTorch sample (/usr/bin/python3)
  cargo librust-libloading-dev        # the Rust sample (offline, Debian's crates)
  iproute2                            # simulated hosts (scripts/cluster.sh: ip netns, tc tbf)
  python3-matplotlib                  # benchmark and trace plots (bench/, scripts/)
  python3-setuptools python3-wheel    # pip install . / the wheel, offline (pyproject.toml)
  python3-pip python3-venv python3-build  # the pip and wheel test (tests/python/packaging/test_pip_install.py)
  debootstrap                         # the manylinux wheel's minimal-root smoke test (tests/python/packaging/test_wheel.py)
  clang-14 libclang-rt-14-dev         # libFuzzer targets (tests/fuzz: ctest -L fuzz)
  openmpi-bin                         # mpirun for the launcher tests (mpi:// loads libmpi.so.40)
  slurm-wlm munge                     # a single-node Slurm for the launcher tests (srun -n 2)
  doxygen                             # the C reference of the docs site (scripts/docs-venv.sh, ctest -R docs_site)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q "${missing[@]}"
