"""What a buffer argument of sfsync may be, as the ABI takes it (an address
and a byte count): ``address_and_size`` and ``digest`` (sf_digest of any
buffer), and a numpy array's sf_dtype and one over plugin memory
(``dtype_of_array``, ``array_at``). Used by context.py; ``digest`` is importable from sfsync and
sfsync.context as in 0.3.

Not responsible for: the context (context.py), loading (loader.py).
"""

import ctypes

from sfsync._abi import (DTYPE_BFLOAT16, DTYPE_FLOAT16, DTYPE_FLOAT32, DTYPE_FLOAT64,
                         ERR_INVALID_ARGUMENT)
from sfsync.loader import error, lib

__all__ = ["address_and_size", "digest", "dtype_of_array", "array_at"]

# numpy has no bfloat16: its gradients are exposed as uint16 bit patterns.
_NUMPY_DTYPES = {DTYPE_FLOAT32: "float32", DTYPE_FLOAT64: "float64", DTYPE_FLOAT16: "float16",
                 DTYPE_BFLOAT16: "uint16"}
_CTYPES_ELEMENTS = {DTYPE_FLOAT32: ctypes.c_float, DTYPE_FLOAT64: ctypes.c_double,
                    DTYPE_FLOAT16: ctypes.c_uint16, DTYPE_BFLOAT16: ctypes.c_uint16}


def address_and_size(data, nbytes=None):
    """(address, bytes) of a buffer: an int address with ``nbytes``, an object
    with ``data_ptr()`` (a contiguous CPU torch tensor), a numpy array, or a
    bytes-like object."""
    if isinstance(data, int):
        if nbytes is None:
            raise TypeError("a raw address needs nbytes")
        return data, int(nbytes)
    if hasattr(data, "data_ptr") and hasattr(data, "element_size"):
        if getattr(data, "is_cuda", False) or not data.is_contiguous():
            raise error(ERR_INVALID_ARGUMENT, "the tensor must be a contiguous CPU tensor")
        size = data.numel() * data.element_size()
        return data.data_ptr(), size if nbytes is None else int(nbytes)
    if hasattr(data, "ctypes") and hasattr(data, "nbytes"):  # numpy
        if not data.flags["C_CONTIGUOUS"]:
            raise error(ERR_INVALID_ARGUMENT, "the array must be C-contiguous")
        return data.ctypes.data, data.nbytes if nbytes is None else int(nbytes)
    view = memoryview(data)
    if not view.contiguous:
        raise error(ERR_INVALID_ARGUMENT, "the buffer must be contiguous")
    raw = view.cast("B")
    if raw.readonly:
        buf = (ctypes.c_char * len(raw)).from_buffer_copy(raw)
    else:
        buf = (ctypes.c_char * len(raw)).from_buffer(raw)
    return ctypes.addressof(buf), len(raw) if nbytes is None else int(nbytes)


def digest(data, seed=0, nbytes=None):
    """sf_digest: the 64-bit digest (an int) of a buffer's bytes (see
    address_and_size for what ``data`` may be), chained from ``seed``."""
    address, size = address_and_size(data, nbytes)
    out = ctypes.c_uint64()
    lib().sf_digest(address or None, size, seed, ctypes.byref(out))
    return out.value


def dtype_of_array(arr):
    """The sf_dtype of a numpy array (float32, float64, float16)."""
    by_name = {"float32": DTYPE_FLOAT32, "float64": DTYPE_FLOAT64, "float16": DTYPE_FLOAT16}
    try:
        return by_name[str(arr.dtype)]
    except KeyError:
        raise TypeError("sfsync has no dtype for numpy %s (float32, float64, float16; bfloat16 "
                        "through a raw address)" % arr.dtype) from None


def array_at(address, numel, dtype, keep):
    """A numpy array over ``numel`` elements of sf_dtype ``dtype`` at
    ``address`` (no copy; bfloat16 as uint16); the array keeps ``keep``
    (the owner of the memory) alive."""
    import numpy as np
    raw = (_CTYPES_ELEMENTS[dtype] * numel).from_address(address)
    raw.sf_context = keep
    return np.frombuffer(raw, dtype=_NUMPY_DTYPES[dtype])
