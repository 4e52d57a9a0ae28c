"""Replica verification: are the ranks' parameters (and buffers) the same
bytes? One chained sf_digest per check and one 8-byte sf_check_replicas; on
a mismatch a binary search names the first differing tensor.

Responsible for: ``Verifier`` (the check), ``ReplicaMismatchError``,
``ReplicaCheck`` (verify_every for a trainer with neither GradientSync nor
attach), ``named_state``. Not responsible for: when a GradientSync or DDPSync
checks (face.py: verify_if_due), the bytes of a tensor (store.py).
"""

import ctypes
import weakref

import torch

import sfsync
from sfsync.torch.store import host_address
from sfsync.torch.rendezvous import log, make_context

__all__ = ["ReplicaMismatchError", "Verifier", "ReplicaCheck", "named_state"]


class ReplicaMismatchError(RuntimeError):
    """Ranks hold different parameters (verify_every). ``name`` is the first
    differing tensor, ``step`` the number of optimizer steps (windows) taken
    when the weights compared were read."""

    def __init__(self, message, name=None, step=None):
        super().__init__(message)
        self.name, self.step = name, step


def _digest(t, seed=0):
    """sf_digest of a tensor's bytes."""
    address, nbytes, keep = host_address(t)
    if not nbytes:
        return seed
    out = ctypes.c_uint64()
    sfsync.lib().sf_digest(address, nbytes, seed, ctypes.byref(out))
    del keep
    return out.value


def _chain(values):
    """The digests of each prefix of ``values`` (64-bit ints), chained."""
    lib = sfsync.lib()
    word, out, acc = ctypes.c_uint64(), ctypes.c_uint64(), 0
    prefix = []
    for v in values:
        word.value = v
        lib.sf_digest(ctypes.addressof(word), 8, acc, ctypes.byref(out))
        acc = out.value
        prefix.append(acc)
    return prefix


class Verifier:
    """Compares the named tensors' bytes across ranks: one chained digest
    and sf_check_replicas; on a mismatch, a binary search over prefixes of
    the per-tensor digests (log2(n) + 1 more checks, the same answer on every
    rank) names the first differing tensor."""

    def __init__(self, ctx, named):
        self.ctx = ctx
        self.named = named  # callable -> [(name, tensor)]
        self.checks = 0

    def check(self, step):
        self.checks += 1
        if self.ctx.options()["world_size"] == 1:
            return  # one replica: nothing to compare, nothing to pay
        named = self.named()
        prefix = _chain([_digest(t) for _, t in named])
        chain = prefix[-1] if prefix else 0
        try:
            self.ctx.check_replicas(chain)
            log(sfsync.LOG_TRACE, "step %d: replicas agree (%d tensors)" % (step, len(named)))
            return
        except sfsync.MismatchError as e:
            first = e.message
        lo, hi = 0, len(named) - 1  # the first i whose prefix 0..i differs
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                self.ctx.check_replicas(prefix[mid])
                lo = mid + 1
            except sfsync.MismatchError:
                hi = mid
        name = named[lo][0] if named else None
        message = ("sfsync: replicas differ after optimizer step %d: the first differing tensor "
                   "is %r (%s)" % (step, name, first))
        log(sfsync.LOG_WARN, message)
        raise ReplicaMismatchError(message, name, step)


def named_state(module, buffers):
    """A callable -> [(name, tensor)]: the parameters (and buffers)."""
    def named():
        out = [(n, p) for n, p in module.named_parameters()]
        if buffers:
            out += [(n, b) for n, b in module.named_buffers()]
        return out
    return named


class ReplicaCheck:
    """``verify_every`` for a trainer that uses neither GradientSync nor
    attach (e.g. DDP under the shim with SF_ACCUMULATION_STEPS): every K
    training forwards of ``module`` (forwards with grad enabled, i.e. steps
    of a loop that steps every pass), compare the ranks' parameters (and
    buffers with ``buffers=True``); ReplicaMismatchError from that forward,
    naming the first differing tensor. ``ReplicaCheck(model, every=K)``."""

    def __init__(self, module, every, buffers=False, context=None, **options):
        if not isinstance(every, int) or every < 1:
            raise ValueError("ReplicaCheck: every must be an integer >= 1, not %r" % (every,))
        self.every = every
        self.forwards = 0
        self._owns_context = context is None
        self.context = context if context is not None else make_context(**options)
        if self.context.options()["world_size"] > 1:
            self.context.connect()
        self._verifier = Verifier(self.context, named_state(module, buffers))
        self._handle = module.register_forward_pre_hook(
            _forward_hook(weakref.WeakMethod(self._forward)))

    def _forward(self):
        if torch.is_grad_enabled():
            self.forwards += 1
            if self.forwards % self.every == 0:  # the weights after forwards - 1 steps
                self._verifier.check(self.forwards - 1)

    def close(self):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._owns_context and self.context is not None:
            ctx, self.context = self.context, None
            ctx.close()


def _forward_hook(method):
    """A forward pre-hook calling ``method`` (a WeakMethod) while it lives."""
    def hook(module, inputs):
        fn = method()
        if fn is not None:
            fn()
    return hook
