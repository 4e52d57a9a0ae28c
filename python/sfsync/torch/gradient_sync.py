"""GradientSync: sfsync in place of DDP for an nn.Module (see
sfsync/torch/__init__.py for the two ways in).

Responsible for: attaching a module (its trainable parameters into a
GradientStore, the autograd hooks that report each gradient and see each
pass end), the pass and window bookkeeping through the face's HostWindow,
the layout check at each synchronization, and telling its WindowDriver
when a pass and a window end. Not responsible for: the window's
collectives (the publish, the buffer broadcast, the waits and gathers:
window_driver.py, which the optimizer calls too; GradientSync never calls
the optimizer), the memory of the gradients (store.py), the optimizer
(optim.py), replica checks (verify.py), DDP (ddp.py), the checks of its
arguments and parameters (attach_checks.py).
"""

import weakref

import torch

import sfsync
from sfsync import shard
from sfsync.host_window import HostWindow
from sfsync.torch.attach_checks import (accumulate_dtype_of, call, check_layout,
                                        check_shard_setting, forward_hook, install_grad_hooks,
                                        signature, trainable)
from sfsync.torch.face import SET_TO_NONE_DEFAULT, WindowFace, check_counts, set_window
from sfsync.torch.rendezvous import log, make_context
from sfsync.torch.store import GradientStore, broadcast_tensors
from sfsync.torch.verify import Verifier, named_state
from sfsync.torch.weighted import Weighing, reduce_option
from sfsync.torch.window_driver import WindowDriver

__all__ = ["GradientSync"]

# module -> weakref to the open GradientSync attached to it (one at a time).
_attached = weakref.WeakKeyDictionary()


