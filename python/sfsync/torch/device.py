"""What sfsync.torch does differently per device, and nothing else (issue 23).

One code path for every device (docs/cuda.md, "sfsync.torch on a CUDA model"): the flat gradient buffer, the
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

The stand-in lives with the tests (tests/python/support/device_standin.py).
Lines only a GPU can run (marked ``# GPU only`` below): every line of
``CudaOps`` past its constructor's checks (``torch.cuda`` streams and
events, ``data_ptr`` of a CUDA tensor, ``torch.as_tensor`` over
``__cuda_array_interface__``). Everything else, including the logic that
calls these functions in sfsync.torch, runs here on ``CpuOps`` or
``StandinCudaOps``.

Contract for the caller (found with the strict stand-in,
tests/python/sfsync/torch/test_device_ops.py StandinContractTests): the stream given to
sf_set_cuda_stream must stay alive until the context is closed, or be
replaced first: sf_destroy records an event on it before it frees the
plugin's device buffers. torch's current stream of a device always is; a
user's ``torch.cuda.Stream`` current at attach may not be: keep a reference.

Used by sfsync.torch (its GradientStore holds one, chosen per device by
``ops_for`` or given as ``GradientSync(device_ops=...)``).
"""

import torch

import sfsync

__all__ = ["DeviceOps", "CpuOps", "CudaOps", "ops_for", "dtype_check", "shape_of", "host_tensor"]

SIZES = {torch.float32: 4, torch.float64: 8, torch.float16: 2, torch.bfloat16: 2}
# __cuda_array_interface__ type strings (bfloat16 has none: int16, viewed).
TYPESTR = {torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2",
            torch.bfloat16: "<i2"}


def dtype_check(dtype, who):
    if dtype not in SIZES:
        raise TypeError("%s: dtype must be float32, float64, float16 or bfloat16, not %s"
                        % (who, dtype))


def shape_of(numel, shape, who):
    shape = (int(numel),) if shape is None else tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    if n != numel:
        raise ValueError("%s: shape %s has %d elements, not numel=%d" % (who, shape, n, numel))
    return shape


def host_tensor(address, numel, dtype, shape, owner):
    """A CPU tensor over `numel` elements at host `address` (no copy); the
    tensor keeps `owner` alive (e.g. the sfsync.Context that owns the memory)."""
    import ctypes

    import numpy as np
    raw = (ctypes.c_uint8 * (numel * SIZES[dtype])).from_address(address)
    raw.sf_owner = owner
    flat = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8)).view(dtype)
    return flat.view(shape)

class DeviceOps:
    """The device-specific operations sfsync.torch needs; see the module
    docstring. ``stream`` arguments default to ``current_stream()``."""

    name = "abstract"
    sf_device = None  # sfsync.DEVICE_HOST or sfsync.DEVICE_CUDA

    def pointer(self, tensor):
        """The address to register for ``tensor`` (contiguous, on this device:
        each implementation's ``_check_tensor`` says what that means)."""
        self._check_tensor(tensor, "pointer")
        if not tensor.is_contiguous():
            raise ValueError("pointer: the tensor must be contiguous (shape %s, strides %s)"
                             % (tuple(tensor.shape), tensor.stride()))
        return tensor.data_ptr()

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

    def compute_point(self):
        """torch is about to run work on the current stream (a step, a
        forward, a backward over the gradients). Nothing on the host or a
        GPU: torch queues that work on the stream, behind the waits queued
        there. StandinCudaOps overrides it (its tensors are CPU tensors that
        torch computes on the host at once)."""

    # The three orderings sfsync.torch needs, in terms of the above.

    def order(self, before, after):
        """``after`` waits on the device for what ``before`` holds now."""
        if after is None or before is None or \
                self.stream_handle(before) == self.stream_handle(after):
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
        return self.order(self.current_stream(), sync_stream)

    def after_reduction(self, sync_stream, stream=None):
        """After sf_synchronize (which made ``sync_stream`` wait for the
        reduction): ``stream`` (the optimizer's, default the current one)
        waits for it too, on the device."""
        return self.order(sync_stream, stream if stream is not None else self.current_stream())

    def before_forward(self, gather_stream, stream=None):
        """In a module's forward pre-hook: ``stream`` (the forward's, default
        the current one) waits on the device for the all-gather of its
        parameters, queued behind ``gather_stream``."""
        return self.order(gather_stream, stream if stream is not None else self.current_stream())

    def _check_tensor(self, tensor, who):
        pass


class CpuOps(DeviceOps):
    """Host memory: pointers are host addresses, no streams, no events."""

    name = "cpu"
    sf_device = sfsync.DEVICE_HOST

    def wrap(self, address, numel, dtype, shape=None, owner=None):
        dtype_check(dtype, "wrap")
        if not address:
            raise ValueError("wrap: address must not be 0 (numel=%d)" % numel)
        return host_tensor(address, numel, dtype, shape_of(numel, shape, "wrap"), owner)

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

    def wrap(self, address, numel, dtype, shape=None, owner=None):
        dtype_check(dtype, "wrap")
        shape = shape_of(numel, shape, "wrap")

        class _Memory:  # what torch.as_tensor reads; the tensor keeps it (and owner) alive
            __cuda_array_interface__ = {"shape": (int(numel),), "typestr": TYPESTR[dtype],
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
