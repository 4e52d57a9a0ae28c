"""The flat stores: where a GradientSync's gradients (and, sharded, its
parameters) live, and every tensor-to-memory decision of the torch package.

Responsible for: the sf_dtype/sf_device of a tensor; registering the
trainable parameters' gradients with a context (plugin-owned flat buffer,
or the parameters' own ``.grad`` with ``flat_buffer=False``); the views of
the flat gradient and parameter buffers that become ``p.grad`` / ``p.data``;
the used-parameter mask; the bytes of a tensor as seen by sf_broadcast and
sf_digest. Every ``.data_ptr()``, every address handed to the library and
every allocation of a flat buffer is in this module, so that the device of
the buffers is decided in one place: the store's DeviceOps
(sfsync/torch/device.py: CpuOps, CudaOps, or the tests' StandinCudaOps) gives the
pointer, the wrapped tensor, the stream and the events; nothing else here
forks on the device.

Not responsible for: when a pass or a window starts or ends (gradient_sync.py,
sfsync/host_window.py), the optimizer (optim.py), replica checks (verify.py).
"""

import torch

import sfsync
from sfsync import shard
from sfsync.torch import device as _device_ops

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


def device_ops_for(params, names, device_ops=None):
    """The DeviceOps of a parameter list (sfsync/torch/device.py): ``device_ops``
    when given (StandinCudaOps in the CPU tests of the device path), else the
    one of the parameters' device; every parameter must be on that one
    device (TypeError naming the first that is not)."""
    first = params[0].device
    for p, name in zip(params, names):
        if p.device != first:
            raise TypeError("GradientSync: every parameter must be on one device: %s is on %s, "
                            "%s on %s" % (names[0], first, name, p.device))
    return device_ops if device_ops is not None else _device_ops.ops_for(first)


