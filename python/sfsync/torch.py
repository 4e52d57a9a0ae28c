"""PyTorch integration of sfsync: gradients synchronized exactly once per
gradient-accumulation window, in a trainer launched by torchrun or not.

Two ways in, one line each:

``GradientSync(model, accumulation_steps=N)`` replaces DDP. It counts the
backward passes itself: the loop stays ::

    sync = sfsync.torch.GradientSync(model, accumulation_steps=4)
    for x, y in loader:
        (loss_fn(model(x), y) / 4).backward()     # loss scaling: yours, explicit
        if sync.is_step():                        # the 4th pass synchronized
            opt.step()
            opt.zero_grad()

``attach(ddp_model, accumulation_steps=N)`` keeps DDP: it registers a DDP
communication hook bound to sfsync's window state. Inside a window a bucket is
returned locally (nothing is sent); outside it is averaged with the process
group's all-reduce, as DDP's default. Same loop, no ``no_sync()``.

Both also follow the host's own windows instead of counting, as the
trainer frameworks drive DDP: ``with sync.no_sync():`` (GradientSync, or
DDP's own ``ddp.no_sync()`` under attach) around forward and backward of
micro-batches 1..N-1, and the first pass outside synchronizes at its end
(sfsync/host_window.py: the rule between the host and a counter). Both take
``verify_every=K``: every K optimizer steps (windows) the ranks compare a
digest of their parameters (``verify_buffers=True``: and buffers) with one
8-byte collective, and a mismatch raises ``ReplicaMismatchError`` on every
rank naming the first differing tensor (found by a second round). A check
costs one pass over the weights' bytes (1-3 ms per 10 MB measured here) plus
one small collective; K = 100 costs nothing measurable, K = 1 is for
debugging.

Where sfsync meets its peers (the rule, see ``make_context``):

1. ``torch.distributed`` initialized: through torch's own store
   (``_get_default_store()``) under a key prefix per context: no port of its
   own, nothing to collide with torchrun's.
2. else under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``): through a
   client of torchrun's store on ``MASTER_ADDR:MASTER_PORT``.
3. else: sfsync's own ``env://`` store on ``MASTER_PORT`` (e.g. ``sfsync-run``),
   or whatever ``SF_RENDEZVOUS`` says. Initialize torch.distributed first if
   you use both.

The context connects when attached (``sf_connect``), so a wrong world size or
an unreachable store is an error there, not inside a backward pass. Initial
parameters and buffers are broadcast from rank 0 at attach (``sf_broadcast``),
as DDP does.

Logging goes through sfsync's logger (``SF_DEBUG=INFO`` shows each attach).
"""

import contextlib
import ctypes
import datetime
import inspect
import itertools
import os
import threading
import time
import weakref

import torch

import sfsync
from sfsync import shard
from sfsync.host_window import HostWindow

__all__ = ["GradientSync", "DDPSync", "attach", "ReplicaCheck", "ReplicaMismatchError",
           "make_context", "sf_dtype"]

_DTYPES = {
    torch.float32: sfsync.DTYPE_FLOAT32,
    torch.float64: sfsync.DTYPE_FLOAT64,
    torch.float16: sfsync.DTYPE_FLOAT16,
    torch.bfloat16: sfsync.DTYPE_BFLOAT16,
}

_contexts = itertools.count()  # the key prefix of each context made here
# module -> weakref to the open GradientSync attached to it (one at a time).
_attached = weakref.WeakKeyDictionary()


def sf_dtype(dtype):
    """The sf_dtype of a torch dtype (TypeError for those sfsync cannot reduce)."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError("sfsync reduces float32, float64, float16 and bfloat16 gradients, "
                        "not %s" % dtype) from None


def _sf_device(device):
    if device.type == "cpu":
        return sfsync.DEVICE_HOST
    if device.type == "cuda":
        return sfsync.DEVICE_CUDA
    raise TypeError("sfsync has no device for %s parameters" % device)


def _log(level, message):
    sfsync.log(level, message, "torch")


class ReplicaMismatchError(RuntimeError):
    """Ranks hold different parameters (verify_every). ``name`` is the first
    differing tensor, ``step`` the number of optimizer steps (windows) taken
    when the weights compared were read."""

    def __init__(self, message, name=None, step=None):
        super().__init__(message)
        self.name, self.step = name, step


# ---- Where ranks meet --------------------------------------------------------


def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def _check_counts(who, accumulation_steps, verify_every):
    """ValueError naming the argument unless each is None or an int >= 1."""
    for name, value in (("accumulation_steps", accumulation_steps),
                        ("verify_every", verify_every)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError("%s: %s must be an integer >= 1 or None, not %r"
                             % (who, name, value))


def _set_window(context, local):
    """The context's window state for a pass that stays local (inside a
    window) or synchronizes (outside)."""
    if context.in_accumulation() != local:
        if local:
            context.begin_accumulation()
        else:
            context.end_accumulation()


#: torch's own default for zero_grad(set_to_none=...): False in 1.13, True since 2.0.
SET_TO_NONE_DEFAULT = inspect.signature(torch.optim.Optimizer.zero_grad).parameters[
    "set_to_none"].default


class _WindowFace:
    """What GradientSync and DDPSync share: the HostWindow (which pass stays
    local), the host's no_sync() flag, and the window numbers read through
    the face (windows, accumulation_steps, is_step)."""

    _window = None
    _host_inside = False

    @property
    def accumulation_steps(self):
        return self._window.accumulation_steps

    @property
    def windows(self):
        """Windows synchronized (= optimizer steps)."""
        return self._window.windows

    @windows.setter
    def windows(self, value):
        self._window.windows = value

    @property
    def _passes(self):
        return self._window.passes

    def is_step(self):
        """True once the window's last backward pass has synchronized (every
        .grad holds the reduced gradient on every rank), until the next
        backward pass starts: the time to clip, unscale and step."""
        return self._window.step_ready

    def set_accumulation_steps(self, n):
        """Windows of ``n`` backward passes from the next window on (now if
        no pass of the current window has started), e.g. an epoch's shorter
        last window. Every rank must call it at the same point."""
        _check_counts("set_accumulation_steps", n, None)
        if n is None or not self.accumulation_steps:
            raise ValueError("set_accumulation_steps: %r (%s was made without "
                             "accumulation_steps: its windows come from no_sync())"
                             % (n, type(self).__name__))
        self._window.set_accumulation_steps(n)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's ``no_sync()``: the forward and backward passes inside it
        stay local (their gradients sum into .grad, nothing is sent); the
        first backward pass outside synchronizes the window at its end.
        Trainer frameworks call it (Accelerate's accumulate(), Lightning,
        the HF Trainer); with ``accumulation_steps`` too, the host's windows
        must agree with it in the first window (RuntimeError otherwise)."""
        _verify_if_due(self)  # before the window's forwards move the buffers
        outer = self._host_inside
        self._host_inside = True
        _set_window(self.context, True)
        try:
            yield self
        finally:
            self._host_inside = outer
            if not outer and self.context is not None and self.context.in_accumulation():
                self.context.end_accumulation()

    accumulate = no_sync  # sfsync's own name for it


