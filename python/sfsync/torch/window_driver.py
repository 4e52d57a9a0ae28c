"""WindowDriver: the one object that sequences a GradientSync window's
collectives (Megatron-core's ``DistributedDataParallel`` drives its bucket
groups the same way: the wrapper and the optimizer each call the driver,
never each other).

Responsible for, in this order: the start of every bucket's collective
(sf_synchronize_start), the waits (sf_wait_bucket, sf_synchronize), the
used-parameter mask's sum (sharded: one sf_allreduce_float64), the gradient
gather (sharded, whole gradients), the publish (accumulated ``.grad``,
unused parameters' ``.grad = None``), the buffer broadcast, and the
parameter gathers after a sharded step with the waits for them (forward
pre-hooks, reads of the module's parameters). It holds the facts of the
attachment that both callers read (context, store, module, parameters,
rank). The window's collective state it asks the plugin, which holds it
(issue 44: one holder): whether a bucket was waited or its parameter
gather is in flight (``Context.bucket_state``: sf_bucket_state), whether
the window's reductions are under way and its gradients whole
(``Context.window_state``: sf_window_state), the shard layout
(``sharded``, ``shard_layout``) and the window count (``windows``).

What it keeps is what the plugin cannot know: whether the optimizer's step
of the window is due (a window closed with an optimizer and not stepped)
or was taken (sharded: until the next window begins). An unsharded step
leaves no trace in the plugin (its buckets stay reduced), and a sharded
one's parameter gathers outlive the window into the next forward, so
neither can be read back; ``phase`` combines this one fact with the
plugin's (``REDUCING`` or ``SYNCHRONIZED`` is sf_window_state's answer).

Not responsible for: counting passes (sfsync/host_window.py) and windows
(the plugin: ``windows`` asks it),
the hooks that see the backward (gradient_sync.py), stepping (optim.py),
memory and streams (store.py).
"""

import enum
import inspect
import weakref

import torch

import sfsync
from sfsync import shard
from sfsync.torch.rendezvous import log
from sfsync.torch.store import broadcast_tensors
from sfsync.torch.weighted import zero_weight

__all__ = ["WindowDriver", "Phase"]

# register_forward_pre_hook's keyword that puts a hook first (torch >= 2.0)
_FIRST = ({"prepend": True} if "prepend" in
          inspect.signature(torch.nn.Module.register_forward_pre_hook).parameters else {})

# WindowDriver._step: the window's optimizer step is due, or was taken.
_DUE, _TAKEN = "due", "taken"


class Phase(enum.Enum):
    """Where the window's collectives are in their cycle (WindowDriver.phase:
    the step's fact, kept by the driver, with the plugin's answer)."""
    IDLE = "idle"                  # no window closed since the last step
    REDUCING = "reducing"          # the window's collectives started, not synchronized
    SYNCHRONIZED = "synchronized"  # sf_synchronize completed it: gradients final
    STEPPED = "stepped"            # sharded: stepped, its gathers started