def _queue_callback(fn):
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class GradientSync(WindowFace, Weighing):
    """Attaches an nn.Module's parameters to an sfsync context, in place of DDP.

    ``GradientSync(module, context=None, *, accumulation_steps=None,
    flat_buffer=True, hooks=True, broadcast=True, broadcast_buffers=True,
    find_unused_parameters=True, verify_every=None, verify_buffers=False,
    store=None, bucket_cap_mb=None, first_bucket_cap_mb=None, reduce=None, **options)``

    * Windows, as DDP's: the passes inside ``with sync.no_sync():`` (forward
      and backward) stay local; the first backward pass outside synchronizes
      at its end (inside ``backward()``), and ``is_step()`` is True until the
      next pass: every ``.grad`` then holds the reduced gradient on every
      rank. ``sync(x)`` is the module's forward and ``sync.module`` the
      module, so trainer frameworks drive it as they drive DDP. A host
      without backward hooks (``hooks=False``) keeps every pass inside
      ``no_sync()`` and calls ``sync.synchronize()``.
    * ``accumulation_steps=N``: for loops with no ``no_sync()``: passes
      1..N-1 of each window stay local, the N-th synchronizes. A host that
      uses ``no_sync()`` anyway decides (see sfsync/host_window.py: the
      first window must agree with N, else RuntimeError).
    * Loss scaling is the caller's: gradients are averaged over ranks and
      summed over the window's passes, so divide each micro-batch's loss by N
      to get DDP's ``no_sync()`` result.
    * ``reduce="weighted"`` (0.4; the same as the context option
      ``reduce_op="weighted"``, either may be given): the loss is a plain
      sum (e.g. over tokens), ``sync.weigh(n)`` adds each micro-batch's
      weight before its backward, and every gradient is the sum over ranks
      and micro-batches divided by the window's global weight: the token
      mean of the whole window, with no extra collective.
      ``sync.add_window_sums(loss=..., tokens=...)`` and ``sync.window_sums()``
      carry metrics the same way (sfsync/torch/weighted.py). A window whose
      global weight is 0 raises sfsync.InvalidStateError from its last
      ``backward()`` on every rank (its gradients are the plain sums; no
      step: ``is_step()`` stays False; zero them and go on). ``reduce`` also
      takes "average" (the default) and "sum".
    * At attach: connect (collective), broadcast parameters and buffers from
      rank 0 (``broadcast``). After each synchronization the buffers (e.g.
      BatchNorm statistics) are broadcast from rank 0 (``broadcast_buffers``).
    * Parameters that received no gradient in a window on any rank get
      ``.grad = None`` (``find_unused_parameters``, as DDP's): one extra float
      per parameter travels in the same buckets, no extra collective. Frozen
      parameters (``requires_grad=False``) are ignored.
    * A parameter added, removed, resized or frozen after attach is an error
      at the next synchronization, naming it.
    * ``verify_every=K``: see the module docstring.
    * ``accumulate_dtype=torch.float32`` (FSDP2's
      ``MixedPrecisionPolicy.reduce_dtype``): bf16/fp16 parameters' gradients
      are accumulated over the window's micro-batches and reduced in float32
      (the flat buffer holds them in float32, the buckets travel in float32);
      each micro-batch's ``.grad`` is added in at its grad-ready, and after
      the synchronization ``.grad`` is the reduced sum cast to the
      parameter's dtype (``accumulated_grads()``: the float32 sums).
      Unsharded, flat_buffer and hooks only (ValueError otherwise).
    * ``shard_optimizer=True, shard_layout="flat" | "parameter"`` (0.3):
      sharded windows: each bucket is reduce-scattered, the parameters live
      in the plugin's flat parameter buffer, and ``sync.optimizer(cls, params,
      **kw)`` steps this rank's shard and gathers the rest (sfsync/torch/optim.py).
      Without it ``sync.optimizer`` steps bucket by bucket as each all-reduce
      completes. ``set_accumulation_steps(n)``: N from the next window.
      Sharded, ``bucket_cap_mb=None`` (and no ``SF_BUCKET_CAP_MB``) is the
      plugin's sharded default (0.5; Python's alone in 0.4): about an eighth
      of the gradients, within 1..25 MiB (sf_set_shard_layout in sfsync.h).
      ``sync.shard_optimizer`` and ``sync.shard_layout`` ask the context.

    Each parameter's ``.grad`` is a view into the plugin's flat buffer
    (``flat_buffer=True``), on the parameters' device: host memory for a
    CPU model, NCCL's device memory for a CUDA one (one code path: only the
    pointer, the stream and the events differ, sfsync/torch/device.py);
    ``flat_buffer=False`` registers their own ``.grad``. ``device_ops``: the
    DeviceOps to use instead of the parameters' device's (tests: the CUDA
    stand-in's StandinCudaOps). Grad-ready is reported from each parameter's
    post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``,
    torch >= 2.1; torch 1.13: a post hook on its AccumulateGrad node), so
    buckets are reduced while the backward pass is still running.
    """

    def __init__(self, module, context=None, *, accumulation_steps=None, flat_buffer=True,
                 hooks=True, broadcast=True, broadcast_buffers=True, find_unused_parameters=True,
                 verify_every=None, verify_buffers=False, store=None, bucket_cap_mb=None,
                 first_bucket_cap_mb=None, connect=True, shard_optimizer=False,
                 shard_layout="flat", accumulate_dtype=None, device_ops=None, reduce=None,
                 **options):
        check_counts("GradientSync", accumulation_steps, verify_every)
        options = reduce_option(reduce, options, context)
        self.context = None  # (close() needs it, whatever fails below)
        other = _attached.get(module)
        other = other() if other is not None else None
        if other is not None and other.context is not None:
            raise RuntimeError("GradientSync: this %s is already attached to a GradientSync "
                               "(rank %s/%s, %d windows so far): a second one would own the "
                               "same .grad tensors; close() the first one, or keep using it"
                               % (type(module).__name__, getattr(other, "rank", "?"),
                                  getattr(other, "world_size", "?"), other.windows))
        if shard_optimizer:
            shard.layout_value(shard_layout)  # ValueError naming it before anything
            if not flat_buffer:
                raise ValueError("GradientSync(shard_optimizer=True) keeps parameters in the "
                                 "plugin's flat buffer: flat_buffer=False does not fit")
        self.accumulate_dtype = accumulate_dtype_of(accumulate_dtype, flat_buffer, hooks,
                                                    shard_optimizer)
        self._optimizer = None  # sync.optimizer(...): steps per bucket (sfsync/torch/optim.py)
        self._driver = None  # the window's collectives (window_driver.py), made with the store
        # (its windows are the plugin's to count: windows asks it, _plugin_windows)
        self._window = HostWindow("GradientSync", accumulation_steps)
        self.module = module
        self.params, self.names = trainable(module)
        if not self.params:
            raise ValueError("GradientSync: the module has no parameter that requires grad "
                             "(and has elements)")
        width = torch.empty(0, dtype=self.accumulate_dtype or torch.float64).element_size()
        for p, n in zip(self.params, self.names):
            if p.element_size() > width:
                raise ValueError("GradientSync: accumulate_dtype=%s is narrower than parameter "
                                 "%s's dtype %s: it would lose precision, not keep it"
                                 % (self.accumulate_dtype, n, p.dtype))
        self._signature = signature(self.params)
        self.flat_buffer = flat_buffer
        self.broadcast_buffers = broadcast_buffers
        self._track_unused = bool(hooks and find_unused_parameters)
        self._owns_context = context is None
        self.context = context
        self._hooks = bool(hooks)
        self._handles = []
        self._report = None  # the hooks' fast path (GradReport), with the hooks
        self.store = None  # the registered gradients (store.py), made with the context
        self._reported = None
        self._verify_every = verify_every
        self._verifier = None
        self._last_verified = 0
        try:
            if self.context is None:
                self.context = make_context(store=store, **options)
            ctx = self.context
            # (sharded, bucket_cap_mb=None: the plugin's sharded default, 0.5)
            if bucket_cap_mb is not None:
                ctx.set_bucket_cap_mb(bucket_cap_mb)
            if first_bucket_cap_mb is not None:
                ctx.set_first_bucket_cap_mb(first_bucket_cap_mb)
            check_shard_setting(ctx, shard_optimizer, shard_layout)
            if shard_optimizer:
                shard.set_layout(ctx, shard_layout)  # from now on the context says (shard_layout)
            self.store = GradientStore(ctx, self.params, self.names, flat_buffer=flat_buffer,
                                       track_unused=self._track_unused, device_ops=device_ops,
                                       accumulate_dtype=self.accumulate_dtype)
            self.store.register()
            o = ctx.options()
            self.rank, self.world_size = o["rank"], o["world_size"]
            self._driver = WindowDriver(
                ctx, self.store, self._window, module=module, params=self.params,
                names=self.names, rank=self.rank, world_size=self.world_size,
                broadcast_buffers=broadcast_buffers, accumulate_dtype=self.accumulate_dtype)
            if connect and self.world_size > 1:
                ctx.connect()
            if broadcast and self.world_size > 1:
                broadcast_tensors(ctx, [p.data for p in module.parameters()] +
                                   list(module.buffers()))
            if verify_every:
                self._verifier = Verifier(ctx, named_state(module, verify_buffers))
            if hooks:
                self._install_hooks()
            _attached[module] = weakref.ref(self)
            log(sfsync.LOG_INFO, "GradientSync: %d parameters (%d bytes), %s, rank %d/%d%s" % (
                len(self.params), sum(p.numel() * p.element_size() for p in self.params),
                "accumulation_steps=%d" % accumulation_steps if accumulation_steps
                else "explicit windows", self.rank, self.world_size,
                ", verify_every=%d" % verify_every if verify_every else ""))
        except BaseException:
            self.close()
            raise

    # -- setup

    @property
    def shard_layout(self):
        """The context's shard layout, "flat", "parameter" or "none", asked
        of its one holder (sfsync.Context.shard_layout)."""
        if self.context is None:
            raise RuntimeError("GradientSync is closed: its context held the shard layout")
        return self.context.shard_layout

    @property
    def shard_optimizer(self):
        """True in a sharded context (asked, as shard_layout)."""
        return self.shard_layout != "none"

    @property
    def _ids(self):
        """The gradient id of each parameter (the store's)."""
        return self.store.ids

    def _install_hooks(self):
        # Hooks hold weak methods: they must not keep an abandoned GradientSync alive.
        grad, forward = weakref.WeakMethod(self._hook_grad), weakref.WeakMethod(self._hook_forward)
        self._report, handles = install_grad_hooks(self.params, self.store, grad)
        self._handles += handles
        self._handles.append((None, self.module.register_forward_pre_hook(forward_hook(forward))))

    # -- the pass and the window

    def _hook_grad(self, i):
        if self.context is None:
            return
        if not self._driver.in_pass:
            self._start_pass()
        store = self.store
        if store.plain[i] and self.params[i].grad is store.views[i]:
            self._reported[i] = True  # (_grad's common case in one frame: a hook per parameter)
            self.context.grad_ready(store.ids[i])
            return
        self._grad(i)

    def _hook_forward(self):
        if self.context is not None:
            self._forward()

    def _hook_end_pass(self):
        if self.context is not None:
            self._end_pass()

    def _window_start(self):
        return self._driver.at_boundary()

    def __call__(self, *args, **kwargs):
        """The module's forward (DDP's face)."""
        return self.module(*args, **kwargs)

    forward = __call__

    def __getattr__(self, name):
        """DDP's face for duck-typing hosts: what GradientSync does not
        define is the module's (parameters(), named_parameters(), train(),
        eval(), to(), ...). state_dict() stays GradientSync's own (the window
        count); the module's is sync.module.state_dict(), as DDP's
        ddp.module.state_dict()."""
        if name.startswith("_") or name in ("module", "context"):
            raise AttributeError(name)  # (also while __init__ has not set them yet)
        return getattr(self.module, name)

    def _begin_pass(self):
        """The pass's decision (local or synchronizing), applied to the context."""
        set_window(self.context, self._window.begin_pass(self._host_inside))

    def _forward(self):
        if not torch.is_grad_enabled() or self._driver.in_pass:
            return
        if self._verifier is not None and \
                self.windows - self._last_verified >= self._verify_every:
            self._driver.wait_parameters()  # the digest reads every parameter
        if self._window_start():
            self._driver.begin_window()
            self.store.attach_grads(defer_none=True)  # (a None .grad: adopted at its hook)
            # Before the window's first forward moves a buffer (BatchNorm
            # statistics: each rank's own batches), while every rank still
            # holds the buffers broadcast after the last window.
            self._verify_if_due()
        self._begin_pass()
        self._verify_if_due()

    def _start_pass(self):
        self._driver.in_pass = True
        self._reported = [False] * len(self.params)
        self._begin_pass()  # (decided at the forward already, unless it had no hook)
        if self._report is not None:  # the hooks report plain gradients themselves
            self._report.reported = self._reported
            self._report.ready = self.context.grad_ready  # (a closed context: its error)
            self._report.adopt = self._passes == 0
        end = weakref.WeakMethod(self._hook_end_pass)
        _queue_callback(lambda: call(end))

    def _grad(self, i):
        store, name = self.store, self.names[i]
        g = self.params[i].grad
        if not store.grad_is_view(i):
            if g is not None and self._passes == 0:
                # .grad was None at the window's first pass (zero_grad with
                # set_to_none=True, or an unused parameter): autograd made a
                # fresh tensor holding exactly this pass's gradient.
                store.adopt_grad(i)
            else:
                raise RuntimeError(
                    "sfsync: %s.grad is no longer the buffer registered with sfsync (it is %s: "
                    "an assignment to .grad, or optimizer.zero_grad(set_to_none=True) in the "
                    "middle of a window); zero gradients between windows only"
                    % (name, "None" if g is None else "another tensor"))
        if store.mask is not None:
            store.mask[i] = 1
        self._reported[i] = True
        store.grad_ready(store.take_micro(i), store.ids[i])

    def _end_pass(self):
        self._driver.in_pass = False
        if self._report is not None:
            self._report.ready = None
        if self.store.deferred:
            self.store.attach_deferred()  # the first pass's unused: from zero
        if self._track_unused:
            # Parameters without a gradient in this pass are final too: report
            # them (their buckets can go), then the mask.
            for i, done in enumerate(self._reported):
                if not done:
                    self.context.grad_ready(self._ids[i])
            self._driver.pass_ended()  # this rank's own use, before the mask is reduced
            if self.store.mask_id is not None:
                self.store.grad_ready(self.store.mask, self.store.mask_id)
        if self._window.end_pass():
            self._synchronize()

    # -- per window

    def synchronize(self):
        """Reduce what the window accumulated (every rank then holds the same
        averaged gradient), for a host without backward hooks that kept every
        pass inside ``no_sync()``. Nothing to do (and nothing is sent) when
        the window's last backward pass synchronized it already."""
        if self._window.step_ready and self._hooks:
            return  # (without hooks no pass is seen: every call synchronizes)
        if self.accumulation_steps and not self._window.host_signal:
            raise RuntimeError("GradientSync(accumulation_steps=%d) synchronizes at the end of "
                               "every %d-th backward pass itself: do not call synchronize(); "
                               "step when is_step() is True" % (self.accumulation_steps,
                                                                 self.accumulation_steps))
        self._synchronize()

    def _synchronize(self):
        check_layout(self.module, self._signature, self.names)
        if not self._hooks:
            # No pass was seen: a .grad that zero_grad(set_to_none=True) left
            # None at the window's start is a fresh tensor autograd made (it
            # holds the whole window), or still None (no gradient).
            self.store.attach_grads()
        for i, (p, name) in enumerate(zip(self.params, self.names)):
            if not self.store.grad_is_view(i):
                raise RuntimeError(
                    "sfsync: %s.grad is no longer the buffer registered with sfsync (it is %s: "
                    "optimizer.zero_grad(set_to_none=True) or an assignment to .grad inside the "
                    "window)" % (name, "None" if p.grad is None else "another tensor"))
        self.store.before_plugin()  # (hooks=False: no grad_ready ordered the last pass)
        try:
            # final now, or (an optimizer's overlap_step) bucket by bucket in opt.step()
            self._driver.close_window()
        except sfsync.InvalidStateError as e:
            if getattr(e, "weight_zero", False):
                # The plugin refused the window (global weight 0; the driver
                # ended its part) and stays usable: over, without a step.
                self._window.fail_window()
            raise
        self._window.close_window()

    @property
    def sync_optimizer(self):
        """The optimizer ``sync.optimizer(...)`` made (a SyncOptimizer), or None."""
        return self._optimizer

    def optimizer(self, optimizer_class, params, overlap_gather=True, overlap_step=False,
                  whole_gradients=True, **defaults):
        """``optimizer_class(params, **defaults)`` over this rank's shards
        with ``shard_optimizer=True``, over the parameters otherwise. A
        torch.optim.Optimizer (param_groups, state, step, zero_grad,
        state_dict, clip_grad_norm_): see sfsync/torch/optim.py. Every ``.grad``
        is final when is_step() turns True; ``overlap_step=True`` (opt-in)
        steps bucket by bucket as each reduction completes inside
        ``opt.step()`` instead, and forbids reading ``.grad`` between the
        window's last backward and ``opt.step()`` (clip with
        ``opt.clip_grad_norm_``). ``whole_gradients=False`` (sharded; or a
        callable asked at each window's end): no gradient gather, ``.grad``
        holds this rank's ranges only, for a loop in which nothing but
        ``opt.clip_grad_norm_`` and ``opt.step()`` reads it (the frameworks'
        integrations decide it for theirs)."""
        from sfsync.torch.optim import SyncOptimizer
        self._optimizer = SyncOptimizer(self._driver, optimizer_class, params,
                                        overlap_gather=overlap_gather,
                                        overlap_step=overlap_step,
                                        whole_gradients=whole_gradients, **defaults)
        return self._optimizer

    def accumulated_grads(self):
        """With ``accumulate_dtype``: each parameter's gradient in the flat
        buffer (a view, in accumulate_dtype for the parameters of another
        dtype): after a synchronization the reduced window's sum in full
        precision, of which ``.grad`` is the cast. Without it: the ``.grad``
        views."""
        return list(self.store.views)

    def zero_grad(self, set_to_none=SET_TO_NONE_DEFAULT):
        """Zero every gradient in place (sf_zero_gradients), re-attaching a
        ``.grad`` that was set to None or replaced. ``set_to_none=True`` sets
        them to None instead (re-attached, zeroed, at the next window)."""
        self.store.zero_grad(set_to_none)

    def verify(self):
        """Compare the parameters (and buffers if verify_buffers) across ranks
        now (collective, outside a window): ReplicaMismatchError naming the
        first differing tensor."""
        self._driver.wait_parameters()
        verifier = self._verifier or Verifier(self.context, named_state(self.module, False))
        verifier.check(self.windows)

    def state_dict(self):
        """What a resumed run needs to continue where this one stopped, as a
        dict of plain values: the windows synchronized (= optimizer steps,
        ``windows``), ``accumulation_steps``, the verify_every cadence
        (``verify_every``, the window of the last replica check
        ``last_verified``, ``checks``). Save it with the model and optimizer
        at a step (is_step() True); RuntimeError inside a window."""
        return self._face_state_dict("GradientSync")

    def load_state_dict(self, state):
        """Continue from ``state`` (state_dict() of a GradientSync or DDPSync
        of an earlier run, e.g. before an elastic restart): the window count
        and the replica checks go on as if uninterrupted. Call it before the
        first backward pass of the resumed run. ValueError if the state was
        saved with another accumulation_steps."""
        self._face_load_state_dict("GradientSync", state)

    def _at_window_boundary(self):
        return self._window_start()

    def _plugin_windows(self):
        """The plugin's count (WindowDriver.windows; 0 before the driver exists)."""
        return self._driver.windows if self._driver is not None else 0

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
        if self._report is not None:
            self._report.ready = None
        self._keep_windows()  # (the context goes below)
        if self._driver is not None:
            self._driver.close()  # the gathers waited, their hooks removed
        if self.store is not None:
            self.store.release()
        mine = _attached.get(self.module)
        if mine is not None and mine() is self:
            del _attached[self.module]
        if self._owns_context:
            self.context.close()
        self.context = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