def _torch_store_callbacks(store):
    """set/get callables over a c10d store for Context.set_store.

    Two traps of torch 1.13's TCPStore client shape this. It is one socket
    and not thread-safe, while sfsync calls these from several threads: every
    operation holds one lock. And a wait() that times out leaves the
    server's late answer in the socket, so the next request reads the wrong
    reply: nothing here ever waits with a timeout. Each value gets a counter
    key (add() answers at once and creates it at 0), and get() polls that
    counter until the value exists, then reads it."""
    lock = threading.Lock()

    def set_fn(key, value):
        with lock:
            store.set(key, value)
            store.add(key + "/sfsync.set", 1)

    def get_fn(key, timeout_ms):
        deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
        pause = 0.0005
        while True:
            with lock:
                if store.add(key + "/sfsync.set", 0) > 0:
                    return store.get(key)
            if time.monotonic() >= deadline:
                raise TimeoutError("key %r did not appear within %d ms" % (key, timeout_ms))
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
    return set_fn, get_fn


def _agent_store():
    """A client of torchrun's own store (MASTER_ADDR:MASTER_PORT), or None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    import torch.distributed as dist
    timeout = int(os.environ.get("SF_TIMEOUT_MS", "300000"))
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=datetime.timedelta(milliseconds=timeout))


def make_context(store=None, prefix=None, **options):
    """An sfsync.Context for this process, meeting its peers by the rule in
    the module docstring. ``store``: a c10d store to use instead. ``prefix``:
    the context's key prefix in the store, the same on every rank; by default
    ``sfsync/ctx<k>`` for the k-th context made here, so ranks must make their
    contexts (GradientSync, attach, ReplicaCheck) in the same order, else pass
    ``prefix=`` (GradientSync and attach forward it). ``options``:
    sf_options fields (rank, world_size, timeout_ms, ...); with
    torch.distributed initialized, rank and world_size default to its own."""
    dist = _dist()
    how = None
    if store is None and dist is not None:
        store = dist.distributed_c10d._get_default_store()
        options.setdefault("rank", dist.get_rank())
        options.setdefault("world_size", dist.get_world_size())
        how = "torch.distributed's store"
    elif store is None and "rendezvous" not in options:
        store = _agent_store()
        how = "torchrun's store" if store is not None else None
    elif store is not None:
        how = "the given store"
    if store is not None:
        # The store replaces the rendezvous ("host://": the host's store).
        options.setdefault("rendezvous", "host://")
    ctx = sfsync.Context(**options)
    try:
        if store is not None:
            if prefix is None:
                prefix = "sfsync/ctx%d" % next(_contexts)
            set_fn, get_fn = _torch_store_callbacks(store)
            ctx.set_store(set_fn, get_fn, prefix)
        o = ctx.options()
        _log(sfsync.LOG_INFO, "context rank %d/%d meets through %s" % (
            o["rank"], o["world_size"],
            "%s, prefix %s" % (how, prefix) if store is not None
            else (o["rendezvous"] or "nothing (world size 1)")))
    except BaseException:
        ctx.close()
        raise
    return ctx


# ---- Tensors as bytes ----------------------------------------------------------


def _bytes_view(t):
    """A contiguous CPU uint8 tensor holding t's bytes (t itself when it can)."""
    t = t.detach()
    if t.is_cuda or not t.is_contiguous():
        t = t.contiguous().cpu()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _broadcast_tensors(ctx, tensors, root=0):
    """One sf_broadcast of every tensor's bytes, in place."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return
    views = [_bytes_view(t) for t in tensors]
    flat = torch.cat(views)
    ctx.broadcast(flat, root)
    offset = 0
    with torch.no_grad():
        for t, v in zip(tensors, views):
            n = v.numel()
            src = flat[offset:offset + n]
            offset += n
            if t.is_cuda or not t.is_contiguous():
                t.copy_(src.clone().view(t.dtype).view(t.shape))
            else:
                v.copy_(src)


def _digest(t, seed=0):
    """sf_digest of a tensor's bytes (a contiguous CPU tensor directly)."""
    t = t.detach()
    if t.is_cuda or not t.is_contiguous():
        t = t.contiguous().cpu()
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return seed
    out = ctypes.c_uint64()
    sfsync.lib().sf_digest(t.data_ptr(), nbytes, seed, ctypes.byref(out))
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


