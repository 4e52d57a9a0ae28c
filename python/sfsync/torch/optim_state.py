"""StateDicts: the state dicts of a SyncOptimizer, an object the optimizer
holds: the per-rank sharded form, the full form (collective), the
ZeroRedundancyOptimizer protocol (``consolidate_state_dict``) and loading
any of them at any world size and layout (optim_load.py's StateLoader).

Responsible for: ``state_dict``, ``full_state_dict``,
``consolidate_state_dict`` (loading is optim_load.py's). Unsharded these are
torch.optim.Optimizer's own (the host groups hold the model's parameters,
``state`` is keyed by them). Not responsible for: stepping, waiting,
gathering (optim.py). It reads only what it is given: the optimizer's
public face (``state``, ``param_groups``, ``steps``, ``inner_optimizers``),
its ShardMap (shard_map.py) and the WindowDriver (rank, layout, phase,
the context for the collectives).

[Note: the sharded form] ``state_dict()`` of a sharded optimizer is shaped
as a torch optimizer's over the whole model: ``state`` keyed by the
parameter's index in the groups (as torch numbers them), ``param_groups``
with those indices, so ``torch.distributed.checkpoint``'s ``get_state_dict``
maps every entry to the right parameter name. Each tensor of a parameter's
state holds only this rank's range of it, laid out in the parameter's own
shape: the rows of the parameter that the range touches (a slab; elements
outside the range are zero and belong to no shard) and torch's
``CheckpointableTensor`` fields (``global_shape``, ``global_offsets``,
``local_offsets``, ``local_sizes``: torch.distributed.checkpoint.protocol)
naming the boxes of the parameter the range covers. DCP then writes each
rank's boxes, with no gather, and on load fills each rank's own boxes from
whatever boxes were saved: another world size or layout reshards. A plain
tensor with ``dim() == 0`` (AdamW's ``step``) is the same on every rank that
steps part of the parameter. Every parameter has an entry (``{}`` where this
rank steps nothing of it), so that torch's ``set_state_dict`` finds one. The
``"sfsync"`` entry (rank, world size, layout, this rank's ranges) is what
errors name; bf16/fp16 parameters' float32 master shards travel in their
parameter's state as ``"sfsync_master"``.
"""


import io

import torch

import sfsync
from sfsync import shard
from sfsync.torch.optim_load import SHARDED_FORM, MASTER_KEY, StateLoader
from sfsync.torch.rendezvous import log
from sfsync.torch.shard_boxes import to_slab

__all__ = ["StateDicts", "consolidate_state_dict"]

_WINDOW_RULE = ("a sharded optimizer's state is saved and loaded at window boundaries (after "
                "opt.step(), before the next window's first backward pass): checkpoint there")


def consolidate_state_dict(optimizer, to=0):
    """Collective (every rank calls it, at a step): before rank ``to`` alone
    saves ``optimizer.state_dict()``, gather a sharded optimizer's full form
    there (sfsync's sharded optimizer, torch's ZeroRedundancyOptimizer:
    anything with ``consolidate_state_dict``); for any other optimizer,
    whose state_dict() is already whole on every rank, nothing. The one line
    that makes "rank 0 saves, every rank loads" resume a sharded run, at any
    world size."""
    inner = getattr(optimizer, "optimizer", optimizer)  # (a framework's wrapper)
    consolidate = getattr(inner, "consolidate_state_dict", None)
    if consolidate is not None:
        consolidate(to=to)


class _Reader(io.RawIOBase):
    """A read-only file over a memoryview (torch.load reads the received
    bytes in place: io.BytesIO would copy them first)."""

    def __init__(self, view):
        super().__init__()
        self._view, self._at = view.cast("B"), 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def readinto(self, b):
        n = min(len(b), len(self._view) - self._at)
        b[:n] = self._view[self._at:self._at + n]
        self._at += n
        return n

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self):
        return self._at


