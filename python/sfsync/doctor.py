"""``python3 -m sfsync``: what this process's sfsync can do, one ``key: value``
line each (``report()`` returns the pairs): the library and its versions, the
backends and why not, the launcher discovery (the library's own,
sf_discover_launcher), the torch this interpreter imports, whether the shim
(libsfsync_shim.so) can serve that torch, and the NCCL module.

The shim forwards ``gloo::allreduce(const gloo::AllreduceOptions&)`` to the
system ``libgloo.so.0`` that Debian's ``libtorch_cpu.so`` needs, and reads its
options with that Gloo's headers. pip's torch builds its own Gloo into
``libtorch_cpu.so``: there is nothing the shim may interpose, and the
in-process integration (``sfsync.torch.attach`` / ``GradientSync``) is the
way. The verdict reads ``libtorch_cpu.so``'s dynamic section (DT_NEEDED)
and asks the loader which object defines ``gloo::allreduce`` for it.
"""

import ctypes
import os
import struct
import sys

import sfsync

#: gloo::allreduce(gloo::AllreduceOptions const&), the one Gloo call the shim interposes.
GLOO_ALLREDUCE = "_ZN4gloo9allreduceERKNS_16AllreduceOptionsE"
SHIM_CAN = ("the shim can serve it (a Python host: every DDP follows the host's windows "
            "in-process; SF_FOLLOW_HOST=0: the shim's Gloo interposer)")
SHIM_CANNOT = ("the shim serves it in-process only (every DDP follows the host's windows; "
               "its Gloo interposer cannot read this torch's Gloo)")

_DT_NEEDED, _DT_STRTAB, _PT_LOAD, _PT_DYNAMIC = 1, 5, 1, 2


def needed_libraries(path):
    """The DT_NEEDED entries of an ELF64 little-endian shared object (what
    ``readelf -d`` lists as NEEDED), read without binutils."""
    with open(path, "rb") as f:
        ident = f.read(64)
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise ValueError("%s is not a little-endian ELF64 object" % path)
        phoff, = struct.unpack_from("<Q", ident, 32)
        phentsize, phnum = struct.unpack_from("<HH", ident, 54)
        f.seek(phoff)
        headers = [struct.unpack_from("<IIQQQQQQ", f.read(phentsize)) for _ in range(phnum)]
        loads = [(h[3], h[2], h[5]) for h in headers if h[0] == _PT_LOAD]  # vaddr, offset, filesz
        dynamic = [h for h in headers if h[0] == _PT_DYNAMIC]
        if not dynamic:
            return []
        f.seek(dynamic[0][2])
        raw = f.read(dynamic[0][5])
        entries = [struct.unpack_from("<qQ", raw, i) for i in range(0, len(raw) - 15, 16)]
        strtab = next((v for t, v in entries if t == _DT_STRTAB), None)
        if strtab is None:
            return []
        base = next((off + strtab - va for va, off, size in loads if va <= strtab < va + size),
                    strtab)
        names = []
        for tag, value in entries:
            if tag == 0:
                break
            if tag == _DT_NEEDED:
                f.seek(base + value)
                names.append(f.read(256).split(b"\0", 1)[0].decode())
        return names


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def symbol_definer(library, symbol):
    """The file that defines ``symbol`` as the loader resolves it from
    ``library`` (loaded already, or loaded now), or None when nothing does."""
    try:
        handle = ctypes.CDLL(library, mode=getattr(os, "RTLD_NOLOAD", 4) | ctypes.RTLD_LOCAL)
    except OSError:  # not loaded under that name: load it (torch is imported already)
        handle = ctypes.CDLL(library, mode=ctypes.RTLD_LOCAL)
    try:
        address = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not libc.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return "?"
    return os.path.realpath(info.dli_fname.decode())


def torch_gloo():
    """(torch version, libtorch_cpu.so, how it carries Gloo, shim verdict),
    or (None, why not, None, verdict) when torch cannot be imported."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any failure to import is the finding
        return None, "%s: %s" % (type(e).__name__, e), None, "not applicable: no torch"
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(lib):
        return torch.__version__, "%s missing" % lib, None, "unknown: no libtorch_cpu.so"
    needed = needed_libraries(lib)
    shared = [n for n in needed if n.startswith("libgloo")]
    definer = symbol_definer(lib, GLOO_ALLREDUCE)
    if shared and definer and os.path.basename(definer).startswith("libgloo.so"):
        how = "system %s (DT_NEEDED; gloo::allreduce from %s)" % (", ".join(shared), definer)
        return torch.__version__, lib, how, SHIM_CAN
    where = ("gloo::allreduce defined in %s" % definer) if definer else "no gloo::allreduce found"
    how = "built into libtorch_cpu.so (DT_NEEDED has %s; %s)" % (
        ", ".join(shared) or "no libgloo", where)
    return torch.__version__, lib, how, SHIM_CANNOT


def report():
    """[(key, value)] in the order printed."""
    # torch first: probing the NCCL backend loads libnccl.so.2 (the module's
    # dependency), and a pip torch imported after that binds to that NCCL
    # instead of its own wheel's (ImportError: undefined symbol ncclCommResume).
    torch_found = torch_gloo()
    out = []
    try:
        sfsync.lib()
    except sfsync.LibraryLoadError as e:
        return [("library", "not loadable: %s" % e)]
    out += [("version", sfsync.version()), ("library", sfsync.library_path()),
            ("abi", "%d (binding %d)" % (sfsync.abi_version(), sfsync.ABI_VERSION)),
            ("python", "%s %s" % (sys.executable, sys.version.split()[0]))]
    for name in ("gloo", "nccl"):
        why = sfsync.backend_unavailable_reason(name)
        out.append(("backend_" + name, "available" if why is None else "unavailable: " + why))
    why = sfsync.backend_unavailable_reason("nccl")
    if why is None:
        out.append(("nccl_module", "loaded (a GPU is usable)"))
    elif "cannot load its module" in why:
        out.append(("nccl_module", "not loadable: " + why))
    else:
        out.append(("nccl_module", "loaded, backend unusable here: " + why))
    from sfsync import launch
    found = launch.discover()
    out.append(("launch", launch.describe(found)))
    for key in ("launcher", "rank_vars", "rank", "world_size", "local_rank", "rendezvous",
                "meeting", "error", "unmet"):
        value = getattr(found, key)
        out.append(("launch_" + key if key in ("error", "unmet") else key,
                    "none" if value is None or value == "" else str(value)))
    version, where, how, verdict = torch_found
    out.append(("torch", version or "not importable: " + where))
    if version:
        out.append(("torch_library", where))
        out.append(("torch_gloo", how or "unknown"))
    out.append(("shim", verdict))
    return out


def main():
    pairs = report()
    for key, value in pairs:
        print("%s: %s" % (key, " ".join(str(value).splitlines())))
    return 1 if pairs and pairs[0][1].startswith("not loadable") else 0
