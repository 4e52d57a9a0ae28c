"""``python3 -m sfsync`` (sfsync/doctor.py) under this interpreter: every line
is there, shaped ``key: value``, and says what this process can do; the shim
verdict is the one expected for this torch (--expect-shim can: Debian's torch
1.13, which links the system libgloo.so.0; cannot: pip's torch 2.x, with Gloo
built into libtorch_cpu.so), checked against readelf's own DT_NEEDED where
binutils is installed; the launcher lines are the library's discovery.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 PYTHON tests/python/sfsync/test_doctor.py --expect-shim can|cannot
"""

import os
import re
import shutil
import subprocess
import sys
import unittest

# torch before anything probes NCCL: the NCCL module's libnccl.so.2, once
# loaded, is the one a pip torch imported later binds to (and fails with).
import torch  # noqa: E402

import sfsync  # noqa: E402
from sfsync import doctor, launch  # noqa: E402

KEYS = ["version", "library", "abi", "python", "backend_gloo", "backend_nccl", "nccl_module",
        "launch", "launcher", "rank_vars", "rank", "world_size", "local_rank", "rendezvous",
        "meeting", "launch_error", "launch_unmet", "torch", "torch_library", "torch_gloo", "shim"]
LAUNCH_VARS = ("SF_RANK", "SF_WORLD_SIZE", "SF_LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT", "SF_RENDEZVOUS")
EXPECT = None  # "can" or "cannot", from --expect-shim


def run_doctor(**env):
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    base.update(env)
    r = subprocess.run([sys.executable, "-m", "sfsync"], env=base, capture_output=True, text=True,
                       timeout=120)
    lines = r.stdout.splitlines()
    pairs = [line.split(": ", 1) for line in lines]
    return r, lines, dict(p for p in pairs if len(p) == 2)


class Doctor(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.r, cls.lines, cls.got = run_doctor()

    def test_every_line_is_there_once_as_key_value(self):
        self.assertEqual(self.r.returncode, 0, self.r.stderr)
        for line in self.lines:
            self.assertRegex(line, r"^[a-z_]+: \S", line)
        self.assertEqual([line.split(": ", 1)[0] for line in self.lines], KEYS, self.r.stdout)

    def test_library_and_versions(self):
        self.assertEqual(self.got["version"], sfsync.version())
        self.assertEqual(os.path.realpath(self.got["library"]),
                         os.path.realpath(sfsync.library_path()))
        self.assertEqual(self.got["abi"], "%d (binding %d)" % (sfsync.abi_version(),
                                                                sfsync.ABI_VERSION))
        self.assertTrue(self.got["python"].startswith(sys.executable + " "), self.got["python"])

    def test_backends_and_nccl_module(self):
        self.assertEqual(self.got["backend_gloo"], "available")
        why = sfsync.backend_unavailable_reason("nccl")
        self.assertEqual(self.got["backend_nccl"], "available" if why is None
                         else "unavailable: " + why)
        self.assertRegex(self.got["nccl_module"], r"^(loaded|not loadable)")

    def test_torch_and_the_shim_verdict(self):
        self.assertEqual(self.got["torch"], torch.__version__)
        lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        self.assertEqual(self.got["torch_library"], lib)
        want = {"can": doctor.SHIM_CAN, "cannot": doctor.SHIM_CANNOT}[EXPECT]
        self.assertEqual(self.got["shim"], want, self.got["torch_gloo"])
        needs_gloo = any(n.startswith("libgloo") for n in doctor.needed_libraries(lib))
        self.assertEqual(needs_gloo, EXPECT == "can", doctor.needed_libraries(lib))
        if shutil.which("readelf"):  # binutils' view of DT_NEEDED, as check_static_gloo.py reads it
            dyn = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True).stdout
            needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
            self.assertEqual(doctor.needed_libraries(lib), needed)

    def test_launch_lines_are_the_library_discovery(self):
        for env in ({}, {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
                    {"RANK": "0", "WORLD_SIZE": "2"}, {"SLURM_NTASKS": "2"}):
            r, _, got = run_doctor(**env) if env else (self.r, None, self.got)
            self.assertEqual(r.returncode, 0, r.stderr)
            found = launch.discover(env)
            self.assertEqual(got["launch"], launch.describe(found))
            self.assertEqual(got["launcher"], found.launcher)
            self.assertEqual((int(got["rank"]), int(got["world_size"]), int(got["local_rank"])),
                             (found.rank, found.world_size, found.local_rank))
            self.assertEqual(got["rendezvous"], found.rendezvous or "none")
            self.assertEqual(got["launch_error"], found.error or "none")
            self.assertEqual(got["launch_unmet"], found.unmet or "none")
        self.assertIn("say this process is rank 0 of 2", run_doctor(RANK="0", WORLD_SIZE="2")[2]
                      ["launch_unmet"])

    def test_no_library_is_said_not_raised(self):
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        env["SFSYNC_LIBRARY"] = "/nonexistent/libsfsync.so.1"
        r = subprocess.run([sys.executable, "-m", "sfsync"], env=env, capture_output=True,
                           text=True, timeout=120)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertRegex(r.stdout, r"^library: not loadable: cannot load libsfsync")


if __name__ == "__main__":
    if "--expect-shim" in sys.argv:
        i = sys.argv.index("--expect-shim")
        EXPECT = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    if EXPECT not in ("can", "cannot"):
        sys.exit("test_doctor.py: --expect-shim can|cannot is required")
    unittest.main()
