"""pip install and the wheel, from a clean copy of the checkout, as a user
does it (pyproject.toml + setup.py: the CMake build of the libraries inside
the package), then a torchrun restart run from the installed package:

1. the source tree copied (no build*/, no .git) to a temporary directory;
2. ``pip install --no-build-isolation --target T COPY``: T/sfsync holds
   libsfsync.so.1, the shim and the NCCL module (where this build has it);
   ``PYTHONPATH=T python3 -c "import sfsync; print(sfsync.library_path())"``
   from / with no SFSYNC_LIBRARY prints T/sfsync/libsfsync.so.1; the shim
   loads libsfsync.so.1 from next to itself (RUNPATH $ORIGIN, its own dlopen);
3. ``python3 -m build --wheel --no-isolation COPY``: one py3-none-<platform>
   wheel holding the same libraries;
4. a fresh ``python3 -m venv --system-site-packages V``; ``pip --python
   V/bin/python install`` the wheel; the package loads its own library from V
   and V's torch is this interpreter's. Started from a venv's python (the
   torch 2.x suites: scripts/torch2-venv.sh), V is made without
   --system-site-packages and sees that venv's site-packages through a .pth
   file: --system-site-packages from a venv's python gives the *base*
   interpreter's packages (Debian's torch 1.13), so the run would silently
   test the wrong torch;
5. run_restarts.py with V/bin/python (GradientSync through torchrun's agent
   store, two SIGKILLs, --max_restarts 2), with no PYTHONPATH and no
   SFSYNC_LIBRARY: every rank's OK line names V's library;
6. ``pip --python V/bin/python uninstall -y sfsync`` removes every file of it.

The pip build goes through ccache (setup.py), so a second run of this test
(or one after a pip build of the same sources anywhere) recompiles nothing.

    test_pip_install.py [--python PY] [--keep DIR]

PY runs pip, the build and the venv; by default this script's interpreter
(ctest starts it with each torch's python). A venv PY needs setuptools,
wheel and build in it (scripts/torch2-venv.sh installs them).
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SUPPORT = os.path.join(os.path.dirname(HERE), "support")  # tests/python/support
LIBS = ("libsfsync.so.1", "libsfsync_shim.so", "libsfsync_nccl.so")
failures = []
LINE_TABLES = "OFF"


def check(ok, what):
    print("%s %s" % ("ok  " if ok else "FAIL", what), flush=True)
    if not ok:
        failures.append(what)
    return ok


def clean_env():
    """The user's environment: none of ctest's development overrides."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "SFSYNC_LIBRARY", "LD_LIBRARY_PATH", "PYTHONHOME")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run(cmd, cwd=None, timeout=600):
    start = time.monotonic()
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=cwd, env=clean_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout)
    print("  (exit %d, %.1f s)" % (r.returncode, time.monotonic() - start), flush=True)
    if r.returncode != 0:
        print(r.stdout[-6000:])
    return r


