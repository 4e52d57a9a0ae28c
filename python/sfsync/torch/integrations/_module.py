"""SyncedModule: a GradientSync in DistributedDataParallel's shape, for
frameworks that take and drive an nn.Module (they call it, move it, put it
in train mode, read its parameters and look for ``no_sync`` by name).

It is responsible for that shape only: windows, reduction, verification and
the optimizer are the GradientSync's (sfsync/torch/gradient_sync.py).
"""

import inspect
import weakref

import torch

__all__ = ["SyncedModule", "synced", "sync_optimizer", "rebuild_optimizer", "split_options",
           "consolidate_for_save", "owned_gradients", "overrides"]

#: Options of sync.optimizer(...) (sfsync/torch/optim.py) that a framework's
#: integration takes with GradientSync's and passes to the optimizer it builds.
OPTIMIZER_OPTIONS = ("overlap_step", "overlap_gather", "whole_gradients")


def split_options(options):
    """(GradientSync's keyword arguments, sync.optimizer's) from one dict."""
    sync = dict(options)
    return sync, {k: sync.pop(k) for k in OPTIMIZER_OPTIONS if k in sync}


class SyncedModule(torch.nn.Module):
    """``SyncedModule(sync)``: ``.module`` is the GradientSync's module (a
    submodule, so ``parameters()``, ``train()``, ``to()`` and
    ``state_dict()`` reach it, keys prefixed ``module.`` as DDP's),
    ``forward`` calls it through the GradientSync, ``no_sync()`` is the
    GradientSync's (forward and backward inside it accumulate locally; the
    next pass outside synchronizes), ``.sync`` is the GradientSync.

    ``host_defers``: for a framework that says "this micro-batch does not
    synchronize" by a flag rather than (only) by ``no_sync()`` (Accelerate's
    ``sync_gradients``, which it keeps also where it enters no ``no_sync()``:
    one process), a callable read at each forward; True runs that forward
    inside ``no_sync()``, exactly as the framework's own ``no_sync()`` would."""

    def __init__(self, sync, host_defers=None):
        super().__init__()
        self.module = sync.module
        object.__setattr__(self, "sync", sync)  # not a submodule (no second parameter list)
        object.__setattr__(self, "host_defers", host_defers)

    def forward(self, *args, **kwargs):
        call = self.sync if callable(self.sync) else self.module
        if self.host_defers is not None and self.host_defers():
            with self.sync.no_sync():
                return call(*args, **kwargs)
        return call(*args, **kwargs)

    def no_sync(self):
        """DDP's context manager: micro-batches 1..N-1 of a window."""
        return self.sync.no_sync()

    def is_step(self):
        return self.sync.is_step()

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """Clip by the global gradient norm (as FSDP's method of the same
        name); returns the norm before clipping. While every ``.grad`` is
        whole (GradientSync's default), ``torch.nn.utils.clip_grad_norm_``
        over the module's parameters: DDP's result bit for bit. With a
        sharded optimizer whose gradients are this rank's ranges
        (``overlap_step=True``, or ``whole_gradients=False``, which the
        integrations choose where they own every reader of ``.grad``), that
        optimizer's ``clip_grad_norm_``: torch's bits wherever each rank owns
        its gradients whole (sfsync/torch/optim.py)."""
        opt = sync_optimizer(self.sync)
        if opt is not None and (getattr(opt, "overlap_step", False) or
                                not getattr(opt, "gradients_whole", True)):
            return opt.clip_grad_norm_(max_norm, norm_type)
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)


def owned_gradients(optimizer_options, owns_readers):
    """``optimizer_options`` with ``whole_gradients`` decided by the
    framework's integration unless the user gave it: whole (the gradient
    gather) unless the bound method ``owns_readers()`` says that nothing but
    sfsync reads ``.grad`` between the window's last backward and the step
    (asked at each window's end, so callbacks added later count; held
    weakly: the optimizer does not keep the trainer alive)."""
    if "whole_gradients" in optimizer_options:
        return dict(optimizer_options)
    method = weakref.WeakMethod(owns_readers)

    def whole():
        owns = method()
        return owns is None or not owns()
    return dict(optimizer_options, whole_gradients=whole)


def overrides(obj, base, names):
    """The names of ``names`` that ``type(obj)`` defines otherwise than
    ``base`` does (a framework hook or method a user class replaced)."""
    return [n for n in names if getattr(type(obj), n, None) is not getattr(base, n, None)]


def sync_optimizer(sync):
    """The optimizer made by ``sync.optimizer(...)``, or None."""
    return getattr(sync, "sync_optimizer", None)  # (DDPSync has none: DDP steps)


def synced(model):
    """The SyncedModule in or at ``model`` (None if there is none)."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        if isinstance(model, SyncedModule):
            return model
        model = getattr(model, "module", None)
    return None


def rebuild_optimizer(sync, opt, **optimizer_options):
    """``sync.optimizer`` of ``opt``'s class, parameter groups and
    constructor defaults, for a framework that built a plain one (before any
    step: its state is not carried over). torch's optimizers keep some
    defaults their constructor does not take (AdamW's
    decoupled_weight_decay): only the constructor's arguments pass."""
    cls = type(opt)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
    groups = [{k: v for k, v in g.items() if k == "params" or k in accepted}
              for g in opt.param_groups]
    return sync.optimizer(cls, groups, **optimizer_options, **defaults)


def consolidate_for_save(sync, to=0):
    """Before a framework saves the optimizer from rank ``to`` alone (the HF
    Trainer's main process, Accelerate's ``save_state``; Lightning calls
    ``consolidate_state_dict`` itself): every rank gathers a sharded sfsync
    optimizer's full form there, so that the file resumes on every rank, at
    any world size (collective: called on every rank)."""
    opt = sync_optimizer(sync) if sync is not None else None
    if opt is not None and getattr(opt, "_sharded", False):
        opt.consolidate_state_dict(to)
