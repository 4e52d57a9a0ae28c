"""Probing NCCL before ``import torch`` (issue 23's known problem): under pip
torch, sfsync.backend_available("nccl") used to load the system's
libnccl.so.2 (the plugin's NCCL module, by soname) before torch, and
``import torch`` then failed (libtorch_cuda.so: undefined symbol
ncclCommResume). sfsync now loads pip torch's own copies first
(sfsync.prefer_torch_cuda_libraries). Each case runs in a fresh interpreter
(this one's, so both torches), nothing of torch imported before the probe.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 \\
    python3 tests/python/sfsync/test_nccl_probe_order.py -v
"""

import os
import subprocess
import sys
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

PROBE = r"""
import sys
import sfsync
%s
reason = sfsync.backend_unavailable_reason("nccl")
assert "torch" not in sys.modules, "the probe imported torch"
print("PROBE", "available" if reason is None else "unavailable: " + reason)
import torch
maps = sorted(set(l.split()[-1] for l in open("/proc/self/maps")
                  if "/libnccl" in l or "/libcudart" in l))
print("TORCH", torch.__version__)
for m in maps:
    print("MAPPED", m)
"""


def run(before=""):
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", os.path.join(ROOT, "python"))
    for k in ("SF_CUDART_LIBRARY", "SF_NCCL_LIBRARY"):
        env.pop(k, None)  # (the caller's choice would disable the preference)
    return subprocess.run([sys.executable, "-c", PROBE % before], env=env, timeout=180,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True)


def torch_nvidia_nccl():
    """pip torch's own libnccl.so.2, found without importing torch (None: none)."""
    import importlib.util
    spec = importlib.util.find_spec("torch")
    site = os.path.dirname(list(spec.submodule_search_locations)[0])
    path = os.path.join(site, "nvidia", "nccl", "lib", "libnccl.so.2")
    return path if os.path.isfile(path) else None


class ProbeOrderTests(unittest.TestCase):
    def test_probe_then_import_torch(self):
        r = run()
        self.assertEqual(r.returncode, 0, "import torch after the NCCL probe failed:\n" + r.stdout)
        self.assertIn("PROBE ", r.stdout)
        self.assertIn("TORCH ", r.stdout)
        mapped = [line.split(None, 1)[1] for line in r.stdout.splitlines()
                  if line.startswith("MAPPED ")]
        own = torch_nvidia_nccl()
        nccls = [m for m in mapped if "/libnccl" in m]
        if own is not None:  # pip torch: its NCCL, and no other, is in the process
            self.assertEqual([os.path.realpath(m) for m in nccls], [os.path.realpath(own)],
                             r.stdout)
        print("\nINFO probe first:", r.stdout.replace("\n", " | "))

    def test_the_preference_is_what_fixes_it(self):
        """The same probe with the preference switched off: the process then
        loads whatever libnccl.so.2 the loader finds first (the system's
        here). Reported, not asserted: it fails only where the system's NCCL
        is older than torch's."""
        r = run("import sfsync.loader as L; L._preferred = ()")
        print("\nINFO without the preference: exit %d; %s" % (
            r.returncode, (r.stdout.strip().splitlines() or [""])[-1]))
        if torch_nvidia_nccl() is None:
            self.assertEqual(r.returncode, 0, r.stdout)


if __name__ == "__main__":
    unittest.main()
