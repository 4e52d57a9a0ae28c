"""The CUDA/NCCL stand-ins (tests/standin: NOT CUDA, NOT NCCL) for a Python
test of sfsync.torch's device path: import this module first, before
anything imports sfsync (the plugin's NCCL module must find the stand-ins,
by path: pip torch loads the real libcudart/libnccl into the global scope,
so LD_LIBRARY_PATH alone would not put them under torch 2.x).

``STANDIN``: the stand-in directory (SF_STANDIN_LIB_DIR), or None;
``needs_standin``: a unittest skip decorator for when it is None;
``require(who)``: with CI=true a missing stand-in directory is an error, not
a skip. Also puts the checkout's python/ on sys.path when no sfsync is.
"""

import os
import sys
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
if not any(os.path.exists(os.path.join(p, "sfsync", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.join(ROOT, "python"))

STANDIN = os.environ.get("SF_STANDIN_LIB_DIR")
if STANDIN:  # before anything loads the plugin's NCCL module
    os.environ.setdefault("SF_CUDART_LIBRARY", os.path.join(STANDIN, "libcudart.so.13"))
    os.environ.setdefault("SF_NCCL_LIBRARY", os.path.join(STANDIN, "libnccl.so.2"))

needs_standin = unittest.skipUnless(STANDIN, "SF_STANDIN_LIB_DIR not set: no CUDA stand-in")


def require(who):
    if not STANDIN and os.environ.get("CI") == "true":
        raise SystemExit("%s: SF_STANDIN_LIB_DIR is not set (CI=true: not a skip)" % who)
