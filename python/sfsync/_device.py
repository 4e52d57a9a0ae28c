"""What sfsync.torch does differently per device, and nothing else (issue 23).

One code path for every device (DESIGN.md): the flat gradient buffer, the
flat parameter buffer and the shard views are torch tensors on the model's
device, handled by the same Python logic whatever that device is. What
differs is only:

* the pointer and the ``sf_device`` code of a tensor (``pointer``,
  ``sf_device``), and a tensor over memory the plugin owns (``wrap``);
* the stream: the handle given to ``sf_set_cuda_stream`` (``stream_handle``
  of ``current_stream()``: the stream torch queues the model's work on);
* the events, all without a host synchronization:
  ``grad_ready(grad, sync_stream)``: a readiness event recorded on the
  stream autograd used for ``grad`` (the current stream inside a
  post-accumulate-grad hook), which ``sync_stream`` waits on, so that the
  collective the plugin orders after ``sync_stream`` reads the final
  gradient; ``after_reduction(sync_stream, stream)``: the optimizer's stream
  waits for the reduction (``sf_synchronize`` made ``sync_stream`` wait for
  it); ``before_forward(gather_stream, stream)``: a module's forward
  pre-hook waits for its parameters' all-gather on the device.

Three implementations with one interface (``DeviceOps``):

* ``CpuOps``: host pointers (``sfsync.DEVICE_HOST``); no stream (``None``),
  no event (``None``), every wait a no-op: host code runs in program order.
* ``CudaOps``: torch's CUDA streams and events (``sfsync.DEVICE_CUDA``).
* ``StandinCudaOps``: **a STAND-IN for tests, not CUDA**. It drives the
  CUDA runtime stand-in (tests/standin, libcudart.so.13 with
  ``sfStandinCudaCounter``) through ctypes: its streams and events are the
  stand-in's, strict where CUDA is undefined (a wait on an event never
  recorded, a destroyed event or stream used again: RuntimeError here, a
  counted misuse there), and "device" memory is host memory the stand-in's
  ``cudaMalloc`` gave (tensors are CPU tensors over it). With the plugin's
  NCCL backend loading the same stand-ins (``SF_CUDART_LIBRARY`` /
  ``SF_NCCL_LIBRARY``, or ``LD_LIBRARY_PATH``), a CPU test runs the whole
  device path: SF_DEVICE_CUDA registrations, the plugin's stream and events,
  the stand-in NCCL's collectives.

Lines only a GPU can run (marked ``# GPU only`` below): every line of
``CudaOps`` past its constructor's checks (``torch.cuda`` streams and
events, ``data_ptr`` of a CUDA tensor, ``torch.as_tensor`` over
``__cuda_array_interface__``). Everything else, including the logic that
calls these functions in sfsync.torch, runs here on ``CpuOps`` or
``StandinCudaOps``.

Not imported by sfsync.torch yet (the CUDA path wires it in); no import of
torch at module level beyond what the functions need.
"""

import contextlib
import ctypes
import os
import threading

import torch

import sfsync

__all__ = ["DeviceOps", "CpuOps", "CudaOps", "StandinCudaOps", "ops_for"]

_SIZES = {torch.float32: 4, torch.float64: 8, torch.float16: 2, torch.bfloat16: 2}
# __cuda_array_interface__ type strings (bfloat16 has none: int16, viewed).
_TYPESTR = {torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2",
            torch.bfloat16: "<i2"}


def _dtype_check(dtype, who):
    if dtype not in _SIZES:
        raise TypeError("%s: dtype must be float32, float64, float16 or bfloat16, not %s"
                        % (who, dtype))


def _shape_of(numel, shape, who):
    shape = (int(numel),) if shape is None else tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    if n != numel:
        raise ValueError("%s: shape %s has %d elements, not numel=%d" % (who, shape, n, numel))
    return shape


