"""The no-code path's start, before torch is imported: ``install()`` waits
for the host to import ``torch.nn.parallel.distributed`` and then has
sfsync/torch/follow.py attach every DistributedDataParallel the host makes.

Responsible for: the import hook (a ``sys.meta_path`` finder that runs the
patch right after that module executes, or at once if it is imported
already), ``boot_path()`` (the folder to put on PYTHONPATH). Not
responsible for: what an attached DDP does (sfsync/torch/follow.py). Imports
neither torch nor the library: every Python process the shim is preloaded
into runs this, most of them never train.
"""

import importlib.abc
import os
import sys
import threading

__all__ = ["install", "boot_path", "TARGET"]

#: The module whose import triggers the patch.
TARGET = "torch.nn.parallel.distributed"

_lock = threading.Lock()
_installed = False


def boot_path():
    """The folder holding sfsync's sitecustomize (put it first on PYTHONPATH)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")


def _patch():
    """Wrap DistributedDataParallel.__init__ (once). The module executes
    inside ``import torch``, so sfsync.torch (which needs the whole of torch)
    is imported at the first DDP's construction, not here."""
    module = sys.modules[TARGET]
    cls = module.DistributedDataParallel
    init = cls.__init__
    if getattr(init, "sfsync_follow", False):
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        from sfsync.torch import follow
        follow.follow(self)

    __init__.sfsync_follow = True
    __init__.__wrapped__ = init
    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of TARGET so that the patch
    runs right after the module body."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                exec_module = loader.exec_module

                def exec_and_patch(module, _exec=exec_module):
                    _exec(module)
                    _patch()

                loader.exec_module = exec_and_patch
                return spec
        return None


def install():
    """Attach every DDP the host makes from now on (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    if TARGET in sys.modules:
        _patch()
    else:
        sys.meta_path.insert(0, _AfterImport())
