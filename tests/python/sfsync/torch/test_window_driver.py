"""WindowDriver (sfsync/torch/window_driver.py): the one sequence of a
window's collectives, checked call by call against a recording context,
store and collectives (no library, no rank: the driver is given them). The
recording context keeps the bucket and window states as the plugin does
(sf_bucket_state, sf_window_state: include/sfsync.h), and the driver keeps
none of its own: what it answers, it asks (issue 44).

    PYTHONPATH=python /usr/bin/python3 tests/python/sfsync/torch/test_window_driver.py -v
"""

import os
import sys
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "..", ".."))
if not any(os.path.exists(os.path.join(p, "sfsync", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.join(ROOT, "python"))  # the package from the source tree

import torch  # noqa: E402

from sfsync.torch.window_driver import Phase, WindowDriver  # noqa: E402


class Recorder:
    """The context, the store and sfsync.shard's collectives at once: every
    call appended to ``calls`` as (name, args...); the context's bucket and
    window states moved as the plugin moves them (the driver asks them)."""

    def __init__(self, buckets, mask=None):
        self.calls, self.buckets, self.mask = [], buckets, mask
        self.states = ["idle"] * buckets
        self.synchronizing = self.whole = False
        self.completed = 0

    def _log(name, then=None):
        def call(self, *args):
            self.calls.append((name,) + tuple(a for a in args if not isinstance(a, Recorder)))
            if then is not None:
                then(self, *[a for a in args if not isinstance(a, Recorder)])
        return call

    # the context, and the plugin's states
    def _synchronized(self):
        self.states = ["reduced"] * self.buckets
        self.synchronizing, self.completed = False, self.completed + 1

    def _started(self):
        self.states = ["reducing"] * self.buckets  # (a gather in flight is waited first)
        self.synchronizing, self.whole = True, False

    def _waited(self, b):
        self.states[b] = "reduced"

    def _gathered(self):
        self.whole = True

    def _gather_started(self, b):
        self.states[b] = "gathering"

    def _gather_waited(self, b):
        for i in (range(self.buckets) if b == -1 else [b]):
            if self.states[i] == "gathering":
                self.states[i] = "gathered"

    synchronize = _log("synchronize", _synchronized)

    def stats(self):
        return {"bucket_count": self.buckets, "windows_completed": self.completed}

    def bucket_state(self, b):
        return self.states[b]

    def window_state(self):
        return {"synchronizing": self.synchronizing, "gradients_whole": self.whole}

    # the store
    after_plugin = _log("after_plugin")
    before_plugin = _log("before_plugin")
    after_gather = _log("after_gather")
    publish = _log("publish")

    def take_unused(self):
        return []

    # sfsync.shard's calls
    synchronize_start = _log("synchronize_start", _started)
    wait_bucket = _log("wait_bucket", _waited)
    gather_gradients = _log("gather_gradients", _gathered)
    start_gather = _log("start_gather", _gather_started)
    wait_gather = _log("wait_gather", _gather_waited)

    def allreduce_float64(self, ctx, t):
        self.calls.append(("allreduce_float64",))


class Window:
    windows, at_boundary = 3, True


def driver(buckets=3, sharded=False, mask=None, module=None):
    r = Recorder(buckets, mask)
    r.shard_layout = "flat" if sharded else "none"  # the context's: the driver asks it
    r.sharded = sharded
    d = WindowDriver(r, r, Window(), module=module or torch.nn.Linear(2, 2), params=[],
                     names=[], rank=0, world_size=1, broadcast_buffers=True,
                     accumulate_dtype=None, collectives=r)
    return d, r


def names(r):
    return [c[0] for c in r.calls]


class WindowDriverSequence(unittest.TestCase):
    def test_alone_one_synchronize_then_the_publish(self):
        d, r = driver()
        d.close_window()
        self.assertEqual(names(r), ["synchronize", "after_plugin", "publish"])
        self.assertEqual(d.phase, Phase.IDLE)  # no optimizer: nothing in flight
        d.begin_window()
        d.wait_parameters()
        self.assertEqual(names(r), ["synchronize", "after_plugin", "publish"])

    def test_with_an_optimizer_start_then_every_wait(self):
        d, r = driver()
        self.assertEqual(d.attach_stepping(False, True), 3)
        d.close_window()
        self.assertEqual(names(r), ["synchronize_start", "synchronize", "after_plugin",
                                    "publish"])
        self.assertEqual(d.phase, Phase.SYNCHRONIZED)
        self.assertTrue(all(d.waited(b) for b in range(3)))
        d.stepped()
        self.assertEqual(d.phase, Phase.IDLE)  # unsharded: no gathers

    def test_a_second_optimizer_is_refused(self):
        d, _ = driver()
        d.attach_stepping(False, True)
        with self.assertRaisesRegex(RuntimeError, "already has an optimizer"):
            d.attach_stepping(False, True)

    def test_overlap_step_waits_bucket_by_bucket(self):
        d, r = driver()
        d.attach_stepping(True, True)
        self.assertTrue(d.overlap_step)
        d.close_window()
        self.assertEqual(names(r), ["synchronize_start"])
        self.assertEqual(d.phase, Phase.REDUCING)
        d.wait(1)
        d.wait(1)
        self.assertEqual(r.calls[1:], [("wait_bucket", 1), ("after_plugin",)])
        self.assertEqual([d.waited(b) for b in range(3)], [False, True, False])
        self.assertEqual((d.phase, d.windows), (Phase.REDUCING, 1))  # counted at its end
        d.begin_window()  # closed without a step: synchronized now, the step skipped
        self.assertEqual(names(r)[3:], ["synchronize", "after_plugin", "publish"])
        self.assertEqual(d.phase, Phase.IDLE)

    def test_overlap_step_is_off_unsharded_with_one_bucket(self):
        d, _ = driver(buckets=1)
        d.attach_stepping(True, True)
        self.assertFalse(d.overlap_step)

    def test_sharded_mask_then_gather_then_publish_then_gathers_in_forward_order(self):
        d, r = driver(sharded=True, mask=torch.ones(2, dtype=torch.float64))
        d.attach_stepping(False, lambda: True)
        d.close_window()
        self.assertEqual(names(r), ["synchronize_start", "synchronize", "after_plugin",
                                    "allreduce_float64", "gather_gradients", "after_plugin",
                                    "publish"])
        self.assertTrue(d.gradients_whole)
        del r.calls[:]
        d.stepped()
        self.assertEqual(r.calls, [("before_plugin",), ("start_gather", 2), ("start_gather", 1),
                                   ("start_gather", 0)])
        self.assertEqual(d.phase, Phase.STEPPED)
        self.assertTrue(d.gradients_whole)  # the window's gradients, until the next one
        del r.calls[:]
        d.wait_gathers([1])
        d.wait_gathers([1])
        self.assertEqual(r.calls, [("wait_gather", 1), ("after_gather",)])
        d.wait_parameters()
        self.assertEqual(r.calls[2:], [("wait_gather", -1), ("after_gather",)])
        d.wait_parameters()  # none in flight: the plugin says so
        self.assertEqual(len(r.calls), 4)

    def test_sharded_without_whole_gradients_leaves_ranges(self):
        d, r = driver(sharded=True)
        d.attach_stepping(False, False)
        d.close_window()
        self.assertNotIn("gather_gradients", names(r))
        self.assertFalse(d.gradients_whole)

    def test_a_failed_window_ends_without_waits(self):
        d, r = driver()
        d.attach_stepping(True, True)
        d.close_window()
        r._synchronized()  # the plugin summed the buckets, then refused the weight
        d.fail_window()
        self.assertEqual(d.phase, Phase.IDLE)
        self.assertTrue(all(d.waited(b) for b in range(3)))
        d.wait_gradients()
        self.assertEqual(names(r), ["synchronize_start"])

    def test_the_driver_keeps_no_copy_of_the_plugins_state(self):
        """What the plugin holds is asked each time: a change of the
        context's states alone changes the driver's answers."""
        d, r = driver(sharded=True)
        d.attach_stepping(True, True)
        d.close_window()
        self.assertEqual(d.phase, Phase.REDUCING)
        r.synchronizing = False
        self.assertEqual(d.phase, Phase.SYNCHRONIZED)
        self.assertFalse(d.gradients_whole)
        r.whole = True
        self.assertTrue(d.gradients_whole)
        r.states[2] = "reduced"
        self.assertTrue(d.waited(2))
        for name in ("waited", "gathering", "whole", "phase"):
            self.assertNotIn(name, vars(d), "the driver stores .%s" % name)

    def test_reads_of_the_module_wait_for_the_gathers_until_close(self):
        module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        d, r = driver(sharded=True, module=module)
        d.attach_stepping(False, True)
        d.install_gather_waits({id(p): 0 for p in module.parameters()}, True)
        d.stepped()  # the step starts the gathers (bucket 0 holds both Linears)
        self.assertEqual(r.calls, [("before_plugin",)] + [("start_gather", b) for b in (2, 1, 0)])
        list(module.named_parameters())
        self.assertEqual(r.calls[4:], [("wait_gather", -1), ("after_gather",)])
        r.states[0] = "gathering"
        module(torch.ones(1, 2))  # the forward's pre-hooks wait for their buckets
        self.assertEqual(r.calls[6:], [("wait_gather", 0), ("after_gather",)])
        r.states[0] = "gathering"
        module(torch.ones(1, 2))  # waited once per step: the hooks went
        self.assertEqual(len(r.calls), 8)
        d.close()  # (waits for the gather in flight)
        self.assertEqual(r.calls[8:], [("wait_gather", -1), ("after_gather",)])
        r.states[0] = "gathering"
        list(module.named_parameters())
        module(torch.ones(1, 2))
        self.assertEqual(len(r.calls), 10)  # hooks and patched reads gone


if __name__ == "__main__":
    unittest.main()
