"""The flat stores: where a GradientSync's gradients (and, sharded, its
parameters) live, and every tensor-to-memory decision of the torch package.

Responsible for: the sf_dtype/sf_device of a tensor; registering the
trainable parameters' gradients with a context (plugin-owned flat buffer,
or the parameters' own ``.grad`` with ``flat_buffer=False``); the views of
the flat gradient and parameter buffers that become ``p.grad`` / ``p.data``;
the used-parameter mask; the bytes of a tensor as seen by sf_broadcast and
sf_digest. Every ``.data_ptr()``, every address handed to the library and
every allocation of a flat buffer is in this module, so that the device of
the buffers is decided in one place (today: host memory; a CUDA store
changes only the pointer, stream and event here).

Not responsible for: when a pass or a window starts or ends (gradient_sync.py,
sfsync/host_window.py), the optimizer (optim.py), replica checks (verify.py).
"""

import ctypes

import torch

import sfsync
from sfsync import shard

__all__ = ["sf_dtype", "sf_device", "host_bytes", "host_address", "broadcast_tensors",
           "GradientStore"]

_DTYPES = {
    torch.float32: sfsync.DTYPE_FLOAT32,
    torch.float64: sfsync.DTYPE_FLOAT64,
    torch.float16: sfsync.DTYPE_FLOAT16,
    torch.bfloat16: sfsync.DTYPE_BFLOAT16,
}


def sf_dtype(dtype):
    """The sf_dtype of a torch dtype (TypeError for those sfsync cannot reduce)."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError("sfsync reduces float32, float64, float16 and bfloat16 gradients, "
                        "not %s" % dtype) from None


def sf_device(device):
    """The sf_device of a torch device (TypeError for others)."""
    if device.type == "cpu":
        return sfsync.DEVICE_HOST
    if device.type == "cuda":
        return sfsync.DEVICE_CUDA
    raise TypeError("sfsync has no device for %s parameters" % device)


def host_bytes(t):
    """A contiguous CPU uint8 tensor holding t's bytes (t itself when it can)."""
    t = t.detach()
    if t.is_cuda or not t.is_contiguous():
        t = t.contiguous().cpu()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def host_address(t):
    """(address, nbytes, keep) of t's bytes in host memory: ``keep`` is the
    tensor that owns them (hold it while the address is used)."""
    t = t.detach()
    if t.is_cuda or not t.is_contiguous():
        t = t.contiguous().cpu()
    return t.data_ptr(), t.numel() * t.element_size(), t


