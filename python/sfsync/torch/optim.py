"""The optimizer of a GradientSync (``sync.optimizer(cls, params, **kw)``):
any torch.optim class stepped bucket by bucket as each bucket's reduction
completes, and, with ``GradientSync(shard_optimizer=True)``, on this rank's
shard only (a distributed optimizer: sharded state, parameters gathered
while the next forward runs).

Gradients are final whenever user code can read them: the window's last
backward pass starts every bucket's collective (sf_synchronize_start) and
waits for all of them before it returns, so that when ``sync.is_step()``
turns True every ``.grad`` holds the reduced gradient on every rank
(torch's clip_grad_norm_, GradScaler.unscale_, logging, step hooks). In a
sharded context the reduced shards are then all-gathered into ``.grad``
(sf_gather_gradients: the price of final gradients, half an all-reduce).

``overlap_step=True`` (opt-in): the window's last pass only starts the
collectives (unsharded with a single bucket it is off, ``opt.overlap_step``
False: nothing to overlap, so the final-gradient step runs); inside
``opt.step()`` each bucket is waited (sf_wait_bucket) and
its parameters stepped at once, so the step of bucket k overlaps the wire
time of buckets k+1.. (DDP steps after the last bucket). It forbids reading
``.grad`` between the window's last backward and ``opt.step()``: the
gradients are final only inside ``opt.step()`` / ``opt.clip_grad_norm_()``
(or after ``opt.wait_gradients()``), and in a sharded context only this
rank's range ever (no gradient gather: 1x the bytes). A bucket holding a
parameter this rank did not use in the window waits for the used-parameter
mask (it rides in the last bucket), so a globally unused parameter keeps
``.grad = None`` and is skipped, as with DDP.

Sharded (``shard_optimizer=True, shard_layout="flat" | "parameter"``): every
parameter lives in the plugin's flat parameter buffer (``p.data`` is a view,
as ``p.grad`` is a view into the flat gradient buffer). At synchronization
each bucket is reduce-scattered; this rank's range of parameter p
(sf_shard_range) is a view ``p.data.view(-1)[off:off+count]`` (the whole
``p.data`` when the rank owns all of it, e.g. layout "parameter"), and the
inner optimizer is built over those shard tensors only, so its ``state``
holds 1/W of the full optimizer's. bf16/fp16 parameters get float32 master
shards (one float32 copy of the shard, none of the whole parameter),
written back rounded before the gather. Once every bucket's shard stepped,
the all-gathers start (sf_start_gather) in forward order, the first layers'
bucket first (it was reduced last); the next forward's pre-hooks (one per
module holding parameters) wait for the buckets of that module's parameters
(sf_wait_gather), so the gather overlaps the forward; every module's
``state_dict()`` and ``named_parameters()`` / ``parameters()`` wait for the
gathers in flight (a checkpoint, evaluation code). A module whose
forward reads a parameter of another module that is not called (a parent
using ``self.child.weight`` in its own forward) needs
``sync.optimizer(..., overlap_gather=False)``: then every gather is waited when
the model's forward starts. A direct attribute read (``model.fc.weight``)
outside a forward needs ``opt.wait_parameters()`` first.
The used-parameter mask is not a gradient there (it would be sharded): it
is summed with one sf_allreduce_float64 after the reduce-scatters, so
with ``find_unused_parameters=True`` (GradientSync's default) the shards
step after every bucket is reduced; pass
``find_unused_parameters=False`` for per-bucket steps.

``whole_gradients=False`` (sharded; or a callable asked at each window's
end): the default's final-gradient step without the gradient gather (1x
the bytes); ``.grad`` holds this rank's ranges only (``gradients_whole``
False) until ``opt.gather_gradients()``, and ``None`` after ``opt.step()``
(no partial gradient is left to read). The integrations choose it where
they own every reader of ``.grad`` (sfsync/torch/integrations).

``opt.clip_grad_norm_(max_norm)`` clips by the global norm as
``torch.nn.utils.clip_grad_norm_`` over the full model: torch's own
function while the gradients are whole; over ranges, torch's result bit
for bit wherever each rank owns its gradients whole (per-tensor norms
summed with one sf_allreduce_float64: sfsync/torch/clip.py); where a
gradient straddles two ranks (flat layout) it gathers first
(``whole_gradients=False``) or, with ``overlap_step=True``, takes a float64
norm from the ranges (equal to rounding). Call it before ``opt.step()``; it
waits for every bucket (no per-bucket overlap then).

State dicts (optim_state.py's StateDicts, "[Note: the sharded form]"): sharded,
``opt.state_dict()`` is a torch optimizer's whole-model form (state keyed by
parameter index) whose tensors hold this rank's range only, with
torch.distributed.checkpoint's shard fields: ``dcp.save`` / ``dcp.load`` of
it (the optimizer as a Stateful, or torch's ``get_state_dict`` /
``set_state_dict``) write each rank's part and reshard at any world size
and layout. ``opt.consolidate_state_dict(to=0)`` (collective;
ZeroRedundancyOptimizer's protocol, which Lightning calls) makes rank
``to``'s next ``state_dict()`` the full form, for frameworks that save from
one rank; ``opt.full_state_dict()`` (collective) is that full form on every
rank: exactly what the same torch.optim class over the whole model would
return (plus ``"sfsync_master"``, a bf16 parameter's float32 master).
``load_state_dict`` takes any of them at any world size and layout (each
rank takes its ranges), checks the groups, shapes and ranges on every rank
before any rank loads (a bad state is a ValueError on every rank naming the
parameter and what to call instead), and, as the saves, refuses inside a
window. Unsharded, every form is the inner optimizer's own state dict.

``param_groups`` are what a torch optimizer over the same parameters has:
the user's groups with the model's parameters, so that LR schedulers,
GradScaler.unscale_ and the frameworks' clipping over the optimizer's
parameters see the whole model. Sharded, the inner optimizer over this
rank's shard tensors gets their hyperparameters (lr, weight_decay, ...)
before each step, as ZeroRedundancyOptimizer's local optimizer does.

Who calls whom: the optimizer asks the WindowDriver
(sfsync/torch/window_driver.py) for every collective and wait, and steps
over a ShardMap (shard_map.py); it never calls GradientSync, which calls the
same driver. Its state dicts are a StateDicts object (optim_state.py).
"""

