"""sfsync: data-parallel gradient synchronization exactly once per
gradient-accumulation window. The ctypes binding of the whole C ABI
(include/sfsync.h: every function and struct declared once, with its Since
version, in ``sfsync._abi``); the PyTorch integration is ``sfsync.torch``.

Two layers:

* ``lib()`` returns the loaded library with every ``sf_*`` function typed
  (argtypes/restype).  Functions returning an ``sf_status`` raise an
  ``SfError`` subclass instead of returning a non-zero status, with
  ``sf_status_string`` and the thread's ``sf_last_error()`` in the message, so
  even the raw functions cannot fail silently.
* ``Context`` (and ``options()``, ``version()``, ``digest()``, ...) is the
  Pythonic layer: gradients as numpy views, the accumulation window as a
  context manager, stats as a dict, the host's key-value store as two Python
  callables.

Which library is loaded (``library_path()`` says), in this order:

1. ``SFSYNC_LIBRARY`` (a full path), if set: the development override, to
   run this package against a build tree's library (``PYTHONPATH=python
   SFSYNC_LIBRARY=build/plugin/libsfsync.so.1``); nothing else is tried then;
2. the package's own copy: a ``libsfsync.so.1`` inside this directory (``pip
   install .`` or a wheel puts it there, with the shim and the NCCL module);
3. the library installed with this package by ``cmake --install``, which
   writes ``_install.py`` here with the path of the installed
   ``libsfsync.so.1`` relative to this directory (``<prefix>/lib`` next to
   ``<prefix>/lib/python3.X/dist-packages/sfsync``);
4. the system loader (``libsfsync.so.1`` on ``LD_LIBRARY_PATH`` / ld.so.conf).

No build tree is ever searched. On load, ``sf_abi_version()`` must equal
``ABI_VERSION``, the version this module was written against.

Only the standard library is needed; numpy is imported by the functions that
return arrays.
"""

import contextlib
import ctypes
import os
import threading
import weakref

__all__ = [
    "ABI_VERSION", "Options", "Stats", "Context", "SfError", "InvalidArgumentError",
    "InvalidStateError", "MismatchError", "BackendError", "SfTimeoutError", "UnsupportedError",
    "SfMemoryError", "InternalError", "LibraryLoadError", "lib", "load", "library_path",
    "options", "version", "version_number", "abi_version", "status_string", "last_error",
    "backend_available", "backend_unavailable_reason", "Store", "digest", "log", "log_level",
    "LOG_NONE", "LOG_WARN", "LOG_INFO", "LOG_TRACE",
]

# The one binding (constants, structs, prototypes with their Since): _abi.py.
from sfsync import _abi
from sfsync._abi import *  # noqa: F401,F403 - the header's names, re-exported
from sfsync._abi import _ContextPtr, _ContextStruct, _STATUS  # noqa: F401

STATUS_NAMES = {
    OK: "SF_OK",
    ERR_INVALID_ARGUMENT: "SF_ERR_INVALID_ARGUMENT",
    ERR_INVALID_STATE: "SF_ERR_INVALID_STATE",
    ERR_MISMATCH: "SF_ERR_MISMATCH",
    ERR_BACKEND: "SF_ERR_BACKEND",
    ERR_TIMEOUT: "SF_ERR_TIMEOUT",
    ERR_UNSUPPORTED: "SF_ERR_UNSUPPORTED",
    ERR_OUT_OF_MEMORY: "SF_ERR_OUT_OF_MEMORY",
    ERR_INTERNAL: "SF_ERR_INTERNAL",
}

#: Bytes per element of each sf_dtype.
DTYPE_SIZES = {DTYPE_FLOAT32: 4, DTYPE_FLOAT64: 8, DTYPE_FLOAT16: 2, DTYPE_BFLOAT16: 2}
DTYPE_NAMES = {DTYPE_FLOAT32: "float32", DTYPE_FLOAT64: "float64", DTYPE_FLOAT16: "float16",
               DTYPE_BFLOAT16: "bfloat16"}
# numpy has no bfloat16: its gradients are exposed as uint16 bit patterns.
_NUMPY_DTYPES = {DTYPE_FLOAT32: "float32", DTYPE_FLOAT64: "float64", DTYPE_FLOAT16: "float16",
                 DTYPE_BFLOAT16: "uint16"}
