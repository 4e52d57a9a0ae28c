"""sfsync's start-up hook for unmodified Python hosts (the no-code path).

This folder is put first on PYTHONPATH by the shim (LD_PRELOAD of
libsfsync_shim.so into a Python interpreter) or by hand
(``PYTHONPATH=$(python3 -m sfsync boot-path)``, with ``SF_FOLLOW_HOST=1``).
Python imports ``sitecustomize`` at start-up; this one installs
sfsync.torch.follow when SF_FOLLOW_HOST is 1 (nothing else is imported: no
torch, no library, until the host imports DistributedDataParallel), then
runs the ``sitecustomize`` it shadows (Debian's, a virtual environment's),
so that nothing the host relied on is lost.
"""


def _sfsync_boot():
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("SF_FOLLOW_HOST", "") == "1":
        try:
            import sfsync  # noqa: F401
        except ImportError:  # the source tree: python/ is two folders up
            sys.path.append(os.path.dirname(os.path.dirname(here)))
        try:
            from sfsync.follow_boot import install
            install()
        except Exception as e:  # never keep the host from starting
            sys.stderr.write("sfsync: SF_FOLLOW_HOST=1, but the no-code path could not be "
                             "installed: %s: %s\n" % (type(e).__name__, e))
            if os.environ.get("SF_STRICT", "") == "1":
                raise
    # The sitecustomize this one shadows, if any.
    for entry in sys.path:
        if not entry or os.path.realpath(entry) == os.path.realpath(here):
            continue
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_sfsync_shadowed_sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            break


_sfsync_boot()
del _sfsync_boot