import math

import torch

from sfsync import shard
from sfsync.torch import clip
from sfsync.torch.face import SET_TO_NONE_DEFAULT
from sfsync.torch.optim_state import StateDicts
from sfsync.torch.shard_map import ShardMap, share_state
from sfsync.torch.window_driver import Phase

__all__ = ["SyncOptimizer", "Phase"]


class SyncOptimizer(torch.optim.Optimizer):
    """See the module docstring. Made by ``GradientSync.optimizer`` over
    its WindowDriver (``driver``), which runs every collective of the
    window (the waits, the mask, the publish, the buffer broadcast, the
    gathers).

    Built as torch's own wrappers are: ``torch.optim.Optimizer.__init__``
    over the model's parameters (the host's ``param_groups``, the step
    hooks, the profiler's step), and one inner ``optimizer_class`` per
    bucket over what this rank steps of that bucket's parameters (the
    parameters themselves, or sharded their shard tensors), each with one
    group per host group (possibly empty), all sharing this optimizer's
    ``state``. Stepping bucket b is ``inner[b].step()`` after the host
    groups' hyperparameters were copied into its groups."""

    def __init__(self, driver, optimizer_class, params, overlap_gather=True, overlap_step=False,
                 whole_gradients=True, **defaults):
        if not (isinstance(optimizer_class, type) and
                issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("sync.optimizer: optimizer_class must be a torch.optim.Optimizer "
                            "subclass, not %r" % (optimizer_class,))
        if driver.stepping:
            raise RuntimeError("sync.optimizer: this GradientSync already has an optimizer")
        if overlap_step and driver.accumulate_dtype is not None:
            raise ValueError("sync.optimizer(overlap_step=True) steps a bucket before the "
                             "window's gradients are cast into .grad; GradientSync(accumulate_"
                             "dtype=%s) needs overlap_step=False" % driver.accumulate_dtype)
        if not (isinstance(whole_gradients, bool) or callable(whole_gradients)):
            raise TypeError("sync.optimizer: whole_gradients must be True, False or a callable "
                            "returning one, not %r" % (whole_gradients,))
        self._driver = driver
        self._split = None   # per slot: the gradient straddles two ranks (first clip)
        self._class = optimizer_class
        self._buckets = driver.context.stats()["bucket_count"]
        self._map = ShardMap(driver, params, self._buckets)
        hyper = self._map.hyper
        # One inner optimizer per bucket that this rank steps something of.
        self._inner = []
        for b in range(self._buckets):
            mine = self._map.tensors(b)
            self._inner.append(optimizer_class([dict(h, params=ts) for h, ts in zip(hyper, mine)],
                                               **defaults) if any(mine) else None)
        template = next((o for o in self._inner if o is not None), None) or optimizer_class(
            [dict(h, params=[]) for h in hyper], **defaults)
        # The host's view: the model's parameters in the user's groups.
        torch.optim.Optimizer.__init__(
            self, [dict(h, params=[s.param for s in slots])
                   for h, slots in zip(hyper, self._map.groups)], template.defaults)
        for outer, inner in zip(self.param_groups, template.param_groups):
            for k, v in inner.items():  # what the class's own __init__ set in its groups
                outer.setdefault(k, v)
        share_state(self)
        self.steps = 0
        self._states = StateDicts(self, self._map, driver, optimizer_class)
        driver.attach_stepping(overlap_step, whole_gradients)
        if self.sharded:
            driver.install_gather_waits(self._map.bucket_of(), overlap_gather)

    @property
    def sharded(self):
        """Steps this rank's shards (asked: the driver asks the context)."""
        return self._driver.sharded

    @property
    def overlap_step(self):
        """Steps bucket by bucket inside ``opt.step()`` (see the module
        docstring; off unsharded with a single bucket)."""
        return self._driver.overlap_step

    @property
    def shard_map(self):
        """What this rank steps of each parameter (shard_map.py's ShardMap)."""
        return self._map

    @property
    def inner_optimizers(self):
        """The inner optimizer of each bucket (None where this rank steps
        nothing of the bucket)."""
        return list(self._inner)

    def _hyperparameters_in(self, inner):
        """The host's hyperparameters (a scheduler's lr, ...) into one inner
        optimizer's groups, as ZeroRedundancyOptimizer's local optimizer."""
        for outer, group in zip(self.param_groups, inner.param_groups):
            for k, v in outer.items():
                if k != "params":
                    group[k] = v

    def __getstate__(self):
        raise TypeError("an sfsync SyncOptimizer cannot be pickled: save opt.state_dict()")

    def __repr__(self):
        return "sfsync.%s(%s over %s, %d of %d parameters stepped here)" % (
            type(self).__name__, "sharded" if self.sharded else "per-bucket",
            self._class.__name__, len(self._map.stepped), len(self._map.slots))

    # -- state dicts (optim_state.py's StateDicts)

    def state_dict(self):
        """Unsharded: torch's own. Sharded: the per-rank form (optim_state.py:
        DCP-ready, whole-model keys, this rank's ranges); after
        ``consolidate_state_dict(to)``, on rank ``to``, once: the full form."""
        return self._states.state_dict()

    def full_state_dict(self):
        """Collective (every rank calls it): the full form, the state dict the
        same torch.optim class over the whole model would have, on every rank
        (plus ``"sfsync_master"``, the float32 master of a bf16/fp16
        parameter, in its state)."""
        return self._states.full_state_dict()

    def consolidate_state_dict(self, to=0):
        """ZeroRedundancyOptimizer's protocol (collective: every rank calls
        it): the full form is gathered on rank ``to``, whose next
        ``state_dict()`` (before another step) returns it. What Lightning
        calls before saving from global zero, and what the sfsync
        integrations call for the HF Trainer and Accelerate."""
        self._states.consolidate_state_dict(to)

    def load_state_dict(self, state_dict):
        """Takes any form: unsharded torch's own; sharded the full form (any
        world size and layout: each rank takes its ranges), this rank's own
        per-rank form, or a per-rank form that torch.distributed.checkpoint
        filled (its boxes resharded). Anything else is a ValueError naming
        the parameter, what the state dict holds and what to save instead."""
        self._states.load_state_dict(state_dict)

    # -- the window (its collectives are the driver's)

    @property
    def gradients_whole(self):
        """True when every ``.grad`` holds the whole reduced gradient once
        the window's reductions are waited: unsharded, or sharded after the
        gradient gather (the default: ``whole_gradients=True``). False in a
        sharded window whose gradients are this rank's ranges only
        (``overlap_step=True``, ``whole_gradients=False``): clip with
        ``opt.clip_grad_norm_``, or call ``opt.gather_gradients()``."""
        return self._driver.gradients_whole

    def gather_gradients(self):
        """Sharded: make every ``.grad`` the whole reduced gradient now
        (sf_gather_gradients, half an all-reduce's bytes), in a window whose
        gradients were left as this rank's ranges (``whole_gradients=False``
        or ``overlap_step=True``); nothing when they are whole already. Between
        the window's last backward and ``opt.step()`` (collective: every rank
        calls it)."""
        if self.gradients_whole:
            return
        phase = self._driver.phase
        if phase not in (Phase.REDUCING, Phase.SYNCHRONIZED):
            raise RuntimeError("sfsync: opt.gather_gradients() %s: call it between the window's "
                               "last backward and opt.step()" % (
                                   "after opt.step() (the parameter gathers started)"
                                   if phase == Phase.STEPPED else
                                   "before the window's last backward"))
        self.wait_gradients()
        self._driver.gather_gradients()

    def wait_gradients(self):
        """Wait for every bucket's reduction now (the gradients are final:
        in a sharded context, this rank's ranges)."""
        self._driver.wait_gradients()

    def wait_parameters(self):
        """Wait for every parameter gather in flight (sharded): afterwards
        every parameter is whole on this rank."""
        self._driver.wait_parameters()

    # -- stepping

    def _grad_of(self, s):
        g = s.param.grad
        if g is None:
            return None
        if not self.sharded:
            return g
        piece = s.piece(g)
        return piece.to(torch.float32) if s.master else piece

    def _step_bucket(self, b):
        slots = self._map.by_bucket[b]
        if not slots:
            return
        if self.sharded:
            for s in slots:
                # The view into p.grad, or a fresh float32 copy of it for a
                # master shard (after any clip scaled p.grad in place).
                s.tensor.grad = self._grad_of(s)
        inner = self._inner[b]
        self._hyperparameters_in(inner)
        inner.step()
        if self.sharded:
            with torch.no_grad():
                for s in slots:
                    if s.master:
                        s.piece(s.param.data).copy_(s.tensor)

    @torch.no_grad()
    def step(self, closure=None):
        """Step every parameter this rank owns (the inner optimizer's step),
        bucket by bucket as reductions complete; sharded: then every
        bucket's gather, in forward order (WindowDriver.stepped)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        driver = self._driver
        if self.sharded and driver.phase == Phase.IDLE:
            raise RuntimeError("sfsync: opt.step() before synchronization: a sharded optimizer "
                               "steps once per window, after the window's last backward pass "
                               "(when sync.is_step() is True); the gradients of this rank's "
                               "shard are not reduced yet")
        if driver.phase == Phase.STEPPED:
            raise RuntimeError("sfsync: opt.step() was already called for window %d; step once "
                               "per window (when sync.is_step() is True)" % driver.windows)
        mask_apart = self.sharded and driver.store.mask is not None  # summed apart
        if driver.phase == Phase.REDUCING and not mask_apart:
            self._step_per_bucket()
        else:
            self.wait_gradients()
            for b in range(self._buckets):
                self._step_bucket(b)
        driver.stepped()
        if not self.gradients_whole and not self.overlap_step:
            # whole_gradients=False: .grad held this rank's ranges only; after
            # the step it is None (no gradient) rather than a partial one
            # (code after the loop, a final inspection). zero_grad() would
            # drop it anyway; the next window starts from zero.
            for s in self._map.slots:
                s.param.grad = None
        self.steps += 1
        return loss

    def _step_per_bucket(self):
        driver, store = self._driver, self._driver.store
        deferred = []
        used = driver.local_used if store.mask is not None else None
        mask_bucket = (shard.gradient_bucket(driver.context, store.mask_id)
                       if used is not None and store.mask_id is not None else None)
        for b in range(self._buckets):
            driver.wait(b)
            if used is not None and b != mask_bucket and \
                    any(used[s.index] == 0 for s in self._map.by_bucket[b]) and \
                    (mask_bucket is None or not driver.waited(mask_bucket)):
                deferred.append(b)  # needs the global mask: after the mask's bucket
                continue
            if b == mask_bucket:
                for s in self._map.slots:  # the global mask is here: unused grads None first
                    if store.mask[s.index] == 0:
                        s.param.grad = None
            self._step_bucket(b)
        driver.finish()
        for b in deferred:
            self._step_bucket(b)

    def zero_grad(self, set_to_none=None):
        """Zero the gradients (GradientSync.zero_grad: the flat buffer in
        place, or None with set_to_none=True, re-attached at the next
        window; the default is torch's own: True since torch 2.0); the shard
        tensors' gradients are dropped."""
        if set_to_none is None:
            set_to_none = SET_TO_NONE_DEFAULT
        self._driver.zero_grad(set_to_none)
        if self.sharded:
            for s in self._map.stepped:
                s.tensor.grad = None

    # -- clipping

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """torch.nn.utils.clip_grad_norm_ over every parameter of the sync's
        module (the global gradient norm; the gradients scaled in place);
        returns the total norm. Before step().

        Bit for bit torch's wherever the result can be: whole gradients
        (unsharded, or sharded after the gather) go to torch's function; a
        sharded window's ranges where each rank owns its gradients whole
        (no gradient straddles two ranks: shard_layout="parameter", often a
        flat layout too) add the per-tensor norms with one
        sf_allreduce_float64 (sfsync/torch/clip.py). Where some gradient
        straddles ranks: with ``whole_gradients=False`` the gradients are
        gathered first (exact again, at the gather's bytes); with
        ``overlap_step=True`` the norm is accumulated in float64 from the
        ranges (one sf_allreduce_float64; it may differ from torch's float32
        one in the last bits)."""
        max_norm, norm_type = float(max_norm), float(norm_type)
        if math.isnan(norm_type) or norm_type <= 0:
            raise ValueError("clip_grad_norm_: norm_type must be p > 0 or inf, not %r"
                             % norm_type)
        self.wait_gradients()
        slots = [s for s in self._map.slots if s.param.grad is not None]
        straddle = not self.gradients_whole and any(self._straddling()[s.index] for s in slots)
        if straddle and not self.overlap_step:
            self.gather_gradients()  # no exact norm from pieces: whole, then torch's
        if self.gradients_whole:
            return torch.nn.utils.clip_grad_norm_([s.param for s in self._map.slots], max_norm,
                                                  norm_type)
        if not straddle:
            total = self._exact_norm(slots, norm_type)
        elif math.isinf(norm_type):
            raise ValueError("clip_grad_norm_: norm_type inf of an overlap_step=True "
                             "optimizer whose gradients straddle ranks (flat layout) is "
                             "not supported; use a finite p, or shard_layout='parameter'")
        else:
            total = self._float64_norm(slots, norm_type)
        coef = clip.clip_coefficient(max_norm, total)
        for s in slots:
            if s.count > 0:
                s.piece(s.param.grad).mul_(coef.to(s.param.grad.device))
        return total

    def _straddling(self):
        """Per slot: its gradient straddles two ranks (the same answer on
        every rank: one sf_allreduce_float64, the first time)."""
        if self._split is None:
            t = torch.tensor([1.0 if 0 < s.count < s.param.numel() else 0.0
                              for s in self._map.slots], dtype=torch.float64)
            shard.allreduce_float64(self._driver.context, t)
            self._split = [v > 0 for v in t.tolist()]
        return self._split

    def _exact_norm(self, slots, norm_type):
        """torch's total norm: each rank's whole gradients' norms (torch's
        function), summed across ranks (0.0 from the others: exact)."""
        grads = [s.param.grad for s in slots]
        mine = [k for k, s in enumerate(slots) if s.count == s.param.numel() and s.count > 0]
        t = torch.zeros(len(slots), dtype=torch.float64)
        for k, n in zip(mine, clip.tensor_norms([grads[k] for k in mine], norm_type)):
            t[k] = float(n)
        shard.allreduce_float64(self._driver.context, t)
        norms = [torch.tensor(v, dtype=g.dtype, device=g.device)
                 for v, g in zip(t.tolist(), grads)]
        return clip.total_norm(norms, grads, norm_type)

    def _float64_norm(self, slots, norm_type):
        """The norm accumulated in float64 from this rank's ranges (one
        sf_allreduce_float64), as a float32 tensor (float64 gradients: float64)."""
        pieces = [s.piece(s.param.grad) for s in slots if s.count > 0]
        t = torch.tensor([sum(float(g.double().abs().pow(norm_type).sum()) for g in pieces)],
                         dtype=torch.float64)
        shard.allreduce_float64(self._driver.context, t)
        wide = any(s.param.grad.dtype == torch.float64 for s in slots)
        return torch.tensor(float(t[0]) ** (1.0 / norm_type),
                            dtype=torch.float64 if wide else torch.float32)
