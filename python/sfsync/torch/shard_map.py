"""ShardMap: which part of each model parameter this rank's optimizer
steps, in which bucket, in which of the user's groups (FSDP2 keeps the same
facts on each ``FSDPParam``).

Responsible for: one ``Slot`` per trainable parameter (its bucket, this
rank's range from sf_shard_range, the tensor the inner optimizer steps:
the parameter, a view of its shard, or a float32 master copy of a 16-bit
shard), the user's groups checked against the parameters, and the slots
per bucket. Not responsible for: stepping (optim.py), the collectives
(window_driver.py), state dicts (optim_state.py).
"""

import torch

from sfsync import shard

__all__ = ["ShardMap", "Slot", "share_state"]

_LOW = (torch.bfloat16, torch.float16)


class Slot:
    """One model parameter and what this rank steps of it."""

    __slots__ = ("index", "param", "gid", "bucket", "offset", "count", "tensor", "master")

    def __init__(self, index, param, gid, bucket, offset, count):
        self.index, self.param, self.gid, self.bucket = index, param, gid, bucket
        self.offset, self.count = offset, count
        self.tensor = None   # what the inner optimizer steps (None: nothing here)
        self.master = False  # tensor is a float32 master copy of a bf16/fp16 shard

    def piece(self, t):
        """This rank's range of ``t`` (shaped as the parameter): ``t`` itself
        where the rank holds the whole parameter, else a flat view."""
        if self.offset == 0 and self.count == self.param.numel():
            return t
        return t.view(-1)[self.offset:self.offset + self.count]

    def make_tensor(self, sharded):
        p = self.param
        if not sharded:
            self.tensor = p
        elif self.count > 0:
            view = self.piece(p.data)
            if p.dtype in _LOW:
                self.tensor = view.detach().to(torch.float32, copy=True)
                self.master = True
            else:
                self.tensor = view.detach()


class ShardMap:
    """The slots of a WindowDriver's parameters for the user's ``params``
    (a list of parameters or of group dicts), over ``buckets`` buckets.

    ``slots``: every parameter's, in the driver's order; ``groups``: the
    slots of each user group; ``hyper``: each group's options; ``stepped``:
    the slots this rank steps something of (group order); ``by_bucket``:
    those per bucket; ``unstepped``: parameters in no group."""

    def __init__(self, driver, params, buckets):
        self._driver = driver  # asked whether the context is sharded (``sharded``)
        ctx, sharded = driver.context, driver.sharded
        self.slots = []
        for i, (p, gid) in enumerate(zip(driver.params, driver.store.ids)):
            off, cnt = shard.shard_range(ctx, gid) if sharded else (0, p.numel())
            self.slots.append(Slot(i, p, gid, shard.gradient_bucket(ctx, gid), off, cnt))
        groups = list(params)
        if not groups:
            raise ValueError("sync.optimizer: got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        index_of = {id(p): i for i, p in enumerate(driver.params)}
        self.groups = []
        seen = set()
        for g in groups:
            ps = g["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            slots = []
            for p in ps:
                i = index_of.get(id(p))
                if i is None:
                    raise ValueError("sync.optimizer: a parameter of shape %s is not one of the "
                                     "GradientSync's (trainable parameters of its module)"
                                     % list(p.shape))
                if i in seen:
                    raise ValueError("sync.optimizer: parameter %r appears in more than one "
                                     "group" % driver.names[i])
                seen.add(i)
                slots.append(self.slots[i])
            self.groups.append(slots)
            for s in slots:
                s.make_tensor(sharded)
        self.hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self.stepped = [s for group in self.groups for s in group if s.tensor is not None]
        self.by_bucket = [[] for _ in range(buckets)]
        for s in self.stepped:
            self.by_bucket[s.bucket].append(s)
        self.unstepped = [s for s in self.slots if s.index not in seen]

    @property
    def sharded(self):
        return self._driver.sharded

    def full_index(self):
        """The slots in the order of torch's parameter indices (group order)."""
        return [s for group in self.groups for s in group]

    def tensors(self, b):
        """Per group, the tensors this rank steps of bucket ``b``."""
        return [[s.tensor for s in slots if s.tensor is not None and s.bucket == b]
                for slots in self.groups]

    def bucket_of(self):
        """id(parameter) -> its bucket."""
        return {id(s.param): s.bucket for s in self.slots}


def share_state(optimizer):
    """Every inner optimizer's state is ``optimizer.state`` (again after a
    torch load replaced it)."""
    for inner in optimizer.inner_optimizers:
        if inner is not None:
            inner.state = optimizer.state
