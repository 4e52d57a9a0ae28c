"""Longer than 400 lines: the module docstring (about 100 lines) is the user's
reference for overlap_step, sharding and clipping, and the class is one
object (set-up, waits, per-bucket steps, clipping); its state dicts are
apart (optim_state.py).

The optimizer of a GradientSync (``sync.optimizer(cls, params, **kw)``):
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

State dicts (optim_state.py, "[Note: the sharded form]"): sharded,
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
"""

import enum
import math
import weakref

import torch

from sfsync import shard
from sfsync.torch import clip
from sfsync.torch.face import SET_TO_NONE_DEFAULT
from sfsync.torch.optim_state import ShardedStateDicts

__all__ = ["SyncOptimizer", "Phase"]

_LOW = (torch.bfloat16, torch.float16)


class Phase(enum.Enum):
    """Where the optimizer is in the window's cycle."""
    IDLE = "idle"                  # no window closed since the last step
    REDUCING = "reducing"          # the window's collectives started, not all waited
    SYNCHRONIZED = "synchronized"  # every bucket waited: gradients final
    STEPPED = "stepped"            # sharded: stepped, its gathers started


class _Slot:
    """One model parameter and what this rank steps of it."""

    __slots__ = ("index", "param", "gid", "bucket", "offset", "count", "tensor", "master")

    def __init__(self, index, param, gid, bucket, offset, count):
        self.index, self.param, self.gid, self.bucket = index, param, gid, bucket
        self.offset, self.count = offset, count
        self.tensor = None   # what the inner optimizer steps (None: nothing here)
        self.master = False  # tensor is a float32 master copy of a bf16/fp16 shard

    def piece(self, t):
        """This rank's range of ``t`` (shaped as the parameter): ``t`` itself
        where the rank holds the whole parameter, else a flat view."""
        if self.offset == 0 and self.count == self.param.numel():
            return t
        return t.view(-1)[self.offset:self.offset + self.count]


