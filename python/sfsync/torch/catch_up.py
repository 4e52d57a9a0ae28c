"""The reduction at the optimizer step of what a wrong guess left local
(sfsync/host_window.py, "the host's optimizer step"): every gradient of the
DDPs whose window ended with passes that DDP would have sent but sfsync kept
local is averaged over its process group before the optimizer reads it.

Responsible for: which tensors (each DDP's parameters that DDP reduces,
each once where nested DDPs share them), the collectives (per process group:
one all-reduce of an int32 mask of which gradients exist on some rank, then
one all-reduce per (device, dtype) of the flattened gradients, divided by
the world size first as DDP's hook does), the copy back and the counts.
Not responsible for: deciding that it is due (HostWindow.step).
"""

import torch

__all__ = ["reduce_left_local"]


def _reduced_parameters(ddp):
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    return [p for name, p in ddp.module.named_parameters()
            if p.requires_grad and name not in ignored]


def reduce_left_local(syncs):
    """Average .grad of every parameter the DDPs of ``syncs`` (DDPSyncs)
    reduce, over each DDP's process group; nested DDPs' shared parameters
    once. Every rank calls it at the same step (the decision is the same on
    every rank: it depends only on the host's loop)."""
    import torch.distributed as dist
    groups = []  # [(group, world_size, [sync], [param])], in the syncs' order
    seen = set()
    for sync in syncs:
        entry = next((g for g in groups if g[0] is sync.group), None)
        if entry is None:
            entry = (sync.group, sync.world_size, [], [])
            groups.append(entry)
        entry[2].append(sync)
        for p in _reduced_parameters(sync.ddp):
            if id(p) not in seen:
                seen.add(id(p))
                entry[3].append(p)
    for group, world, members, params in groups:
        if not params:
            continue
        device = params[0].device
        # Which gradients exist on some rank: a rank whose parameter got no
        # gradient adds zeros, and every rank then holds the same tensors.
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                           device=device)
        dist.all_reduce(has, group=group)
        present = [p for p, n in zip(params, has.tolist()) if n]
        nbytes = 0
        by_kind = {}
        for p in present:
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        for (dev, dtype), ps in by_kind.items():
            flat = torch.cat([p.grad.detach().reshape(-1) if p.grad is not None
                              else torch.zeros(p.numel(), device=dev, dtype=dtype) for p in ps])
            flat.div_(world)
            dist.all_reduce(flat, group=group)
            nbytes += flat.numel() * flat.element_size()
            offset = 0
            with torch.no_grad():
                for p in ps:
                    part = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                    if p.grad is None:
                        p.grad = part.clone()
                    else:
                        p.grad.copy_(part)
        for sync in members:
            sync.catch_ups += 1
        members[0].catch_up_bytes += nbytes
