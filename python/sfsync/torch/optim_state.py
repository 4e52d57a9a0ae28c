"""The state dicts of a SyncOptimizer (a mixin of optim.py's class, split
off for size): the per-rank sharded form, the full form (collective), the
ZeroRedundancyOptimizer protocol (``consolidate_state_dict``) and loading
any of them at any world size and layout.

Responsible for: ``state_dict``, ``load_state_dict``, ``full_state_dict``,
``consolidate_state_dict`` and the checks at load. Unsharded these are
torch.optim.Optimizer's own (the host groups hold the model's parameters,
``state`` is keyed by them). Not responsible for: stepping, waiting,
gathering (optim.py). Every attribute read here is the SyncOptimizer's own
(``self``): ``_stepped``, ``_full_groups``, ``_inner``, ``_sharded``,
``_sync``, ``_share_state``, ``_phase``.

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
import math

import torch

from sfsync import shard

__all__ = ["ShardedStateDicts", "consolidate_state_dict"]

_FORM = "sharded"
_MASTER = "sfsync_master"
_WINDOW_RULE = ("a sharded optimizer's state is saved and loaded at window boundaries (after "
                "opt.step(), before the next window's first backward pass): checkpoint there")


def _boxes(shape, start, stop):
    """The boxes (offsets, sizes) of a C-ordered ``shape`` that cover the
    flat range [start, stop), each one flat-contiguous, in order."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    full = tuple(0 for _ in shape[1:])
    if r0 == r1:
        return [((r0,) + o, (1,) + z) for o, z in _boxes(shape[1:], c0, c1)]
    out = []
    if c0:
        out += [((r0,) + o, (1,) + z) for o, z in _boxes(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + full, (r1 - r0,) + tuple(shape[1:])))
    if c1:
        out += [((r1,) + o, (1,) + z) for o, z in _boxes(shape[1:], 0, c1)]
    return out


