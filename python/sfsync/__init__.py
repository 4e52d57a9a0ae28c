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

The package's rooms: ``_abi`` (the one binding), ``errors``, ``loader``
(loading, module-level functions), ``context`` (Context, options, digest),
``shard`` (the 0.3 sharded calls), ``host_window`` (the window rule of every
host face), ``torch/`` (the PyTorch integration, one module per concern),
``integrations/`` (Accelerate, Lightning, transformers), ``launch``,
``doctor``. This module only re-exports their public names.
"""


__all__ = [
    "ABI_VERSION", "Options", "Stats", "Context", "SfError", "InvalidArgumentError",
    "InvalidStateError", "MismatchError", "BackendError", "SfTimeoutError", "UnsupportedError",
    "SfMemoryError", "InternalError", "LibraryLoadError", "lib", "load", "library_path",
    "options", "version", "version_number", "abi_version", "status_string", "last_error",
    "backend_available", "backend_unavailable_reason", "Store", "digest", "log", "log_level",
    "LOG_NONE", "LOG_WARN", "LOG_INFO", "LOG_TRACE",
]

# The one binding (constants, structs, prototypes with their Since): _abi.py.
from sfsync import _abi  # noqa: F401,E402
from sfsync._abi import *  # noqa: F401,F403,E402 - the header's names, re-exported
from sfsync.errors import (STATUS_NAMES, BackendError, InternalError,  # noqa: F401,E402
                           InvalidArgumentError, InvalidStateError, LibraryLoadError,
                           MismatchError, SfError, SfMemoryError, SfTimeoutError,
                           UnsupportedError)
from sfsync.loader import (SINCE_0_2, SINCE_0_3, SINCE_0_4, abi_version,  # noqa: F401,E402
                           backend_available, backend_unavailable_reason, check_abi,
                           last_error, lib, library_path, load, log, log_level,
                           prefer_torch_cuda_libraries,
                           status_string, version, version_number)
from sfsync.context import DTYPE_NAMES, DTYPE_SIZES, Context, digest, options  # noqa: F401,E402

# The 0.3 private names the package's tests still read here (test_binding.py).
from sfsync import errors as _errors, loader as _loader  # noqa: E402
from sfsync._abi import _ContextPtr, _ContextStruct, _STATUS  # noqa: F401,E402
_ERROR_CLASSES = _errors.ERROR_CLASSES
_candidates = _loader.candidates
_Missing = _loader.Missing