class WindowDriver:
    """See the module docstring. Made by GradientSync once its store is
    registered; ``attach_stepping`` (by the optimizer) turns the window's
    end from one sf_synchronize into start + waits the optimizer steps
    between.

    Who calls what: GradientSync calls ``pass_ended``, ``close_window``,
    ``fail_window``, ``begin_window``, ``wait_parameters``, ``close`` and
    sets ``in_pass``; the optimizer calls ``attach_stepping``,
    ``install_gather_waits``, ``wait``, ``finish``, ``wait_gradients``,
    ``gather_gradients``, ``stepped`` and reads ``phase``, ``waited``,
    ``gradients_whole``, ``local_used``. The driver calls neither of them."""

    def __init__(self, context, store, window, *, module, params, names, rank, world_size,
                 broadcast_buffers, accumulate_dtype, collectives=shard):
        self.context, self.store, self.window = context, store, window
        # sfsync.shard's calls on the context (FSDP2 injects its collectives
        # so: a test records them, tests/python/sfsync/torch/test_window_driver.py)
        self._collectives = collectives
        self.module, self.params, self.names = module, params, names
        self.rank, self.world_size = rank, world_size
        self.broadcast_buffers = broadcast_buffers
        self.accumulate_dtype = accumulate_dtype
        self.in_pass = False     # a backward pass is running (GradientSync's hooks say so)
        self.stepping = False    # an optimizer steps between start and the waits
        self.overlap_step = False
        self._whole_rule = True
        self.buckets = 0         # the plan's count (frozen once built), read at attach_stepping
        # The step's one fact (see the module docstring): None, _DUE or _TAKEN.
        self._step = None
        self.local_used = None   # this rank's used mask at the window's last pass
        self._hooks = []
        self._patched = []       # modules whose named_parameters() waits for the gathers
        self._gather_plan = []   # (module, its buckets in forward order): install_gather_waits
        self._armed = {}         # plan index -> its forward pre-hook, armed until it waited

    # -- what both callers read

    @property
    def windows(self):
        """Windows synchronized: the plugin's count (sf_stats.windows_completed,
        its one holder), the window whose reductions started
        (sf_synchronize_start, ``REDUCING``) included: the plugin counts it
        at its sf_synchronize (``finish``)."""
        return self.context.stats()["windows_completed"] + (self.phase == Phase.REDUCING)

    @property
    def phase(self):
        """The step's fact (kept here) with the plugin's answer: a window
        whose step is due is ``REDUCING`` while sf_window_state says its
        reductions are under way (no sf_synchronize completed it), else
        ``SYNCHRONIZED``."""
        if self._step is None:
            return Phase.IDLE
        if self._step is _TAKEN:
            return Phase.STEPPED
        return (Phase.REDUCING if self.context.window_state()["synchronizing"]
                else Phase.SYNCHRONIZED)

    def waited(self, b):
        """Bucket ``b``'s reduction of this window is waited for and in place
        (sf_bucket_state "reduced"), asked."""
        return self.context.bucket_state(b) == "reduced"

    def _gathering(self, buckets):
        """Those of ``buckets`` whose parameter gather is in flight (sf_bucket_state
        "gathering": started, not waited), asked."""
        return [b for b in buckets if self.context.bucket_state(b) == "gathering"]

    @property
    def shard_layout(self):
        """The context's shard layout ("none", "flat", "parameter"): asked,
        never held here (the context is its one holder)."""
        return self.context.shard_layout

    @property
    def sharded(self):
        return self.context.sharded

    def at_boundary(self):
        """Between windows: no pass of the next one has run."""
        return self.window.at_boundary and not self.in_pass

    @property
    def gradients_whole(self):
        """Every ``.grad`` holds the whole reduced gradient once waited:
        unsharded, or the plugin says this window's were gathered whole
        (sf_window_state, after sf_gather_gradients)."""
        return not self.sharded or self.context.window_state()["gradients_whole"]

    def zero_grad(self, set_to_none):
        self.store.zero_grad(set_to_none)

    def attach_stepping(self, overlap_step, whole_rule):
        """The optimizer steps this window's buckets: from now on the
        window's end starts the collectives, and unless ``overlap_step``
        waits for all of them (gathering whole gradients as ``whole_rule``
        says). Returns the bucket count."""
        if self.stepping:
            raise RuntimeError("sync.optimizer: this GradientSync already has an optimizer")
        self.buckets = self.context.stats()["bucket_count"]
        # The rule (issue 24): unsharded with one bucket there is no other
        # bucket's wire time for a step to overlap, so the per-bucket step
        # cannot win: off (the final-gradient step). Sharded it stays: there
        # it also leaves out the gradient gather.
        self.overlap_step = bool(overlap_step) and (self.sharded or self.buckets > 1)
        self.stepping, self._whole_rule = True, whole_rule
        return self.buckets

    # -- called by GradientSync (the pass and the window)

    def pass_ended(self):
        """The window's pass ended with the used mask still local: keep this
        rank's own use (the optimizer's per-bucket step reads it)."""
        if self.stepping:
            self.local_used = self.store.mask.clone()

    def close_window(self):
        """The window's last pass ended: synchronize it. Alone, one
        sf_synchronize and the publish; with an optimizer, start every
        bucket's collective and, unless overlap_step, wait for all of them,
        so that every .grad is final when is_step() turns True."""
        if not self.stepping:
            self._synchronize()
            self.store.after_plugin()  # the current stream after the reduction
            self.publish()
            return
        # (the plugin waits for the last window's parameter gathers itself)
        self._collectives.synchronize_start(self.context)
        self._step = _DUE
        if not self.overlap_step:
            rule = self._whole_rule
            self.finish(whole=bool(rule() if callable(rule) else rule))

    def _synchronize(self):
        """sf_synchronize. A window the plugin refused for its global weight 0
        is over (counted, no step): ``fail_window`` here, the one place that
        tells, and the error says so to the caller (``weight_zero``: its
        HostWindow ends the window too) before it propagates."""
        try:
            self.context.synchronize()
        except sfsync.InvalidStateError as e:
            e.weight_zero = zero_weight(self.context)
            if e.weight_zero:
                self.fail_window()
            raise

    def fail_window(self):
        """The window's synchronization failed and the plugin ended it (a
        weighted window of global weight 0): nothing to wait for (its buckets
        are reduced: the plugin summed them), no step."""
        self._step = None

    def begin_window(self):
        """A new window starts (forward at its start): a window that was
        closed without a step is synchronized now (the step is skipped)."""
        if self.phase == Phase.REDUCING:
            self.finish()
        self._step = None

    # -- the waits

    def wait(self, b):
        if not self.waited(b):
            self._collectives.wait_bucket(self.context, b)
            self.store.after_plugin()  # the optimizer's stream after the reduction

    def wait_gradients(self):
        """Wait for every bucket's reduction now, if the window is reducing."""
        if self.phase == Phase.REDUCING:
            self.finish()

    def finish(self, whole=False):
        """Wait for every bucket; the window check and count (sf_synchronize);
        the used mask (sharded: one sf_allreduce_float64); ``whole``
        (sharded): gather the reduced gradient shards too, so that every
        rank's .grad holds the whole reduced gradient; then the publish. A
        window the plugin refused for its global weight 0 is over (counted,
        no step): ``fail_window``, so that no later call synchronizes it again."""
        self._synchronize()
        self.store.after_plugin()  # the optimizer's stream after the reductions
        if self.sharded and self.store.mask is not None:
            self.wait_parameters()
            self._collectives.allreduce_float64(self.context, self.store.mask)
        if self.sharded and whole:
            self.gather_gradients()
        self.publish()
        self._step = _DUE  # SYNCHRONIZED: the plugin completed the window

    def gather_gradients(self):
        """Sharded: every ``.grad`` the whole reduced gradient (sf_gather_gradients)."""
        self._collectives.gather_gradients(self.context)
        self.store.after_plugin()

    def publish(self):
        """Every bucket reduced: accumulated parameters' .grad, unused
        parameters' .grad None, buffers."""
        self.store.publish()
        unused = self.store.take_unused()
        if unused:
            log(sfsync.LOG_TRACE, "window %d: no gradient on any rank for %s" % (
                self.windows, ", ".join(self.names[i] for i in unused)))
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers and self.world_size > 1:
                broadcast_tensors(self.context, buffers)

    def stepped(self):
        """The optimizer stepped the window: sharded, its gathers start."""
        if self.sharded:
            self.store.before_plugin()  # the gathers read what the steps wrote
            # In forward order (the reverse of the bucket order: the last
            # bucket reduced holds the first layers, which the next forward
            # needs first), once every bucket has stepped: started as each
            # bucket stepped, the first layers' gather would queue behind
            # every other's. The same order on every rank.
            for b in reversed(range(self.buckets)):
                self._collectives.start_gather(self.context, b)
            self._arm_gather_waits()
        self._step = _TAKEN if self.sharded else None

    # -- the parameter gathers (sharded)

    def wait_parameters(self):
        """Wait for every parameter gather in flight: afterwards every
        parameter is whole on this rank."""
        if self._gathering(range(self.buckets)):
            self._collectives.wait_gather(self.context, -1)
            self.store.after_gather()

    def wait_gathers(self, buckets):
        in_flight = self._gathering(buckets)
        for b in in_flight:
            self._collectives.wait_gather(self.context, b)
        if in_flight:  # the forward's stream waits for them on the device
            self.store.after_gather()

    def _arm_gather_waits(self):
        """After the step started the gathers: every module's forward
        pre-hook of the plan that is not armed yet (install_gather_waits)."""
        me = weakref.WeakMethod(self._wait_armed)
        for k, (m, _) in enumerate(self._gather_plan):
            if k not in self._armed:
                # Before the module's other pre-hooks (torch >= 2.0), which
                # may read its parameters (weight_norm's computes the weight)
                self._armed[k] = m.register_forward_pre_hook(_gather_hook(me, k), **_FIRST)

    def _wait_armed(self, k):
        """Plan entry ``k``'s module is about to run: wait for its buckets'
        gathers, then remove its hook (kept armed if the wait raised)."""
        self.wait_gathers(self._gather_plan[k][1])
        handle = self._armed.pop(k, None)
        if handle is not None:
            handle.remove()

    def install_gather_waits(self, bucket_of, overlap):
        """The waits for the parameter gathers: forward pre-hooks that wait
        for the gathers of each module's parameters (``bucket_of``:
        id(parameter) -> bucket; every gather at the model's forward when
        not ``overlap``), and reads of the parameters outside a forward that
        wait for all of them: every module's state_dict() and
        named_parameters() / parameters(). Direct attribute reads
        (``model.fc.weight``) cannot be seen.

        The forward pre-hooks are armed at each step, as its gathers start
        (``stepped``), and each is removed once its wait returned: the
        window's later forwards, and every forward of an unsharded or
        not yet stepped model, run without them (issue 46: on the
        transformer 75 modules x 4 micro-batches of hooks per window, each
        asking the plugin, where one forward needs them)."""
        module = self.module
        if not overlap:
            self._gather_plan = [(module, list(range(self.buckets))[::-1])]
        else:
            self._gather_plan = []
            for m in module.modules():
                buckets = sorted({bucket_of[id(p)] for p in m.parameters(recurse=False)
                                  if id(p) in bucket_of}, reverse=True)
                if buckets:
                    self._gather_plan.append((m, buckets))
        ref = weakref.ref(self)
        for m in module.modules():
            if hasattr(m, "register_state_dict_pre_hook"):
                self._hooks.append(m.register_state_dict_pre_hook(_read_pre_hook(ref)))
            else:  # torch 1.13 (no public pre hook): a post hook; the dict holds views
                self._hooks.append(m._register_state_dict_hook(_read_post_hook(ref)))
            m.__dict__["named_parameters"] = _waiting_named_parameters(ref, m)
            self._patched.append(m)

    def close(self):
        """GradientSync.close(): wait for the gathers, remove the hooks and
        the patched reads."""
        self.wait_parameters()
        for h in self._hooks + list(self._armed.values()):
            h.remove()
        self._hooks = []
        self._armed = {}
        for m in self._patched:
            m.__dict__.pop("named_parameters", None)
        self._patched = []


def _read_pre_hook(me):
    def hook(module, prefix, keep_vars):
        driver = me()
        if driver is not None:
            driver.wait_parameters()
    return hook


def _read_post_hook(me):
    def hook(module, state_dict, prefix, local_metadata):
        driver = me()
        if driver is not None:
            driver.wait_parameters()
    return hook


def _waiting_named_parameters(me, module):
    method = type(module).named_parameters

    def named_parameters(*args, **kwargs):
        driver = me()
        if driver is not None:
            driver.wait_parameters()
        return method(module, *args, **kwargs)
    return named_parameters


def _gather_hook(method, k):
    def hook(module, inputs):
        wait = method()
        if wait is not None:
            wait(k)
    return hook
