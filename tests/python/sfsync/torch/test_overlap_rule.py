"""The per-bucket step's rule (issue 24): ``sync.optimizer(..., overlap_step=True)``
is off where it cannot win. Unsharded with a single bucket there is no other
bucket's wire time for a step to overlap: the per-bucket step would be the
plain step with ``.grad`` not final until ``opt.step()``, so the final-gradient
step runs instead (``opt.overlap_step`` False: the window is synchronized when
its last backward returns). With two or more buckets, and always when sharded
(there overlap_step also drops the gradient gather: 1x the bytes instead of
1.5x), it stays on. One rank; a second or so.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 /usr/bin/python3 tests/python/sfsync/torch/test_overlap_rule.py
"""

import os
import sys
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "..", ".."))
if not any(os.path.exists(os.path.join(p, "sfsync", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.join(ROOT, "python"))  # the package from the source tree

import torch  # noqa: E402

from sfsync import torch as sft  # noqa: E402

LOCAL = dict(rank=0, world_size=1, rendezvous="", find_unused_parameters=False)
# Every tensor of the model below in a bucket of its own (4 buckets).
MANY = dict(bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def run_window(model, sync, opt, steps=2):
    """One window; returns windows_completed seen after its last backward
    (before opt.step()) and the model's weights after the step."""
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        model(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
    assert sync.is_step()
    done_before_step = sync.stats()["windows_completed"]
    opt.step()
    opt.zero_grad()
    return done_before_step, [p.detach().clone() for p in model.parameters()]


class OverlapStepRule(unittest.TestCase):
    def make(self, overlap_step, shard=False, **caps):
        model = mlp()
        sync = sft.GradientSync(model, accumulation_steps=2, shard_optimizer=shard,
                                **dict(LOCAL, **caps))
        self.addCleanup(sync.close)
        opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=0.01,
                             overlap_step=overlap_step)
        return model, sync, opt

    def test_one_bucket_unsharded_steps_with_final_gradients(self):
        model, sync, opt = self.make(True)
        self.assertEqual(sync.stats()["bucket_count"], 1)
        self.assertFalse(opt.overlap_step)
        done, weights = run_window(model, sync, opt)
        self.assertEqual(done, 1)  # synchronized when the last backward returned
        # The same step as overlap_step=False asks for.
        model2, sync2, opt2 = self.make(False)
        self.assertFalse(opt2.overlap_step)
        done2, weights2 = run_window(model2, sync2, opt2)
        self.assertEqual(done2, 1)
        for a, b in zip(weights, weights2):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    def test_several_buckets_keep_the_per_bucket_step(self):
        model, sync, opt = self.make(True, **MANY)
        self.assertEqual(sync.stats()["bucket_count"], 4)
        self.assertTrue(opt.overlap_step)
        done, _ = run_window(model, sync, opt)
        self.assertEqual(done, 0)  # the buckets are waited inside opt.step()
        self.assertEqual(sync.stats()["windows_completed"], 1)

    def test_sharded_one_bucket_keeps_it(self):
        model, sync, opt = self.make(True, shard=True)
        self.assertEqual(sync.stats()["bucket_count"], 1)
        self.assertTrue(opt.overlap_step)
        done, _ = run_window(model, sync, opt)
        self.assertEqual(done, 0)

    def test_off_stays_off(self):
        model, sync, opt = self.make(False, **MANY)
        self.assertFalse(opt.overlap_step)
        done, _ = run_window(model, sync, opt)
        self.assertEqual(done, 1)


if __name__ == "__main__":
    unittest.main()
