"""The default context's explicit windows, as a host marks them with two
ctypes lines (``sf_begin_accumulation`` / ``sf_end_accumulation`` on
``sf_default_context``, docs/shim.md): a backward inside one stays local for
every DDP that follows the host, as inside ``no_sync()``.

Responsible for: reading the default context's window state through the
library's private ``sf_internal_window_state_v1@SFSYNC_PRIVATE_0.2`` (what the
shim reads: a few atomic loads, and never makes the context), looked up once
with ``dlvsym``. Not responsible for: what a window means to a pass
(host_window.py), the hook (ddp.py).
"""

import ctypes

import sfsync

__all__ = ["explicit_window_open"]

_NODE = b"SFSYNC_PRIVATE_0.2"


class _WindowState(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint64), ("context_made", ctypes.c_int32),
                ("in_window", ctypes.c_int32), ("windows_begun", ctypes.c_int64),
                ("windows_ended", ctypes.c_int64), ("refused_begins", ctypes.c_int64),
                ("refused_begin_window", ctypes.c_int64), ("gradients", ctypes.c_int64),
                ("strict", ctypes.c_int32), ("reserved", ctypes.c_int32)]


_reader = []  # [the function, or None where the library has none]


def _lookup():
    try:
        lib = sfsync.loader.lib()
        handle = lib._handle  # ctypes.CDLL's dlopen handle
        libc = ctypes.CDLL(None)  # (not ctypes.util.find_library: it runs ldconfig)
        libc.dlvsym.restype = ctypes.c_void_p
        libc.dlvsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
        address = libc.dlvsym(handle, b"sf_internal_window_state_v1", _NODE)
    except (OSError, AttributeError, sfsync.LibraryLoadError):
        address = None
    if not address:
        return None
    proto = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32,
                             ctypes.POINTER(_WindowState))
    return proto(address)


def explicit_window_open():
    """True inside a window the host opened on the default context."""
    if not _reader:
        _reader.append(_lookup())
    read = _reader[0]
    if read is None:
        return False
    state = _WindowState(struct_size=ctypes.sizeof(_WindowState))
    return read(None, 0, ctypes.byref(state)) == 0 and bool(state.context_made and state.in_window)