class SyncOptimizer(ShardedStateDicts, torch.optim.Optimizer):
    """See the module docstring. Made by ``GradientSync.optimizer``, which
    passes its own ``after_synchronize`` (unused parameters' ``.grad = None``,
    the buffer broadcast, once every bucket is reduced).

    Built as torch's own wrappers are: ``torch.optim.Optimizer.__init__``
    over the model's parameters (the host's ``param_groups``, the step
    hooks, the profiler's step), and one inner ``optimizer_class`` per
    bucket over what this rank steps of that bucket's parameters (the
    parameters themselves, or sharded their shard tensors), each with one
    group per host group (possibly empty), all sharing this optimizer's
    ``state``. Stepping bucket b is ``inner[b].step()`` after the host
    groups' hyperparameters were copied into its groups."""

    def __init__(self, sync, optimizer_class, params, overlap_gather=True, overlap_step=False,
                 after_synchronize=None, whole_gradients=True, **defaults):
        if not (isinstance(optimizer_class, type) and
                issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("sync.optimizer: optimizer_class must be a torch.optim.Optimizer "
                            "subclass, not %r" % (optimizer_class,))
        if sync.sync_optimizer is not None:
            raise RuntimeError("sync.optimizer: this GradientSync already has an optimizer")
        if overlap_step and getattr(sync, "accumulate_dtype", None) is not None:
            raise ValueError("sync.optimizer(overlap_step=True) steps a bucket before the "
                             "window's gradients are cast into .grad; GradientSync(accumulate_"
                             "dtype=%s) needs overlap_step=False" % sync.accumulate_dtype)
        if not (isinstance(whole_gradients, bool) or callable(whole_gradients)):
            raise TypeError("sync.optimizer: whole_gradients must be True, False or a callable "
                            "returning one, not %r" % (whole_gradients,))
        self._whole_rule = whole_gradients
        self._whole = True   # every .grad holds the whole reduced gradient (once waited)
        self._split = None   # per slot: the gradient straddles two ranks (first clip)
        self._sync = weakref.proxy(sync)
        self._store = sync.store
        self._after_synchronize = after_synchronize if after_synchronize is not None else (
            lambda: None)
        self._class = optimizer_class
        self._sharded = sync.shard_optimizer
        ctx = sync.context
        self._buckets = ctx.stats()["bucket_count"]
        # The rule (issue 24): unsharded with one bucket there is no other
        # bucket's wire time for a step to overlap, so the per-bucket step
        # cannot win: off (the final-gradient step). Sharded it stays: there
        # it also leaves out the gradient gather.
        self.overlap_step = bool(overlap_step) and (self._sharded or self._buckets > 1)
        index_of = {id(p): i for i, p in enumerate(sync.params)}
        self._slots = []
        for i, (p, gid) in enumerate(zip(sync.params, self._store.ids)):
            off, cnt = shard.shard_range(ctx, gid) if self._sharded else (0, p.numel())
            self._slots.append(_Slot(i, p, gid, shard.gradient_bucket(ctx, gid), off, cnt))
        groups = list(params)
        if not groups:
            raise ValueError("sync.optimizer: got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._full_groups = []
        seen = set()
        for g in groups:
            ps = g["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            slots = []
            for p in ps:
                i = index_of.get(id(p))
                if i is None:
                    raise ValueError("sync.optimizer: a parameter of shape %s is not one of the "
                                     "GradientSync's (trainable parameters of its module)"
                                     % list(p.shape))
                if i in seen:
                    raise ValueError("sync.optimizer: parameter %r appears in more than one "
                                     "group" % sync.names[i])
                seen.add(i)
                slots.append(self._slots[i])
            self._full_groups.append(slots)
            for s in slots:
                self._make_tensor(s)
        self._stepped = [s for group in self._full_groups for s in group if s.tensor is not None]
        self._by_bucket = [[] for _ in range(self._buckets)]
        for s in self._stepped:
            self._by_bucket[s.bucket].append(s)
        self._unstepped = [s for s in self._slots if s.index not in seen]
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        # One inner optimizer per bucket that this rank steps something of.
        self._inner = []
        for b in range(self._buckets):
            mine = [[s.tensor for s in slots if s.tensor is not None and s.bucket == b]
                    for slots in self._full_groups]
            self._inner.append(optimizer_class([dict(h, params=ts) for h, ts in zip(hyper, mine)],
                                               **defaults) if any(mine) else None)
        template = next((o for o in self._inner if o is not None), None) or optimizer_class(
            [dict(h, params=[]) for h in hyper], **defaults)
        # The host's view: the model's parameters in the user's groups.
        torch.optim.Optimizer.__init__(
            self, [dict(h, params=[s.param for s in slots])
                   for h, slots in zip(hyper, self._full_groups)], template.defaults)
        for outer, inner in zip(self.param_groups, template.param_groups):
            for k, v in inner.items():  # what the class's own __init__ set in its groups
                outer.setdefault(k, v)
        self._share_state()
        self._phase = Phase.IDLE
        self._waited = set()     # buckets waited this window
        self._gathering = set()  # buckets whose gather is in flight
        self.local_used = None   # GradientSync's used mask at the window's last pass (unsharded)
        self.steps = 0
        self._hooks = []
        self._patched = []       # modules whose named_parameters() waits for the gathers
        if self._sharded:
            self._install_gather_hooks(sync.module, overlap_gather)
            self._install_read_waits(sync.module)

    @property
    def inner_optimizers(self):
        """The inner optimizer of each bucket (None where this rank steps
        nothing of the bucket)."""
        return list(self._inner)

    def _share_state(self):
        """Every inner optimizer's state is this optimizer's ``state``."""
        for inner in self._inner:
            if inner is not None:
                inner.state = self.state

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
            type(self).__name__, "sharded" if self._sharded else "per-bucket",
            self._class.__name__, len(self._stepped), len(self._slots))

    # -- set-up

    def _make_tensor(self, s):
        p = s.param
        if not self._sharded:
            s.tensor = p
        elif s.count == 0:
            return None
        else:
            view = s.piece(p.data)
            if p.dtype in _LOW:
                s.tensor = view.detach().to(torch.float32, copy=True)
                s.master = True
            else:
                s.tensor = view.detach()
        return s.tensor

    def _install_gather_hooks(self, module, overlap):
        by_param = {id(s.param): s.bucket for s in self._slots}
        me = weakref.WeakMethod(self._wait_gathers)
        if not overlap:  # every gather waited when the model's forward starts
            self._hooks.append(module.register_forward_pre_hook(
                _gather_hook(me, list(range(self._buckets))[::-1])))
            return
        for m in module.modules():
            buckets = sorted({by_param[id(p)] for p in m.parameters(recurse=False)
                              if id(p) in by_param}, reverse=True)
            if buckets:
                self._hooks.append(m.register_forward_pre_hook(_gather_hook(me, buckets)))

    def _install_read_waits(self, module):
        """Reads of the parameters outside a forward wait for the gathers in
        flight: every module's state_dict() (a checkpoint) and
        named_parameters() / parameters() (saving, evaluation code, the
        frameworks' own loops). Direct attribute reads (``model.fc.weight``)
        cannot be seen: wait_parameters() first, or overlap_gather=False."""
        me = weakref.ref(self)
        for m in module.modules():
            if hasattr(m, "register_state_dict_pre_hook"):
                self._hooks.append(m.register_state_dict_pre_hook(_read_pre_hook(me)))
            else:  # torch 1.13 (no public pre hook): a post hook; the dict holds views
                self._hooks.append(m._register_state_dict_hook(_read_post_hook(me)))
            m.__dict__["named_parameters"] = _waiting_named_parameters(me, m)
            self._patched.append(m)

    def detach(self):
        """GradientSync.close(): remove the hooks and the patched reads."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for m in self._patched:
            m.__dict__.pop("named_parameters", None)
        self._patched = []

    # -- called by GradientSync (its window protocol)

    def window_closed(self):
        """The window's last pass ended: start what is left of the bucket
        collectives; unless overlap_step, wait for all of them, so that
        every .grad is final when is_step() turns True."""
        self._gathering.clear()  # the plugin waits for last window's gathers itself
        shard.synchronize_start(self._sync.context)
        self._phase = Phase.REDUCING
        self._waited = set()
        self._global_used = None
        self._whole = not self._sharded
        if not self.overlap_step:
            self._synchronize(whole=self._wants_whole())

    def _wants_whole(self):
        rule = self._whole_rule
        return bool(rule() if callable(rule) else rule)

    @property
    def gradients_whole(self):
        """True when every ``.grad`` holds the whole reduced gradient once
        the window's reductions are waited: unsharded, or sharded after the
        gradient gather (the default: ``whole_gradients=True``). False in a
        sharded window whose gradients are this rank's ranges only
        (``overlap_step=True``, ``whole_gradients=False``): clip with
        ``opt.clip_grad_norm_``, or call ``opt.gather_gradients()``."""
        return not self._sharded or self._whole

    def window_failed(self):
        """The window's synchronization failed and the plugin ended it (a
        weighted window of global weight 0): nothing to wait for, no step."""
        self._waited = set(range(self._buckets))
        self._phase = Phase.IDLE

    def window_starts(self):
        """A new window starts (forward at its start): a window that was
        closed without a step is synchronized now (the step is skipped)."""
        if self._phase == Phase.REDUCING:
            self._synchronize()
        self._phase = Phase.IDLE

    # -- waiting

    def _wait(self, b):
        if b not in self._waited:
            shard.wait_bucket(self._sync.context, b)
            self._store.after_plugin()  # the optimizer's stream after the reduction
            self._waited.add(b)

    def _synchronize(self, whole=False):
        """Wait for every bucket; the window check and count (sf_synchronize);
        the used mask (sharded: one sf_allreduce_float64) and the buffers.
        ``whole`` (sharded): gather the reduced gradient shards too, so that
        every rank's .grad holds the whole reduced gradient (user code may
        read it: torch's clip, GradScaler.unscale_ over param_groups)."""
        sync = self._sync
        sync.context.synchronize()
        self._store.after_plugin()  # the optimizer's stream after the reductions
        self._waited = set(range(self._buckets))
        if self._sharded and self._store.mask is not None:
            self.wait_parameters()
            shard.allreduce_float64(sync.context, self._store.mask)
        if self._sharded and whole:
            shard.gather_gradients(sync.context)
            self._store.after_plugin()
            self._whole = True
        self._after_synchronize()
        self._phase = Phase.SYNCHRONIZED

    def gather_gradients(self):
        """Sharded: make every ``.grad`` the whole reduced gradient now
        (sf_gather_gradients, half an all-reduce's bytes), in a window whose
        gradients were left as this rank's ranges (``whole_gradients=False``
        or ``overlap_step=True``); nothing when they are whole already. Between
        the window's last backward and ``opt.step()`` (collective: every rank
        calls it)."""
        if self.gradients_whole:
            return
        if self._phase not in (Phase.REDUCING, Phase.SYNCHRONIZED):
            raise RuntimeError("sfsync: opt.gather_gradients() %s: call it between the window's "
                               "last backward and opt.step()" % (
                                   "after opt.step() (the parameter gathers started)"
                                   if self._phase == Phase.STEPPED else
                                   "before the window's last backward"))
        self.wait_gradients()
        shard.gather_gradients(self._sync.context)
        self._store.after_plugin()
        self._whole = True

    def wait_gradients(self):
        """Wait for every bucket's reduction now (the gradients are final:
        in a sharded context, this rank's ranges)."""
        if self._phase == Phase.REDUCING:
            self._synchronize()

    def wait_parameters(self):
        """Wait for every parameter gather in flight (sharded): afterwards
        every parameter is whole on this rank."""
        if self._gathering:
            shard.wait_gather(self._sync.context, -1)
            self._store.after_gather()
            self._gathering.clear()

    def _wait_gathers(self, buckets):
        if not self._gathering:
            return
        ctx = self._sync.context
        waited = False
        for b in buckets:
            if b in self._gathering:
                shard.wait_gather(ctx, b)
                self._gathering.discard(b)
                waited = True
        if waited:  # the forward's stream waits for them on the device
            self._store.after_gather()

    # -- stepping

    def _grad_of(self, s):
        g = s.param.grad
        if g is None:
            return None
        if not self._sharded:
            return g
        piece = s.piece(g)
        return piece.to(torch.float32) if s.master else piece

    def _step_slots(self, slots):
        if not slots:
            return
        if self._sharded:
            for s in slots:
                # The view into p.grad, or a fresh float32 copy of it for a
                # master shard (after any clip scaled p.grad in place).
                s.tensor.grad = self._grad_of(s)
        inner = self._inner[slots[0].bucket]  # (the slots of one bucket)
        self._hyperparameters_in(inner)
        inner.step()
        if self._sharded:
            with torch.no_grad():
                for s in slots:
                    if s.master:
                        s.piece(s.param.data).copy_(s.tensor)

    def _step_bucket(self, b):
        self._step_slots(self._by_bucket[b])

    def _start_gathers(self):
        """Sharded: every bucket's parameter gather, in forward order (the
        reverse of the bucket order: the last bucket reduced holds the first
        layers, which the next forward needs first), once every bucket has
        stepped. Started as each bucket stepped, the first layers' gather
        would queue behind every other's and the next forward would wait
        for all of them. The same order on every rank (not the order the
        forward hooks fire in, which data may change)."""
        if not self._sharded:
            return
        self._store.before_plugin()  # the gathers read what the steps wrote
        for b in reversed(range(self._buckets)):
            shard.start_gather(self._sync.context, b)
            self._gathering.add(b)

    @torch.no_grad()
    def step(self, closure=None):
        """Step every parameter this rank owns (the inner optimizer's step),
        bucket by bucket as reductions complete; sharded: start each bucket's
        gather after its step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sync = self._sync
        if self._sharded and self._phase == Phase.IDLE:
            raise RuntimeError("sfsync: opt.step() before synchronization: a sharded optimizer "
                               "steps once per window, after the window's last backward pass "
                               "(when sync.is_step() is True); the gradients of this rank's "
                               "shard are not reduced yet")
        if self._phase == Phase.STEPPED:
            raise RuntimeError("sfsync: opt.step() was already called for window %d; step once "
                               "per window (when sync.is_step() is True)" % sync.windows)
        mask_apart = self._sharded and self._store.mask is not None  # summed apart
        if self._phase == Phase.REDUCING and not mask_apart:
            self._step_per_bucket()
        else:
            self.wait_gradients()
            for b in range(self._buckets):
                self._step_bucket(b)
            self._start_gathers()
        if not self.gradients_whole and not self.overlap_step:
            # whole_gradients=False: .grad held this rank's ranges only; after
            # the step it is None (no gradient) rather than a partial one
            # (code after the loop, a final inspection). zero_grad() would
            # drop it anyway; the next window starts from zero.
            for s in self._slots:
                s.param.grad = None
        self._phase = Phase.STEPPED if self._sharded else Phase.IDLE
        self.steps += 1
        return loss

    def _step_per_bucket(self):
        sync = self._sync
        deferred = []
        used = self.local_used if self._store.mask is not None else None
        mask_id = self._store.mask_id
        mask_bucket = (shard.gradient_bucket(sync.context, mask_id)
                       if used is not None and mask_id is not None else None)
        for b in range(self._buckets):
            self._wait(b)
            if used is not None and b != mask_bucket and mask_bucket not in self._waited and \
                    any(used[s.index] == 0 for s in self._by_bucket[b]):
                deferred.append(b)  # needs the global mask: after the mask's bucket
                continue
            if b == mask_bucket:
                for s in self._slots:  # the global mask is here: unused grads None first
                    if self._store.mask[s.index] == 0:
                        s.param.grad = None
            self._step_bucket(b)
        self._synchronize()
        for b in deferred:
            self._step_bucket(b)
        self._start_gathers()

    def zero_grad(self, set_to_none=None):
        """Zero the gradients (GradientSync.zero_grad: the flat buffer in
        place, or None with set_to_none=True, re-attached at the next
        window; the default is torch's own: True since torch 2.0); the shard
        tensors' gradients are dropped."""
        if set_to_none is None:
            set_to_none = SET_TO_NONE_DEFAULT
        self._sync.zero_grad(set_to_none=set_to_none)
        if self._sharded:
            for s in self._stepped:
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
        slots = [s for s in self._slots if s.param.grad is not None]
        straddle = not self.gradients_whole and any(self._straddling()[s.index] for s in slots)
        if straddle and not self.overlap_step:
            self.gather_gradients()  # no exact norm from pieces: whole, then torch's
        if self.gradients_whole:
            return torch.nn.utils.clip_grad_norm_([s.param for s in self._slots], max_norm,
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
                              for s in self._slots], dtype=torch.float64)
            shard.allreduce_float64(self._sync.context, t)
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
        shard.allreduce_float64(self._sync.context, t)
        norms = [torch.tensor(v, dtype=g.dtype, device=g.device)
                 for v, g in zip(t.tolist(), grads)]
        return clip.total_norm(norms, grads, norm_type)

    def _float64_norm(self, slots, norm_type):
        """The norm accumulated in float64 from this rank's ranges (one
        sf_allreduce_float64), as a float32 tensor (float64 gradients: float64)."""
        pieces = [s.piece(s.param.grad) for s in slots if s.count > 0]
        t = torch.tensor([sum(float(g.double().abs().pow(norm_type).sum()) for g in pieces)],
                         dtype=torch.float64)
        shard.allreduce_float64(self._sync.context, t)
        wide = any(s.param.grad.dtype == torch.float64 for s in slots)
        return torch.tensor(float(t[0]) ** (1.0 / norm_type),
                            dtype=torch.float64 if wide else torch.float32)


def _read_pre_hook(me):
    def hook(module, prefix, keep_vars):
        opt = me()
        if opt is not None:
            opt.wait_parameters()
    return hook


def _read_post_hook(me):
    def hook(module, state_dict, prefix, local_metadata):
        opt = me()
        if opt is not None:
            opt.wait_parameters()
    return hook


def _waiting_named_parameters(me, module):
    method = type(module).named_parameters

    def named_parameters(*args, **kwargs):
        opt = me()
        if opt is not None:
            opt.wait_parameters()
        return method(module, *args, **kwargs)
    return named_parameters


def _gather_hook(method, buckets):
    def hook(module, inputs):
        wait = method()
        if wait is not None:
            wait(buckets)
    return hook
