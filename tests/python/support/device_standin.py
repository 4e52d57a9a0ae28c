"""STAND-IN, for tests: CUDA's device operations (sfsync/torch/device.py's
DeviceOps) on the CUDA runtime stand-in of tests/standin, driven through
ctypes. Not CUDA: its "device" memory is host memory the stand-in's
cudaMalloc gave, its streams are host threads, and its tensors are CPU
tensors over that memory. Strict where CUDA is undefined (a wait on an event
never recorded, a destroyed event or stream used again: RuntimeError here, a
counted misuse there). With the plugin's NCCL backend loading the same
stand-ins (SF_CUDART_LIBRARY / SF_NCCL_LIBRARY), a CPU test runs the whole
device path of sfsync.torch: SF_DEVICE_CUDA registrations, the plugin's
stream and events, the stand-in NCCL's collectives
(tests/python/sfsync/torch/test_device_path.py, test_device_ops.py).
"""

import contextlib
import ctypes
import os
import threading

import torch

import sfsync
from sfsync.torch.device import SIZES, DeviceOps, dtype_check, host_tensor, shape_of

__all__ = ["StandinCudaOps", "StandinStream", "StandinEvent"]


class StandinStream:
    """A stream of the CUDA stand-in (its cudaStream_t as ``handle``)."""

    def __init__(self, ops, handle, owned):
        self.ops, self.handle, self.owned = ops, handle, owned

    @property
    def cuda_stream(self):  # the attribute sfsync.Context.set_cuda_stream reads
        return self.handle

    def __repr__(self):
        return "StandinStream(0x%x)" % (self.handle or 0)


class StandinEvent:
    """An event of the CUDA stand-in (its cudaEvent_t as ``handle``)."""

    def __init__(self, handle):
        self.handle = handle

    def __repr__(self):
        return "StandinEvent(0x%x)" % self.handle