class _Verifier:
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
            _log(sfsync.LOG_TRACE, "step %d: replicas agree (%d tensors)" % (step, len(named)))
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
        _log(sfsync.LOG_WARN, message)
        raise ReplicaMismatchError(message, name, step)


def _verify_if_due(sync):
    """verify_every: once every verify_every windows, outside a window,
    compare the replicas (GradientSync and DDPSync). GradientSync calls it at
    a window's first forward and on entering accumulate(), before any forward
    of the window moved a buffer (verify_buffers), and at later forwards;
    DDPSync at the wrapped module's forward, after DDP's buffer broadcast."""
    if (sync._verifier is not None and sync.windows - sync._last_verified >= sync._verify_every
            and not sync.context.in_accumulation()):
        sync._last_verified = sync.windows
        sync._verifier.check(sync.windows)


def _named_state(module, buffers):
    def named():
        out = [(n, p) for n, p in module.named_parameters()]
        if buffers:
            out += [(n, b) for n, b in module.named_buffers()]
        return out
    return named


_STATE_FORMAT = 1


def _state_dict(sync, kind):
    """state_dict() of GradientSync and DDPSync (see GradientSync.state_dict)."""
    if not sync._at_window_boundary():
        raise RuntimeError("%s.state_dict(): called inside a window (%d backward passes of it "
                           "done): save at a step, when is_step() is True"
                           % (kind, sync._passes))
    return {"format": _STATE_FORMAT, "kind": kind, "windows": sync.windows,
            "accumulation_steps": sync.accumulation_steps, "verify_every": sync._verify_every,
            "last_verified": sync._last_verified,
            "checks": sync._verifier.checks if sync._verifier is not None else 0}


def _load_state_dict(sync, kind, state):
    """load_state_dict() of GradientSync and DDPSync: ValueError naming the
    key for a state that is not one of ours or does not fit this object."""
    who = "%s.load_state_dict" % kind
    if not isinstance(state, dict):
        raise TypeError("%s: expected the dict state_dict() returned, not %s"
                        % (who, type(state).__name__))
    if state.get("format") != _STATE_FORMAT or state.get("kind") not in ("GradientSync",
                                                                         "DDPSync"):
        raise ValueError("%s: not an sfsync state (format %r, kind %r; expected format %d)"
                         % (who, state.get("format"), state.get("kind"), _STATE_FORMAT))
    for key in ("windows", "last_verified", "checks"):
        value = state.get(key)
        if not isinstance(value, int) or value < 0:
            raise ValueError("%s: state[%r] = %r is not an integer >= 0" % (who, key, value))
    if state["last_verified"] > state["windows"]:
        raise ValueError("%s: state['last_verified'] = %d is after state['windows'] = %d"
                         % (who, state["last_verified"], state["windows"]))
    if state.get("accumulation_steps") != sync.accumulation_steps:
        raise ValueError("%s: the state was saved with accumulation_steps=%r, this object has "
                         "accumulation_steps=%r: a resumed run must count windows the same way"
                         % (who, state.get("accumulation_steps"), sync.accumulation_steps))
    if not sync._at_window_boundary():
        raise RuntimeError("%s: called inside a window (%d backward passes of it done): load "
                           "before training resumes" % (who, sync._passes))
    if state.get("verify_every") != sync._verify_every:
        _log(sfsync.LOG_INFO, "%s: verify_every was %r, is now %r" % (
            who, state.get("verify_every"), sync._verify_every))
    sync.windows = state["windows"]
    sync._last_verified = state["last_verified"]
    if sync._verifier is not None:
        sync._verifier.checks = state["checks"]


# ---- GradientSync ----------------------------------------------------------------


