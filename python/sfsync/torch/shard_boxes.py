"""Where a rank's range of a parameter sits in the parameter's shape, for
torch.distributed.checkpoint (optim_state.py's "[Note: the sharded form]").

Responsible for: the flat-contiguous boxes of a flat range [offset, offset +
count) of a C-ordered shape, the slab (the rows the range touches) that holds
them, torch's ``CheckpointableTensor`` fields on it
(torch.distributed.checkpoint.protocol: ``global_shape``, ``global_offsets``,
``local_offsets``, ``local_sizes``), and reading a range back out of such a
tensor. Pure functions of shapes and tensors; not responsible for which
range a rank holds (the plugin's shard plan) or for state dicts.
"""

import math

__all__ = ["boxes", "slab", "annotate", "to_slab", "covered", "range_text"]


def boxes(shape, start, stop):
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
        return [((r0,) + o, (1,) + z) for o, z in boxes(shape[1:], c0, c1)]
    out = []
    if c0:
        out += [((r0,) + o, (1,) + z) for o, z in boxes(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + full, (r1 - r0,) + tuple(shape[1:])))
    if c1:
        out += [((r1,) + o, (1,) + z) for o, z in boxes(shape[1:], 0, c1)]
    return out


def slab(shape, offset, count):
    """(first row, slab shape) of the rows of ``shape`` that [offset,
    offset + count) touches."""
    inner = math.prod(shape[1:])
    r0 = offset // inner
    r1 = -(-(offset + count) // inner)
    return r0, (r1 - r0,) + tuple(shape[1:])


def annotate(local, shape, offset, count):
    """``local`` (the slab of [offset, offset + count) of ``shape``) with
    torch's CheckpointableTensor fields."""
    r0, _ = slab(shape, offset, count)
    parts = boxes(shape, offset, offset + count)
    local.global_shape = tuple(shape)
    local.global_offsets = tuple(o for o, _ in parts)
    local.local_offsets = tuple((o[0] - r0,) + o[1:] for o, _ in parts)
    local.local_sizes = tuple(z for _, z in parts)
    return local


def to_slab(v, shape, offset, count):
    """A shard-sized state tensor ``v`` as its annotated slab: a view when the
    range is whole rows, else a zero-padded copy of the rows it touches."""
    if len(shape) == 0:
        return v
    flat = v.detach().reshape(-1)
    r0, slab_shape = slab(shape, offset, count)
    inner = math.prod(shape[1:])
    if offset % inner == 0 and count % inner == 0:
        local = flat.view(slab_shape)
    else:
        local = flat.new_zeros(math.prod(slab_shape))
        start = offset - r0 * inner
        local[start:start + count] = flat
        local = local.view(slab_shape)
    return annotate(local, shape, offset, count)


def _ravel(index, shape):
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def covered(t):
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


def range_text(pieces):
    return ", ".join("[%d, %d)" % (a, a + v.numel()) for a, v in pieces) or "nothing"