_CTYPES_ELEMENTS = {DTYPE_FLOAT32: ctypes.c_float, DTYPE_FLOAT64: ctypes.c_double,
                    DTYPE_FLOAT16: ctypes.c_uint16, DTYPE_BFLOAT16: ctypes.c_uint16}

_BACKEND_NAMES = {"auto": BACKEND_AUTO, "gloo": BACKEND_GLOO, "nccl": BACKEND_NCCL}
_REDUCE_NAMES = {"average": REDUCE_AVERAGE, "sum": REDUCE_SUM,
                 "prescaled_sum": REDUCE_PRESCALED_SUM}

# ---- Errors ----------------------------------------------------------------


class SfError(Exception):
    """A non-zero sf_status.

    Attributes: ``status`` (the int), ``status_name`` ("SF_ERR_..."),
    ``status_string`` (sf_status_string: what to do next), ``message``
    (sf_last_error(): "function: the argument and value at fault") and
    ``function`` (the sf_* function that failed, when known).
    """

    status = None  # set by the subclasses; an instance always has its own

    def __init__(self, status, message, status_string=None, function=None):
        self.status = int(status)
        self.status_name = STATUS_NAMES.get(self.status, "status %d" % self.status)
        self.message = message
        self.status_string = status_string if status_string is not None else "unknown status"
        self.function = function
        super().__init__(str(self))

    def __str__(self):
        return "%s [%s: %s]" % (self.message, self.status_name, self.status_string)


class InvalidArgumentError(SfError, ValueError):
    """SF_ERR_INVALID_ARGUMENT: a NULL, out-of-range or malformed argument."""


class InvalidStateError(SfError):
    """SF_ERR_INVALID_STATE: a call at the wrong time (window misuse, late registration)."""


class MismatchError(SfError):
    """SF_ERR_MISMATCH: ranks disagree (gradient layout, replica digests)."""


class BackendError(SfError, ConnectionError):
    """SF_ERR_BACKEND: the transport failed (peer lost, connection refused)."""


class SfTimeoutError(SfError, TimeoutError):
    """SF_ERR_TIMEOUT: a collective or the rendezvous outlived timeout_ms."""


class UnsupportedError(SfError, NotImplementedError):
    """SF_ERR_UNSUPPORTED: not available in this build or on this machine."""


class SfMemoryError(SfError, MemoryError):
    """SF_ERR_OUT_OF_MEMORY: an allocation failed."""


class InternalError(SfError):
    """SF_ERR_INTERNAL: a bug in sfsync."""


_ERROR_CLASSES = {
    ERR_INVALID_ARGUMENT: InvalidArgumentError,
    ERR_INVALID_STATE: InvalidStateError,
    ERR_MISMATCH: MismatchError,
    ERR_BACKEND: BackendError,
    ERR_TIMEOUT: SfTimeoutError,
    ERR_UNSUPPORTED: UnsupportedError,
    ERR_OUT_OF_MEMORY: SfMemoryError,
    ERR_INTERNAL: InternalError,
}


class LibraryLoadError(ImportError):
    """libsfsync could not be found or loaded, or its ABI version differs."""


# ---- Loading ---------------------------------------------------------------

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


def _error_for(dll, status, function=None):
    """The exception for a failed call, built from the thread's last error
    (read at once: it is only valid until the next sfsync call)."""
    message = dll.sf_last_error().decode("utf-8", "replace")
    if not message:
        message = "%s failed" % (function or "sfsync")
    text = dll.sf_status_string(status).decode("utf-8", "replace")
    cls = _ERROR_CLASSES.get(int(status), SfError)
    return cls(status, message, text, function)


def _error(status, message):
    """An exception raised by this module itself, in the library's terms."""
    text = _lib.sf_status_string(status).decode() if _lib is not None else None
    return _ERROR_CLASSES.get(status, SfError)(status, message, text)


def _make_check(dll):
    def check(result, func, args):
        """ctypes errcheck for sf_status functions: raise instead of returning != 0."""
        if result != OK:
            raise _error_for(dll, result, func.__name__)
        return result
    return check


def _package_dir():
    return os.path.dirname(os.path.abspath(__file__))


def _candidates():
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


