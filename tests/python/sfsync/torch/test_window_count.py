"""The window count has one holder, the plugin (issue 44, item 1):
GradientSync's ``windows`` is the plugin's ``sf_stats.windows_completed``
(a window whose reductions started, sf_synchronize_start, counts from then:
the plugin counts it at its sf_synchronize), ``load_state_dict`` restores it
there (sf_restore_windows) or refuses, and the faces' HostWindow keeps no
count of its own. DDPSync's windows, which DDP reduces through its own
process group, are counted there too: sf_count_window as each one ends.

One rank; seconds.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 /usr/bin/python3 tests/python/sfsync/torch/test_window_count.py
"""

import os
import sys
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "..", ".."))
if not any(os.path.exists(os.path.join(p, "sfsync", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.join(ROOT, "python"))  # the package from the source tree

import torch  # noqa: E402

import sfsync  # noqa: E402
from sfsync import torch as sft  # noqa: E402

LOCAL = dict(rank=0, world_size=1, rendezvous="")


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def window(model, steps=2):
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        model(torch.randn(5, 6, generator=g)).pow(2).sum().backward()


class GradientSyncAsksThePlugin(unittest.TestCase):
    def attach(self, model=None, context=None, **kw):
        model = model or mlp()
        sync = sft.GradientSync(model, context, accumulation_steps=2,
                                **dict(kw, **({} if context is not None else LOCAL)))
        self.addCleanup(sync.close)
        return model, sync

    def counts(self, sync):
        return sync.windows, sync.stats()["windows_completed"]

    def test_windows_is_the_plugins_count(self):
        ctx = sfsync.Context(**LOCAL)
        self.addCleanup(ctx.close)
        ctx.restore_windows(40)  # the context holds the count: 40 windows before
        model, sync = self.attach(context=ctx)
        self.assertEqual(self.counts(sync), (40, 40))
        window(model)
        self.assertEqual(self.counts(sync), (41, 41))
        self.assertFalse(hasattr(sync._window, "windows"))  # the face's HostWindow counts none

    def test_a_window_of_weight_zero_counts_once(self):
        model, sync = self.attach(reduce="weighted")
        with self.assertRaises(sfsync.InvalidStateError):
            window(model)  # no sync.weigh(): the global weight is 0
        self.assertFalse(sync.is_step())
        self.assertEqual(self.counts(sync), (1, 1))

    def test_a_window_of_weight_zero_stepped_per_bucket_counts_once(self):
        """With overlap_step the plugin refuses the window in opt.step()
        (sf_synchronize there): counted once, and not synchronized again at
        the next window's start."""
        model, sync = self.attach(reduce="weighted", bucket_cap_mb=1e-4,
                                  first_bucket_cap_mb=1e-4)
        opt = sync.optimizer(torch.optim.SGD, model.parameters(), lr=0.1, overlap_step=True)
        window(model)  # no sync.weigh()
        self.assertEqual(self.counts(sync), (1, 0))
        with self.assertRaises(sfsync.InvalidStateError):
            opt.step()
        self.assertEqual(self.counts(sync), (1, 1))
        for i in range(2):
            sync.weigh(5)
            model(torch.randn(5, 6)).pow(2).sum().backward()
        self.assertEqual(self.counts(sync), (2, 1))
        opt.step()
        self.assertEqual(self.counts(sync), (2, 2))

    def test_a_started_window_counts_before_its_waits(self):
        model, sync = self.attach(bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
        opt = sync.optimizer(torch.optim.SGD, model.parameters(), lr=0.1, overlap_step=True)
        self.assertTrue(opt.overlap_step)
        window(model)
        # sf_synchronize_start ran, sf_synchronize (the plugin's count) runs in opt.step()
        self.assertEqual(self.counts(sync), (1, 0))
        opt.step()
        self.assertEqual(self.counts(sync), (1, 1))

    def test_load_state_dict_restores_the_plugins_count(self):
        model, sync = self.attach()
        for _ in range(3):
            window(model)
        state = sync.state_dict()
        self.assertEqual(state["windows"], 3)
        sync.close()
        model, resumed = self.attach(model)
        resumed.load_state_dict(state)
        self.assertEqual(self.counts(resumed), (3, 3))
        window(model)
        self.assertEqual(self.counts(resumed), (4, 4))

    def test_load_state_dict_after_a_window_is_refused(self):
        model, sync = self.attach()
        window(model)
        state = dict(sync.state_dict(), windows=7, last_verified=0)
        with self.assertRaisesRegex(RuntimeError, "sf_restore_windows"):
            sync.load_state_dict(state)  # the plugin counted one window already
        self.assertEqual(self.counts(sync), (1, 1))


class DDPSyncAsksThePlugin(unittest.TestCase):
    """attach(ddp): DDP reduces the windows (its comm hook); each window's
    end is counted in the plugin (sf_count_window), the count's one holder."""

    @classmethod
    def setUpClass(cls):
        import tempfile
        import torch.distributed as dist
        cls.dir = tempfile.TemporaryDirectory()
        dist.init_process_group("gloo", init_method="file://" + os.path.join(cls.dir.name, "store"),
                                rank=0, world_size=1)

    @classmethod
    def tearDownClass(cls):
        import torch.distributed as dist
        dist.destroy_process_group()
        cls.dir.cleanup()

    def attach(self, **kw):
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(mlp())
        sync = sft.attach(ddp, accumulation_steps=2, **dict(LOCAL, **kw))
        self.addCleanup(sync.close)
        return ddp, sync

    def test_windows_are_counted_in_the_plugin(self):
        ddp, sync = self.attach()
        for n in range(1, 4):
            window(ddp)
            self.assertEqual((sync.windows, sync.context.stats()["windows_completed"]), (n, n))
        self.assertFalse(hasattr(sync._window, "windows"))
        self.assertEqual(sync.counts()["windows"], 3)
        ctx = sync.context
        sync.close()
        self.assertEqual(sync.windows, 3)  # its last count, once closed
        del ctx

    def test_load_state_dict_restores_the_plugins_count(self):
        ddp, sync = self.attach()
        for _ in range(3):
            window(ddp)
        state = sync.state_dict()
        self.assertEqual(state["windows"], 3)
        sync.close()
        ddp, resumed = self.attach()
        resumed.load_state_dict(state)
        self.assertEqual(resumed.context.stats()["windows_completed"], 3)
        window(ddp)
        self.assertEqual(resumed.windows, 4)
        late = dict(resumed.state_dict(), windows=9, last_verified=0)
        with self.assertRaisesRegex(RuntimeError, "sf_restore_windows"):
            resumed.load_state_dict(late)  # the plugin counted a window already
        self.assertEqual(resumed.windows, 4)

    def test_count_window_is_refused_inside_a_window_and_with_gradients(self):
        ctx = sfsync.Context(**LOCAL)
        self.addCleanup(ctx.close)
        ctx.begin_accumulation()
        with self.assertRaisesRegex(sfsync.InvalidStateError, "sf_count_window inside an "
                                    "accumulation window"):
            ctx.count_window()
        ctx.end_accumulation()
        ctx.count_window()
        self.assertEqual(ctx.stats()["windows_completed"], 1)
        model, sync = mlp(), None
        sync = sft.GradientSync(model, accumulation_steps=2, **LOCAL)
        self.addCleanup(sync.close)
        with self.assertRaisesRegex(sfsync.InvalidStateError, r"registered gradients: "
                                    r"sf_synchronize reduces and counts"):
            sync.context.count_window()


if __name__ == "__main__":
    unittest.main()
