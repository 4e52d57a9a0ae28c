"""sfsync/torch/shard_boxes.py against brute force (issue 32): for every
flat range of a few shapes (1-D to 4-D, rows of one, empty dims excluded),
the boxes cover exactly the range, in order, each flat-contiguous; the slab
holds them at their local offsets; to_slab then covered() gives the range's
values back; torch.distributed.checkpoint's own validation (torch >= 2.15)
accepts the fields. Runs in a second."""

import itertools
import math
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "..", "..", "python"))
from sfsync.torch import shard_boxes as sb  # noqa: E402

SHAPES = [(7,), (3, 5), (4, 1), (1, 6), (2, 3, 4), (3, 2, 2, 3)]


def ranges(n):
    return [(a, b) for a in range(n) for b in range(a + 1, n + 1)]


class ShardBoxesTests(unittest.TestCase):
    def test_boxes_cover_the_range_exactly(self):
        for shape in SHAPES:
            n = math.prod(shape)
            for a, b in ranges(n):
                covered = []
                for off, size in sb.boxes(shape, a, b):
                    idx = [tuple(o + d for o, d in zip(off, ds))
                           for ds in itertools.product(*[range(z) for z in size])]
                    flat = [sum(i * math.prod(shape[k + 1:]) for k, i in enumerate(ix))
                            for ix in idx]
                    self.assertEqual(flat, list(range(flat[0], flat[0] + len(flat))),
                                     "%s [%d, %d): box %s %s not contiguous" % (
                                         shape, a, b, off, size))
                    covered += flat
                self.assertEqual(covered, list(range(a, b)), "%s [%d, %d)" % (shape, a, b))

    def test_slab_round_trip(self):
        for shape in SHAPES:
            n = math.prod(shape)
            for a, b in ranges(n):
                values = torch.arange(a, b, dtype=torch.float64) + 0.5
                t = sb.to_slab(values, shape, a, b - a)
                r0, slab_shape = sb.slab(shape, a, b - a)
                self.assertEqual(tuple(t.shape), slab_shape)
                self.assertEqual(t.global_shape, shape)
                pieces = sb.covered(t)
                got = torch.cat([v for _, v in pieces])
                self.assertEqual(pieces[0][0], a)
                self.assertTrue(torch.equal(got, values), "%s [%d, %d)" % (shape, a, b))
                # the slab's cells at the global coordinates hold the values
                full = torch.zeros(n, dtype=torch.float64)
                full[a:b] = values
                full = full.view(shape)
                self.assertTrue(torch.equal(t[t != 0], full[r0:r0 + slab_shape[0]][t != 0]))

    def test_whole_rows_are_views(self):
        values = torch.arange(10.0)
        t = sb.to_slab(values, (4, 5), 5, 10)
        self.assertEqual(t.data_ptr(), values.data_ptr())
        self.assertEqual(t.global_offsets, ((1, 0),))

    def test_torch_accepts_the_fields(self):
        try:
            from torch.distributed.checkpoint import protocol
        except ImportError:
            self.skipTest("torch %s has no torch.distributed.checkpoint.protocol"
                          % torch.__version__)
        for shape in SHAPES:
            n = math.prod(shape)
            for a, b in ranges(n)[::3]:
                t = sb.to_slab(torch.ones(b - a), shape, a, b - a)
                self.assertTrue(protocol._is_checkpointable_tensor(t))
                chunks = protocol._get_checkpointable_tensor_chunks(t)
                self.assertEqual(sum(math.prod(c.sizes) for c in chunks), b - a)

    def test_a_box_that_is_not_contiguous_is_refused(self):
        t = torch.zeros(2, 3)
        t.global_shape, t.global_offsets = (2, 3), ((0, 0),)
        t.local_offsets, t.local_sizes = ((0, 0),), ((2, 2),)
        with self.assertRaisesRegex(ValueError, "not contiguous"):
            sb.covered(t)


if __name__ == "__main__":
    unittest.main()