class _Missing:
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
                setattr(dll, name, _Missing(name, dll._name, proto.since))
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
        for candidate in ([explicit] if explicit else _candidates()):
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


def lib():
    """The loaded library (loading it on first use), every sf_* function typed."""
    return _lib if _lib is not None else load()


def library_path():
    """The path (or soname) the library was loaded from."""
    lib()
    return _lib_path


# ---- Module-level functions -------------------------------------------------


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
        backend = _BACKEND_NAMES[backend]
    try:
        lib().sf_backend_available(backend)
    except UnsupportedError as e:
        return e.message
    return None


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


def _address_and_size(data, nbytes=None):
    """(address, bytes) of a buffer: an int address with ``nbytes``, an object
    with ``data_ptr()`` (a contiguous CPU torch tensor), a numpy array, or a
    bytes-like object."""
    if isinstance(data, int):
        if nbytes is None:
            raise TypeError("a raw address needs nbytes")
        return data, int(nbytes)
    if hasattr(data, "data_ptr") and hasattr(data, "element_size"):
        if getattr(data, "is_cuda", False) or not data.is_contiguous():
            raise _error(ERR_INVALID_ARGUMENT, "the tensor must be a contiguous CPU tensor")
        size = data.numel() * data.element_size()
        return data.data_ptr(), size if nbytes is None else int(nbytes)
    if hasattr(data, "ctypes") and hasattr(data, "nbytes"):  # numpy
        if not data.flags["C_CONTIGUOUS"]:
            raise _error(ERR_INVALID_ARGUMENT, "the array must be C-contiguous")
        return data.ctypes.data, data.nbytes if nbytes is None else int(nbytes)
    view = memoryview(data)
    if not view.contiguous:
        raise _error(ERR_INVALID_ARGUMENT, "the buffer must be contiguous")
    raw = view.cast("B")
    if raw.readonly:
        buf = (ctypes.c_char * len(raw)).from_buffer_copy(raw)
    else:
        buf = (ctypes.c_char * len(raw)).from_buffer(raw)
    return ctypes.addressof(buf), len(raw) if nbytes is None else int(nbytes)


def digest(data, seed=0, nbytes=None):
    """sf_digest: the 64-bit digest (an int) of a buffer's bytes (see
    _address_and_size for what ``data`` may be), chained from ``seed``."""
    address, size = _address_and_size(data, nbytes)
    out = ctypes.c_uint64()
    lib().sf_digest(address or None, size, seed, ctypes.byref(out))
    return out.value


def _set_fields(opts, overrides):
    for key, value in overrides.items():
        if key in ("struct_size",) or key not in dict(Options._fields_):
            raise TypeError("options: unknown field %r (fields: %s)" % (
                key, ", ".join(n for n, _ in Options._fields_[1:])))
        if key == "rendezvous":
            raw = value.encode() if isinstance(value, str) else bytes(value)
            if len(raw) >= RENDEZVOUS_MAX:
                raise _error(ERR_INVALID_ARGUMENT, "options: rendezvous is %d bytes, at most %d "
                             "fit" % (len(raw), RENDEZVOUS_MAX - 1))
            value = raw
        elif key == "backend" and isinstance(value, str):
            value = _BACKEND_NAMES[value]
        elif key == "reduce_op" and isinstance(value, str):
            value = _REDUCE_NAMES[value]
        setattr(opts, key, value)
    return opts


def options(**overrides):
    """An Options filled by sf_options_init (defaults + SF_* / torchrun
    environment), then ``overrides`` (field=value; backend and reduce_op also
    take their names, e.g. backend="gloo", reduce_op="sum")."""
    opts = Options()
    lib().sf_options_init(ctypes.byref(opts), ctypes.sizeof(opts))
    return _set_fields(opts, overrides)


# ---- Context ----------------------------------------------------------------


class _Gradient:
    __slots__ = ("numel", "dtype", "device", "name", "owner")

    def __init__(self, numel, dtype, device, name, owner):
        self.numel, self.dtype, self.device, self.name, self.owner = (numel, dtype, device, name,
                                                                      owner)


def _destroy(handle, keep=None):
    """sf_destroy; ``keep`` (the store callbacks) is only released after it."""
    if _lib is not None and handle:
        _lib.sf_destroy(handle)
    if keep:
        del keep[:]


