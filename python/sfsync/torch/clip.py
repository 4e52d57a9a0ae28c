"""The global gradient norm of a sharded optimizer, bit for bit torch's.

``torch.nn.utils.clip_grad_norm_`` computes one norm per gradient tensor,
then the norm of those norms, then ``max_norm / (total + 1e-6)`` clamped to
1, and multiplies every gradient by it. The last two steps need only the
per-tensor norms; the first needs each tensor whole. When each rank owns its
gradients whole (``shard_layout="parameter"``, or a flat layout in which no
gradient straddles two ranks), each rank computes the norms of its own with
torch's own function, one sf_allreduce_float64 adds them (every other rank
adds 0.0: the sum is exact), and the rest is torch's arithmetic on the same
float values: the total, the coefficient and each scaled element are torch's
bit for bit. Where a gradient straddles ranks its norm is not: the caller
gathers it first (``SyncOptimizer``) or takes the float64 one (overlap_step).

Both torch generations are followed: 1.13 (``torch.norm`` per gradient, in
parameter order) and 2.x (``torch._foreach_norm`` per (device, dtype) group,
the groups in first-seen order; ``torch.linalg.vector_norm`` of the stack).
"""

import math

import torch

__all__ = ["tensor_norms", "total_norm", "clip_coefficient"]

# torch 2.x's clip groups the gradients by (device, dtype) and takes
# torch._foreach_norm where torch's own rule says foreach applies; 1.13's
# takes torch.norm of each gradient, in order.
_GROUPED = int(torch.__version__.split(".")[0]) >= 2
if _GROUPED:
    from torch.utils._foreach_utils import _has_foreach_support


def _groups(grads):
    """torch 2.x's clip's groups: (device, dtype) -> the indices of
    ``grads`` in it, the groups in first-seen order."""
    groups = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    return groups


def _order(grads):
    """The order in which torch's clip stacks the norms of ``grads``: its
    groups' (2.x), else as given."""
    if not _GROUPED:
        return list(range(len(grads)))
    return [i for members in _groups(grads).values() for i in members]


def tensor_norms(grads, norm_type):
    """torch's clip's norm of each tensor of ``grads`` (0-dim tensors, in the
    order given), computed as the installed torch's clip computes it."""
    if not grads:
        return []
    if not _GROUPED:
        if math.isinf(norm_type):
            return [g.detach().abs().max() for g in grads]
        return [torch.norm(g.detach(), norm_type) for g in grads]
    out = [None] * len(grads)
    for (device, _), members in _groups(grads).items():
        ts = [grads[i] for i in members]
        if _has_foreach_support(ts, device):
            norms = torch._foreach_norm(ts, norm_type)
        else:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in ts]
        for i, n in zip(members, norms):
            out[i] = n
    return out


def total_norm(norms, grads, norm_type):
    """torch's clip's total norm from ``norms`` (one 0-dim tensor per
    gradient of ``grads``, in their order, of the gradient's dtype)."""
    if not norms:
        return torch.tensor(0.0)
    first = grads[0].device
    stacked = [norms[i].to(first) for i in _order(grads)]
    if not _GROUPED:
        if math.isinf(norm_type):
            return stacked[0] if len(stacked) == 1 else torch.max(torch.stack(stacked))
        return torch.norm(torch.stack(stacked), norm_type)
    return torch.linalg.vector_norm(torch.stack(stacked), norm_type)


def clip_coefficient(max_norm, total):
    """torch's clamped clip coefficient (a 0-dim tensor of total's dtype)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)
