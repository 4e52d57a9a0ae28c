"""Where a torch process's sfsync context meets its peers: ``make_context``
and the c10d store as sfsync's key-value store.

Responsible for: the rule (1. torch.distributed's own store under a key
prefix per context, 2. a client of torchrun's agent store, 3. sfsync's own
rendezvous, see sfsync/torch/__init__.py), and the thread-safe set/get
callables over a c10d store. Not responsible for: what the context then
synchronizes (store.py, gradient_sync.py, ddp.py).
"""

import datetime
import itertools
import os
import threading
import time

import sfsync

__all__ = ["make_context", "torch_store_callbacks", "distributed"]

_contexts = itertools.count()  # the key prefix of each context made here


def log(level, message):
    """sfsync's logger, subsystem "torch" (every module of this package)."""
    sfsync.log(level, message, "torch")


def distributed():
    """torch.distributed when it is initialized, else None."""
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def torch_store_callbacks(store):
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
    dist = distributed()
    how = None
    if store is None and dist is not None:
        # torch's own default store: no public accessor exists in 1.13 or 2.x
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
            set_fn, get_fn = torch_store_callbacks(store)
            ctx.set_store(set_fn, get_fn, prefix)
        o = ctx.options()
        log(sfsync.LOG_INFO, "context rank %d/%d meets through %s" % (
            o["rank"], o["world_size"],
            "%s, prefix %s" % (how, prefix) if store is not None
            else (o["rendezvous"] or "nothing (world size 1)")))
    except BaseException:
        ctx.close()
        raise
    return ctx
