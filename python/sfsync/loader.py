"""Loading libsfsync (the search order of the package docstring, the ABI
check, binding every prototype of ``_abi`` with its errcheck) and the
module-level functions over it (version, status strings, backends, log).

Responsible for: ``load``/``lib``/``library_path``, turning a non-zero
sf_status into its SfError (``error_for``, ``error``), the functions of no
context. Not responsible for: the declarations (_abi.py, the one binding),
contexts (context.py).
"""

import ctypes
import os
import threading

from sfsync import _abi
# The binding's two private marks, shared with its loader only (kept private
# so that `from sfsync._abi import *` does not export them).
from sfsync._abi import _STATUS
from sfsync._abi import (ABI_VERSION, BACKEND_AUTO, BACKEND_GLOO, BACKEND_NCCL, ERR_UNSUPPORTED,
                         LOG_WARN, OK, PROTOTYPES)
from sfsync.errors import ERROR_CLASSES, LibraryLoadError, SfError, UnsupportedError

BACKEND_NAMES = {"auto": BACKEND_AUTO, "gloo": BACKEND_GLOO, "nccl": BACKEND_NCCL}

__all__ = ["SINCE_0_2", "SINCE_0_3", "SINCE_0_4", "load", "lib", "loaded", "library_path",
           "check_abi", "error", "error_for", "candidates", "Missing", "abi_version",
           "version_number", "version", "status_string", "last_error", "backend_available",
           "backend_unavailable_reason", "log_level", "log", "prefer_torch_cuda_libraries"]

#: name -> (restype, argtypes) of every function (from _abi.PROTOTYPES).
_PROTOTYPES = {name: (p.restype, p.argtypes) for name, p in PROTOTYPES.items()}
#: Functions added after 0.1, by version: a library older than that (same
#: ABI version) lacks them; they then raise UnsupportedError when called
#: instead of failing the load.
SINCE_0_2 = _abi.since("0.2")
SINCE_0_3 = _abi.since("0.3")
SINCE_0_4 = _abi.since("0.4")

_lock = threading.Lock()
_lib = None
_lib_path = None


def error_for(dll, status, function=None):
    """The exception for a failed call, built from the thread's last error
    (read at once: it is only valid until the next sfsync call)."""
    message = dll.sf_last_error().decode("utf-8", "replace")
    if not message:
        message = "%s failed" % (function or "sfsync")
    text = dll.sf_status_string(status).decode("utf-8", "replace")
    cls = ERROR_CLASSES.get(int(status), SfError)
    return cls(status, message, text, function)


def error(status, message):
    """An exception raised by this module itself, in the library's terms."""
    text = _lib.sf_status_string(status).decode() if _lib is not None else None
    return ERROR_CLASSES.get(status, SfError)(status, message, text)


def _make_check(dll):
    def check(result, func, args):
        """ctypes errcheck for sf_status functions: raise instead of returning != 0."""
        if result != OK:
            raise error_for(dll, result, func.__name__)
        return result
    return check


def _package_dir():
    return os.path.dirname(os.path.abspath(__file__))


def candidates():
    """Where to look for the library, in order (see the module docstring)."""
    here = _package_dir()
    found = []
    bundled = os.path.join(here, "libsfsync.so.1")  # pip install / a wheel
    if os.path.exists(bundled):
        found.append(bundled)
    try:
        from sfsync import _install  # written by cmake --install
        found.append(os.path.normpath(os.path.join(here, _install.LIBRARY)))
    except ImportError:
        pass
    return found + ["libsfsync.so.1"]


class Missing:
    """Stands for a function the loaded library does not export (one older
    than the function's Since): calling it raises UnsupportedError naming it."""

    def __init__(self, name, where, since="0.2"):
        self.__name__ = name
        self._where = where
        self._since = since

    def __call__(self, *args):
        raise UnsupportedError(ERR_UNSUPPORTED, "%s: %s does not export it (it is older than "
                               "sfsync %s); install a newer libsfsync" % (
                                   self.__name__, self._where, self._since),
                               "not available in this build or on this machine", self.__name__)


def _bind(dll):
    check = _make_check(dll)
    for name, proto in PROTOTYPES.items():
        try:
            fn = getattr(dll, name)
        except AttributeError:
            if proto.since != "0.1":
                setattr(dll, name, Missing(name, dll._name, proto.since))
                continue
            raise LibraryLoadError("%s does not export %s: it is older than this binding (ABI %d)"
                                   % (dll._name, name, ABI_VERSION)) from None
        fn.argtypes = [ctypes.c_int32 if t is _STATUS else t for t in proto.argtypes]
        if proto.restype is _STATUS:
            fn.restype = ctypes.c_int32
            fn.errcheck = check
        else:
            fn.restype = proto.restype


def check_abi(dll, where):
    """Raise LibraryLoadError unless dll.sf_abi_version() == ABI_VERSION."""
    found = int(dll.sf_abi_version())
    if found != ABI_VERSION:
        raise LibraryLoadError("%s has ABI version %d, but this binding was written for ABI "
                               "version %d: use the sfsync package that comes with that library"
                               % (where, found, ABI_VERSION))


