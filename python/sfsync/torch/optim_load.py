"""Loading a SyncOptimizer's state dicts: any form, at any world size and
layout (StateLoader, used by optim_state.py's StateDicts).

Responsible for: ``load_state_dict`` and its checks (the groups, the shapes,
the ranges a per-rank form holds, the window boundary), agreed on every rank
before any rank loads; loading through each bucket's inner optimizer.
Not responsible for: making the forms (optim_state.py), where a range sits
in a shape (shard_boxes.py). It reads only what its StateDicts hands it:
the optimizer's public face (``state``, ``param_groups``,
``inner_optimizers``), the ShardMap and the WindowDriver.
"""

import torch

from sfsync.torch.shard_boxes import annotate, covered, range_text, slab
from sfsync.torch.shard_map import share_state

__all__ = ["StateLoader", "SHARDED_FORM", "MASTER_KEY"]

SHARDED_FORM = "sharded"
MASTER_KEY = "sfsync_master"


class StateLoader:
    """One ``load_state_dict`` of a StateDicts' optimizer (see optim_state.py)."""

    def __init__(self, forms):
        self.forms = forms
        self.optimizer, self.map, self.driver = forms.optimizer, forms.map, forms.driver

    def load_state_dict(self, state_dict):
        """SyncOptimizer.load_state_dict: every form, checked on every rank first."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or \
                "param_groups" not in state_dict:
            raise ValueError("load_state_dict: expected an optimizer state dict (with 'state' "
                             "and 'param_groups'), got %s" % (
                                 sorted(state_dict) if isinstance(state_dict, dict)
                                 else type(state_dict).__name__))
        meta = state_dict.get("sfsync")
        if not self.driver.sharded:
            if isinstance(meta, dict) and "rank" in meta:
                raise ValueError("load_state_dict: a sharded state dict (rank %s of %s); this "
                                 "optimizer is not sharded: load the full form "
                                 "(full_state_dict(), or consolidate_state_dict() then "
                                 "state_dict() on that rank)"
                                 % (meta.get("rank"), meta.get("world_size")))
            torch.optim.Optimizer.load_state_dict(self.optimizer, state_dict)
            share_state(self.optimizer)  # (torch's load made a new state)
            return None
        self.forms.check_boundary("load_state_dict")
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
                             % (", ".join(map(str, failed)), self.forms.where()))
        apply()

    def _agree(self, failed):
        """The ranks whose load failed."""
        flags = self.forms.per_rank(1.0 if failed else 0.0)
        return [r for r in range(len(flags)) if flags[r] > 0]

    def _pairs(self, sd):
        """[(saved key, slot)] in group order, checked against this
        optimizer's groups."""
        saved = sd["param_groups"]
        if len(saved) != len(self.map.groups):
            raise ValueError("load_state_dict: the state dict has %d param groups, this "
                             "optimizer %d: a checkpoint of another model or optimizer?"
                             % (len(saved), len(self.map.groups)))
        pairs = []
        for n, (g, slots) in enumerate(zip(saved, self.map.groups)):
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
        elsewhere = (meta or {}).get("form") == SHARDED_FORM and id(sd) not in self.forms.issued and \
            any(meta.get(k) != v for k, v in (("rank", self.driver.rank),
                                               ("world_size", self.driver.world_size),
                                               ("layout", self.driver.shard_layout)))
        inner_index = {id(s.tensor): i for i, s in enumerate(self.map.stepped)}
        state, masters = {}, {}
        for k, (key, s) in enumerate(self._pairs(sd)):
            entry = sd["state"].get(key)
            if s.tensor is None:
                continue
            if not entry:
                if elsewhere and k not in saved_ranges and self._keeps_state():
                    raise ValueError(self._not_mine(s, "holds no state for parameter %s, which "
                                                    "this rank steps [%d, %d) of"
                                                    % (self.driver.names[s.index], s.offset,
                                                       s.offset + s.count), meta))
                continue
            mine = {}
            for name, v in entry.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v = self._piece_in(s, name, v, saved_ranges.get(k), meta)
                mine[name] = v.clone() if isinstance(v, torch.Tensor) else v
            master = mine.pop(MASTER_KEY, None)
            if master is not None and s.master:
                masters[id(s.tensor)] = master
            if mine:
                state[inner_index[id(s.tensor)]] = mine
        groups = []
        for g, slots in zip(sd["param_groups"], self.map.groups):
            ids = [inner_index[id(s.tensor)] for s in slots if s.tensor is not None]
            groups.append(dict({k: v for k, v in g.items() if k != "params"}, params=ids))
        return lambda: self._apply(state, groups, masters)

    def _apply(self, state, groups, masters):
        self._load_shard_state({"state": state, "param_groups": groups})
        with torch.no_grad():
            for s in self.map.stepped:
                if not s.master:
                    continue
                if id(s.tensor) in masters:  # the saved float32 master
                    s.tensor.copy_(masters[id(s.tensor)])
                else:  # none saved: the master restarts from the parameter
                    s.tensor.copy_(s.piece(s.param.data))

    def _piece_in(self, s, name, v, saved_range, meta):
        """This rank's range of state tensor ``v`` of slot ``s``, shaped as
        the shard tensor."""
        p = s.param
        what = "load_state_dict: %r of parameter %s" % (name, self.driver.names[s.index])
        if not hasattr(v, "global_offsets") and saved_range is not None and \
                tuple(v.shape) != tuple(p.shape) and p.dim() > 0:
            off, cnt = saved_range  # a per-rank file whose torch dropped the fields
            if tuple(v.shape) == slab(p.shape, off, cnt)[1]:
                v = annotate(v, p.shape, off, cnt)
        if hasattr(v, "global_offsets"):
            if tuple(v.global_shape) != tuple(p.shape):
                raise ValueError("%s is a shard of a tensor of shape %s; the parameter's is %s: "
                                 "a checkpoint of another model?"
                                 % (what, list(v.global_shape), list(p.shape)))
            pieces = covered(v)
            want = (s.offset, s.offset + s.count)
            flat = [(a, x) for a, x in pieces if a < want[1] and a + x.numel() > want[0]]
            got = torch.cat([x for _, x in flat]) if flat else v.new_zeros(0)
            if not flat or flat[0][0] > want[0] or \
                    any(a + x.numel() != b for (a, x), (b, _) in zip(flat, flat[1:])) or \
                    flat[0][0] + got.numel() < want[1]:
                raise ValueError(self._not_mine(s, "%s covers elements %s of %d" % (
                    what[len("load_state_dict: "):], range_text(pieces), p.numel()), meta))
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
        return bool(self.optimizer.state) or bool(self.forms.fresh_state())

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
                % (what, who, self.forms.where(), s.offset, s.offset + s.count,
                   self.driver.names[s.index]))

    def _load_v04(self, sd, meta):
        """The 0.4 per-rank form (state numbered over this rank's shards):
        only on the rank, world size and layout that saved it."""
        mine = {"rank": self.driver.rank, "world_size": self.driver.world_size,
                "layout": self.driver.shard_layout}
        for key in ("rank", "world_size", "layout"):
            if meta.get(key) != mine[key]:
                raise ValueError("load_state_dict: a 0.4 sharded state dict of rank %s of %s "
                                 "(layout %s); this optimizer is %s: it loads only where it "
                                 "was saved. Save the full form (opt.full_state_dict(), or "
                                 "consolidate_state_dict() then state_dict()) to resume "
                                 "elsewhere" % (meta.get("rank"), meta.get("world_size"),
                                                meta.get("layout"), self.forms.where()))
        ranges = [(s.index, s.offset, s.count) for s in self.map.stepped]
        if [tuple(x) for x in meta.get("ranges", [])] != ranges:
            raise ValueError("load_state_dict: the 0.4 sharded state dict's shard ranges differ "
                             "from this optimizer's (another model or bucket cap?)")
        def apply():
            self._load_shard_state({k: v for k, v in sd.items() if k != "sfsync"})
            with torch.no_grad():
                for s, m in zip(self.map.stepped, meta.get("master", [])):
                    if m is not None:
                        s.tensor.copy_(m)
        return apply

    def _load_shard_state(self, sd):
        """Sharded: load a state dict numbered over this rank's shard tensors
        (group order), through each bucket's inner optimizer's own
        load_state_dict (its checks and casts), into the one shared
        ``state``; the host groups take the loaded hyperparameters."""
        owned = []
        for g, slots in zip(sd["param_groups"], self.map.groups):
            mine = [s for s in slots if s.tensor is not None]
            if len(g["params"]) != len(mine):
                raise ValueError("load_state_dict: a param group of the state dict has %d "
                                 "parameters, this optimizer's %d"
                                 % (len(g["params"]), len(mine)))
            owned.append(list(zip(g["params"], mine)))
        loaded = {}
        first = None
        for b, inner in enumerate(self.optimizer.inner_optimizers):
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
        self.optimizer.state.clear()
        self.optimizer.state.update(loaded)
        share_state(self.optimizer)
        source = first.param_groups if first is not None else sd["param_groups"]
        for outer, group in zip(self.optimizer.param_groups, source):
            for k, v in group.items():
                if k != "params":
                    outer[k] = v
