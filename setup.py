"""The pip build of the sfsync package (pyproject.toml names this file).

build_py copies python/sfsync/**/*.py (the package and its subpackages
sfsync.torch, sfsync.integrations), then runs the project's CMake build of
the libraries only (SF_BUILD_TESTS=OFF, SF_BUILD_SAMPLES=OFF; targets sfsync,
sfsync_shim and sfsync_nccl where they exist) and copies libsfsync.so.1,
libsfsync_shim.so and libsfsync_nccl.so into the package, where
sfsync.library_path() finds them first. The CMake tree is build-pip/cmake
under the source tree (SFSYNC_CMAKE_BUILD_DIR to put it elsewhere); a
Release build (no debug info: smaller, and ccache hits from any checkout
path), through ccache when it is on PATH (CCACHE_BASEDIR = the source tree
unless set). The binaries carry RPATH $ORIGIN, so the shim and the NCCL
module find the package's libsfsync.so.1 next to them. Environment:
SFSYNC_BUILD_TYPE (default Release), SFSYNC_CMAKE_ARGS (extra cmake
arguments, split at spaces), SFSYNC_BUILD_JOBS (default: the CPU count),
SFSYNC_ZIG (the zig executable: the portable build of
scripts/build-wheel.sh, Gloo and hiredis from third_party/ linked in, glibc
SFSYNC_ZIG_GLIBC, default 2.28, and no libstdc++).
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 (PyPI's, under build isolation) has its own
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    try:  # Debian 12's setuptools 66 + python3-wheel (--no-build-isolation)
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:  # no wheel: `pip install` still works through setup.py
        bdist_wheel = None

ROOT = os.path.dirname(os.path.abspath(__file__))
PIP_DIR = os.path.join(ROOT, "build-pip")
# (target, file in the CMake tree, name in the package); the first is required.
LIBRARIES = [
    ("sfsync", "plugin/libsfsync.so.1", "libsfsync.so.1"),
    ("sfsync_shim", "shim/libsfsync_shim.so", "libsfsync_shim.so"),
    ("sfsync_nccl", "plugin/libsfsync_nccl.so", "libsfsync_nccl.so"),
]


def project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(sfsync VERSION ([0-9.]+)", f.read())
    if not m:
        raise RuntimeError("setup.py: no 'project(sfsync VERSION x.y.z' in CMakeLists.txt")
    return m.group(1)


def run(cmd, env):
    print("+ " + " ".join(cmd), flush=True)
    subprocess.check_call(cmd, env=env)


class CMakeBuildPy(build_py):
    """build_py, then the CMake build of the libraries into the package."""

    def run(self):
        super().run()
        cmake = shutil.which("cmake")
        if not cmake:
            sys.exit("setup.py: cmake is not on PATH (scripts/install-deps.sh installs it)")
        tree = os.environ.get("SFSYNC_CMAKE_BUILD_DIR") or os.path.join(PIP_DIR, "cmake")
        env = dict(os.environ)
        args = ["-DCMAKE_BUILD_TYPE=" + os.environ.get("SFSYNC_BUILD_TYPE", "Release"),
                "-DSF_BUILD_TESTS=OFF", "-DSF_BUILD_SAMPLES=OFF",
                "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"]
        if shutil.which("ccache"):
            env.setdefault("CCACHE_BASEDIR", ROOT)
            args += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        zig = os.environ.get("SFSYNC_ZIG")
        if zig:  # the portable wheel (scripts/build-wheel.sh): Zig, vendored Gloo + hiredis
            args += ["-DSF_VENDORED_DEPS=ON", "-DSF_ZIG=" + zig,
                     "-DCMAKE_TOOLCHAIN_FILE=" + os.path.join(ROOT, "cmake", "zig-toolchain.cmake"),
                     "-DSF_ZIG_GLIBC=" + os.environ.get("SFSYNC_ZIG_GLIBC", "2.28")]
        args += os.environ.get("SFSYNC_CMAKE_ARGS", "").split()
        run([cmake, "-S", ROOT, "-B", tree] + args, env)
        targets = subprocess.run([cmake, "--build", tree, "--target", "help"], env=env,
                                 stdout=subprocess.PIPE, text=True, check=True).stdout
        present = set(re.findall(r"^\.\.\. (\S+)", targets, re.M))
        wanted = [lib for i, lib in enumerate(LIBRARIES) if i == 0 or lib[0] in present]
        jobs = os.environ.get("SFSYNC_BUILD_JOBS") or str(os.cpu_count() or 1)
        run([cmake, "--build", tree, "-j", jobs, "--target"] + [t for t, _, _ in wanted], env)
        package = os.path.join(self.build_lib, "sfsync")
        for target, built, name in wanted:
            # copyfile follows the symlink libsfsync.so.1 -> libsfsync.so.X.Y.Z
            shutil.copyfile(os.path.join(tree, built), os.path.join(package, name))
            os.chmod(os.path.join(package, name), 0o755)
            print("setup.py: %s -> sfsync/%s" % (built, name), flush=True)
        skipped = [t for t, _, _ in LIBRARIES if t not in [w[0] for w in wanted]]
        if skipped:
            print("setup.py: not in this CMake build (skipped): %s" % ", ".join(skipped))


class BinaryDistribution(Distribution):
    """The package carries native libraries: a platform wheel."""

    def has_ext_modules(self):
        return True


cmdclass = {"build_py": CMakeBuildPy}
if bdist_wheel is not None:
    class PlatformWheel(bdist_wheel):
        """py3-none-<platform>: the libraries use no Python ABI (ctypes)."""

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat
    cmdclass["bdist_wheel"] = PlatformWheel

def license_metadata():
    """Apache-2.0 as an SPDX expression (PEP 639) where setuptools knows them
    (>= 77: PyPI's, under build isolation; the TOML-table form is deprecated
    there), as the old License field for Debian 12's setuptools 66."""
    import setuptools
    major = int(re.match(r"\d+", setuptools.__version__).group(0))
    if major >= 77:
        return {"license_expression": "Apache-2.0", "license_files": ["LICENSE"]}
    return {"license": "Apache-2.0"}


os.makedirs(PIP_DIR, exist_ok=True)
setup(
    **license_metadata(),
    version=project_version(),
    # sfsync and its subpackages (sfsync.torch, sfsync.integrations).
    packages=find_packages("python", include=["sfsync", "sfsync.*"]),
    package_dir={"": "python"},
    distclass=BinaryDistribution,
    cmdclass=cmdclass,
    # setuptools' own build and egg-info trees stay out of the CMake build/.
    options={"build": {"build_base": os.path.relpath(PIP_DIR, ROOT)},
             "egg_info": {"egg_base": os.path.relpath(PIP_DIR, ROOT)}},
    zip_safe=False,
)
