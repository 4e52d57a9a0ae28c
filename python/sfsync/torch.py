"""PyTorch integration of sfsync: synchronize an nn.Module's gradients exactly
once per gradient-accumulation window.

    sync = GradientSync(model)                 # after the model is built and placed
    for window in windows:
        with sync.accumulate():                # micro-batches 1..N-1: local sums only
            for x, y in window[:-1]:
                loss_fn(model(x), y).backward()
        loss_fn(model(*window[-1])).backward() # hooks start bucket all-reduces
        sync.synchronize()                     # every rank: the same averaged gradient
        optimizer.step()
        sync.zero_grad()

How the gradients get to the plugin (``flat_buffer``):

* True (default): every parameter's ``.grad`` is a view into the plugin's
  flat buffer (sf_add_gradient + sf_gradient_data, through numpy), so
  synchronization copies nothing, like DDP's ``gradient_as_bucket_view``.
  Autograd accumulates into a preassigned ``.grad`` in place (``grad +=
  new``) unless ``create_graph=True``; GradientSync checks at every hook and at
  synchronize() that each ``.grad`` is still its view and fails loudly if not.
* False: each parameter's own ``.grad`` tensor is registered with
  sf_register_gradient; the plugin packs it into a bucket and back.

Grad-ready is reported from a post hook on each parameter's AccumulateGrad
node, i.e. after the new gradient has been added to ``.grad`` (a tensor hook,
``param.register_hook``, runs *before* the addition, so a bucket could be
reduced without the last micro-batch's contribution).  Parameters are
registered in ``model.parameters()`` order; the plugin buckets them in
reverse, so the last layers' buckets, ready first, go first.

CUDA parameters need ``flat_buffer=False`` (their own ``.grad`` is registered
as a device pointer and reduced with NCCL; the stream current at attach time
is given to sf_set_cuda_stream). That path is not exercised by the tests
here: Debian's torch has no CUDA.

Call ``optimizer.zero_grad(set_to_none=True)`` (the default of torch >= 2.0)
and ``.grad`` is gone: use ``sync.zero_grad()`` (or ``set_to_none=False``)
instead; ``sync.zero_grad()`` also re-attaches views if they were dropped.
"""

import torch

import sfsync

__all__ = ["GradientSync", "sf_dtype"]

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


def _sf_device(device):
    if device.type == "cpu":
        return sfsync.DEVICE_HOST
    if device.type == "cuda":
        return sfsync.DEVICE_CUDA
    raise TypeError("sfsync has no device for %s parameters" % device)


def _check_grad(p, ptr, name):
    """Fail loudly if p.grad is no longer the memory sfsync reduces."""
    g = p.grad
    if g is None or g.data_ptr() != ptr:
        raise RuntimeError(
            "sfsync: %s.grad is no longer the buffer registered with sfsync (it is %s: "
            "optimizer.zero_grad(set_to_none=True) or an assignment to .grad); use "
            "GradientSync.zero_grad() or optimizer.zero_grad(set_to_none=False)"
            % (name, "None" if g is None else "another tensor"))