def _queue_callback(fn):
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class GradientSync(_WindowFace):
    """Attaches an nn.Module's parameters to an sfsync context, in place of DDP.

    ``GradientSync(module, context=None, *, accumulation_steps=None,
    flat_buffer=True, hooks=True, broadcast=True, broadcast_buffers=True,
    find_unused_parameters=True, verify_every=None, verify_buffers=False,
    store=None, bucket_cap_mb=None, first_bucket_cap_mb=None, **options)``

    * Windows, as DDP's: the passes inside ``with sync.no_sync():`` (forward
      and backward) stay local; the first backward pass outside synchronizes
      at its end (inside ``backward()``), and ``is_step()`` is True until the
      next pass: every ``.grad`` then holds the reduced gradient on every
      rank. ``sync(x)`` is the module's forward and ``sync.module`` the
      module, so trainer frameworks drive it as they drive DDP. A host
      without backward hooks (``hooks=False``) keeps every pass inside
      ``no_sync()`` and calls ``sync.synchronize()``.
    * ``accumulation_steps=N``: for loops with no ``no_sync()``: passes
      1..N-1 of each window stay local, the N-th synchronizes. A host that
      uses ``no_sync()`` anyway decides (see sfsync/host_window.py: the
      first window must agree with N, else RuntimeError).
    * Loss scaling is the caller's: gradients are averaged over ranks and
      summed over the window's passes, so divide each micro-batch's loss by N
      to get DDP's ``no_sync()`` result.
    * At attach: connect (collective), broadcast parameters and buffers from
      rank 0 (``broadcast``). After each synchronization the buffers (e.g.
      BatchNorm statistics) are broadcast from rank 0 (``broadcast_buffers``).
    * Parameters that received no gradient in a window on any rank get
      ``.grad = None`` (``find_unused_parameters``, as DDP's): one extra float
      per parameter travels in the same buckets, no extra collective. Frozen
      parameters (``requires_grad=False``) are ignored.
    * A parameter added, removed, resized or frozen after attach is an error
      at the next synchronization, naming it.
    * ``verify_every=K``: see the module docstring.
    * ``shard_optimizer=True, shard_layout="flat" | "parameter"`` (0.3):
      sharded windows: each bucket is reduce-scattered, the parameters live
      in the plugin's flat parameter buffer, and ``sync.optimizer(cls, params,
      **kw)`` steps this rank's shard and gathers the rest (sfsync/optim.py).
      Without it ``sync.optimizer`` steps bucket by bucket as each all-reduce
      completes. ``set_accumulation_steps(n)``: N from the next window.

    Each parameter's ``.grad`` is a view into the plugin's flat buffer
    (``flat_buffer=True``; CUDA parameters need ``flat_buffer=False``, their
    own ``.grad`` registered). Grad-ready is reported from each parameter's
    post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``,
    torch >= 2.1; torch 1.13: a post hook on its AccumulateGrad node), so
    buckets are reduced while the backward pass is still running.
    """

    def __init__(self, module, context=None, *, accumulation_steps=None, flat_buffer=True,
                 hooks=True, broadcast=True, broadcast_buffers=True, find_unused_parameters=True,
                 verify_every=None, verify_buffers=False, store=None, bucket_cap_mb=None,
                 first_bucket_cap_mb=None, connect=True, shard_optimizer=False,
                 shard_layout="flat", **options):
        _check_counts("GradientSync", accumulation_steps, verify_every)
        self.context = None  # (close() needs it, whatever fails below)
        other = _attached.get(module)
        other = other() if other is not None else None
        if other is not None and other.context is not None:
            raise RuntimeError("GradientSync: this %s is already attached to a GradientSync "
                               "(rank %s/%s, %d windows so far): a second one would own the "
                               "same .grad tensors; close() the first one, or keep using it"
                               % (type(module).__name__, getattr(other, "rank", "?"),
                                  getattr(other, "world_size", "?"), other.windows))
        if shard_optimizer:
            shard.layout_value(shard_layout)  # ValueError naming it before anything
            if not flat_buffer:
                raise ValueError("GradientSync(shard_optimizer=True) keeps parameters in the "
                                 "plugin's flat buffer: flat_buffer=False does not fit")
        self.shard_optimizer = bool(shard_optimizer)
        self.shard_layout = shard_layout if shard_optimizer else "none"
        self._optimizer = None  # sync.optimizer(...): steps per bucket (sfsync/optim.py)
        self._window = HostWindow("GradientSync", accumulation_steps)
        self.module = module
        self.params, self.names = self._trainable(module)
        if not self.params:
            raise ValueError("GradientSync: the module has no parameter that requires grad "
                             "(and has elements)")
        self._signature = self._signature_of(self.params)
        self.flat_buffer = flat_buffer
        self.broadcast_buffers = broadcast_buffers
        self._track_unused = bool(hooks and find_unused_parameters)
        self._owns_context = context is None
        self.context = context
        self._hooks = bool(hooks)
        self._handles = []
        self._views = []   # per parameter: the tensor .grad must be
        self._ids = []
        self._mask = None  # the "used in this window" gradient (one float per parameter)
        self._mask_id = None
        self._in_pass = False  # a backward pass is running (its first gradient came)
        self._reported = None
        self._verify_every = verify_every
        self._verifier = None
        self._last_verified = 0
        try:
            if self.context is None:
                self.context = make_context(store=store, **options)
            ctx = self.context
            if bucket_cap_mb is not None:
                ctx.set_bucket_cap_mb(bucket_cap_mb)
            if first_bucket_cap_mb is not None:
                ctx.set_first_bucket_cap_mb(first_bucket_cap_mb)
            if self.shard_optimizer:
                shard.set_layout(ctx, shard_layout)
            self._register()
            o = ctx.options()
            self.rank, self.world_size = o["rank"], o["world_size"]
            if connect and self.world_size > 1:
                ctx.connect()
            if broadcast and self.world_size > 1:
                _broadcast_tensors(ctx, [p.data for p in module.parameters()] +
                                   list(module.buffers()))
            if verify_every:
                self._verifier = _Verifier(ctx, _named_state(module, verify_buffers))
            if hooks:
                self._install_hooks()
            _attached[module] = weakref.ref(self)
            _log(sfsync.LOG_INFO, "GradientSync: %d parameters (%d bytes), %s, rank %d/%d%s" % (
                len(self.params), sum(p.numel() * p.element_size() for p in self.params),
                "accumulation_steps=%d" % accumulation_steps if accumulation_steps
                else "explicit windows", self.rank, self.world_size,
                ", verify_every=%d" % verify_every if verify_every else ""))
        except BaseException:
            self.close()
            raise

    # -- setup

    @staticmethod
    def _trainable(module):
        """The parameters sfsync synchronizes: those that require grad and
        have elements (a zero-size one, which DDP accepts, has nothing to
        reduce: autograd gives it its own empty .grad)."""
        names = {id(p): n for n, p in module.named_parameters()}
        params = [p for p in module.parameters() if p.requires_grad and p.numel() > 0]
        return params, [names.get(id(p), "param%d" % i) for i, p in enumerate(params)]

    @staticmethod
    def _signature_of(params):
        return [(id(p), tuple(p.shape), p.dtype, p.device) for p in params]

    def _register(self):
        ctx = self.context
        if self._track_unused and self.shard_optimizer:
            # Sharded: a gradient would arrive sharded; summed by the optimizer
            # with one sf_allreduce_float64 instead (sfsync/optim.py).
            self._mask = torch.zeros(len(self.params), dtype=torch.float64)
        elif self._track_unused:
            # Registered first: bucketed last (reverse order), with the first
            # parameter's dtype, so it shares a bucket instead of adding one.
            p0 = self.params[0]
            mdtype = p0.dtype
            if self.flat_buffer or p0.device.type == "cpu":
                self._mask_id = ctx.add_gradient(len(self.params), sf_dtype(mdtype),
                                                 sfsync.DEVICE_HOST, "sfsync.used")
            else:
                self._mask = torch.zeros(len(self.params), dtype=mdtype, device=p0.device)
                self._mask_id = ctx.register_gradient(self._mask.data_ptr(), self._mask.numel(),
                                                      sf_dtype(mdtype), _sf_device(p0.device),
                                                      "sfsync.used")
        for p, name in zip(self.params, self.names):
            dtype, device = sf_dtype(p.dtype), _sf_device(p.device)
            if self.flat_buffer:
                if device != sfsync.DEVICE_HOST:
                    raise TypeError("GradientSync(flat_buffer=True) needs CPU parameters; %s is on "
                                    "%s (use flat_buffer=False)" % (name, p.device))
                self._ids.append(ctx.add_gradient(p.numel(), dtype, device, name))
                if self.shard_optimizer:  # its parameter: a view of the flat parameter buffer
                    shard.register_parameter(ctx, self._ids[-1], p.numel(), dtype, device)
            else:
                grad = p.grad
                if grad is None or not grad.is_contiguous() or grad.shape != p.shape:
                    grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if p.grad is not None:
                        grad.copy_(p.grad)
                    p.grad = grad
                self._views.append(grad)
                self._ids.append(ctx.register_gradient(grad.data_ptr(), p.numel(), dtype, device,
                                                       name))
        cuda = [p for p in self.params if p.is_cuda]
        if cuda:  # NCCL orders its work after what torch queued on this stream
            ctx.set_cuda_stream(torch.cuda.current_stream(cuda[0].device))
        ctx.build_buckets()
        if self._track_unused and self._mask is None:
            self._mask = self._flat_view(self._mask_id, self.params[0].dtype,
                                         (len(self.params),))
        if self.flat_buffer:
            for gid, p in zip(self._ids, self.params):
                view = self._flat_view(gid, p.dtype, p.shape)
                if p.grad is not None:  # keep what was already accumulated
                    view.copy_(p.grad)
                p.grad = view
                self._views.append(view)
                if self.shard_optimizer:
                    data = self._flat_view(gid, p.dtype, p.shape, shard.parameter_data)
                    data.copy_(p.data)
                    p.data = data
        self._ptrs = [v.data_ptr() for v in self._views]

    def _flat_view(self, gid, dtype, shape, parameter_data=None):
        if parameter_data is not None:  # the parameter's view of the flat parameter buffer
            import numpy as np
            g = self.context._grads[gid]
            raw = (ctypes.c_uint8 * (g.numel * torch.empty(0, dtype=dtype).element_size())
                   ).from_address(parameter_data(self.context, gid))
            raw._sf_context = self.context
            array = np.frombuffer(raw, dtype=np.uint8)
            return torch.from_numpy(array).view(dtype).view(shape)
        array = self.context.gradient_array(gid)
        if dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
            t = torch.from_numpy(array.view("int16")).view(torch.bfloat16)
        else:
            t = torch.from_numpy(array)
        return t.view(shape)

    def _install_hooks(self):
        me = weakref.ref(self)  # hooks must not keep an abandoned GradientSync alive
        public = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")  # torch >= 2.1
        with torch.enable_grad():
            for i, p in enumerate(self.params):
                if public:  # runs after the new gradient was added into p.grad
                    self._handles.append((None, p.register_post_accumulate_grad_hook(
                        _post_accumulate_hook(me, i))))
                    continue
                # torch 1.13: a post hook on p's AccumulateGrad node (the
                # same moment). Kept here: the parameter holds it weakly.
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._handles.append((acc, acc.register_hook(_grad_hook(me, i))))
        self._handles.append((None, self.module.register_forward_pre_hook(_forward_hook(me))))

    # -- the pass and the window

    def _attach_grads(self):
        """At a window's start: every .grad is its view again (one set to
        None by zero_grad(set_to_none=True) or for an unused parameter
        starts from zero, one replaced by another tensor is copied in)."""
        for p, view in zip(self.params, self._views):
            g = p.grad
            if g is None:
                view.zero_()
                p.grad = view
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
                p.grad = view

    def _window_start(self):
        return self._window.at_boundary and not self._in_pass

    def __call__(self, *args, **kwargs):
        """The module's forward (DDP's face)."""
        return self.module(*args, **kwargs)

    forward = __call__

    def __getattr__(self, name):
        """DDP's face for duck-typing hosts: what GradientSync does not
        define is the module's (parameters(), named_parameters(), train(),
        eval(), to(), ...). state_dict() stays GradientSync's own (the window
        count); the module's is sync.module.state_dict(), as DDP's
        ddp.module.state_dict()."""
        if name.startswith("_") or name in ("module", "context"):
            raise AttributeError(name)  # (also while __init__ has not set them yet)
        return getattr(self.module, name)

    def _begin_pass(self):
        """The pass's decision (local or synchronizing), applied to the context."""
        _set_window(self.context, self._window.begin_pass(self._host_inside))

    def _forward(self):
        if not torch.is_grad_enabled() or self._in_pass:
            return
        if self._optimizer is not None and self._verifier is not None and \
                self.windows - self._last_verified >= self._verify_every:
            self._optimizer.wait_parameters()  # the digest reads every parameter
        if self._window_start():
            if self._optimizer is not None:
                self._optimizer._window_starts()
            self._attach_grads()
            # Before the window's first forward moves a buffer (BatchNorm
            # statistics: each rank's own batches), while every rank still
            # holds the buffers broadcast after the last window.
            _verify_if_due(self)
        self._begin_pass()
        _verify_if_due(self)

    def _start_pass(self):
        self._in_pass = True
        self._reported = [False] * len(self.params)
        self._begin_pass()  # (decided at the forward already, unless it had no hook)
        me = weakref.ref(self)
        _queue_callback(lambda: _end_pass(me))

    def _grad(self, i):
        if not self._in_pass:
            self._start_pass()
        p, view, name = self.params[i], self._views[i], self.names[i]
        g = p.grad
        if g is None or g.data_ptr() != view.data_ptr():
            if g is not None and self._passes == 0:
                # .grad was None at the window's first pass (zero_grad with
                # set_to_none=True, or an unused parameter): autograd made a
                # fresh tensor holding exactly this pass's gradient.
                view.copy_(g)
                p.grad = view
            else:
                raise RuntimeError(
                    "sfsync: %s.grad is no longer the buffer registered with sfsync (it is %s: "
                    "an assignment to .grad, or optimizer.zero_grad(set_to_none=True) in the "
                    "middle of a window); zero gradients between windows only"
                    % (name, "None" if g is None else "another tensor"))
        if self._mask is not None:
            self._mask[i] = 1
        self._reported[i] = True
        self.context.grad_ready(self._ids[i])

    def _end_pass(self):
        self._in_pass = False
        if self._track_unused:
            # Parameters without a gradient in this pass are final too: report
            # them (their buckets can go), then the mask.
            for i, done in enumerate(self._reported):
                if not done:
                    self.context.grad_ready(self._ids[i])
            if self._optimizer is not None:  # this rank's own use, before the mask is reduced
                self._optimizer.local_used = self._mask.clone()
            if self._mask_id is not None:
                self.context.grad_ready(self._mask_id)
        if self._window.end_pass():
            self._synchronize()

    # -- per window

    def _check_layout(self):
        params, names = self._trainable(self.module)
        sig = self._signature_of(params)
        if sig == self._signature:
            return
        old = {s[0]: (s, n) for s, n in zip(self._signature, self.names)}
        new = {s[0]: (s, n) for s, n in zip(sig, names)}
        for s, n in zip(sig, names):
            if s[0] not in old:
                raise RuntimeError("sfsync: parameter %r (shape %s) was added or replaced after "
                                   "GradientSync attached the module; its gradient would not be "
                                   "synchronized: attach again (a new GradientSync)"
                                   % (n, list(s[1])))
        for s, n in zip(self._signature, self.names):
            if s[0] not in new:
                raise RuntimeError("sfsync: parameter %r was removed, replaced or frozen after "
                                   "GradientSync attached the module: attach again" % n)
            if new[s[0]][0] != s:
                raise RuntimeError("sfsync: parameter %r changed from shape %s %s to %s %s after "
                                   "GradientSync attached the module: attach again"
                                   % (n, list(s[1]), s[2], list(new[s[0]][0][1]),
                                      new[s[0]][0][2]))
        raise RuntimeError("sfsync: the module's parameters were reordered after GradientSync "
                           "attached it: attach again")

    def synchronize(self):
        """Reduce what the window accumulated (every rank then holds the same
        averaged gradient), for a host without backward hooks that kept every
        pass inside ``no_sync()``. Nothing to do (and nothing is sent) when
        the window's last backward pass synchronized it already."""
        if self._window.step_ready and self._hooks:
            return  # (without hooks no pass is seen: every call synchronizes)
        if self.accumulation_steps and not self._window.host_signal:
            raise RuntimeError("GradientSync(accumulation_steps=%d) synchronizes at the end of "
                               "every %d-th backward pass itself: do not call synchronize(); "
                               "step when is_step() is True" % (self.accumulation_steps,
                                                                 self.accumulation_steps))
        self._synchronize()

    def _synchronize(self):
        self._check_layout()
        if not self._hooks:
            # No pass was seen: a .grad that zero_grad(set_to_none=True) left
            # None at the window's start is a fresh tensor autograd made (it
            # holds the whole window), or still None (no gradient).
            self._attach_grads()
        for p, view, name in zip(self.params, self._views, self.names):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                raise RuntimeError(
                    "sfsync: %s.grad is no longer the buffer registered with sfsync (it is %s: "
                    "optimizer.zero_grad(set_to_none=True) or an assignment to .grad inside the "
                    "window)" % (name, "None" if p.grad is None else "another tensor"))
        if self._optimizer is not None:  # final now, or bucket by bucket in opt.step()
            self._optimizer._window_closed()
        else:
            self.context.synchronize()
            self._after_synchronize()
        self._window.close_window()

    def _after_synchronize(self):
        """Every bucket reduced: unused parameters' .grad None, buffers."""
        if self._mask is not None:
            unused = (self._mask == 0).nonzero().reshape(-1).tolist()
            for i in unused:
                self.params[i].grad = None
            self._mask.zero_()
            if unused:
                _log(sfsync.LOG_TRACE, "window %d: no gradient on any rank for %s" % (
                    self.windows, ", ".join(self.names[i] for i in unused)))
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers and self.world_size > 1:
                _broadcast_tensors(self.context, buffers)

    @property
    def sync_optimizer(self):
        """The optimizer ``sync.optimizer(...)`` made (a SyncOptimizer), or None."""
        return self._optimizer

    def optimizer(self, optimizer_class, params, overlap_gather=True, overlap_step=False,
                  **defaults):
        """``optimizer_class(params, **defaults)`` over this rank's shards
        with ``shard_optimizer=True``, over the parameters otherwise. A
        torch.optim.Optimizer (param_groups, state, step, zero_grad,
        state_dict, clip_grad_norm_): see sfsync/optim.py. Every ``.grad``
        is final when is_step() turns True; ``overlap_step=True`` (opt-in)
        steps bucket by bucket as each reduction completes inside
        ``opt.step()`` instead, and forbids reading ``.grad`` between the
        window's last backward and ``opt.step()`` (clip with
        ``opt.clip_grad_norm_``)."""
        from sfsync.optim import SyncOptimizer
        self._optimizer = SyncOptimizer(self, optimizer_class, params,
                                        overlap_gather=overlap_gather,
                                        overlap_step=overlap_step, **defaults)
        return self._optimizer

    def zero_grad(self, set_to_none=SET_TO_NONE_DEFAULT):
        """Zero every gradient in place (sf_zero_gradients), re-attaching a
        ``.grad`` that was set to None or replaced. ``set_to_none=True`` sets
        them to None instead (re-attached, zeroed, at the next window)."""
        if set_to_none:
            for p in self.params:
                p.grad = None
            return
        self.context.zero_gradients()
        for p, view in zip(self.params, self._views):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def verify(self):
        """Compare the parameters (and buffers if verify_buffers) across ranks
        now (collective, outside a window): ReplicaMismatchError naming the
        first differing tensor."""
        if self._optimizer is not None:
            self._optimizer.wait_parameters()
        verifier = self._verifier or _Verifier(self.context, _named_state(self.module, False))
        verifier.check(self.windows)

    def state_dict(self):
        """What a resumed run needs to continue where this one stopped, as a
        dict of plain values: the windows synchronized (= optimizer steps,
        ``windows``), ``accumulation_steps``, the verify_every cadence
        (``verify_every``, the window of the last replica check
        ``last_verified``, ``checks``). Save it with the model and optimizer
        at a step (is_step() True); RuntimeError inside a window."""
        return _state_dict(self, "GradientSync")

    def load_state_dict(self, state):
        """Continue from ``state`` (state_dict() of a GradientSync or DDPSync
        of an earlier run, e.g. before an elastic restart): the window count
        and the replica checks go on as if uninterrupted. Call it before the
        first backward pass of the resumed run. ValueError if the state was
        saved with another accumulation_steps."""
        _load_state_dict(self, "GradientSync", state)

    def _at_window_boundary(self):
        return self._window_start()

    def stats(self):
        return self.context.stats()

    def buckets(self):
        return self.context.buckets()

    # -- teardown

    def close(self):
        """Remove the hooks, give every parameter a private copy of its
        gradient, and close the context if this object created it."""
        if self.context is None:
            return
        for _, handle in self._handles:
            handle.remove()
        self._handles = []
        if self._optimizer is not None:
            self._optimizer.wait_parameters()
            self._optimizer._detach()
        if self.shard_optimizer:  # the flat parameter buffer goes with the context
            for p in self.params:
                p.data = p.data.clone()
        if self.flat_buffer:
            for p, view in zip(self.params, self._views):
                if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                    # (a parameter resized after attach cannot take it: None)
                    p.grad = view.clone() if p.grad.shape == p.shape else None
        self._views = []
        self._mask = None
        mine = _attached.get(self.module)
        if mine is not None and mine() is self:
            del _attached[self.module]
        if self._owns_context:
            self.context.close()
        self.context = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _grad_hook(me, i):
    def hook(grad_inputs, grad_outputs):
        sync = me()
        if sync is not None and sync.context is not None:
            sync._grad(i)
    return hook


