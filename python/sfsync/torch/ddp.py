"""Keeping DDP: ``attach(ddp_model)`` registers sfsync's communication hook
on a DistributedDataParallel model and returns its ``DDPSync``.

Responsible for: the comm hook (inside a window a bucket is returned
locally, nothing sent; outside it is averaged with the process group's
all-reduce, as DDP's default), the forward hooks that see DDP's own
``no_sync()`` and run the replica check after DDP's buffer broadcast, and,
without a count, the host's windows as it wrote them: a backward that runs
while any attached DDP's ``no_sync()`` is active stays local (DDP decided at
the forward, and calls the hook anyway), and the optimizer step ends a
window (step_hook.py), with the reduction of what a wrong guess left local
(catch_up.py). Not responsible for: the window rule (the face's
HostWindow), the check itself (verify.py). One hook family, one file, as
torch's ``ddp_comm_hooks/``.
"""

import weakref

import torch

import sfsync
from sfsync.host_window import UNTIL_STEP, HostWindow
from sfsync.torch import step_hook
from sfsync.torch.explicit_windows import explicit_window_open
from sfsync.torch.face import WindowFace, check_counts, set_window
from sfsync.torch.rendezvous import log, make_context
from sfsync.torch.verify import Verifier, named_state

#: The DDPSyncs that follow the host's windows (no count): a backward inside
#: any one's no_sync() is inside the window for all (nested DDPs), and the
#: optimizer step ends the window of each.
_following = weakref.WeakSet()


def following_syncs():
    """The live DDPSyncs that follow the host's windows (no count)."""
    return [s for s in list(_following) if s.context is not None]

__all__ = ["DDPSync", "attach"]