def _slab(shape, offset, count):
    """(first row, slab shape) of the rows of ``shape`` that [offset,
    offset + count) touches."""
    inner = math.prod(shape[1:])
    r0 = offset // inner
    r1 = -(-(offset + count) // inner)
    return r0, (r1 - r0,) + tuple(shape[1:])


def _annotate(local, shape, offset, count):
    """``local`` (the slab of [offset, offset + count) of ``shape``) with
    torch's CheckpointableTensor fields."""
    r0, _ = _slab(shape, offset, count)
    boxes = _boxes(shape, offset, offset + count)
    local.global_shape = tuple(shape)
    local.global_offsets = tuple(o for o, _ in boxes)
    local.local_offsets = tuple((o[0] - r0,) + o[1:] for o, _ in boxes)
    local.local_sizes = tuple(z for _, z in boxes)
    return local


def _to_slab(v, shape, offset, count):
    """A shard-sized state tensor ``v`` as its annotated slab: a view when the
    range is whole rows, else a zero-padded copy of the rows it touches."""
    if len(shape) == 0:
        return v
    flat = v.detach().reshape(-1)
    r0, slab_shape = _slab(shape, offset, count)
    inner = math.prod(shape[1:])
    if offset % inner == 0 and count % inner == 0:
        local = flat.view(slab_shape)
    else:
        local = flat.new_zeros(math.prod(slab_shape))
        start = offset - r0 * inner
        local[start:start + count] = flat
        local = local.view(slab_shape)
    return _annotate(local, shape, offset, count)


def _ravel(index, shape):
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def _covered(t):
    """[(start, flat values)] of an annotated tensor's boxes (ValueError for
    a box that is not flat-contiguous: not one of sfsync's)."""
    shape = tuple(t.global_shape)
    out = []
    for g, lo, z in zip(t.global_offsets, t.local_offsets, t.local_sizes):
        lead = next((d for d, n in enumerate(z) if n > 1), len(z))
        if any(z[d] != shape[d] for d in range(lead + 1, len(z))):
            raise ValueError("box at %s of size %s is not contiguous" % (tuple(g), tuple(z)))
        piece = t[tuple(slice(o, o + n) for o, n in zip(lo, z))] if len(lo) else t
        out.append((_ravel(g, shape), piece.reshape(-1)))
    return sorted(out, key=lambda x: x[0])


def _range_text(pieces):
    return ", ".join("[%d, %d)" % (a, a + v.numel()) for a, v in pieces) or "nothing"


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


class ShardedStateDicts:
    """SyncOptimizer's state dicts (see the module docstring)."""

    _consolidated = None  # (rank, steps, full form) after consolidate_state_dict
    _issued = None        # id() of the last sharded state_dict() returned

    # -- where a save or load may happen

    def _check_boundary(self, who):
        sync = self._sync
        inside = self._phase.value in ("reducing", "synchronized")
        at_start = getattr(sync, "_at_window_boundary", lambda: True)()
        if inside or not at_start:
            raise RuntimeError("%s: called inside window %d (%s): %s"
                               % (who, sync.windows + 1,
                                  "its gradients are reduced but not stepped" if inside else
                                  "backward passes of it are done", _WINDOW_RULE))

    def _full_index(self):
        return [s for group in self._full_groups for s in group]

    def _meta(self):
        sync = self._sync
        return {"form": _FORM, "rank": sync.rank, "world_size": sync.world_size,
                "layout": sync.shard_layout,
                "ranges": {k: (s.offset, s.count) for k, s in enumerate(self._full_index())
                           if s.tensor is not None}}

    def _where(self):
        sync = self._sync
        return "rank %d of %d (layout %s)" % (sync.rank, sync.world_size, sync.shard_layout)

    # -- saving

    def state_dict(self):
        """Unsharded: torch's own. Sharded: the per-rank form (see the module
        docstring: DCP-ready, whole-model keys, this rank's ranges); after
        ``consolidate_state_dict(to)``, on rank ``to``, once: the full form."""
        if not self._sharded:
            return torch.optim.Optimizer.state_dict(self)
        held, self._consolidated = self._consolidated, None
        if held is not None and held[0] == self._sync.rank and held[1] == self.steps:
            return held[2]
        self._check_boundary("state_dict")
        # a load template (what DCP fills) only for an optimizer that never
        # stepped: a stepped one, as torch's, has no state for parameters it
        # never stepped
        fresh = self._fresh_state() if not self.state and self.steps == 0 else {}
        state = {}
        for k, s in enumerate(self._full_index()):
            entry = {}
            if s.tensor is not None:
                own = self.state.get(s.tensor) or fresh.get(id(s.tensor), {})
                for key, v in own.items():
                    entry[key] = self._piece_out(s, key, v)
                if s.master:
                    entry[_MASTER] = _to_slab(s.tensor, s.param.shape, s.offset, s.count)
            state[k] = entry
        groups, start = [], 0
        for g, slots in zip(self.param_groups, self._full_groups):
            groups.append(dict({k: v for k, v in g.items() if k != "params"},
                               params=list(range(start, start + len(slots)))))
            start += len(slots)
        out = {"state": state, "param_groups": groups, "sfsync": self._meta()}
        self._issued = id(out)  # filled in place by dcp.load: its "sfsync" is another rank's
        return out

    def _piece_out(self, s, key, v):
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return v
        if v.numel() != s.count:
            raise ValueError("state_dict: %s's state %r has %d elements, its shard %d: only "
                             "state of the shard's size (or scalars) can be sharded"
                             % (self._sync.names[s.index], key, v.numel(), s.count))
        return _to_slab(v, s.param.shape, s.offset, s.count)

    def _fresh_state(self):
        """{id(shard tensor): state} that the inner optimizers would start
        from, for the shards that never stepped (a load template: what
        torch.distributed.checkpoint fills). Made on throwaway copies by one
        zero-lr step on zero gradients (as torch's _init_optim_state does to
        a real optimizer); ``step`` counters set back to 0."""
        out = {}
        for inner in self._inner:
            if inner is None or all(t in self.state for g in inner.param_groups
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
                if t not in self.state:
                    out[id(t)] = {k: (torch.zeros_like(v) if k == "step" and
                                      isinstance(v, torch.Tensor) else
                                      0 if k == "step" else v)
                                  for k, v in tmp.state.get(c, {}).items()}
        return out

    def consolidate_state_dict(self, to=0):
        """ZeroRedundancyOptimizer's protocol (collective: every rank calls
        it): the full form is gathered on rank ``to``, whose next
        ``state_dict()`` (before another step) returns it. What Lightning
        calls before saving from global zero, and what the sfsync
        integrations call for the HF Trainer and Accelerate."""
        if not self._sharded:
            return
        self._check_boundary("consolidate_state_dict")
        full = self._gather_full(to)
        self._consolidated = (to, self.steps, full) if self._sync.rank == to else None

    # -- the full form

    def full_state_dict(self):
        """Collective (every rank calls it): the full form, the state dict the
        same torch.optim class over the whole model would have, on every rank
        (plus ``"sfsync_master"``, the float32 master of a bf16/fp16
        parameter, in its state)."""
        if not self._sharded:
            return torch.optim.Optimizer.state_dict(self)
        self._check_boundary("full_state_dict")
        return self._gather_full(None)

    def _gather_full(self, to):
        """The full form on rank ``to`` (every rank if None); {} elsewhere.
        Each rank's pieces travel by one broadcast (its size first)."""
        sync = self._sync
        ctx, world = sync.context, sync.world_size
        pieces = {}
        for s in self._stepped:
            st = dict(self.state.get(s.tensor) or {})
            if s.master:
                st[_MASTER] = s.tensor
            if st:
                pieces[s.index] = (s.offset, s.count, st)
        buf = io.BytesIO()
        torch.save(pieces, buf)
        payload = buf.getvalue()
        sizes = torch.zeros(world, dtype=torch.float64)
        sizes[sync.rank] = len(payload)
        shard.allreduce_float64(ctx, sizes)
        keep = to is None or to == sync.rank
        every = {}
        for r in range(world):
            data = torch.zeros(int(sizes[r]), dtype=torch.uint8)
            if r == sync.rank:
                data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            if world > 1 and data.numel():
                ctx.broadcast(data, r)
            if not keep:
                continue
            got = torch.load(io.BytesIO(data.numpy().tobytes())) if data.numel() else {}
            for index, piece in got.items():
                every.setdefault(index, []).append(piece)
        if not keep:
            return {}
        state = {}
        for k, s in enumerate(self._full_index()):
            parts = every.get(s.index)
            if not parts:
                continue
            entry = {}
            for off, cnt, st in parts:
                for key, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == cnt:
                        if key not in entry:
                            entry[key] = torch.zeros(s.param.numel(), dtype=v.dtype)
                        entry[key][off:off + cnt] = v.reshape(-1)
                    elif key not in entry:
                        entry[key] = v
            for key, v in entry.items():
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == s.param.numel():
                    entry[key] = v.view(s.param.shape)
            state[k] = entry
        groups, start = [], 0
        for g, slots in zip(self.param_groups, self._full_groups):
            groups.append(dict({k: v for k, v in g.items() if k != "params"},
                               params=list(range(start, start + len(slots)))))
            start += len(slots)
        return {"state": state, "param_groups": groups}

    # -- loading

    def load_state_dict(self, state_dict):
        """Takes any form: unsharded torch's own; sharded the full form (any
        world size and layout: each rank takes its ranges), this rank's own
        per-rank form, or a per-rank form that torch.distributed.checkpoint
        filled (its boxes resharded). Anything else is a ValueError naming
        the parameter, what the state dict holds and what to save instead."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or \
                "param_groups" not in state_dict:
            raise ValueError("load_state_dict: expected an optimizer state dict (with 'state' "
                             "and 'param_groups'), got %s" % (
                                 sorted(state_dict) if isinstance(state_dict, dict)
                                 else type(state_dict).__name__))
        meta = state_dict.get("sfsync")
        if not self._sharded:
            if isinstance(meta, dict) and "rank" in meta:
                raise ValueError("load_state_dict: a sharded state dict (rank %s of %s); this "
                                 "optimizer is not sharded: load the full form "
                                 "(full_state_dict(), or consolidate_state_dict() then "
                                 "state_dict() on that rank)"
                                 % (meta.get("rank"), meta.get("world_size")))
            torch.optim.Optimizer.load_state_dict(self, state_dict)
            self._share_state()  # (torch's load made a new state)
            return None
        self._check_boundary("load_state_dict")
        # Checked on every rank before any rank loads: one rank's bad state
        # is an error on all of them (never one rank's crash and the others'
        # hang at the next collective), and no rank is left half-loaded.
        try:
            if isinstance(meta, dict) and "form" not in meta:
                apply, error = self._load_v04(state_dict, meta), None
            else:
                apply, error = self._load(state_dict, meta if isinstance(meta, dict) else None), None
        except ValueError as e:
            apply, error = None, e
        failed = self._agree(error is not None)
        if error is not None:
            raise error
        if failed:
            raise ValueError("load_state_dict: the state dict did not fit on rank(s) %s (their "
                             "errors say why); nothing was loaded here, on %s"
                             % (", ".join(map(str, failed)), self._where()))
        apply()

    def _agree(self, failed):
        """The ranks whose load failed (one small all-reduce, every rank)."""
        sync = self._sync
        flags = torch.zeros(sync.world_size, dtype=torch.float64)
        flags[sync.rank] = 1.0 if failed else 0.0
        if sync.world_size > 1:
            shard.allreduce_float64(sync.context, flags)
        return [r for r in range(sync.world_size) if flags[r] > 0]

    def _pairs(self, sd):
        """[(saved key, slot)] in group order, checked against this
        optimizer's groups."""
        saved = sd["param_groups"]
        if len(saved) != len(self._full_groups):
            raise ValueError("load_state_dict: the state dict has %d param groups, this "
                             "optimizer %d: a checkpoint of another model or optimizer?"
                             % (len(saved), len(self._full_groups)))
        pairs = []
        for n, (g, slots) in enumerate(zip(saved, self._full_groups)):
            if len(g["params"]) != len(slots):
                raise ValueError("load_state_dict: param group %d of the state dict has %d "
                                 "parameters, this optimizer's %d: a checkpoint of another "
                                 "model or optimizer?" % (n, len(g["params"]), len(slots)))
            pairs.extend(zip(g["params"], slots))
        return pairs

    def _load(self, sd, meta):
        saved_ranges = (meta or {}).get("ranges") or {}
        # a per-rank form saved elsewhere (not this optimizer's own dict that
        # dcp.load filled): its "sfsync" says whose ranges it holds
        elsewhere = (meta or {}).get("form") == _FORM and id(sd) != self._issued and \
            any(meta.get(k) != v for k, v in (("rank", self._sync.rank),
                                               ("world_size", self._sync.world_size),
                                               ("layout", self._sync.shard_layout)))
        inner_index = {id(s.tensor): i for i, s in enumerate(self._stepped)}
        state, masters = {}, {}
        for k, (key, s) in enumerate(self._pairs(sd)):
            entry = sd["state"].get(key)
            if s.tensor is None:
                continue
            if not entry:
                if elsewhere and k not in saved_ranges and self._keeps_state():
                    raise ValueError(self._not_mine(s, "holds no state for parameter %s, which "
                                                    "this rank steps [%d, %d) of"
                                                    % (self._sync.names[s.index], s.offset,
                                                       s.offset + s.count), meta))
                continue
            mine = {}
            for name, v in entry.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v = self._piece_in(s, name, v, saved_ranges.get(k), meta)
                mine[name] = v.clone() if isinstance(v, torch.Tensor) else v
            master = mine.pop(_MASTER, None)
            if master is not None and s.master:
                masters[id(s.tensor)] = master
            if mine:
                state[inner_index[id(s.tensor)]] = mine
        groups = []
        for g, slots in zip(sd["param_groups"], self._full_groups):
            ids = [inner_index[id(s.tensor)] for s in slots if s.tensor is not None]
            groups.append(dict({k: v for k, v in g.items() if k != "params"}, params=ids))
        return lambda: self._apply(state, groups, masters)

    def _apply(self, state, groups, masters):
        self._load_shard_state({"state": state, "param_groups": groups})
        with torch.no_grad():
            for s in self._stepped:
                if not s.master:
                    continue
                if id(s.tensor) in masters:  # the saved float32 master
                    s.tensor.copy_(masters[id(s.tensor)])
                else:  # none saved: the master restarts from the parameter
                    p = s.param.data
                    s.tensor.copy_(p if s.tensor.shape == p.shape else
                                   p.view(-1)[s.offset:s.offset + s.count])

    def _piece_in(self, s, name, v, saved_range, meta):
        """This rank's range of state tensor ``v`` of slot ``s``, shaped as
        the shard tensor."""
        p = s.param
        what = "load_state_dict: %r of parameter %s" % (name, self._sync.names[s.index])
        if not hasattr(v, "global_offsets") and saved_range is not None and \
                tuple(v.shape) != tuple(p.shape) and p.dim() > 0:
            off, cnt = saved_range  # a per-rank file whose torch dropped the fields
            if tuple(v.shape) == _slab(p.shape, off, cnt)[1]:
                v = _annotate(v, p.shape, off, cnt)
        if hasattr(v, "global_offsets"):
            if tuple(v.global_shape) != tuple(p.shape):
                raise ValueError("%s is a shard of a tensor of shape %s; the parameter's is %s: "
                                 "a checkpoint of another model?"
                                 % (what, list(v.global_shape), list(p.shape)))
            pieces = _covered(v)
            want = (s.offset, s.offset + s.count)
            flat = [(a, x) for a, x in pieces if a < want[1] and a + x.numel() > want[0]]
            got = torch.cat([x for _, x in flat]) if flat else v.new_zeros(0)
            if not flat or flat[0][0] > want[0] or \
                    any(a + x.numel() != b for (a, x), (b, _) in zip(flat, flat[1:])) or \
                    flat[0][0] + got.numel() < want[1]:
                raise ValueError(self._not_mine(s, "%s covers elements %s of %d" % (
                    what[len("load_state_dict: "):], _range_text(pieces), p.numel()), meta))
            got = got[want[0] - flat[0][0]:want[0] - flat[0][0] + s.count]
            return got.view(s.tensor.shape)
        if v.numel() == p.numel() and (tuple(v.shape) == tuple(p.shape) or v.dim() == 1):
            return v.reshape(-1)[s.offset:s.offset + s.count].reshape(s.tensor.shape)
        raise ValueError("%s has shape %s; the parameter is %s (this rank's shard: %d elements "
                         "at %d): a checkpoint of another model, or a sharded state dict that "
                         "lost its shard fields?"
                         % (what, list(v.shape), list(p.shape), s.count, s.offset))

    def _keeps_state(self):
        """Whether this optimizer class keeps per-parameter state (SGD
        without momentum keeps none)."""
        return bool(self.state) or bool(self._fresh_state())

    def _not_mine(self, s, what, meta):
        who = ("rank %s of %s (layout %s)" % (meta.get("rank"), meta.get("world_size"),
                                             meta.get("layout"))
               if meta and "rank" in meta else "another rank")
        return ("load_state_dict: the state dict %s: it is the sharded state dict of %s; this "
                "optimizer is %s and needs [%d, %d) of %s. A framework that saves the "
                "optimizer from one rank needs the full form: call opt.consolidate_state_dict() "
                "on every rank before it saves (the sfsync integrations do) or save "
                "opt.full_state_dict(); torch.distributed.checkpoint (dcp.save / dcp.load of "
                "opt.state_dict()) saves each rank's part and reshards at load"
                % (what, who, self._where(), s.offset, s.offset + s.count,
                   self._sync.names[s.index]))

    def _load_v04(self, sd, meta):
        """The 0.4 per-rank form (state numbered over this rank's shards):
        only on the rank, world size and layout that saved it."""
        mine = {"rank": self._sync.rank, "world_size": self._sync.world_size,
                "layout": self._sync.shard_layout}
        for key in ("rank", "world_size", "layout"):
            if meta.get(key) != mine[key]:
                raise ValueError("load_state_dict: a 0.4 sharded state dict of rank %s of %s "
                                 "(layout %s); this optimizer is %s: it loads only where it "
                                 "was saved. Save the full form (opt.full_state_dict(), or "
                                 "consolidate_state_dict() then state_dict()) to resume "
                                 "elsewhere" % (meta.get("rank"), meta.get("world_size"),
                                                meta.get("layout"), self._where()))
        ranges = [(s.index, s.offset, s.count) for s in self._stepped]
        if [tuple(x) for x in meta.get("ranges", [])] != ranges:
            raise ValueError("load_state_dict: the 0.4 sharded state dict's shard ranges differ "
                             "from this optimizer's (another model or bucket cap?)")
        def apply():
            self._load_shard_state({k: v for k, v in sd.items() if k != "sfsync"})
            with torch.no_grad():
                for s, m in zip(self._stepped, meta.get("master", [])):
                    if m is not None:
                        s.tensor.copy_(m)
        return apply

    def _load_shard_state(self, sd):
        """Sharded: load a state dict numbered over this rank's shard tensors
        (group order), through each bucket's inner optimizer's own
        load_state_dict (its checks and casts), into the one shared
        ``state``; the host groups take the loaded hyperparameters."""
        owned = []
        for g, slots in zip(sd["param_groups"], self._full_groups):
            mine = [s for s in slots if s.tensor is not None]
            if len(g["params"]) != len(mine):
                raise ValueError("load_state_dict: a param group of the state dict has %d "
                                 "parameters, this optimizer's %d"
                                 % (len(g["params"]), len(mine)))
            owned.append(list(zip(g["params"], mine)))
        loaded = {}
        first = None
        for b, inner in enumerate(self._inner):
            if inner is None:
                continue
            state, groups, k = {}, [], 0
            for g, pairs in zip(sd["param_groups"], owned):
                ids = []
                for key, s in pairs:
                    if s.bucket == b:
                        if key in sd["state"]:
                            state[k] = sd["state"][key]
                        ids.append(k)
                        k += 1
                groups.append(dict(g, params=ids))
            inner.load_state_dict({"state": state, "param_groups": groups})
            loaded.update(inner.state)
            first = first or inner
        self.state.clear()
        self.state.update(loaded)
        self._share_state()
        source = first.param_groups if first is not None else sd["param_groups"]
        for outer, group in zip(self.param_groups, source):
            for k, v in group.items():
                if k != "params":
                    outer[k] = v
