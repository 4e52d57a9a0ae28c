"""The host's optimizer step, seen from outside the host's code: one
process-wide pre-step hook that ends the windows of every face that follows
the host (DDPSync without a count), and reduces what a wrong guess left
local before anything reads ``.grad``.

Responsible for: installing the hook once, on torch 2.x through torch's
global ``register_optimizer_step_pre_hook`` (every optimizer built on
``torch.optim.Optimizer``, whoever built it), on torch 1.13 (which has no
global hook) by wrapping ``step`` of every ``Optimizer`` subclass, those
defined now and later (a re-entrant ``super().step()`` counts once). The
same hook runs first in ``torch.nn.utils.clip_grad_norm_`` and
``clip_grad_value_`` and in GradScaler's ``unscale_``, which frameworks call
between the window's last backward and the step: they must read the reduced
gradients (a clip bound by name before the first DDP was made is not seen). The optimizers
made after install are remembered (weakly), so that a face can tell whether
the step of its parameters will be seen (``steps_seen_for``).
Not responsible for: what a step means to a window (HostWindow.step), the
reduction (catch_up.py).
"""

import functools
import threading
import weakref

import torch

__all__ = ["install", "installed", "steps_seen_for"]

_optimizers = weakref.WeakSet()  # torch optimizers made since install()

_lock = threading.Lock()
_installed = False
_depth = threading.local()


def installed():
    return _installed


def install():
    """Install the pre-step hook (once per process). True: the step is seen."""
    global _installed
    with _lock:
        if _installed:
            return True
        import torch.optim.optimizer as optimizer_module
        register = getattr(optimizer_module, "register_optimizer_step_pre_hook", None)
        if register is not None:
            register(lambda optimizer, args, kwargs: _before_step())
        else:
            _wrap_every_optimizer_class()
        _remember_optimizers()
        _wrap_clips()
        _wrap_unscale()
        _installed = True
        return True


def steps_seen_for(parameters):
    """True when a torch optimizer made since install() holds one of these
    parameters: its step will be seen."""
    ids = {id(p) for p in parameters}
    return any(id(p) in ids for opt in list(_optimizers)
               for group in opt.param_groups for p in group["params"])


def _remember_optimizers():
    base = torch.optim.Optimizer
    init = base.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _optimizers.add(self)

    base.__init__ = __init__


def _wrap_clips():
    """clip_grad_norm_ / clip_grad_value_ (torch.nn.utils and its clip_grad
    module, where hosts look them up) reduce what is due first."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        fn = getattr(clip_grad, name, None)
        if fn is None or getattr(fn, "sfsync_step", False):
            continue

        def wrapped(*args, _fn=fn, **kwargs):
            _before_step()
            return _fn(*args, **kwargs)

        functools.update_wrapper(wrapped, fn)
        wrapped.sfsync_step = True
        for module in (clip_grad, utils):
            if getattr(module, name, None) is fn:
                setattr(module, name, wrapped)


def _before_step():
    from sfsync.torch.ddp import following_syncs  # (ddp imports this module)
    from sfsync.torch.catch_up import reduce_left_local
    due = [s for s in following_syncs() if s.before_step()]
    if due:
        reduce_left_local(due)


# -- torch 1.13: no global hook

def _wrap_unscale():
    """GradScaler.unscale_ (torch.amp's, torch.cuda.amp's) reads .grad for
    infs: the reduced gradients, or the ranks could disagree on a skip."""
    classes = []
    for path in ("torch.amp.grad_scaler", "torch.cuda.amp.grad_scaler"):
        try:
            module = __import__(path, fromlist=["GradScaler"])
        except ImportError:
            continue
        cls = getattr(module, "GradScaler", None)
        if cls is not None and cls not in classes:
            classes.append(cls)
    for cls in classes:
        unscale = cls.__dict__.get("unscale_")
        if unscale is None or getattr(unscale, "sfsync_step", False):
            continue

        def wrapped(self, optimizer, _fn=unscale):
            _before_step()
            return _fn(self, optimizer)

        functools.update_wrapper(wrapped, unscale)
        wrapped.sfsync_step = True
        setattr(cls, "unscale_", wrapped)


def _wrap_step(cls):
    step = cls.__dict__.get("step")
    if step is None or getattr(step, "sfsync_step", False):
        return

    def wrapped(self, *args, **kwargs):
        depth = getattr(_depth, "n", 0)
        if depth == 0:
            _before_step()
        _depth.n = depth + 1
        try:
            return step(self, *args, **kwargs)
        finally:
            _depth.n = depth

    wrapped.sfsync_step = True
    wrapped.__wrapped__ = step
    wrapped.__name__ = getattr(step, "__name__", "step")
    wrapped.__doc__ = getattr(step, "__doc__", None)
    # torch 1.13's profiler wrapper (Optimizer._hook_for_profile) marks the
    # class's step as hooked; keep the mark so that it wraps ours once.
    if getattr(step, "hooked", False):
        wrapped.hooked = True
    setattr(cls, "step", wrapped)


def _wrap_every_optimizer_class():
    base = torch.optim.Optimizer
    todo = [base]
    while todo:
        cls = todo.pop()
        _wrap_step(cls)
        todo.extend(cls.__subclasses__())
    previous = base.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        _wrap_step(cls)

    base.__init_subclass__ = classmethod(__init_subclass__)