class DDPSync(WindowFace):
    """sfsync's window for a DistributedDataParallel model: a communication
    hook that returns each bucket locally inside a window (nothing sent) and
    averages it with the process group's all-reduce outside, as DDP's default
    does. Made by ``attach``; see there."""

    def __init__(self, ddp, accumulation_steps=None, context=None, verify_every=None,
                 verify_buffers=False, guess=None, connect=True, **options):
        import torch.distributed as dist
        check_counts("attach", accumulation_steps, verify_every)
        if not hasattr(ddp, "register_comm_hook"):
            raise TypeError("attach: expected a torch.nn.parallel.DistributedDataParallel "
                            "model, got %s" % type(ddp).__name__)
        self.ddp = ddp
        self.group = ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        refuse_python_reducer()
        # DDP reduces the windows through its own process group (the comm
        # hook, catch_up.py); the context never synchronizes one, so each
        # window's end is counted there (sf_count_window): the plugin holds
        # the count (``windows``, sf_stats.windows_completed).
        self._window = HostWindow("attach", accumulation_steps, guess,
                                  on_close=self._count_window)
        self._owns_context = context is None
        self.context = None
        self.context = context if context is not None else make_context(**options)
        self.deferred_buckets = 0
        self.reduced_buckets = 0
        self.bytes_deferred = 0     # bucket bytes kept local (what DDP would have sent)
        self.bytes_reduced = 0      # bucket bytes all-reduced by the hook
        self.catch_ups = 0          # steps that found passes left local (a wrong guess)
        self.catch_up_bytes = 0     # the gradient bytes those steps reduced
        self._host_hook = None      # (state, hook) the host registered after ours (follow.py)
        self._verify_every = verify_every
        self._last_verified = 0
        self._verifier = None
        self._handles = []
        try:
            if connect and self.context.options()["world_size"] > 1:
                self.context.connect()
            if verify_every:
                self._verifier = Verifier(self.context, named_state(ddp.module, verify_buffers))
            # The hooks hold weak methods (DDP keeps its comm hook state for
            # its own life; an abandoned DDPSync must go).
            ddp.register_comm_hook(_HookState(weakref.WeakMethod(self._hook_bucket)),
                                   _ddp_comm_hook)
            self._handles.append(ddp.register_forward_pre_hook(
                _call_hook(weakref.WeakMethod(self._hook_forward))))
            # The replica check runs at the wrapped module's forward: after
            # DDP broadcast the buffers (broadcast_buffers), before this
            # forward moves them (BatchNorm statistics).
            self._handles.append(ddp.module.register_forward_pre_hook(
                _call_hook(weakref.WeakMethod(self._hook_verify))))
            if not accumulation_steps:
                self._window.follows_steps = step_hook.install()
                _following.add(self)
            log(sfsync.LOG_INFO, "attach: DDP comm hook, %s, world size %d%s" % (
                "accumulation_steps=%d" % accumulation_steps if accumulation_steps
                else "windows from no_sync() and the optimizer step", self.world_size,
                ", verify_every=%d" % verify_every if verify_every else ""))
        except BaseException:
            self.close()
            raise

    def _hook_forward(self):
        if self.context is not None:
            self._forward()

    def _hook_verify(self):
        if self.context is not None and torch.is_grad_enabled():
            self._verify_if_due()

    def _hook_bucket(self, bucket):
        """The comm hook's call: None once closed (then DDP's default)."""
        return self._hook(bucket) if self.context is not None else None

    def _forward(self):
        """DDP's forward starts a pass. Inside DDP's own no_sync() DDP calls
        no comm hook in the backward: the pass is counted here, whole.
        Without a count the pass is decided at its backward's first bucket
        (the host may enter no_sync() around the backward alone)."""
        if not torch.is_grad_enabled():
            return
        window = self._window
        if not self.ddp.require_backward_grad_sync and not window.pass_open:
            window.begin_pass(True)
            window.end_pass()
            set_window(self.context, True)
            return
        if self.accumulation_steps:
            set_window(self.context, window.begin_pass(self._host_inside))

    def _host_no_sync(self):
        """The host's no_sync() is active now: this face's own, or, without a
        count, that of any DDP that follows the host (its outer DDP), or a
        window the host opened on the default context (explicit_windows.py)."""
        if self._host_inside:
            return True
        if self.accumulation_steps:
            return False
        return (any(not s.ddp.require_backward_grad_sync for s in following_syncs())
                or explicit_window_open())

    def _hook(self, bucket):
        import torch.distributed as dist
        window = self._window
        if not window.pass_open:
            if (window.stepped_windows and window.at_boundary and window.guessed_length() is None
                    and step_hook.steps_seen_for(self.ddp.module.parameters())):
                window.guess = UNTIL_STEP  # the first window: reduced at its step
            set_window(self.context, window.begin_pass(self._host_no_sync()))
        local = window.begin_pass(False)  # (the pass is decided: this returns it)
        buf = bucket.buffer()
        nbytes = buf.numel() * buf.element_size()
        if local:
            self.deferred_buckets += 1
            self.bytes_deferred += nbytes
            window.pending = True  # DDP would have sent it: reduced at the step if still local
            fut = torch.futures.Future()
            fut.set_result(buf)  # the local sum stays in .grad: nothing is sent
        else:
            self.reduced_buckets += 1
            self.bytes_reduced += nbytes
            if self._host_hook is not None:  # the host's own hook sends (follow.py)
                state, hook = self._host_hook
                fut = hook(state, bucket)
            else:
                buf.div_(self.world_size)
                fut = dist.all_reduce(buf, group=self.group, async_op=True).get_future()
                fut = fut.then(lambda f: f.value()[0])
        if bucket.is_last() and window.end_pass():
            window.close_window()
        return fut

    def _count_window(self):
        """The window ended (its last pass went to DDP, or its step): counted
        in the plugin, its context's window closed first (a window the step
        ends may still be open there: its passes stayed local)."""
        if self.context is not None:
            set_window(self.context, False)
            self.context.count_window()

    def _plugin_windows(self):
        return self.context.stats()["windows_completed"]

    def before_step(self):
        """The host's optimizer is about to step (step_hook): the window
        ends; True if this DDP's .grad must be reduced first."""
        return self.context is not None and self._window.step()

    @property
    def guess(self):
        """The guessed length of the first window, or None where nothing is
        guessed (a count was given, or no guess yet)."""
        return self._window.guess

    def set_host_hook(self, state, hook):
        """A comm hook the host registers after sfsync's (follow.py): it does
        the sending for the passes sfsync sends. DDP's rule: one per DDP."""
        if self._host_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be "
                               "called once")
        self._host_hook = (state, hook)

    def counts(self):
        """What the hook did, for a report: buckets and bytes reduced and
        kept local, and the steps that reduced what a wrong guess left."""
        return {"reduced_buckets": self.reduced_buckets, "deferred_buckets": self.deferred_buckets,
                "bytes_reduced": self.bytes_reduced, "bytes_deferred": self.bytes_deferred,
                "catch_ups": self.catch_ups, "catch_up_bytes": self.catch_up_bytes,
                "windows": self.windows}

    def verify(self):
        verifier = self._verifier or Verifier(self.context, named_state(self.ddp.module, False))
        verifier.check(self.windows)

    def state_dict(self):
        """As GradientSync.state_dict(): the window count and the
        verify_every cadence, to save with the model at a step."""
        return self._face_state_dict("DDPSync")

    def load_state_dict(self, state):
        """As GradientSync.load_state_dict()."""
        self._face_load_state_dict("DDPSync", state)

    def close(self):
        """Remove the forward hook and close the context if made here. (DDP
        cannot unregister a comm hook: the hook then reduces every pass.)"""
        for h in self._handles:
            h.remove()
        self._handles = []
        _following.discard(self)
        self._keep_windows()
        if self.context is not None and self._owns_context:
            ctx, self.context = self.context, None
            ctx.close()