def _host_tensor(address, numel, dtype, shape, owner):
    """A CPU tensor over `numel` elements at host `address` (no copy); the
    tensor keeps `owner` alive (e.g. the sfsync.Context that owns the memory)."""
    import numpy as np
    raw = (ctypes.c_uint8 * (numel * _SIZES[dtype])).from_address(address)
    raw._sf_owner = owner
    flat = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8)).view(dtype)
    return flat.view(shape)


class DeviceOps:
    """The device-specific operations sfsync.torch needs; see the module
    docstring. ``stream`` arguments default to ``current_stream()``."""

    name = "abstract"
    sf_device = None  # sfsync.DEVICE_HOST or sfsync.DEVICE_CUDA

    def pointer(self, tensor):
        """The address to register for ``tensor`` (contiguous, on this device)."""
        raise NotImplementedError

    def wrap(self, address, numel, dtype, shape=None, owner=None):
        """A tensor on this device over plugin-owned memory at ``address``."""
        raise NotImplementedError

    def current_stream(self):
        """The stream torch queues the model's work on now (None: no streams)."""
        raise NotImplementedError

    def stream_handle(self, stream):
        """The cudaStream_t for sf_set_cuda_stream (an int; None: none/legacy)."""
        raise NotImplementedError

    def record_event(self, stream=None):
        """An event recorded on ``stream`` now (None where there are no events)."""
        raise NotImplementedError

    def wait_event(self, event, stream=None):
        """``stream`` waits (on the device) for ``event``; no host synchronization."""
        raise NotImplementedError

    def release(self, event):
        """Done with ``event`` (a stream may still wait on it: CUDA allows that)."""

    # The three orderings sfsync.torch needs, in terms of the above.

    def _order(self, before, after):
        """``after`` waits on the device for what ``before`` holds now."""
        if after is None or before is None or self.stream_handle(before) == self.stream_handle(after):
            return None  # one stream orders itself
        event = self.record_event(before)
        self.wait_event(event, after)
        return event

    def grad_ready(self, grad, sync_stream):
        """Called where a gradient became final (post-accumulate-grad hook):
        ``sync_stream`` (the one given to sf_set_cuda_stream) waits for what
        autograd queued for ``grad`` on its stream (the current one in that
        hook). Returns the readiness event (None: same stream, or CPU); the
        caller releases it once the bucket was launched."""
        self._check_tensor(grad, "grad_ready")
        return self._order(self.current_stream(), sync_stream)

    def after_reduction(self, sync_stream, stream=None):
        """After sf_synchronize (which made ``sync_stream`` wait for the
        reduction): ``stream`` (the optimizer's, default the current one)
        waits for it too, on the device."""
        return self._order(sync_stream, stream if stream is not None else self.current_stream())

    def before_forward(self, gather_stream, stream=None):
        """In a module's forward pre-hook: ``stream`` (the forward's, default
        the current one) waits on the device for the all-gather of its
        parameters, queued behind ``gather_stream``."""
        return self._order(gather_stream, stream if stream is not None else self.current_stream())

    def _check_tensor(self, tensor, who):
        pass


class CpuOps(DeviceOps):
    """Host memory: pointers are host addresses, no streams, no events."""

    name = "cpu"
    sf_device = sfsync.DEVICE_HOST

    def pointer(self, tensor):
        self._check_tensor(tensor, "pointer")
        if not tensor.is_contiguous():
            raise ValueError("pointer: the tensor must be contiguous (shape %s, strides %s)"
                             % (tuple(tensor.shape), tensor.stride()))
        return tensor.data_ptr()

    def wrap(self, address, numel, dtype, shape=None, owner=None):
        _dtype_check(dtype, "wrap")
        if not address:
            raise ValueError("wrap: address must not be 0 (numel=%d)" % numel)
        return _host_tensor(address, numel, dtype, _shape_of(numel, shape, "wrap"), owner)

    def current_stream(self):
        return None

    def stream_handle(self, stream):
        return None

    def record_event(self, stream=None):
        return None

    def wait_event(self, event, stream=None):
        return None

    def _check_tensor(self, tensor, who):
        if tensor.device.type != "cpu":
            raise TypeError("%s: CpuOps handles CPU tensors, not one on %s" % (who, tensor.device))