class Context:
    """An sf_context: one data-parallel group with its gradients and window.

    ``Context(opts=None, **overrides)`` creates one (sf_create) from ``opts``
    (an Options) or from ``options(**overrides)``.  ``Context.default()``
    wraps the process-wide default context (owned by the library: close()
    leaves it alone).

    A context created here is destroyed by close(), by ``with``, or when it is
    garbage collected.  Arrays from gradient_array() keep it alive; after an
    explicit close() they must not be used (their memory is freed).
    """

    def __init__(self, opts=None, **overrides):
        lib()
        if opts is None:
            opts = options(**overrides)
        elif overrides:
            copy = Options()
            ctypes.memmove(ctypes.byref(copy), ctypes.byref(opts), ctypes.sizeof(Options))
            opts = _set_fields(copy, overrides)
        handle = _ContextPtr()
        _lib.sf_create(ctypes.byref(opts), ctypes.byref(handle))
        self._init(handle, owned=True)

    def _init(self, handle, owned):
        self._handle = handle
        self._owned = owned
        self._grads = []
        self._keep = []  # store callbacks: alive as long as the context
        self._finalizer = (weakref.finalize(self, _destroy, handle, self._keep) if owned
                           else None)

    @classmethod
    def default(cls):
        """The process-wide default context (sf_default_context)."""
        lib()
        handle = _ContextPtr()
        _lib.sf_default_context(ctypes.byref(handle))
        self = cls.__new__(cls)
        self._init(handle, owned=False)
        return self

    # -- lifetime

    @property
    def handle(self):
        """The raw sf_context* (for calling lib() functions directly)."""
        if self._handle is None:
            raise _error(ERR_INVALID_STATE, "sfsync.Context: the context is closed")
        return self._handle

    @property
    def closed(self):
        return self._handle is None

    def close(self):
        """sf_destroy (waits for collectives in flight). Idempotent."""
        if self._handle is None:
            return
        if self._finalizer is not None:
            self._finalizer()  # calls sf_destroy once
        self._handle = None
        self._grads = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        if self._handle is None:
            return "<sfsync.Context closed>"
        o = self.options()
        return "<sfsync.Context rank %d/%d, %d gradients%s>" % (
            o["rank"], o["world_size"], len(self._grads), "" if self._owned else ", default")

    # -- options and buckets

    def options(self):
        """The effective options (sf_get_options) as a dict."""
        out = Options()
        out.struct_size = ctypes.sizeof(out)
        _lib.sf_get_options(self.handle, ctypes.byref(out))
        return out.to_dict()

    def set_bucket_cap_mb(self, mb):
        _lib.sf_set_bucket_cap_mb(self.handle, mb)

    def set_first_bucket_cap_mb(self, mb):
        _lib.sf_set_first_bucket_cap_mb(self.handle, mb)

    # -- gradients

    def register_gradient(self, buffer, numel=None, dtype=None, device=DEVICE_HOST, name=None):
        """sf_register_gradient: a buffer the host owns. ``buffer`` is a
        C-contiguous, writable numpy array (numel and dtype from it; the
        context keeps a reference) or a raw address (int) with ``numel`` and
        ``dtype`` given. Returns the gradient id."""
        owner = None
        if isinstance(buffer, int) or buffer is None:
            address = buffer
            if numel is None or dtype is None:
                raise TypeError("register_gradient: a raw address needs numel and dtype")
        else:
            arr = buffer
            if not (arr.flags["C_CONTIGUOUS"] and arr.flags["WRITEABLE"]):
                raise _error(ERR_INVALID_ARGUMENT, "register_gradient: the array must be "
                             "C-contiguous and writable")
            found = _dtype_from_numpy(arr.dtype)
            if dtype is not None and dtype != found:
                raise TypeError("register_gradient: dtype %r does not match the array's %s"
                                % (dtype, arr.dtype))
            dtype = found
            if numel is not None and numel != arr.size:
                raise TypeError("register_gradient: numel %d does not match the array's size %d"
                                % (numel, arr.size))
            numel = arr.size
            address = arr.ctypes.data
            owner = arr
        out = ctypes.c_int64(-1)
        _lib.sf_register_gradient(self.handle, address, numel, dtype, device,
                                  _name_bytes(name), ctypes.byref(out))
        self._remember(out.value, _Gradient(numel, dtype, device, name, owner))
        return out.value

    def add_gradient(self, numel, dtype=DTYPE_FLOAT32, device=DEVICE_HOST, name=None):
        """sf_add_gradient: a gradient stored in the plugin's flat buffer.
        Returns its id; get the memory with gradient_array() once all are added."""
        out = ctypes.c_int64(-1)
        _lib.sf_add_gradient(self.handle, numel, dtype, device, _name_bytes(name),
                             ctypes.byref(out))
        self._remember(out.value, _Gradient(numel, dtype, device, name, None))
        return out.value

    def _remember(self, gid, grad):
        if gid != len(self._grads):  # the ABI promises ids 0, 1, ... in order
            raise _error(ERR_INTERNAL, "sfsync returned gradient id %d, expected %d"
                         % (gid, len(self._grads)))
        self._grads.append(grad)

    @property
    def gradient_count(self):
        return len(self._grads)

    def build_buckets(self):
        _lib.sf_build_buckets(self.handle)

    def gradient_data(self, gid):
        """sf_gradient_data: the address (int) of gradient ``gid``."""
        out = ctypes.c_void_p()
        _lib.sf_gradient_data(self.handle, gid, ctypes.byref(out))
        return out.value

    def gradient_array(self, gid):
        """A numpy array over gradient ``gid``'s memory: no copy. For
        plugin-owned gradients that is the flat buffer itself. bfloat16 is
        returned as uint16 (numpy has no bfloat16). The array keeps this
        Context alive."""
        import numpy as np
        address = self.gradient_data(gid)  # validates gid, builds buckets
        g = self._grads[gid]
        if g.device != DEVICE_HOST:
            raise _error(ERR_UNSUPPORTED, "gradient_array: gradient %d is not in host memory"
                         % gid)
        raw = (_CTYPES_ELEMENTS[g.dtype] * g.numel).from_address(address)
        raw._sf_context = self  # the memory lives as long as the context
        return np.frombuffer(raw, dtype=_NUMPY_DTYPES[g.dtype])

    def zero_gradients(self):
        _lib.sf_zero_gradients(self.handle)

    # -- the window

    def begin_accumulation(self):
        _lib.sf_begin_accumulation(self.handle)

    def end_accumulation(self):
        _lib.sf_end_accumulation(self.handle)

    def in_accumulation(self):
        """True inside a window (sf_in_accumulation)."""
        return _lib.sf_in_accumulation(self.handle) == 1

    @contextlib.contextmanager
    def accumulate(self):
        """``with ctx.accumulate():`` brackets the micro-batches whose
        gradients are only summed locally (begin/end accumulation). The window
        is left even if the body raises, so the context stays usable."""
        self.begin_accumulation()
        try:
            yield self
        finally:
            self.end_accumulation()

    def grad_ready(self, gid):
        _lib.sf_grad_ready(self.handle, gid)

    def synchronize(self):
        _lib.sf_synchronize(self.handle)

    # -- set-up, broadcast and replica checks (Since 0.2)

    def set_store(self, set_fn, get_fn, prefix=None):
        """sf_set_store: rendezvous through the host's key-value store.

        ``set_fn(key: str, value: bytes)`` stores a value; ``get_fn(key: str,
        timeout_ms: int) -> bytes`` returns it once present, and raises
        TimeoutError (or returns None) if it did not appear in time. Any other
        exception is a store error (logged at WARN with the key). The
        callbacks are called from sfsync's threads (ctypes takes the GIL for
        them) and are kept alive by this Context until it is closed.
        ``prefix`` goes before every key (the same on every rank)."""
        cache = {}  # key -> value, for a second call with a larger buffer

        def c_set(user, key, value, nbytes):
            try:
                set_fn(key.decode(), ctypes.string_at(value, nbytes) if nbytes else b"")
                return STORE_OK
            except Exception as e:  # noqa: BLE001 - no exception may cross into C
                log(LOG_WARN, "the host store's set(%r) failed: %s" % (key, e), "python")
                return STORE_ERROR

        def c_get(user, key, timeout_ms, buffer, capacity, out_bytes):
            name = key.decode()
            try:
                value = cache.pop(name, None)
                if value is None:
                    value = get_fn(name, int(timeout_ms))
                if value is None:
                    return STORE_TIMEOUT
                value = bytes(value)
                out_bytes[0] = len(value)
                if len(value) <= capacity:
                    if value:
                        ctypes.memmove(buffer, value, len(value))
                else:
                    cache[name] = value
                return STORE_OK
            except TimeoutError:
                return STORE_TIMEOUT
            except Exception as e:  # noqa: BLE001
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    return STORE_TIMEOUT
                log(LOG_WARN, "the host store's get(%r) failed: %s" % (name, e), "python")
                return STORE_ERROR

        store = Store()
        _lib.sf_store_init(ctypes.byref(store), ctypes.sizeof(store))
        store.set = STORE_SET_FN(c_set)
        store.get = STORE_GET_FN(c_get)
        _lib.sf_set_store(self.handle, ctypes.byref(store), _name_bytes(prefix))
        self._keep.append((store, c_set, c_get))  # alive until sf_destroy

    def connect(self):
        """sf_connect: join the peers now (collective), so that rendezvous
        errors surface here rather than inside a backward pass."""
        _lib.sf_connect(self.handle)

    def broadcast(self, data, root=0, nbytes=None):
        """sf_broadcast: copy a writable buffer (contiguous CPU tensor, numpy
        array, writable bytes-like, or int address with ``nbytes``) from rank
        ``root`` to every rank, in place (collective)."""
        address, size = _address_and_size(data, nbytes)
        _lib.sf_broadcast(self.handle, address or None, size, root)

    def digest_gradients(self):
        """sf_digest_gradients: the digest (int) of every registered host gradient."""
        out = ctypes.c_uint64()
        _lib.sf_digest_gradients(self.handle, ctypes.byref(out))
        return out.value

    def check_replicas(self, value):
        """sf_check_replicas: compare a 64-bit digest across ranks (collective).
        Returns None when all agree; raises MismatchError on every rank
        otherwise, naming the ranks that differ from rank 0."""
        _lib.sf_check_replicas(self.handle, int(value) & 0xFFFFFFFFFFFFFFFF)

    # -- CUDA / NCCL

    def set_cuda_stream(self, stream):
        """sf_set_cuda_stream: the host's cudaStream_t (an int address, or an
        object with ``.cuda_stream`` such as torch.cuda.Stream; None or 0 is
        the legacy default stream) on which it produces and reads this
        context's CUDA gradients."""
        address = getattr(stream, "cuda_stream", stream)
        _lib.sf_set_cuda_stream(self.handle, address or None)

    def adopt_nccl_comm(self, comm):
        """sf_adopt_nccl_comm: use the host's ncclComm_t (an int address) for
        this context's CUDA gradients; the host keeps ownership and must keep
        it alive until this context is closed."""
        _lib.sf_adopt_nccl_comm(self.handle, comm)

    # -- stats

    def stats(self):
        """sf_get_stats as a dict (keys: STATS_KEYS)."""
        out = Stats()
        out.struct_size = ctypes.sizeof(out)
        _lib.sf_get_stats(self.handle, ctypes.byref(out))
        return out.to_dict()

    def bucket_info(self, index):
        """sf_bucket_info: {"bytes", "gradient_count", "dtype"} of bucket ``index``."""
        nbytes, count, dtype = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int32()
        _lib.sf_bucket_info(self.handle, index, ctypes.byref(nbytes), ctypes.byref(count),
                            ctypes.byref(dtype))
        return {"bytes": nbytes.value, "gradient_count": count.value, "dtype": dtype.value}

    def buckets(self):
        """bucket_info of every bucket, in synchronization order (builds the
        buckets if needed: no gradient can be added afterwards)."""
        self.build_buckets()
        return [self.bucket_info(i) for i in range(self.stats()["bucket_count"])]


def _name_bytes(name):
    return None if name is None else str(name).encode()


def _dtype_from_numpy(dt):
    by_name = {"float32": DTYPE_FLOAT32, "float64": DTYPE_FLOAT64, "float16": DTYPE_FLOAT16}
    try:
        return by_name[str(dt)]
    except KeyError:
        raise TypeError("sfsync has no dtype for numpy %s (float32, float64, float16; bfloat16 "
                        "through a raw address)" % dt) from None
