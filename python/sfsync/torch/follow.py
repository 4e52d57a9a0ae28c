"""The no-code path: every DistributedDataParallel an unmodified host makes
is attached as ``attach(ddp)`` without a count, so its gradient reductions
follow the windows the host wrote (sfsync/host_window.py): a backward inside
any DDP's ``no_sync()`` stays local, whatever the forward did, and the
optimizer step ends a window.

Started by sfsync/follow_boot.py (``SF_FOLLOW_HOST=1``: the shim sets it for
a Python host, or the user with ``PYTHONPATH=$(python3 -m sfsync
boot-path)``, which wraps ``DistributedDataParallel.__init__`` to call
``follow``). Responsible for: the hosts it cannot serve (said once at WARN with the alternative, an error
at the DDP's construction with ``SF_STRICT=1``), the host's own comm hook
(registered after ours: it does the sending, sfsync keeps the window), the
first guess (``SF_ACCUMULATION_STEPS``), and a line per DDP at exit
(``SF_DEBUG=INFO``). Not responsible for: the hook and the window
(ddp.py, host_window.py).
"""

import atexit
import ctypes
import os
import weakref

import sfsync
from sfsync.torch.rendezvous import log

__all__ = ["follow", "following"]

_said = set()
_syncs = []  # weak references to every DDPSync made here, for the exit line


def _say_once(key, message):
    if key not in _said:
        _said.add(key)
        log(sfsync.LOG_WARN, message)


def _strict():
    return os.environ.get("SF_STRICT", "") == "1"


def _guess():
    """SF_ACCUMULATION_STEPS as the first window's guessed length (steps decide)."""
    value = os.environ.get("SF_ACCUMULATION_STEPS")
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        _say_once("steps", "SF_ACCUMULATION_STEPS=%r is not a positive integer: ignored (the "
                  "optimizer step ends each window)" % value)
        return None
    return n


def following(ddp):
    """The DDPSync that follows ``ddp``'s windows, or None."""
    return ddp.__dict__.get("_sfsync_follow")


def _cannot(ddp, why):
    message = ("SF_FOLLOW_HOST: cannot follow the windows of this DistributedDataParallel (%s): "
               "its gradients are reduced as DDP decides, at every backward whose forward ran "
               "outside no_sync(). Alternatives: no_sync() around forward and backward, or "
               "sfsync.torch.GradientSync(model)" % why)
    if _strict():
        raise RuntimeError(message + " (SF_STRICT=1)")
    _say_once(why, message)


def follow(ddp):
    """Attach sfsync to ``ddp`` (a DistributedDataParallel just made), or say
    why not. Returns the DDPSync or None."""
    from sfsync.torch import ddp as ddp_module
    if following(ddp) is not None:
        return following(ddp)
    if getattr(ddp, "mixed_precision", None) is not None:
        return _cannot(ddp, "mixed_precision= registered DDP's own communication hook")
    try:
        ddp_module.refuse_python_reducer()
    except RuntimeError:
        return _cannot(ddp, "torch._dynamo.config.optimize_ddp = 'python_reducer'")
    sync = ddp_module.DDPSync(ddp, guess=_guess(), connect=False)
    ddp.__dict__["_sfsync_follow"] = sync  # lives as long as the DDP (the hooks hold it weakly)
    _chain_host_hooks(ddp, sync)
    if not _syncs:
        atexit.register(_at_exit)
        _tell_the_shim()
    _syncs.append(weakref.ref(sync))
    log(sfsync.LOG_INFO, "SF_FOLLOW_HOST: DDP %d (%d parameters) follows the host's windows"
        "%s" % (len(_syncs), sum(1 for _ in ddp.module.parameters()),
                ", first guess %d passes" % sync.guess if sync.guess else ""))
    return sync


def _tell_the_shim():
    """A preloaded shim passes every all-reduce from now on (its windows are
    ours); a Python host with no DDP keeps the shim's own windows."""
    try:
        fn = ctypes.CDLL(None).sf_shim_follow_in_process
    except AttributeError:  # no shim preloaded
        return
    fn.restype = None
    fn.argtypes = []
    fn()


def _chain_host_hooks(ddp, sync):
    """DDP takes one comm hook: ours is registered. A hook the host registers
    later does the sending for the passes sfsync sends."""
    def register_comm_hook(state, hook):
        sync.set_host_hook(state, hook)

    def register_builtin_comm_hook(comm_hook_type):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        name = getattr(comm_hook_type, "name", str(comm_hook_type))
        if name == "FP16_COMPRESS":
            register_comm_hook(ddp.process_group, default_hooks.fp16_compress_hook)
        elif name == "ALLREDUCE":
            register_comm_hook(ddp.process_group, default_hooks.allreduce_hook)
        else:
            raise RuntimeError("sfsync (SF_FOLLOW_HOST): builtin comm hook %s is not one it can "
                               "chain; unset SF_FOLLOW_HOST" % name)

    ddp.__dict__["register_comm_hook"] = register_comm_hook
    ddp.__dict__["register_builtin_comm_hook"] = register_builtin_comm_hook


def _at_exit():
    for i, ref in enumerate(_syncs, 1):
        sync = ref()
        if sync is not None:
            c = sync.counts()
            log(sfsync.LOG_INFO, "SF_FOLLOW_HOST: DDP %d: %d windows, %d buckets reduced (%d "
                "bytes), %d kept local (%d bytes), %d steps reduced what a wrong guess left "
                "local (%d bytes)" % (i, c["windows"], c["reduced_buckets"], c["bytes_reduced"],
                                      c["deferred_buckets"], c["bytes_deferred"], c["catch_ups"],
                                      c["catch_up_bytes"]))