class CudaOps(DeviceOps):
    """torch's CUDA streams and events on ``device`` (lines past the
    constructor's checks run only on a GPU)."""

    name = "cuda"
    sf_device = sfsync.DEVICE_CUDA

    def __init__(self, device):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError("CudaOps: device must be a CUDA device, not %s" % device)
        if not torch.cuda.is_available():
            raise RuntimeError("CudaOps(%s): torch.cuda.is_available() is False in this process "
                               "(no GPU, or a CPU-only torch %s)" % (device, torch.__version__))
        self.device = torch.device("cuda", device.index if device.index is not None
                                   else torch.cuda.current_device())  # GPU only

    def pointer(self, tensor):
        self._check_tensor(tensor, "pointer")  # GPU only
        if not tensor.is_contiguous():  # GPU only
            raise ValueError("pointer: the tensor must be contiguous (shape %s, strides %s)"
                             % (tuple(tensor.shape), tensor.stride()))
        return tensor.data_ptr()  # GPU only

    def wrap(self, address, numel, dtype, shape=None, owner=None):
        _dtype_check(dtype, "wrap")
        shape = _shape_of(numel, shape, "wrap")

        class _Memory:  # what torch.as_tensor reads; the tensor keeps it (and owner) alive
            __cuda_array_interface__ = {"shape": (int(numel),), "typestr": _TYPESTR[dtype],
                                        "data": (int(address), False), "version": 2,
                                        "strides": None}

        memory = _Memory()
        memory.owner = owner
        with torch.cuda.device(self.device):  # GPU only
            t = torch.as_tensor(memory, device=self.device)  # GPU only
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)  # GPU only
        return t.view(shape)  # GPU only

    def current_stream(self):
        return torch.cuda.current_stream(self.device)  # GPU only

    def stream_handle(self, stream):
        return stream.cuda_stream if stream is not None else None  # GPU only

    def record_event(self, stream=None):
        stream = stream if stream is not None else self.current_stream()  # GPU only
        event = torch.cuda.Event(enable_timing=False)  # GPU only
        event.record(stream)  # GPU only
        return event

    def wait_event(self, event, stream=None):
        stream = stream if stream is not None else self.current_stream()  # GPU only
        stream.wait_event(event)  # GPU only (device-side: no host synchronization)

    def _check_tensor(self, tensor, who):
        if tensor.device != self.device:  # GPU only
            raise TypeError("%s: this CudaOps handles tensors on %s, not one on %s"
                            % (who, self.device, tensor.device))


# ---- The stand-in (tests only) ----------------------------------------------


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
        _dtype_check(dtype, "empty")
        p = ctypes.c_void_p()
        self._call("cudaMalloc", ctypes.byref(p), numel * _SIZES[dtype])
        owner = _StandinAllocation(self, p.value)
        return _host_tensor(p.value, numel, dtype, _shape_of(numel, shape, "empty"), owner)

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

    def pointer(self, tensor):
        self._check_tensor(tensor, "pointer")
        if not tensor.is_contiguous():
            raise ValueError("pointer: the tensor must be contiguous (shape %s, strides %s)"
                             % (tuple(tensor.shape), tensor.stride()))
        return tensor.data_ptr()

    def wrap(self, address, numel, dtype, shape=None, owner=None):
        _dtype_check(dtype, "wrap")
        t = _host_tensor(address, numel, dtype, _shape_of(numel, shape, "wrap"), owner)
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
            self.ops._lib.cudaFree(self.address)
        except Exception:  # interpreter shutdown
            pass


def ops_for(device):
    """The DeviceOps for a torch device: CpuOps for "cpu", CudaOps for "cuda"
    (TypeError for any other device type)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuOps()
    if device.type == "cuda":
        return CudaOps(device)
    raise TypeError("sfsync has no device operations for %s tensors (cpu and cuda only)"
                    % device.type)