def broadcast_tensors(ctx, tensors, root=0):
    """One sf_broadcast of every tensor's bytes, in place."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return
    views = [host_bytes(t) for t in tensors]
    flat = torch.cat(views)
    ctx.broadcast(flat, root)
    offset = 0
    with torch.no_grad():
        for t, v in zip(tensors, views):
            n = v.numel()
            src = flat[offset:offset + n]
            offset += n
            if t.is_cuda or not t.is_contiguous():
                t.copy_(src.clone().view(t.dtype).view(t.shape))
            else:
                v.copy_(src)


def _gradient_view(ctx, gid, dtype, shape):
    """The plugin-owned gradient ``gid`` as a tensor (no copy)."""
    array = ctx.gradient_array(gid)
    if dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
        t = torch.from_numpy(array.view("int16")).view(torch.bfloat16)
    else:
        t = torch.from_numpy(array)
    return t.view(shape)


def _parameter_view(ctx, gid, dtype, shape):
    """Parameter ``gid``'s view of the plugin's flat parameter buffer (no
    copy; the view keeps the context alive)."""
    import numpy as np
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    raw = (ctypes.c_uint8 * nbytes).from_address(shard.parameter_data(ctx, gid))
    raw.sf_context = ctx  # the memory lives as long as the context
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8)).view(dtype).view(shape)


class GradientStore:
    """The registered gradients of a list of parameters in one context.

    ``ids[i]`` is parameter i's gradient id, ``views[i]`` the tensor its
    ``.grad`` must be (a view of the flat buffer, or its own registered
    ``.grad``); ``mask`` is the used-parameter mask (one element per
    parameter; None without ``track_unused``) and ``mask_id`` its gradient
    id when it rides in the buckets (None when it is reduced apart:
    sharded)."""

    def __init__(self, context, params, names, flat_buffer=True, track_unused=True,
                 sharded=False):
        self.context = context
        self.params, self.names = params, names
        self.flat_buffer, self.track_unused, self.sharded = flat_buffer, track_unused, sharded
        self.ids, self.views = [], []
        self.mask, self.mask_id = None, None
        self.pointers = []

    def register(self):
        """Register every gradient (and, sharded, parameter), build the
        buckets, and point every ``.grad`` (and sharded ``.data``) at its view."""
        ctx, params = self.context, self.params
        if self.track_unused and self.sharded:
            # Sharded: a gradient would arrive sharded; summed by the optimizer
            # with one sf_allreduce_float64 instead (optim.py).
            self.mask = torch.zeros(len(params), dtype=torch.float64)
        elif self.track_unused:
            # Registered first: bucketed last (reverse order), with the first
            # parameter's dtype, so it shares a bucket instead of adding one.
            p0 = params[0]
            mdtype = p0.dtype
            if self.flat_buffer or p0.device.type == "cpu":
                self.mask_id = ctx.add_gradient(len(params), sf_dtype(mdtype),
                                                sfsync.DEVICE_HOST, "sfsync.used")
            else:
                self.mask = torch.zeros(len(params), dtype=mdtype, device=p0.device)
                self.mask_id = ctx.register_gradient(self.mask.data_ptr(), self.mask.numel(),
                                                     sf_dtype(mdtype), sf_device(p0.device),
                                                     "sfsync.used")
        for p, name in zip(params, self.names):
            dtype, device = sf_dtype(p.dtype), sf_device(p.device)
            if self.flat_buffer:
                if device != sfsync.DEVICE_HOST:
                    raise TypeError("GradientSync(flat_buffer=True) needs CPU parameters; %s is on "
                                    "%s (use flat_buffer=False)" % (name, p.device))
                self.ids.append(ctx.add_gradient(p.numel(), dtype, device, name))
                if self.sharded:  # its parameter: a view of the flat parameter buffer
                    shard.register_parameter(ctx, self.ids[-1], p.numel(), dtype, device)
            else:
                grad = p.grad
                if grad is None or not grad.is_contiguous() or grad.shape != p.shape:
                    grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if p.grad is not None:
                        grad.copy_(p.grad)
                    p.grad = grad
                self.views.append(grad)
                self.ids.append(ctx.register_gradient(grad.data_ptr(), p.numel(), dtype, device,
                                                      name))
        cuda = [p for p in params if p.is_cuda]
        if cuda:  # NCCL orders its work after what torch queued on this stream
            ctx.set_cuda_stream(torch.cuda.current_stream(cuda[0].device))
        ctx.build_buckets()
        if self.track_unused and self.mask is None:
            self.mask = _gradient_view(ctx, self.mask_id, params[0].dtype, (len(params),))
        if self.flat_buffer:
            for gid, p in zip(self.ids, params):
                view = _gradient_view(ctx, gid, p.dtype, p.shape)
                if p.grad is not None:  # keep what was already accumulated
                    view.copy_(p.grad)
                p.grad = view
                self.views.append(view)
                if self.sharded:
                    data = _parameter_view(ctx, gid, p.dtype, p.shape)
                    data.copy_(p.data)
                    p.data = data
        self.pointers = [v.data_ptr() for v in self.views]

    def grad_is_view(self, i):
        """Parameter i's ``.grad`` is its registered view."""
        g = self.params[i].grad
        return g is not None and g.data_ptr() == self.views[i].data_ptr()

    def adopt_grad(self, i):
        """Parameter i's ``.grad`` is not its view: copy it in (a fresh
        tensor autograd made) and make the view its ``.grad`` again; None
        starts the view from zero."""
        p, view = self.params[i], self.views[i]
        g = p.grad
        if g is None:
            view.zero_()
            p.grad = view
        elif g.data_ptr() != view.data_ptr():
            view.copy_(g)
            p.grad = view

    def attach_grads(self):
        """Every ``.grad`` is its view again (see adopt_grad)."""
        for i in range(len(self.params)):
            self.adopt_grad(i)

    def zero_grad(self, set_to_none):
        """Zero every gradient in place (sf_zero_gradients), re-attaching a
        ``.grad`` that was None or replaced; or set them all to None."""
        if set_to_none:
            for p in self.params:
                p.grad = None
            return
        self.context.zero_gradients()
        for i, p in enumerate(self.params):
            if not self.grad_is_view(i):
                p.grad = self.views[i]

    def take_unused(self):
        """After a synchronization: the indices of parameters no rank used
        (their ``.grad`` set to None here); the mask starts over."""
        if self.mask is None:
            return []
        unused = (self.mask == 0).nonzero().reshape(-1).tolist()
        for i in unused:
            self.params[i].grad = None
        self.mask.zero_()
        return unused

    def release(self):
        """Before the context goes: every parameter gets a private copy of
        its gradient (and, sharded, of its data)."""
        if self.sharded:  # the flat parameter buffer goes with the context
            for p in self.params:
                p.data = p.data.clone()
        if self.flat_buffer:
            for i, p in enumerate(self.params):
                if self.grad_is_view(i):
                    # (a parameter resized after attach cannot take it: None)
                    p.grad = self.views[i].clone() if p.grad.shape == p.shape else None
        self.views = []
        self.mask = None
