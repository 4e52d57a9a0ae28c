"""The state dicts of a SyncOptimizer (a mixin of optim.py's class, split
off for size): the per-rank sharded form, the full form (collective) and
loading either.

Responsible for: ``state_dict``, ``load_state_dict``, ``full_state_dict``
and the sharded form's metadata. Unsharded these are torch.optim.Optimizer's
own (the host groups hold the model's parameters, ``state`` is keyed by
them). Not responsible for: stepping, waiting, gathering (optim.py). Every
attribute read here is the SyncOptimizer's own (``self``): ``_stepped``,
``_full_groups``, ``_inner``, ``_sharded``, ``_sync``, ``_share_state``.
"""

import io

import torch

from sfsync import shard

__all__ = ["ShardedStateDicts"]


class ShardedStateDicts:
    """SyncOptimizer's state dicts (see the module docstring of optim.py)."""

    def _meta(self):
        sync = self._sync
        return {"rank": sync.rank, "world_size": sync.world_size,
                "layout": sync.shard_layout, "sharded": self._sharded,
                "ranges": [(s.index, s.offset, s.count) for s in self._stepped],
                "master": [s.tensor.clone() if s.master else None for s in self._stepped]}

    def state_dict(self):
        """The per-rank sharded form (see the module docstring); unsharded
        the inner optimizer's own (= the full form)."""
        if not self._sharded:
            return torch.optim.Optimizer.state_dict(self)
        sd = self._shard_state_dict()
        sd["sfsync"] = self._meta()
        return sd

    def _shard_state_dict(self):
        """Sharded: the state dict one optimizer_class over this rank's shard
        tensors would return (its params numbered in group order)."""
        index = {id(s.tensor): k for k, s in enumerate(self._stepped)}
        groups = []
        for g, slots in zip(self.param_groups, self._full_groups):
            ids = [index[id(s.tensor)] for s in slots if s.tensor is not None]
            groups.append(dict({k: v for k, v in g.items() if k != "params"}, params=ids))
        state = {index[id(t)]: v for t, v in self.state.items()
                 if isinstance(t, torch.Tensor) and id(t) in index}
        return {"state": state, "param_groups": groups}

    def _load_shard_state(self, sd):
        """Sharded: load a state dict of _shard_state_dict's form, through
        each bucket's inner optimizer's own load_state_dict (its checks and
        casts), into the one shared ``state``; the host groups take the
        loaded hyperparameters."""
        if len(sd["param_groups"]) != len(self._full_groups):
            raise ValueError("load_state_dict: the state dict has %d param groups, this "
                             "optimizer %d" % (len(sd["param_groups"]), len(self._full_groups)))
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

    def load_state_dict(self, state_dict):
        """Takes either form: the sharded one of this rank (same world size
        and layout), or the full one (any world size and layout)."""
        meta = state_dict.get("sfsync")
        if not self._sharded:
            if meta is not None:
                raise ValueError("load_state_dict: a sharded state dict (rank %d of %d); this "
                                 "optimizer is not sharded: load the full form "
                                 "(full_state_dict())" % (meta["rank"], meta["world_size"]))
            torch.optim.Optimizer.load_state_dict(self, state_dict)
            self._share_state()  # (torch's load made a new state)
            return None
        if meta is None:
            return self._load_full(state_dict)
        mine = self._meta()
        for key in ("rank", "world_size", "layout", "ranges"):
            if [tuple(x) for x in meta[key]] != [tuple(x) for x in mine[key]] \
                    if key == "ranges" else meta[key] != mine[key]:
                raise ValueError("load_state_dict: the sharded state dict's %s (%r) differs from "
                                 "this optimizer's (%r): load the full form instead"
                                 % (key, meta[key] if key != "ranges" else "shard ranges",
                                    mine[key] if key != "ranges" else "shard ranges"))
        inner = {k: v for k, v in state_dict.items() if k != "sfsync"}
        self._load_shard_state(inner)
        with torch.no_grad():
            for s, m in zip(self._stepped, meta["master"]):
                if m is not None:
                    s.tensor.copy_(m)

    def _load_full(self, sd):
        full_index = [s for group in self._full_groups for s in group]
        if len(sd["param_groups"]) != len(self._full_groups):
            raise ValueError("load_state_dict: the full state dict has %d param groups, this "
                             "optimizer %d" % (len(sd["param_groups"]), len(self._full_groups)))
        # the inner optimizer's numbering: its params in order (the owned shards)
        inner_index = {id(s.tensor): k for k, s in enumerate(self._stepped)}
        state = {}
        for k, s in enumerate(full_index):
            entry = sd["state"].get(k)
            if entry is None or s.tensor is None:
                continue
            mine = {}
            for key, v in entry.items():
                if isinstance(v, torch.Tensor) and v.numel() == s.param.numel() and v.dim() > 0:
                    v = v.reshape(-1)[s.offset:s.offset + s.count].reshape(s.tensor.shape)
                mine[key] = v.clone() if isinstance(v, torch.Tensor) else v
            state[inner_index[id(s.tensor)]] = mine
        groups = []
        start = 0
        for g, slots in zip(sd["param_groups"], self._full_groups):
            ids = [inner_index[id(s.tensor)] for s in slots if s.tensor is not None]
            groups.append(dict(g, params=ids))
            start += len(slots)
        self._load_shard_state({"state": state, "param_groups": groups})
        with torch.no_grad():  # bf16: the masters restart from the parameters
            for s in self._stepped:
                if s.master:
                    p = s.param.data
                    s.tensor.copy_(p if s.tensor.shape == p.shape else
                                   p.view(-1)[s.offset:s.offset + s.count])

    def full_state_dict(self):
        """Collective (every rank calls it): the full form, the state dict the
        same torch.optim class over the whole model would have, on every rank."""
        if not self._sharded:
            return torch.optim.Optimizer.state_dict(self)
        sync = self._sync
        ctx, world = sync.context, sync.world_size
        mine = self._shard_state_dict()
        pieces = {}
        for k, s in enumerate(self._stepped):
            if mine["state"].get(k):
                pieces[s.index] = (s.offset, s.count, mine["state"][k])
        buf = io.BytesIO()
        torch.save(pieces, buf)
        payload = buf.getvalue()
        sizes = torch.zeros(world, dtype=torch.float64)
        sizes[sync.rank] = len(payload)
        shard.allreduce_float64(ctx, sizes)
        every = {}
        for r in range(world):
            data = torch.zeros(int(sizes[r]), dtype=torch.uint8)
            if r == sync.rank:
                data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            if world > 1 and data.numel():
                ctx.broadcast(data, r)
            got = torch.load(io.BytesIO(data.numpy().tobytes())) if data.numel() else {}
            for index, piece in got.items():
                every.setdefault(index, []).append(piece)
        full_index = [s for group in self._full_groups for s in group]
        state = {}
        for k, s in enumerate(full_index):
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
        for g, slots in zip(mine["param_groups"], self._full_groups):
            groups.append(dict(g, params=list(range(start, start + len(slots)))))
            start += len(slots)
        return {"state": state, "param_groups": groups}