def load(path=None):
    """Load (once) and return the library; later calls return the same one.

    ``path``: a full path, else ``SFSYNC_LIBRARY``, else the search described
    in the module docstring.  Raises LibraryLoadError if nothing loads or if
    ``sf_abi_version()`` differs from ABI_VERSION.
    """
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            if path is not None and os.path.realpath(path) != os.path.realpath(_lib_path):
                raise LibraryLoadError("libsfsync is already loaded from %s, not %s"
                                       % (_lib_path, path))
            return _lib
        explicit = path or os.environ.get("SFSYNC_LIBRARY") or None
        tried = []
        dll = None
        for candidate in ([explicit] if explicit else candidates()):
            try:
                dll = ctypes.CDLL(candidate)
                break
            except OSError as e:
                tried.append("%s (%s)" % (candidate, e))
        if dll is None:
            how = "SFSYNC_LIBRARY / path" if explicit else "search"
            raise LibraryLoadError("cannot load libsfsync (%s); tried: %s. Install it (pip install "
                                   "., or cmake --install build) or set SFSYNC_LIBRARY to its "
                                   "full path"
                                   % (how, "; ".join(tried)))
        try:
            dll.sf_abi_version.restype = ctypes.c_int32
            dll.sf_abi_version.argtypes = []
        except AttributeError:
            raise LibraryLoadError("%s is not libsfsync (no sf_abi_version)" % candidate) from None
        check_abi(dll, candidate)  # before binding: another ABI may lack functions
        _bind(dll)
        _lib, _lib_path = dll, candidate
        return _lib


def loaded():
    """The library if it is loaded, else None (never loads it)."""
    return _lib


def lib():
    """The loaded library (loading it on first use), every sf_* function typed."""
    return _lib if _lib is not None else load()


def library_path():
    """The path (or soname) the library was loaded from."""
    lib()
    return _lib_path


def abi_version():
    return int(lib().sf_abi_version())


def version_number():
    return int(lib().sf_version_number())


def version():
    """The loaded library's "MAJOR.MINOR.PATCH"."""
    return lib().sf_version_string().decode()


def status_string(status):
    return lib().sf_status_string(status).decode()


def last_error():
    """sf_last_error(): the message of this thread's last failed sfsync call
    ("" if none failed yet)."""
    return lib().sf_last_error().decode("utf-8", "replace")


def backend_available(backend):
    """sf_backend_available: True if ``backend`` (BACKEND_* or "auto", "gloo",
    "nccl") can be used in this process. False for SF_ERR_UNSUPPORTED, with
    the reason in ``backend_unavailable_reason(backend)``; other errors raise."""
    return backend_unavailable_reason(backend) is None


def backend_unavailable_reason(backend):
    """None if ``backend`` is available, else sf_last_error()'s reason."""
    if isinstance(backend, str):
        backend = BACKEND_NAMES[backend]
    if backend == BACKEND_NCCL:  # (it loads the CUDA runtime and NCCL)
        prefer_torch_cuda_libraries()
    try:
        lib().sf_backend_available(backend)
    except UnsupportedError as e:
        return e.message
    return None


_preferred = None  # what prefer_torch_cuda_libraries loaded (once per process)


def prefer_torch_cuda_libraries():
    """Before the first call that loads the CUDA runtime and NCCL (probing
    NCCL, a CUDA gradient, an adopted communicator): where torch is not
    imported yet but an installed pip torch brings its own copies
    (site-packages/nvidia/cu13/lib/libcudart.so.13,
    nvidia/nccl/lib/libnccl.so.2: the RPATH of its libtorch_cuda.so), load
    those first (RTLD_GLOBAL), so that the plugin's NCCL module uses them
    ("the copies already loaded in the process") and a later ``import
    torch`` finds the same ones. Otherwise the module would load the
    system's libnccl.so.2 first and ``import torch`` would then fail
    (libtorch_cuda.so: undefined symbol ncclCommResume, an NCCL newer than
    the system's). Nothing when torch is imported already (its copies are
    loaded), when SF_CUDART_LIBRARY / SF_NCCL_LIBRARY name the files (the
    caller chose), or when no such torch is installed. Returns the paths
    loaded (a tuple, possibly empty)."""
    global _preferred
    import sys
    with _lock:
        if _preferred is not None:
            return _preferred
        found = ()
        if "torch" not in sys.modules:
            found = tuple(p for p in _torch_cuda_libraries() if p)
            for path in found:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _preferred = found
        return found


def _torch_cuda_libraries():
    """(cudart, nccl): the files an installed pip torch's libtorch_cuda.so
    loads (None for one not set by SF_CUDART_LIBRARY / SF_NCCL_LIBRARY and
    present), found without importing torch."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None, None
    if spec is None or not spec.submodule_search_locations:
        return None, None
    site = os.path.dirname(list(spec.submodule_search_locations)[0])
    out = []
    for env, rel in (("SF_CUDART_LIBRARY", ("nvidia", "cu13", "lib", "libcudart.so.13")),
                     ("SF_NCCL_LIBRARY", ("nvidia", "nccl", "lib", "libnccl.so.2"))):
        path = os.path.join(site, *rel)
        out.append(path if not os.environ.get(env) and os.path.isfile(path) else None)
    return tuple(out)


def log_level():
    """sf_log_level(): LOG_NONE..LOG_TRACE, the level SF_DEBUG set (LOG_WARN
    with a 0.1 library)."""
    try:
        return int(lib().sf_log_level())
    except UnsupportedError:
        return LOG_WARN


def log(level, message, subsystem="python"):
    """One line through sfsync's logger (sf_log) if ``level`` (LOG_WARN,
    LOG_INFO, LOG_TRACE) is enabled: ``sfsync <host>:<pid>:<rank> <LEVEL>
    <subsystem> message``, to stderr or SF_DEBUG_FILE. Never raises."""
    try:
        lib().sf_log(int(level), str(subsystem).encode(), str(message).encode("utf-8", "replace"))
    except (UnsupportedError, LibraryLoadError):
        if level <= LOG_WARN:
            import sys
            sys.stderr.write("sfsync WARN %s %s\n" % (subsystem, message))