def _post_accumulate_hook(me, i):
    def hook(param):
        sync = me()
        if sync is not None and sync.context is not None:
            sync._grad(i)
    return hook


def _forward_hook(me):
    def hook(module, inputs):
        sync = me()
        if sync is not None and sync.context is not None:
            sync._forward()
    return hook


def _end_pass(me):
    sync = me()
    if sync is not None and sync.context is not None:
        sync._end_pass()


# ---- Keeping DDP -------------------------------------------------------------------


class DDPSync(_WindowFace):
    """sfsync's window for a DistributedDataParallel model: a communication
    hook that returns each bucket locally inside a window (nothing sent) and
    averages it with the process group's all-reduce outside, as DDP's default
    does. Made by ``attach``; see there."""

    def __init__(self, ddp, accumulation_steps=None, context=None, verify_every=None,
                 verify_buffers=False, **options):
        import torch.distributed as dist
        _check_counts("attach", accumulation_steps, verify_every)
        if not hasattr(ddp, "register_comm_hook"):
            raise TypeError("attach: expected a torch.nn.parallel.DistributedDataParallel "
                            "model, got %s" % type(ddp).__name__)
        self.ddp = ddp
        self.group = ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        _refuse_python_reducer()
        self._window = HostWindow("attach", accumulation_steps)
        self._owns_context = context is None
        self.context = None
        self.context = context if context is not None else make_context(**options)
        self.deferred_buckets = 0
        self.reduced_buckets = 0
        self._verify_every = verify_every
        self._last_verified = 0
        self._verifier = None
        self._handles = []
        try:
            if self.context.options()["world_size"] > 1:
                self.context.connect()
            if verify_every:
                self._verifier = _Verifier(self.context, _named_state(ddp.module, verify_buffers))
            me = weakref.ref(self)
            ddp.register_comm_hook(_HookState(me), _ddp_comm_hook)
            self._handles.append(ddp.register_forward_pre_hook(_ddp_forward_hook(me)))
            # The replica check runs at the wrapped module's forward: after
            # DDP broadcast the buffers (broadcast_buffers), before this
            # forward moves them (BatchNorm statistics).
            self._handles.append(ddp.module.register_forward_pre_hook(_ddp_verify_hook(me)))
            _log(sfsync.LOG_INFO, "attach: DDP comm hook, %s, world size %d%s" % (
                "accumulation_steps=%d" % accumulation_steps if accumulation_steps
                else "windows from no_sync()", self.world_size,
                ", verify_every=%d" % verify_every if verify_every else ""))
        except BaseException:
            self.close()
            raise

    def _forward(self):
        """DDP's forward starts a pass. Inside DDP's own no_sync() DDP calls
        no comm hook in the backward: the pass is counted here, whole."""
        if not torch.is_grad_enabled():
            return
        window = self._window
        if not self.ddp.require_backward_grad_sync and not window.pass_open:
            window.begin_pass(True)
            window.end_pass()
            _set_window(self.context, True)
            return
        _set_window(self.context, window.begin_pass(self._host_inside))

    def _hook(self, bucket):
        import torch.distributed as dist
        window = self._window
        local = window.begin_pass(self._host_inside)  # (decided at the forward)
        buf = bucket.buffer()
        if local:
            self.deferred_buckets += 1
            fut = torch.futures.Future()
            fut.set_result(buf)  # the local sum stays in .grad: nothing is sent
        else:
            self.reduced_buckets += 1
            buf.div_(self.world_size)
            fut = dist.all_reduce(buf, group=self.group, async_op=True).get_future()
            fut = fut.then(lambda f: f.value()[0])
        if bucket.is_last() and window.end_pass():
            window.close_window()
        return fut

    def verify(self):
        verifier = self._verifier or _Verifier(self.context, _named_state(self.ddp.module, False))
        verifier.check(self.windows)

    def state_dict(self):
        """As GradientSync.state_dict(): the window count and the
        verify_every cadence, to save with the model at a step."""
        return _state_dict(self, "DDPSync")

    def load_state_dict(self, state):
        """As GradientSync.load_state_dict()."""
        _load_state_dict(self, "DDPSync", state)

    def _at_window_boundary(self):
        return self._window.at_boundary

    def close(self):
        """Remove the forward hook and close the context if made here. (DDP
        cannot unregister a comm hook: the hook then reduces every pass.)"""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.context is not None and self._owns_context:
            ctx, self.context = self.context, None
            ctx.close()