class GradientSync:
    """Attaches an nn.Module's parameters to an sfsync context.

    ``GradientSync(module, context=None, flat_buffer=True, hooks=True,
    bucket_cap_mb=None, first_bucket_cap_mb=None, **options)``: without
    ``context``, one is created from ``sfsync.options(**options)`` (the
    environment: RANK, WORLD_SIZE, MASTER_ADDR, SF_*) and owned (closed by
    close()). ``hooks=False`` reports no grad-ready: every bucket is then
    reduced by synchronize(), the result is the same.

    The module's parameters must not be replaced or moved (``.to()``) after
    attaching.  Only parameters with ``requires_grad`` are synchronized.
    """

    def __init__(self, module, context=None, *, flat_buffer=True, hooks=True,
                 bucket_cap_mb=None, first_bucket_cap_mb=None, **options):
        names = {id(p): n for n, p in module.named_parameters()}
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = [names.get(id(p), "param%d" % i) for i, p in enumerate(self.params)]
        if not self.params:
            raise ValueError("GradientSync: the module has no parameter that requires grad")
        self.flat_buffer = flat_buffer
        self._owns_context = context is None
        self.context = context if context is not None else sfsync.Context(**options)
        self._handles = []
        self._views = []   # per parameter: the tensor .grad must be
        self._ids = []
        try:
            if bucket_cap_mb is not None:
                self.context.set_bucket_cap_mb(bucket_cap_mb)
            if first_bucket_cap_mb is not None:
                self.context.set_first_bucket_cap_mb(first_bucket_cap_mb)
            self._register()
            if hooks:
                self._install_hooks()
        except BaseException:
            self.close()
            raise

    # -- setup

    def _register(self):
        ctx = self.context
        for p, name in zip(self.params, self.names):
            dtype, device = sf_dtype(p.dtype), _sf_device(p.device)
            if self.flat_buffer:
                if device != sfsync.DEVICE_HOST:
                    raise TypeError("GradientSync(flat_buffer=True) needs CPU parameters; %s is on "
                                    "%s (use flat_buffer=False)" % (name, p.device))
                self._ids.append(ctx.add_gradient(p.numel(), dtype, device, name))
            else:
                grad = p.grad
                if grad is None or not grad.is_contiguous() or grad.shape != p.shape:
                    grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if p.grad is not None:
                        grad.copy_(p.grad)
                    p.grad = grad
                self._views.append(grad)
                self._ids.append(ctx.register_gradient(grad.data_ptr(), p.numel(), dtype, device,
                                                       name))
        cuda = [p for p in self.params if p.is_cuda]
        if cuda:  # NCCL orders its work after what torch queued on this stream
            ctx.set_cuda_stream(torch.cuda.current_stream(cuda[0].device))
        ctx.build_buckets()
        if self.flat_buffer:
            for gid, p in zip(self._ids, self.params):
                view = self._flat_view(gid, p)
                if p.grad is not None:  # keep what was already accumulated
                    view.copy_(p.grad)
                p.grad = view
                self._views.append(view)
        self._ptrs = [v.data_ptr() for v in self._views]

    def _flat_view(self, gid, p):
        array = self.context.gradient_array(gid)
        if p.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
            t = torch.from_numpy(array.view("int16")).view(torch.bfloat16)
        else:
            t = torch.from_numpy(array)
        return t.view(p.shape)

    def _install_hooks(self):
        with torch.enable_grad():
            for i, p in enumerate(self.params):
                # The AccumulateGrad node of p: its post hooks run after the
                # new gradient has been added into p.grad. Kept here: the
                # parameter itself holds it only weakly.
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._handles.append((acc, acc.register_hook(self._make_hook(i))))

    def _make_hook(self, i):
        # The hook holds the context, not self: no cycle through autograd's
        # C++ nodes, so an abandoned GradientSync can still be collected.
        ctx, gid = self.context, self._ids[i]
        p, ptr, name = self.params[i], self._ptrs[i], self.names[i]

        def hook(grad_inputs, grad_outputs):
            _check_grad(p, ptr, name)
            ctx.grad_ready(gid)
        return hook

    # -- per window

    def accumulate(self):
        """Context manager for the micro-batches whose gradients stay local
        (forward AND backward inside it): sf_begin/end_accumulation."""
        return self.context.accumulate()

    no_sync = accumulate  # the name DDP users know

    def synchronize(self):
        """Reduce what the window accumulated; call before optimizer.step()."""
        for p, ptr, name in zip(self.params, self._ptrs, self.names):
            _check_grad(p, ptr, name)
        self.context.synchronize()

    def zero_grad(self):
        """Zero every gradient in place (sf_zero_gradients), re-attaching a
        ``.grad`` that was set to None or replaced."""
        self.context.zero_gradients()
        for p, view in zip(self.params, self._views):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def stats(self):
        return self.context.stats()

    def buckets(self):
        return self.context.buckets()

    # -- teardown

    def close(self):
        """Remove the hooks, give every parameter a private copy of its
        gradient, and close the context if this object created it."""
        if self.context is None:
            return
        for _, handle in self._handles:
            handle.remove()
        self._handles = []
        if self.flat_buffer:
            for p, view in zip(self.params, self._views):
                if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                    p.grad = view.clone()
        self._views = []
        if self._owns_context:
            self.context.close()
        self.context = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