class _HookState:
    """The comm hook's state: a weak method of its DDPSync (DDP keeps the
    state for its own life)."""

    def __init__(self, hook):
        self.hook = hook

    def __getstate__(self):  # DDP pickles nothing here, but be explicit
        return {}


def refuse_python_reducer():
    """attach() needs DDP's C++ reducer, which calls a comm hook once per
    bucket: torch 2.x's compiled DDP with ``torch._dynamo.config.optimize_ddp
    = "python_reducer"`` calls it per parameter as hook(state, (grad, param))."""
    dynamo = getattr(getattr(torch, "_dynamo", None), "config", None)
    mode = getattr(dynamo, "optimize_ddp", None) if dynamo is not None else None
    if mode == "python_reducer":
        raise RuntimeError(_PYTHON_REDUCER)


_PYTHON_REDUCER = ("attach: torch._dynamo.config.optimize_ddp = 'python_reducer' calls DDP comm "
                   "hooks per parameter, not per bucket: sfsync's windows need DDP's own "
                   "reducer; use sfsync.torch.GradientSync(model) with torch.compile instead, or "
                   "another optimize_ddp setting")


def _ddp_comm_hook(state, bucket):
    import torch.distributed as dist
    if isinstance(bucket, tuple):  # the python reducer, turned on after attach
        raise RuntimeError(_PYTHON_REDUCER)
    hook = state.hook()
    fut = hook(bucket) if hook is not None else None
    if fut is None:  # closed: DDP's default
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
    return fut


def _call_hook(method):
    """A forward pre-hook calling ``method`` (a WeakMethod) while it lives."""
    def hook(module, inputs):
        fn = method()
        if fn is not None:
            fn()
    return hook


def attach(ddp_model, accumulation_steps=None, **kwargs):
    """Keep DDP, send gradients once per window: registers sfsync's comm hook
    on ``ddp_model`` (a DistributedDataParallel) and returns its DDPSync.

    ``accumulation_steps=N``: every N-th backward pass is reduced, the others
    stay local (1x the gradient bytes per window from the first window, the
    same weights as DDP with a correct ``no_sync()``); the loop is
    ``loss.backward(); if sync.is_step(): opt.step(); opt.zero_grad()``.
    A host that uses DDP's own ``no_sync()`` (or ``sync.no_sync()``; the
    trainer frameworks do) decides the windows instead: sfsync counts those
    passes and never defers a synchronization the host asks for; with
    ``accumulation_steps`` too, the first window must agree with it
    (RuntimeError naming both otherwise).

    Without ``accumulation_steps`` the host's windows are followed as it
    wrote them, whatever its loop: a backward that runs while DDP's
    ``no_sync()`` is active stays local, even when its forward ran outside
    (``no_sync()`` around the backward alone, which DDP itself ignores), and
    so does every attached DDP's backward inside another's ``no_sync()``
    (nested DDPs). For a host that never calls ``no_sync()``, the optimizer
    step ends the window (torch's global step hook; every optimizer built on
    ``torch.optim.Optimizer``): the window length is guessed from the
    previous windows, ``guess=N`` for the first one, and a wrong guess costs
    a collective at the step, never exactness (sfsync/host_window.py).
    ``verify_every=K`` (and ``verify_buffers``) as GradientSync's.
    ``connect=False``: do not connect the context at attach (the hook uses
    the DDP's own process group; the context then serves no replica check).
    ``context=``: the context whose window count the attachment keeps
    (sf_count_window at each window's end; give each attach its own: two
    attachments on one context count both DDPs' windows). Other keyword
    arguments go to ``make_context``.
    """
    return DDPSync(ddp_model, accumulation_steps=accumulation_steps, **kwargs)