class GradientStore:
    """The registered gradients of a list of parameters in one context.

    ``ids[i]`` is parameter i's gradient id, ``views[i]`` the tensor its
    ``.grad`` must be (a view of the flat buffer, or its own registered
    ``.grad``); ``mask`` is the used-parameter mask (one element per
    parameter; None without ``track_unused``) and ``mask_id`` its gradient
    id when it rides in the buckets (None when it is reduced apart:
    sharded).

    ``accumulate_dtype`` (e.g. torch.float32 for a bf16 model): the
    gradients of parameters of another dtype are registered in it;
    ``views[i]`` is then parameter i's accumulator (the flat buffer, in
    accumulate_dtype), never its ``.grad``: each micro-batch's ``.grad``
    (autograd's, in the parameter's dtype) is added into it at the
    parameter's grad-ready and dropped (``take_micro``), and after a
    synchronization ``.grad`` is the reduced accumulator cast to the
    parameter's dtype (``publish``)."""

    def __init__(self, context, params, names, flat_buffer=True, track_unused=True,
                 device_ops=None, accumulate_dtype=None):
        self.context = context
        self.accumulate_dtype = accumulate_dtype
        self.acc = [accumulate_dtype is not None and p.dtype != accumulate_dtype for p in params]
        self.deferred = []  # parameters whose view attaches at the first pass (attach_grads)
        # The device-specific part (pointer, stream, event): sfsync/torch/device.py.
        self.ops = device_ops_for(params, names, device_ops)
        self.on_host = type(self.ops) is _device_ops.CpuOps  # no streams: grad_ready is the call alone
        self.sync_stream = None  # the stream given to sf_set_cuda_stream (None: host)
        self.params, self.names = params, names
        self.flat_buffer, self.track_unused = flat_buffer, track_unused
        self.ids, self.views = [], []
        self.mask, self.mask_id = None, None
        self.pointers = []

    @property
    def sharded(self):
        """The context is sharded (asked: the context holds its shard layout)."""
        return self.context.sharded

    def register(self):
        """Register every gradient (and, sharded, parameter), build the
        buckets, and point every ``.grad`` (and sharded ``.data``) at its view.
        The same lines for every device: the flat buffers are the plugin's
        (sf_add_gradient / sf_register_parameter with the device's
        sf_device: host memory, or NCCL's device memory), wrapped as tensors
        on that device by ``ops.wrap``."""
        ctx, params, ops = self.context, self.params, self.ops
        if self.track_unused and self.sharded:
            # Sharded: a gradient would arrive sharded; summed by the optimizer
            # with one sf_allreduce_float64 instead (optim.py): host memory.
            self.mask = torch.zeros(len(params), dtype=torch.float64)
        elif self.track_unused:
            # Registered first: bucketed last (reverse order), with the first
            # parameter's dtype, so it shares a bucket instead of adding one.
            p0 = params[0]
            mdtype = self.grad_dtype(0)
            if self.flat_buffer or ops.sf_device == sfsync.DEVICE_HOST:
                self.mask_id = ctx.add_gradient(len(params), sf_dtype(mdtype), ops.sf_device,
                                                "sfsync.used")
            else:
                self.mask = torch.zeros(len(params), dtype=mdtype, device=p0.device)
                self.mask_id = ctx.register_gradient(ops.pointer(self.mask), self.mask.numel(),
                                                     sf_dtype(mdtype), ops.sf_device,
                                                     "sfsync.used")
        for p, name in zip(params, self.names):
            dtype, device = sf_dtype(self.grad_dtype(len(self.ids))), ops.sf_device
            if self.flat_buffer:
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
                self.ids.append(ctx.register_gradient(ops.pointer(grad), p.numel(), dtype,
                                                      device, name))
        if ops.sf_device == sfsync.DEVICE_CUDA:
            # NCCL orders its work after what torch queued on this stream
            # (the current one at attach), and makes it wait for the results.
            self.sync_stream = ops.current_stream()
            ctx.set_cuda_stream(ops.stream_handle(self.sync_stream))
        ctx.build_buckets()
        if self.track_unused and self.mask is None:
            self.mask = ops.wrap(ctx.gradient_data(self.mask_id), len(params), self.grad_dtype(0),
                                 (len(params),), owner=ctx)
        if self.flat_buffer:
            for i, (gid, p) in enumerate(zip(self.ids, params)):
                view = ops.wrap(ctx.gradient_data(gid), p.numel(), self.grad_dtype(i), p.shape,
                                owner=ctx)
                if p.grad is not None:  # keep what was already accumulated
                    view.copy_(p.grad)
                if self.acc[i]:
                    p.grad = None  # autograd's fresh micro-batch gradient, added in (take_micro)
                else:
                    p.grad = view
                self.views.append(view)
                if self.sharded:
                    data = ops.wrap(shard.parameter_data(ctx, gid), p.numel(), p.dtype, p.shape,
                                    owner=ctx)
                    data.copy_(p.data)
                    p.data = data
        self.pointers = [v.data_ptr() for v in self.views]
        # The hooks' common case, one check (GradientSync._hook_grad): host
        # memory, no mask to mark, no accumulator: .grad is the view or not.
        self.plain = [self.on_host and self.mask is None and not a for a in self.acc]

    # -- the device orderings (no-ops on the host; see sfsync/torch/device.py)

    def grad_ready(self, tensor, gid):
        """sf_grad_ready(gid) once ``tensor`` (a gradient, the mask) is final
        on the stream autograd used: the sync stream waits for it first
        (host memory: nothing to order, the call alone)."""
        if self.on_host:
            self.context.grad_ready(gid)
            return
        event = self.ops.grad_ready(tensor, self.sync_stream)
        self.context.grad_ready(gid)
        self.ops.release(event)  # (the wait is queued: CUDA allows it)

    def before_plugin(self):
        """Before a call whose plugin work reads or writes what torch made on
        the current stream (sf_synchronize, sf_start_gather after a step,
        sf_zero_gradients after the step read the gradients): the sync stream
        waits for the current one on the device."""
        self.ops.release(self.ops.order(self.ops.current_stream(), self.sync_stream))

    def after_plugin(self):
        """After a call that made the sync stream wait for the plugin's work
        (sf_synchronize, sf_wait_bucket, sf_gather_gradients,
        sf_zero_gradients): the current stream (the optimizer's, the next
        backward's) waits for it on the device; then torch's work may run."""
        self.ops.release(self.ops.after_reduction(self.sync_stream))
        self.ops.compute_point()

    def after_gather(self):
        """In a forward pre-hook, after sf_wait_gather: the forward's stream
        waits on the device for the gathered parameters."""
        self.ops.release(self.ops.before_forward(self.sync_stream))
        self.ops.compute_point()

    def grad_dtype(self, i):
        """The dtype parameter i's gradient is registered (and reduced) in."""
        return self.accumulate_dtype if self.acc[i] else self.params[i].dtype

    def grad_is_view(self, i):
        """Parameter i's ``.grad`` is its registered view (an accumulated
        parameter's ``.grad`` never is: True for it)."""
        if self.acc[i]:
            return True
        g = self.params[i].grad
        if g is None:
            return False
        view = self.views[i]
        # (torch hands back the tensor object that was assigned: ``is`` is
        # the common answer, the pointers the general one)
        return g is view or g.data_ptr() == view.data_ptr()

    def take_micro(self, i):
        """At parameter i's grad-ready: an accumulated parameter's ``.grad``
        (this micro-batch's, in its own dtype) is added into its accumulator
        (in accumulate_dtype: exact widening, one rounding per addition, as
        a float32 reference loop's ``acc += g.float()``) and dropped, so
        that autograd makes a fresh one for the next micro-batch. Returns
        the tensor that is final now (what the sync stream must wait for)."""
        p, view = self.params[i], self.views[i]
        if not self.acc[i]:
            return p.grad
        if p.grad is not None:
            view.add_(p.grad)
            p.grad = None
        return view

    def publish(self):
        """After a synchronization: each accumulated parameter's ``.grad`` is
        its reduced accumulator in the parameter's dtype (torch's optimizers
        need that dtype); the accumulator itself keeps the full precision
        (``GradientSync.accumulated_grads()``)."""
        for i, p in enumerate(self.params):
            if self.acc[i]:
                p.grad = self.views[i].to(p.dtype)

    def attach_deferred(self):
        """After the window's first pass: a parameter whose ``.grad`` was None
        at the window's start (``attach_grads(defer_none=True)``) and got no
        gradient in that pass starts its view from zero now, so that a later
        pass accumulates into it (the others were adopted at their hook: the
        pass's fresh gradient copied in, no zeroing, as DDP's first pass)."""
        for i in self.deferred:
            if not self.grad_is_view(i):
                self.adopt_grad(i)
        self.deferred = []

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

    def attach_grads(self, defer_none=False):
        """At a window's start: every ``.grad`` is its view again (see
        adopt_grad). An accumulated parameter's accumulator starts from its
        ``.grad`` as the host left it, as torch's own accumulation would:
        from zero where the host set it to None (a torch optimizer's or
        model's ``zero_grad()``, ``sync.zero_grad``) or zeroed it in place,
        from the published gradient where the host kept it; then its
        ``.grad`` is None (the window's first micro-batch gets a fresh one).
        ``defer_none``: a ``.grad`` set to None (torch 2.x's ``zero_grad``)
        stays None; the first pass's hook copies autograd's fresh gradient
        into the view (one copy, not a zeroing and an addition), and
        ``attach_deferred`` zeroes those of parameters that pass left unused."""
        self.deferred = []
        for i, p in enumerate(self.params):
            if not self.acc[i]:
                if defer_none and p.grad is None:
                    self.deferred.append(i)
                else:
                    self.adopt_grad(i)
                continue
            if p.grad is None:
                self.views[i].zero_()
            else:
                self.views[i].copy_(p.grad)
            p.grad = None

    def zero_grad(self, set_to_none):
        """Zero every gradient in place (sf_zero_gradients), re-attaching a
        ``.grad`` that was None or replaced; or set them all to None."""
        if set_to_none:
            for p in self.params:
                p.grad = None
            return
        self.before_plugin()  # (the step read them on the current stream)
        self.context.zero_gradients()  # (on the sync stream)
        self.after_plugin()
        for i, p in enumerate(self.params):
            if self.acc[i]:
                p.grad = None
            elif not self.grad_is_view(i):
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
                if self.acc[i]:
                    continue  # (its .grad is already its own: publish's copy, or None)
                if self.grad_is_view(i):
                    # (a parameter resized after attach cannot take it: None)
                    p.grad = self.views[i].clone() if p.grad.shape == p.shape else None
        self.views = []
        self.mask = None