class StateDicts:
    """The state dicts of ``optimizer`` (a SyncOptimizer) over its ShardMap
    and WindowDriver (see the module docstring)."""

    def __init__(self, optimizer, shard_map, driver, optimizer_class):
        self.optimizer, self.map, self.driver = optimizer, shard_map, driver
        self._class = optimizer_class
        self._consolidated = None  # (rank, steps, full form) after consolidate_state_dict
        self.issued = ()           # id()s of the last sharded state_dict()s returned

    def load_state_dict(self, state_dict):
        """Any form (optim_load.py)."""
        StateLoader(self).load_state_dict(state_dict)

    def per_rank(self, value):
        """Every rank's ``value`` (a float64 each), on every rank: one small
        all-reduce (collective)."""
        driver = self.driver
        values = torch.zeros(driver.world_size, dtype=torch.float64)
        values[driver.rank] = value
        if driver.world_size > 1:
            shard.allreduce_float64(driver.context, values)
        return values

    # -- where a save or load may happen

    def check_boundary(self, who):
        driver = self.driver
        inside = self.driver.phase.value in ("reducing", "synchronized")
        at_start = driver.at_boundary()
        if inside or not at_start:
            raise RuntimeError("%s: called inside window %d (%s): %s"
                               % (who, driver.windows + 1,
                                  "its gradients are reduced but not stepped" if inside else
                                  "backward passes of it are done", _WINDOW_RULE))

    def _meta(self):
        driver = self.driver
        return {"form": SHARDED_FORM, "rank": driver.rank, "world_size": driver.world_size,
                "layout": driver.shard_layout,
                "ranges": {k: (s.offset, s.count) for k, s in enumerate(self.map.full_index())
                           if s.tensor is not None}}

    def where(self):
        driver = self.driver
        return "rank %d of %d (layout %s)" % (driver.rank, driver.world_size, driver.shard_layout)

    # -- saving

    def state_dict(self):
        """SyncOptimizer.state_dict (see the module docstring)."""
        if not self.driver.sharded:
            return torch.optim.Optimizer.state_dict(self.optimizer)
        held, self._consolidated = self._consolidated, None
        if held is not None and held[0] == self.driver.rank and held[1] == self.optimizer.steps:
            return held[2]
        self.check_boundary("state_dict")
        # a load template (what DCP fills) only for an optimizer that never
        # stepped: a stepped one, as torch's, has no state for parameters it
        # never stepped
        fresh = self.fresh_state() if not self.optimizer.state and self.optimizer.steps == 0 else {}
        state = {}
        for k, s in enumerate(self.map.full_index()):
            entry = {}
            if s.tensor is not None:
                own = self.optimizer.state.get(s.tensor) or fresh.get(id(s.tensor), {})
                for key, v in own.items():
                    entry[key] = self._piece_out(s, key, v)
                if s.master:
                    entry[MASTER_KEY] = to_slab(s.tensor, s.param.shape, s.offset, s.count)
            state[k] = entry
        groups, start = [], 0
        for g, slots in zip(self.optimizer.param_groups, self.map.groups):
            groups.append(dict({k: v for k, v in g.items() if k != "params"},
                               params=list(range(start, start + len(slots)))))
            start += len(slots)
        out = {"state": state, "param_groups": groups, "sfsync": self._meta()}
        # dcp.load fills one of these in place, its "sfsync" then another rank's
        self.issued = (self.issued + (id(out),))[-4:]
        return out

    def _piece_out(self, s, key, v):
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return v
        if v.numel() != s.count:
            raise ValueError("state_dict: %s's state %r has %d elements, its shard %d: only "
                             "state of the shard's size (or scalars) can be sharded"
                             % (self.driver.names[s.index], key, v.numel(), s.count))
        return to_slab(v, s.param.shape, s.offset, s.count)

    def fresh_state(self):
        """_fresh_state_of_inner, or {} (no template: a DCP load then has
        nothing to fill, as with torch's own optimizers) for an optimizer
        class that cannot be stepped on copies (said at INFO)."""
        try:
            return self._fresh_state_of_inner()
        except Exception as e:  # (a class whose constructor or step wants more)
            log(sfsync.LOG_INFO, "state_dict: no load template for %s: %s"
                % (self._class.__name__, e))
            return {}

    def _fresh_state_of_inner(self):
        """{id(shard tensor): state} that the inner optimizers would start
        from, for the shards that never stepped (a load template: what
        torch.distributed.checkpoint fills). Made on throwaway copies by one
        zero-lr step on zero gradients (as torch's _init_optim_state does to
        a real optimizer); ``step`` counters set back to 0."""
        out = {}
        for inner in self.optimizer.inner_optimizers:
            if inner is None or all(t in self.optimizer.state for g in inner.param_groups
                                    for t in g["params"]):
                continue
            groups, pairs = [], []
            for g in inner.param_groups:
                copies = []
                for t in g["params"]:
                    c = torch.zeros_like(t, requires_grad=True)
                    c.grad = torch.zeros_like(t)
                    copies.append(c)
                    pairs.append((t, c))
                groups.append(dict({k: v for k, v in g.items() if k != "params"},
                                   params=copies, lr=0.0))
            tmp = type(inner)(groups, **{k: v for k, v in inner.defaults.items()
                                         if k in ("lr",)})
            tmp.step()
            for t, c in pairs:
                if t not in self.optimizer.state:
                    out[id(t)] = {k: (torch.zeros_like(v) if k == "step" and
                                      isinstance(v, torch.Tensor) else
                                      0 if k == "step" else v)
                                  for k, v in tmp.state.get(c, {}).items()}
        return out

    def consolidate_state_dict(self, to=0):
        """SyncOptimizer.consolidate_state_dict (collective)."""
        if not self.driver.sharded:
            return
        self.check_boundary("consolidate_state_dict")
        full = self._gather_full(to)
        self._consolidated = (to, self.optimizer.steps, full) if self.driver.rank == to else None

    # -- the full form

    def full_state_dict(self):
        """SyncOptimizer.full_state_dict (collective)."""
        if not self.driver.sharded:
            return torch.optim.Optimizer.state_dict(self.optimizer)
        self.check_boundary("full_state_dict")
        return self._gather_full(None)

    def _gather_full(self, to):
        """The full form on rank ``to`` (every rank if None); {} elsewhere.
        Each rank's pieces travel by one broadcast (its size first)."""
        driver = self.driver
        ctx, world = driver.context, driver.world_size
        pieces = {}
        for s in self.map.stepped:
            st = dict(self.optimizer.state.get(s.tensor) or {})
            if s.master:
                st[MASTER_KEY] = s.tensor
            if st:
                pieces[s.index] = (s.offset, s.count, st)
        buf = io.BytesIO()
        torch.save(pieces, buf)
        del pieces
        payload = buf.getbuffer()  # (sent as it is: no copy of this rank's part)
        sizes = self.per_rank(payload.nbytes)
        keep = to is None or to == driver.rank
        slots = {s.index: s for s in self.map.full_index()}
        entries = {}  # slot index -> the full entry, filled piece by piece as they arrive
        for r in range(world):
            if r == driver.rank:
                data = torch.frombuffer(payload, dtype=torch.uint8) if payload.nbytes else \
                    torch.zeros(0, dtype=torch.uint8)
            else:
                data = torch.empty(int(sizes[r]), dtype=torch.uint8)
            if world > 1 and data.numel():
                ctx.broadcast(data, r)
            if not keep or not data.numel():
                continue
            got = torch.load(_Reader(memoryview(data.numpy())))
            del data
            if r == driver.rank:  # this rank's bytes are sent and read: free them now
                payload.release()
                buf = None
            for index, (off, cnt, st) in got.items():
                s, entry = slots[index], entries.setdefault(index, {})
                for key, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == cnt:
                        if key not in entry:
                            entry[key] = torch.zeros(s.param.numel(), dtype=v.dtype)
                        entry[key][off:off + cnt] = v.reshape(-1)
                    elif key not in entry:
                        entry[key] = v
            del got
        if not keep:
            return {}
        state = {}
        for k, s in enumerate(self.map.full_index()):
            entry = entries.get(s.index)
            if not entry:
                continue
            for key, v in entry.items():
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == s.param.numel():
                    entry[key] = v.view(s.param.shape)
            state[k] = entry
        groups, start = [], 0
        for g, slots in zip(self.optimizer.param_groups, self.map.groups):
            groups.append(dict({k: v for k, v in g.items() if k != "params"},
                               params=list(range(start, start + len(slots)))))
            start += len(slots)
        return {"state": state, "param_groups": groups}

    # -- loading
