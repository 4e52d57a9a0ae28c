"""Why the shim's torchrun tests (python_torchrun_shim*, tests/python/CMakeLists.txt)
are not registered for this torch: checks that the reason still holds.

The shim (shim/) interposes ``gloo::allreduce(const gloo::AllreduceOptions&)``
and forwards to the system ``libgloo.so.0`` that Debian's ``libtorch_cpu.so``
needs; it reads the options with Debian's 2022 Gloo headers. PyPI's torch 2.x
builds its own Gloo into ``libtorch_cpu.so`` (no ``libgloo.so.0``; in torch
>= 2.8 a Gloo whose ``gloo::Context`` has other field offsets): there is no
shared Gloo to forward to and no layout the shim knows. Passes (printing the
reason) while this torch's libtorch_cpu.so needs no libgloo.so.0; fails,
saying that the shim's tests may apply now, when it does.

    PYTHON tests/python/packaging/check_static_gloo.py
"""

import os
import subprocess
import sys

import torch


def main():
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(lib):
        print("FAILED: %s not found (torch %s at %s)" % (lib, torch.__version__, torch.__file__))
        return 1
    dyn = subprocess.run(["readelf", "-d", lib], stdout=subprocess.PIPE, text=True, check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in dyn.splitlines() if "(NEEDED)" in line]
    if any(n.startswith("libgloo") for n in needed):
        print("FAILED: torch %s's libtorch_cpu.so needs %s: the shim's torchrun tests may apply "
              "to this torch now; register them (tests/python/CMakeLists.txt)"
              % (torch.__version__, [n for n in needed if n.startswith("libgloo")]))
        return 1
    print("NOT APPLICABLE: torch %s (%s) builds Gloo into libtorch_cpu.so (it needs no "
          "libgloo.so.0: %s): the shim, which forwards gloo::allreduce to the system "
          "libgloo.so.0 and reads its options with Debian's Gloo headers, has nothing to "
          "interpose here; its torchrun tests run under Debian's torch 1.13 only"
          % (torch.__version__, sys.executable, ", ".join(needed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
