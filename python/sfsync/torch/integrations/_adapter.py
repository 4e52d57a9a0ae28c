"""What the frameworks' integrations share (accelerate.py, lightning.py,
transformers.py), written once: the options split between GradientSync and
``sync.optimizer``, the refusal of sfsync's own window count, the "is the
sync still open" check, the ``whole_gradients`` decision, the rebuild of a
framework's optimizer as sfsync's, the save-time gather, and the patch of a
framework object's method. ``FrameworkAdapter`` holds these for the
integrations that are objects of their framework (Lightning's strategy, the
HF Trainer); Accelerate's is a function and calls the helpers.

Not responsible for the nn.Module shape (``SyncedModule``, _module.py), for
when a framework makes or closes its GradientSync, or for its hooks and
checkpoint files: those stay with each framework's integration.
"""

import inspect
import weakref

__all__ = ["FrameworkAdapter", "split_options", "refuse_window_count", "sync_open",
           "sync_optimizer", "owned_gradients", "overrides", "rebuild_optimizer",
           "consolidate_for_save", "patch_method"]

#: Options of sync.optimizer(...) (sfsync/torch/optim.py) that a framework's
#: integration takes with GradientSync's and passes to the optimizer it builds.
OPTIMIZER_OPTIONS = ("overlap_step", "overlap_gather", "whole_gradients")


def split_options(options):
    """(GradientSync's keyword arguments, sync.optimizer's) from one dict."""
    sync = dict(options)
    return sync, {k: sync.pop(k) for k in OPTIMIZER_OPTIONS if k in sync}


def refuse_window_count(options, who, whose):
    """TypeError when ``options`` hold GradientSync's ``accumulation_steps``:
    the framework decides the windows. ``who`` names the integration's entry
    point, ``whose`` the framework's own setting (the message reads "<who>:
    accumulation_steps is <whose>")."""
    if "accumulation_steps" in options:
        raise TypeError("%s: accumulation_steps is %s" % (who, whose))


def sync_open(sync):
    """True while ``sync`` (a GradientSync or DDPSync, or None) exists and is
    not closed: its context is alive."""
    return sync is not None and sync.context is not None


def sync_optimizer(sync):
    """The optimizer made by ``sync.optimizer(...)``, or None (also for
    ``sync`` None)."""
    return getattr(sync, "sync_optimizer", None)  # (DDPSync has none: DDP steps)


def owned_gradients(optimizer_options, owns_readers):
    """``optimizer_options`` with ``whole_gradients`` decided by the
    framework's integration unless the user gave it: whole (the gradient
    gather) unless the bound method ``owns_readers()`` says that nothing but
    sfsync reads ``.grad`` between the window's last backward and the step
    (asked at each window's end, so callbacks added later count; held
    weakly: the optimizer does not keep the trainer alive).

    Lightning and the HF Trainer decide it (``FrameworkAdapter``); the
    Accelerate integration does not: there the user writes the loop and
    builds the optimizer (``model.sync.optimizer(...)``), so no integration
    can see who reads ``.grad``, and sync.optimizer's own default (whole)
    holds unless the user passes ``whole_gradients``."""
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
    opt = sync_optimizer(sync)
    if opt is not None and sync.shard_optimizer:  # (asked: the context holds it)
        opt.consolidate_state_dict(to)


def patch_method(obj, name, make):
    """``obj.<name>`` replaced on this instance by ``make(original)``, where
    ``original`` is the bound method it had; once: an instance that holds a
    replacement already keeps it (the framework object outlives one
    integration call, and the first replacement serves the later ones)."""
    if name not in vars(obj):
        setattr(obj, name, make(getattr(obj, name)))


class FrameworkAdapter:
    """Base of an integration that is an object of its framework (Lightning's
    strategy, the HF Trainer or its mixin): it holds the GradientSync
    (``sync``) and the options for it and for ``sync.optimizer``, and decides
    ``whole_gradients`` through ``_owns_gradient_readers``, which the
    subclass answers for its framework. It defines no ``__init__`` (it sits
    in the framework class's MRO): the subclass calls ``_take_options``."""

    def _take_options(self, options):
        """GradientSync's options and sync.optimizer's (split_options); no
        GradientSync yet."""
        self._sync_options, self._optimizer_options = split_options(options)
        self.sync = None

    def _sync_open(self):
        return sync_open(self.sync)

    def _shards_optimizer(self):
        """The optimizer is sharded: the sync says once it exists (its
        context holds the setting); before, the options it will be made with."""
        if self._sync_open():
            return bool(getattr(self.sync, "shard_optimizer", False))  # (DDPSync: never)
        return bool(self._sync_options.get("shard_optimizer"))

    def _owned_options(self):
        """sync.optimizer's options, ``whole_gradients`` decided
        (owned_gradients)."""
        return owned_gradients(self._optimizer_options, self._owns_gradient_readers)

    def _rebuilt(self, opt):
        """The framework's plain optimizer ``opt`` as sfsync's (rebuild_optimizer)."""
        return rebuild_optimizer(self.sync, opt, **self._owned_options())

    def _owns_gradient_readers(self):
        """True when nothing but sfsync reads ``.grad`` between a window's
        last backward and the step's end (the framework's answer)."""
        raise NotImplementedError