class _HookState:
    """The comm hook's state: a weak reference to its DDPSync (DDP keeps the
    state for its own life)."""

    def __init__(self, me):
        self.me = me

    def __getstate__(self):  # DDP pickles nothing here, but be explicit
        return {}


def _refuse_python_reducer():
    """attach() needs DDP's C++ reducer, which calls a comm hook once per
    bucket: torch 2.x's compiled DDP with ``torch._dynamo.config.optimize_ddp
    = "python_reducer"`` calls it per parameter as hook(state, (grad, param))."""
    dynamo = getattr(getattr(torch, "_dynamo", None), "config", None)
    mode = getattr(dynamo, "optimize_ddp", None) if dynamo is not None else None
    if mode == "python_reducer":
        raise RuntimeError(_PYTHON_REDUCER)


_PYTHON_REDUCER = ("attach: torch._dynamo.config.optimize_ddp = 'python_reducer' calls DDP comm "
                   "hooks per parameter, not per bucket: sfsync's windows need DDP's own "
                   "reducer; use sfsync.torch.GradientSync(model) with torch.compile instead, or "
                   "another optimize_ddp setting")


def _ddp_comm_hook(state, bucket):
    import torch.distributed as dist
    if isinstance(bucket, tuple):  # the python reducer, turned on after attach
        raise RuntimeError(_PYTHON_REDUCER)
    sync = state.me()
    if sync is None or sync.context is None:  # closed: DDP's default
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
    return sync._hook(bucket)