class StandinCudaOps(DeviceOps):
    """STAND-IN, for tests: CUDA's device operations on the CUDA runtime
    stand-in (tests/standin), loaded through ctypes by path:
    ``StandinCudaOps(library=None)`` takes ``library``, else
    ``SF_CUDART_LIBRARY``, else ``libcudart.so.13`` from the directories of
    ``LD_LIBRARY_PATH``; it must be the stand-in (it exports
    ``sfStandinCudaCounter``), else RuntimeError. Tensors are CPU tensors
    over the stand-in's "device" memory (``empty`` allocates some; the
    plugin's NCCL backend allocates its flat buffers with the same
    cudaMalloc, and ``pointer`` refuses memory the stand-in did not give).
    Every call's status is checked: a misuse the stand-in catches (a wait on
    an event never recorded, a destroyed stream or event used) raises
    RuntimeError with the stand-in's message, and is taken
    (sfStandinCudaTakeMisuse), so it does not also fail the process at exit.
    ``current_stream()`` is this object's, like torch's: a stream it made at
    construction, changed inside ``with ops.stream(s):`` for the calling
    thread (per thread, as torch's current stream)."""

    name = "cuda-standin"
    sf_device = sfsync.DEVICE_CUDA
    _MEMORY_DEVICE = 2  # cudaMemoryTypeDevice

    def __init__(self, library=None):
        path = library or os.environ.get("SF_CUDART_LIBRARY") or self._search()
        if not path:
            raise RuntimeError("StandinCudaOps: no CUDA stand-in: pass library=, set "
                               "SF_CUDART_LIBRARY, or put the stand-in directory "
                               "(build/standin/lib) on LD_LIBRARY_PATH")
        lib = ctypes.CDLL(path)
        if not hasattr(lib, "sfStandinCudaCounter"):
            raise RuntimeError("StandinCudaOps: %s is not the CUDA stand-in (it has no "
                               "sfStandinCudaCounter): refusing to pose as it" % path)
        self.path = path
        self._lib = lib
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, args in [("cudaStreamCreate", [ctypes.POINTER(vp)]),
                           ("cudaStreamDestroy", [vp]), ("cudaStreamSynchronize", [vp]),
                           ("cudaStreamQuery", [vp]),
                           ("cudaEventCreateWithFlags", [ctypes.POINTER(vp), ctypes.c_uint]),
                           ("cudaEventRecord", [vp, vp]), ("cudaEventDestroy", [vp]),
                           ("cudaEventQuery", [vp]),
                           ("cudaStreamWaitEvent", [vp, vp, ctypes.c_uint]),
                           ("cudaMalloc", [ctypes.POINTER(vp), sz]), ("cudaFree", [vp]),
                           ("cudaMemcpyAsync", [vp, vp, sz, ctypes.c_int, vp]),
                           ("cudaLaunchHostFunc", [vp, vp, vp]),
                           ("cudaPointerGetAttributes", [vp, vp]),
                           ("cudaGetErrorName", [ctypes.c_int])]:
            f = getattr(lib, name)
            f.argtypes = args
            f.restype = ctypes.c_char_p if name == "cudaGetErrorName" else ctypes.c_int
        lib.sfStandinCudaCounter.argtypes = [ctypes.c_char_p]
        lib.sfStandinCudaCounter.restype = ctypes.c_int64
        lib.sfStandinCudaTakeMisuse.argtypes = [ctypes.c_char_p, sz]
        lib.sfStandinCudaTakeMisuse.restype = ctypes.c_int64
        self._callbacks = []  # host functions queued: alive until their stream ran them
        self._default = self.new_stream()  # every thread's current stream, as torch's default
        self._local = threading.local()  # per thread, as torch's: the ``stream()`` stack

    @staticmethod
    def _search():
        for d in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
            p = os.path.join(d, "libcudart.so.13") if d else ""
            if p and os.path.exists(p):
                return p
        return None

    # -- status checks

    def _call(self, name, *args):
        status = getattr(self._lib, name)(*args)
        if status != 0:
            buf = ctypes.create_string_buffer(512)
            n = self._lib.sfStandinCudaTakeMisuse(buf, len(buf))
            why = ("the stand-in's misuse: %s" % buf.value.decode()) if n else "no misuse recorded"
            raise RuntimeError("%s failed: %s (%d); %s" % (
                name, self._lib.cudaGetErrorName(status).decode(), status, why))

    def counter(self, name):
        """sfStandinCudaCounter(name) (e.g. "cudaStreamWaitEvent", "misuse")."""
        return self._lib.sfStandinCudaCounter(name.encode())

    def take_misuse(self):
        """(count, last message) of the misuses not taken yet (sfStandinCudaTakeMisuse)."""
        buf = ctypes.create_string_buffer(512)
        n = self._lib.sfStandinCudaTakeMisuse(buf, len(buf))
        return n, buf.value.decode()

    # -- streams

    def new_stream(self):
        h = ctypes.c_void_p()
        self._call("cudaStreamCreate", ctypes.byref(h))
        return StandinStream(self, h.value, True)

    def destroy_stream(self, stream):
        self._call("cudaStreamDestroy", stream.handle)

    @contextlib.contextmanager
    def stream(self, stream):
        """Like torch.cuda.stream(s): ``current_stream()`` is ``stream`` inside."""
        stack = self._stack()
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    def _stack(self):
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def current_stream(self):
        stack = self._stack()
        return stack[-1] if stack else self._default

    def stream_handle(self, stream):
        return stream.handle if stream is not None else None

    def compute_point(self):
        """STAND-IN ONLY: torch computes on the host at once what a GPU
        would queue on the current stream, so the host waits here for that
        stream (cudaStreamSynchronize, counted as "compute_point" here and by
        the stand-in): work the current stream was ordered after (by the
        waits of grad_ready / after_reduction / before_forward) has run, and
        work it was not ordered after may not have. On a GPU this is
        nothing: sfsync.torch itself never synchronizes a stream."""
        self.compute_points += 1
        self.synchronize(self.current_stream())

    compute_points = 0

    def synchronize(self, stream=None):
        """Host waits for ``stream`` (tests only: sfsync.torch never does this)."""
        self._call("cudaStreamSynchronize", (stream or self.current_stream()).handle)

    def query(self, stream=None):
        """True if ``stream`` has run everything queued on it (cudaStreamQuery)."""
        status = self._lib.cudaStreamQuery((stream or self.current_stream()).handle)
        if status == 600:  # cudaErrorNotReady
            return False
        if status != 0:
            self._call("cudaStreamQuery", (stream or self.current_stream()).handle)
        return True

    # -- events

    def new_event(self):
        """An event not recorded yet (waiting on it is a misuse)."""
        h = ctypes.c_void_p()
        self._call("cudaEventCreateWithFlags", ctypes.byref(h), 2)  # cudaEventDisableTiming
        return StandinEvent(h.value)

    def record_event(self, stream=None, event=None):
        event = event or self.new_event()
        self._call("cudaEventRecord", event.handle, (stream or self.current_stream()).handle)
        return event

    def wait_event(self, event, stream=None):
        self._call("cudaStreamWaitEvent", (stream or self.current_stream()).handle,
                   event.handle, 0)

    def release(self, event):
        if event is not None:
            self._call("cudaEventDestroy", event.handle)

    # -- memory and "kernels"

    def empty(self, numel, dtype, shape=None):
        """A tensor over fresh stand-in "device" memory (not zeroed, as cudaMalloc)."""
        dtype_check(dtype, "empty")
        p = ctypes.c_void_p()
        self._call("cudaMalloc", ctypes.byref(p), numel * SIZES[dtype])
        owner = _StandinAllocation(self, p.value)
        return host_tensor(p.value, numel, dtype, shape_of(numel, shape, "empty"), owner)

    def copy_async(self, dst, src, stream=None):
        """dst <- src in ``stream``'s order (cudaMemcpyAsync): a "kernel"."""
        if dst.numel() != src.numel() or dst.dtype != src.dtype:
            raise ValueError("copy_async: %s x %s into %s x %s" % (src.numel(), src.dtype,
                                                                   dst.numel(), dst.dtype))
        src = src.contiguous()
        self._callbacks.append(src)  # alive until the copy ran (freed with this object)
        self._call("cudaMemcpyAsync", dst.data_ptr(), src.data_ptr(),
                   dst.numel() * dst.element_size(), 4, (stream or self.current_stream()).handle)

    def host_func(self, fn, stream=None):
        """Queues fn() on ``stream`` (cudaLaunchHostFunc): runs on the stand-in's
        stream thread when the stream reaches it."""
        cb = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: fn())
        self._callbacks.append(cb)
        self._call("cudaLaunchHostFunc", (stream or self.current_stream()).handle,
                   ctypes.cast(cb, ctypes.c_void_p), None)

    def free(self, address):
        """cudaFree(address) (the allocation's last tensor went)."""
        self._lib.cudaFree(address)

    def wrap(self, address, numel, dtype, shape=None, owner=None):
        dtype_check(dtype, "wrap")
        t = host_tensor(address, numel, dtype, shape_of(numel, shape, "wrap"), owner)
        self._check_tensor(t, "wrap")
        return t

    def _check_tensor(self, tensor, who):
        if tensor.device.type != "cpu":
            raise TypeError("%s: the stand-in's tensors are CPU tensors over its memory, not "
                            "one on %s" % (who, tensor.device))
        attrs = (ctypes.c_byte * 256)()  # cudaPointerAttributes (88 bytes in CUDA 13), type first
        self._call("cudaPointerGetAttributes", attrs, tensor.data_ptr())
        kind = ctypes.c_int.from_buffer(attrs).value
        if kind != self._MEMORY_DEVICE:
            raise ValueError("%s: address 0x%x is not the stand-in's device memory (memory "
                             "type %d): a plain host tensor cannot pose as a CUDA one"
                             % (who, tensor.data_ptr(), kind))


class _StandinAllocation:
    """Frees one stand-in cudaMalloc when the last tensor over it goes."""

    def __init__(self, ops, address):
        self.ops, self.address = ops, address

    def __del__(self):
        try:
            self.ops.free(self.address)
        except Exception:  # interpreter shutdown
            pass