def library_path(python, pythonpath=None):
    env = clean_env()
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    r = subprocess.run([python, "-c", "import sfsync; print(sfsync.library_path())"], cwd="/",
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return r.stdout.strip() if r.returncode == 0 else "ERROR: " + r.stdout[-2000:]


def python_facts(python):
    """(sys.prefix != sys.base_prefix, its site-packages, torch's version and
    file) of `python`, run in the user's environment."""
    code = ("import json, site, sys\n"
            "try:\n    import torch; t = [torch.__version__, torch.__file__]\n"
            "except ImportError:\n    t = None\n"
            "print(json.dumps([sys.prefix != sys.base_prefix, site.getsitepackages(), t]))")
    r = subprocess.run([python, "-c", code], cwd="/", env=clean_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise SystemExit("FAILED: %s -c ...: %s" % (python, r.stdout[-2000:]))
    return json.loads(r.stdout)


def make_venv(python, venv):
    """A venv V on `python` that sees `python`'s packages (the system's, or
    a venv's own): see 4. in the module docstring. Returns run()'s result."""
    in_venv, site_dirs, _ = python_facts(python)
    if not in_venv:
        return run([python, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    r = run([python, "-m", "venv", "--without-pip", venv])
    if r.returncode == 0:
        vsite = python_facts(os.path.join(venv, "bin", "python"))[1][0]
        with open(os.path.join(vsite, "_sfsync_test_parent.pth"), "w") as f:
            f.write("".join(d + "\n" for d in site_dirs if os.path.isdir(d)))
        print("  (%s is a venv: V sees its site-packages %s through a .pth file)"
              % (python, [d for d in site_dirs if os.path.isdir(d)]), flush=True)
    return r


def copy_checkout(dest):
    def ignore(directory, names):
        top = os.path.abspath(directory) == ROOT
        return [n for n in names if n in ("__pycache__", ".git") or
                (top and (n.startswith("build") or n == "target"))]
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--keep", help="work in DIR and keep it (default: a temporary directory)")
    p.add_argument("--line-tables", default="OFF", help="the normal tree's SF_LINE_TABLES")
    args = p.parse_args()
    global LINE_TABLES
    LINE_TABLES = "ON" if args.line_tables.upper() in ("ON", "1", "TRUE", "YES") else "OFF"
    work = args.keep or tempfile.mkdtemp(prefix="sfsync-pip-")
    os.makedirs(work, exist_ok=True)
    try:
        return body(args.python, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def body(python, work):
    src, target = os.path.join(work, "src"), os.path.join(work, "target")
    dist, venv = os.path.join(work, "dist"), os.path.join(work, "venv")
    for d in (src, target, dist, venv):
        shutil.rmtree(d, ignore_errors=True)
    copy_checkout(src)
    # The CMake build inside pip is the real one; only its build type and
    # place follow the checkout's normal build (build/, RelWithDebInfo, its
    # SF_LINE_TABLES (--line-tables, from the tree ctest runs in), ccache
    # keyed relative to the tree with no working directory, as
    # scripts/test.sh sets it), so that its objects come from ccache when
    # that build ran first instead of compiling everything a second time.
    # A user's pip install builds Release into build-pip/ (setup.py).
    if os.environ.get("SFSYNC_PIP_TEST_COLD") != "1":
        os.environ.update({"CCACHE_BASEDIR": src, "CCACHE_NOHASHDIR": "1",
                           "SFSYNC_BUILD_TYPE": "RelWithDebInfo",
                           "SFSYNC_CMAKE_ARGS": "-DSF_LINE_TABLES=" + LINE_TABLES,
                           "SFSYNC_CMAKE_BUILD_DIR": os.path.join(src, "build")})

    # 2. pip install --target
    r = run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
             "--target", target, src])
    if not check(r.returncode == 0, "pip install --no-build-isolation --target DIR ."):
        return 1
    built = [n for n in LIBS if os.path.exists(os.path.join(target, "sfsync", n))]
    check(built[:2] == list(LIBS[:2]), "DIR/sfsync holds %s (expected at least %s)"
          % (built, list(LIBS[:2])))
    path = library_path(python, target)
    check(path == os.path.join(target, "sfsync", "libsfsync.so.1"),
          "PYTHONPATH=DIR: sfsync.library_path() = %s, inside DIR" % path)
    # The shim opens libsfsync.so.1 itself at load (dlopen, RTLD_LOCAL: it keeps
    # the library's Gloo out of a pip torch's scope), through its RUNPATH
    # $ORIGIN: the loader's trace of a preloaded process names the file.
    shim = os.path.join(target, "sfsync", "libsfsync_shim.so")
    trace = subprocess.run(["/bin/true"], env=dict(os.environ, LD_PRELOAD=shim,
                                                   LD_DEBUG="files"),
                           stderr=subprocess.PIPE, text=True).stderr
    m = re.search(r"calling init: (\S*libsfsync\.so\.1)\b", trace)
    check(m is not None and m.group(1) == os.path.join(target, "sfsync", "libsfsync.so.1"),
          "the preloaded shim loads libsfsync.so.1 next to itself (%s)"
          % (m.group(1) if m else trace[-2000:]))

    # 3. the wheel
    r = run([python, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, src])
    wheels = glob.glob(os.path.join(dist, "sfsync-*.whl"))
    if not check(r.returncode == 0 and len(wheels) == 1,
                 "python3 -m build --wheel --no-isolation: %s" % wheels):
        return 1
    wheel = wheels[0]
    check(re.search(r"-py3-none-linux_\w+\.whl$", wheel) is not None,
          "a py3-none-<platform> wheel: %s" % os.path.basename(wheel))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    check(all("sfsync/" + n in names for n in built), "the wheel holds %s" % built)
    modules = sorted(os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "python"))
                     for d, _, files in os.walk(os.path.join(ROOT, "python", "sfsync"))
                     for f in files if f.endswith(".py"))
    missing = [m for m in modules if m not in names]
    check(len(modules) > 20 and not missing, "the wheel holds every module of python/sfsync, "
          "subpackages too (%d; missing: %s)" % (len(modules), missing))

    # 4. a fresh venv
    # (--without-pip: ensurepip would take ~10 s; this pip installs into the
    # venv's interpreter with --python.)
    r = make_venv(python, venv)
    vpy = os.path.join(venv, "bin", "python")
    vpip = [python, "-m", "pip", "--python", vpy]
    if not check(r.returncode == 0, "a venv on %s that sees its packages" % python):
        return 1
    torch_here, torch_there = python_facts(python)[2], python_facts(vpy)[2]
    check(torch_here is not None and torch_there == torch_here,
          "the venv's torch is %s's: %s (the venv: %s)" % (python, torch_here, torch_there))
    r = run(vpip + ["install", "--no-deps", "--no-index", wheel])
    check(r.returncode == 0, "the wheel installs into the venv")
    path = library_path(vpy)
    check(path.startswith(venv + "/") and path.endswith("/sfsync/libsfsync.so.1"),
          "venv: sfsync.library_path() = %s, inside the venv" % path)

    # 5. torchrun from the installed package
    r = run([vpy, os.path.join(SUPPORT, "run_restarts.py"), "--python", vpy, "--", "--variant",
             "gradsync"], timeout=200)
    oks = re.findall(r"\[rank \d\] OK .* library (\S+)", r.stdout)
    check(r.returncode == 0 and len(oks) == 2 and all(o == path for o in oks),
          "torchrun --max_restarts 2 from the venv's package: exit %d, OK lines naming %s"
          % (r.returncode, oks))
    if r.returncode != 0 or len(oks) != 2:
        print(r.stdout[-8000:])

    # 6. pip uninstall
    site = os.path.dirname(os.path.dirname(path))
    r = run(vpip + ["uninstall", "-y", "sfsync"])
    left = glob.glob(os.path.join(site, "sfsync*"))
    check(r.returncode == 0 and not left,
          "pip uninstall sfsync leaves nothing of it in %s (left: %s)" % (site, left))
    after = library_path(vpy)
    check(not after.startswith(venv + "/"), "after uninstall, the venv does not load %s" % path)

    if failures:
        print("FAILED: %d check(s): %s" % (len(failures), "; ".join(failures)))
        return 1
    print("PASSED: pip --target, wheel into a venv, torchrun restarts from it, uninstall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