def _ddp_forward_hook(me):
    def hook(module, inputs):
        sync = me()
        if sync is not None and sync.context is not None:
            sync._forward()
    return hook


def _ddp_verify_hook(me):
    def hook(module, inputs):
        sync = me()
        if sync is not None and sync.context is not None and torch.is_grad_enabled():
            _verify_if_due(sync)
    return hook


def attach(ddp_model, accumulation_steps=None, **kwargs):
    """Keep DDP, send gradients once per window: registers sfsync's comm hook
    on ``ddp_model`` (a DistributedDataParallel) and returns its DDPSync.

    ``accumulation_steps=N``: every N-th backward pass is reduced, the others
    stay local (1x the gradient bytes per window from the first window, the
    same weights as DDP with a correct ``no_sync()``); the loop is
    ``loss.backward(); if sync.is_step(): opt.step(); opt.zero_grad()``.
    A host that uses DDP's own ``no_sync()`` (or ``sync.no_sync()``; the
    trainer frameworks do) decides the windows instead: sfsync counts those
    passes and never defers a synchronization the host asks for; with
    ``accumulation_steps`` too, the first window must agree with it
    (RuntimeError naming both otherwise).
    ``verify_every=K`` (and ``verify_buffers``) as GradientSync's. Other
    keyword arguments go to ``make_context``.
    """
    return DDPSync(ddp_model, accumulation_steps=accumulation_steps, **kwargs)


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
        self._verifier = _Verifier(self.context, _named_state(module, buffers))
        me = weakref.ref(self)

        def hook(mod, inputs):
            check = me()
            if check is not None and torch.is_grad_enabled():
                check.forwards += 1
                if check.forwards % check.every == 0:  # the weights after forwards - 1 steps
                    check._verifier.check(check.forwards - 1)
        self._handle = module.register_forward_pre_hook(hook)

    def close(self):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._owns_context and self.context is not None:
            ctx, self.context = self.context, None
            ctx.close()
