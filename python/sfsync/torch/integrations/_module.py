"""SyncedModule: a GradientSync in DistributedDataParallel's shape, for
frameworks that take and drive an nn.Module (they call it, move it, put it
in train mode, read its parameters and look for ``no_sync`` by name).

It is responsible for that shape only: windows, reduction, verification and
the optimizer are the GradientSync's (sfsync/torch/gradient_sync.py), what
the integrations share around it is _adapter.py's.
"""

import torch

# sync_optimizer for clip_grad_norm_; the rest live in _adapter.py and are
# named here too for the 0.3 location sfsync.integrations._module (its
# __all__ is this one).
from sfsync.torch.integrations._adapter import (consolidate_for_save, overrides,  # noqa: F401
                                                owned_gradients, rebuild_optimizer,
                                                split_options, sync_optimizer)

__all__ = ["SyncedModule", "synced", "sync_optimizer", "rebuild_optimizer", "split_options",
           "consolidate_for_save", "owned_gradients", "overrides"]


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


def synced(model):
    """The SyncedModule in or at ``model`` (None if there is none)."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        if isinstance(model, SyncedModule):
            return model
        model = getattr(model, "module", None)
    return None
