"""The sharded window's schedule (issue 24): where the time between the last
backward and the next forward goes.

* The parameter gathers start once every bucket has stepped, in forward
  order (the last bucket first: it holds the first layers, reduced last).
  Started as each bucket stepped (0.3), the first layers' gather queued
  behind every other bucket's, and the next forward waited for all of them
  (bench/torch2_bench.py's trace: 170 ms of 1 Gbit/s wire after the window).
* The sharded default bucket cap is about an eighth of the gradients, within
  1..25 MiB: DDP's 25 MiB left the bench's transformer 3 buckets and the
  wire idle through most of the last backward. Since 0.5 it is the plugin's
  (issue 44, item 1): a caller's context, and any host's, gets it too; an
  explicit cap or ``SF_BUCKET_CAP_MB`` keep theirs.
* The shard setting has one holder, the context: GradientSync, its driver,
  store and optimizer ask it; so do the bucket and window states (the
  driver asks sf_bucket_state and sf_window_state).

One rank (the order and the plan are the same at any world size); seconds.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 /usr/bin/python3 tests/python/sfsync/torch/test_sharded_schedule.py
"""

import inspect
import os
import sys
import unittest
from unittest import mock

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "..", ".."))
if not any(os.path.exists(os.path.join(p, "sfsync", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.join(ROOT, "python"))  # the package from the source tree

import torch  # noqa: E402

from sfsync import shard  # noqa: E402
from sfsync import torch as sft  # noqa: E402
import sfsync  # noqa: E402
from sfsync.torch.store import sf_dtype  # noqa: E402

LOCAL = dict(rank=0, world_size=1, rendezvous="", find_unused_parameters=False)
MIB = 2 ** 20


def layers(n, width):
    torch.manual_seed(0)
    mods = []
    for _ in range(n):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def window(model, sync, opt, width, steps=2):
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        model(torch.randn(3, width, generator=g)).pow(2).mean().backward()
    assert sync.is_step()
    opt.step()
    opt.zero_grad()


class ShardedSchedule(unittest.TestCase):
    def make(self, model, overlap_step=True, env=None, **kw):
        with mock.patch.dict(os.environ, env or {}):
            if env is None:
                os.environ.pop("SF_BUCKET_CAP_MB", None)
            sync = sft.GradientSync(model, accumulation_steps=2, shard_optimizer=True,
                                    **dict(LOCAL, **kw))
        self.addCleanup(sync.close)
        opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=0.01,
                             overlap_step=overlap_step)
        return sync, opt

    def record(self, opt):
        """Every inner step and sf_start_gather of the next window, in order."""
        events = []
        for b, inner in enumerate(opt.inner_optimizers):
            step = inner.step

            def logged(*a, _b=b, _step=step, **k):
                events.append(("step", _b))
                return _step(*a, **k)
            inner.step = logged
        start = shard.start_gather

        def gather(ctx, b):
            events.append(("gather", b))
            return start(ctx, b)
        patch = mock.patch.object(shard, "start_gather", gather)
        patch.start()
        self.addCleanup(patch.stop)
        return events

    def check_forward_order(self, overlap_step):
        width = 128
        model = layers(6, width)
        sync, opt = self.make(model, overlap_step=overlap_step,
                              bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)
        buckets = sync.stats()["bucket_count"]
        self.assertEqual(buckets, 12)  # every tensor a bucket of its own
        window(model, sync, opt, width)  # (the first window builds)
        events = self.record(opt)
        window(model, sync, opt, width)
        steps = [b for kind, b in events if kind == "step"]
        gathers = [b for kind, b in events if kind == "gather"]
        self.assertEqual(sorted(steps), list(range(buckets)), events)
        self.assertEqual(gathers, list(reversed(range(buckets))), events)
        last_step = max(i for i, e in enumerate(events) if e[0] == "step")
        first_gather = min(i for i, e in enumerate(events) if e[0] == "gather")
        self.assertLess(last_step, first_gather, events)
        opt.wait_parameters()

    def test_gathers_start_after_every_step_in_forward_order_per_bucket(self):
        self.check_forward_order(True)

    def test_gathers_start_after_every_step_in_forward_order_final_gradients(self):
        self.check_forward_order(False)

    def test_the_driver_answers_what_the_plugin_holds(self):
        """Issue 44: the window's collective state is the plugin's
        (sf_bucket_state, sf_window_state); the driver asks it at each
        point of a sharded window and keeps no copy."""
        from sfsync.torch.window_driver import Phase
        width = 16
        model = layers(2, width)
        sync, opt = self.make(model, overlap_step=True, bucket_cap_mb=1e-6,
                              first_bucket_cap_mb=1e-6)
        driver, ctx = sync._driver, sync.context
        n = sync.stats()["bucket_count"]
        for g in range(2):
            x = torch.randn(3, width, generator=torch.Generator().manual_seed(g))
            model(x).sum().backward()
        self.assertTrue(sync.is_step())
        self.assertEqual(ctx.bucket_states(), ["reducing"] * n)
        self.assertEqual(ctx.window_state(), {"synchronizing": True, "gradients_whole": False})
        self.assertEqual((driver.phase, opt.gradients_whole), (Phase.REDUCING, False))
        self.assertEqual([driver.waited(b) for b in range(n)], [False] * n)
        opt.step()  # each bucket waited and stepped, sf_synchronize, the gathers started
        self.assertEqual(ctx.bucket_states(), ["gathering"] * n)
        self.assertEqual(ctx.window_state(), {"synchronizing": False, "gradients_whole": False})
        self.assertEqual((driver.phase, opt.gradients_whole), (Phase.STEPPED, False))
        opt.wait_parameters()
        self.assertEqual(ctx.bucket_states(), ["gathered"] * n)
        self.assertEqual(driver.phase, Phase.STEPPED)  # the step's fact: the driver's own
        self.assertEqual({"phase", "waited", "gathering", "whole"} & set(vars(driver)), set())

    def sfsync_pre_hooks(self, model):
        """The sfsync forward pre-hooks on the model's modules (the driver's)."""
        return sum(1 for m in model.modules() for h in m._forward_pre_hooks.values()
                   if getattr(h, "__qualname__", "").startswith("_gather_hook"))

    def check_gather_waits_only_in_the_first_forward(self, overlap_gather):
        """Issue 46: the forward pre-hooks that wait for a step's parameter
        gathers are armed at the step and each removed once it waited: the
        window's first forward asks the plugin, its later forwards run
        without a hook (the transformer of bench/torch2_bench.py paid 75
        modules x 4 micro-batches of them per window, each asking
        sf_bucket_state). Every parameter is still the gathered one when
        the forward reads it."""
        width = 32
        model = layers(3, width)
        with mock.patch.dict(os.environ):
            os.environ.pop("SF_BUCKET_CAP_MB", None)
            sync = sft.GradientSync(model, accumulation_steps=2, shard_optimizer=True,
                                    bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6, **LOCAL)
        self.addCleanup(sync.close)
        opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=0.01,
                             overlap_gather=overlap_gather, overlap_step=True)
        modules = 3 if overlap_gather else 1  # the Linears, or the model alone
        self.assertEqual(self.sfsync_pre_hooks(model), 0)  # nothing to wait for yet
        asked = []
        state = sfsync.Context.bucket_state

        def counted(ctx, b):
            asked.append(b)
            return state(ctx, b)
        patch = mock.patch.object(sfsync.Context, "bucket_state", counted)
        patch.start()
        self.addCleanup(patch.stop)
        for w in range(3):
            for i in range(2):
                asked.clear()
                x = torch.randn(3, width, generator=torch.Generator().manual_seed(10 * w + i))
                out = model(x)
                # the first forward after a step waited for every bucket (6:
                # 3 Linears, weight and bias); none before the first step
                self.assertEqual(len(asked), 6 if (w and i == 0) else 0, (w, i, asked))
                self.assertEqual(self.sfsync_pre_hooks(model), 0, (w, i))
                if w and i == 0:
                    self.assertEqual(sync.context.bucket_states(), ["gathered"] * 6)
                out.pow(2).mean().backward()
            opt.step()
            self.assertEqual(self.sfsync_pre_hooks(model), modules)  # armed by the step
            opt.zero_grad()
        # A step without a forward between: each hook armed once, not twice.
        x = torch.randn(3, width)
        model(x).sum().backward()
        model(x).sum().backward()
        opt.step()
        self.assertEqual(self.sfsync_pre_hooks(model), modules)
        opt.wait_parameters()  # a read outside a forward waits too; the hooks then
        model(x)               # find nothing in flight and go
        self.assertEqual(self.sfsync_pre_hooks(model), 0)

    def test_gather_waits_run_before_the_hosts_own_pre_hooks(self):
        """A pre-hook the host registers after the attach (weight_norm's
        kind, which reads the module's parameters) runs after sfsync's wait
        for the module's gathers (torch >= 2.0: armed with prepend=True)."""
        if "prepend" not in inspect.signature(torch.nn.Module.register_forward_pre_hook).parameters:
            self.skipTest("torch < 2.0: no prepend, the hook runs where it was registered")
        width = 16
        model = layers(2, width)
        sync, opt = self.make(model, overlap_step=True, bucket_cap_mb=1e-6,
                              first_bucket_cap_mb=1e-6)
        seen = []
        model[0].register_forward_pre_hook(
            lambda m, i: seen.append(sync.context.bucket_states()))
        x = torch.randn(3, width)
        for _ in range(2):
            model(x).sum().backward()
        opt.step()
        self.assertIn("gathering", sync.context.bucket_states())
        seen.clear()
        model(x)
        # model[0]'s buckets (its weight and bias: the last two) waited first
        self.assertEqual(seen[0][-2:], ["gathered", "gathered"], seen)

    def test_gather_waits_only_in_the_first_forward_per_module(self):
        self.check_gather_waits_only_in_the_first_forward(True)

    def test_gather_waits_only_in_the_first_forward_whole_model(self):
        self.check_gather_waits_only_in_the_first_forward(False)

    def test_default_cap_is_an_eighth_of_the_gradients(self):
        model = layers(32, 512)  # 32 x (1 MiB + 2 KiB): the cap is 4.0 MiB
        sync, _ = self.make(model)
        infos = sync.context.buckets()
        # The first bucket closes at 1 MiB (DDP's first cap), the others hold
        # 4 MiB of 1 MiB weights: 1 + ceil(31 / 4) = 9 buckets.
        self.assertEqual(len(infos), 9, infos)
        biggest = max(i["bytes"] for i in infos)
        self.assertLessEqual(biggest, 4 * MIB + 4 * 2048, infos)
        # the plugin's rule, reported as the effective cap once built
        self.assertEqual(sync.context.options()["bucket_cap_mb"], 32 * (MIB + 2048) / 8 / MIB)

    def test_the_cap_is_clamped_to_1_mib(self):
        # (the 25 MiB ceiling: tests/unit/integration/sharded_bucket_cap_tests.cpp)
        sync, _ = self.make(layers(2, 64))
        self.assertEqual(sync.context.options()["bucket_cap_mb"], 1.0)

    def test_any_sharded_context_without_a_cap_gets_the_default(self):
        """A context of the caller's, sharded, no cap chosen: the plugin's
        default, as for GradientSync's own (and for C, Rust, Julia hosts)."""
        with mock.patch.dict(os.environ):
            os.environ.pop("SF_BUCKET_CAP_MB", None)
            ctx = sfsync.Context(rank=0, world_size=1, rendezvous="")
        self.addCleanup(ctx.close)
        shard.set_layout(ctx, "flat")
        for p in layers(32, 512).parameters():
            gid = ctx.add_gradient(p.numel(), sf_dtype(p.dtype))
            shard.register_parameter(ctx, gid, p.numel(), sf_dtype(p.dtype), sfsync.DEVICE_HOST)
        self.assertEqual(len(ctx.buckets()), 9)

    def test_an_explicit_cap_or_the_environment_keeps_its_cap(self):
        model = layers(32, 512)
        sync, _ = self.make(model, bucket_cap_mb=25)
        self.assertEqual(sync.stats()["bucket_count"], 3)  # 1 MiB, 25 MiB, the rest
        sync.close()
        sync, _ = self.make(layers(32, 512), env={"SF_BUCKET_CAP_MB": "25"})
        self.assertEqual(sync.stats()["bucket_count"], 3)
        sync.close()
        unsharded = sft.GradientSync(layers(32, 512), **LOCAL)  # the rule is the sharded one's
        self.addCleanup(unsharded.close)
        self.assertEqual(unsharded.stats()["bucket_count"], 3)


class ShardSettingAgainstTheEnvironment(unittest.TestCase):
    """SF_SHARD (read by the C context) against GradientSync's arguments: a
    contradiction is an error at construction naming both (issue 44)."""

    def attach(self, env, **kw):
        with mock.patch.dict(os.environ, env):
            sync = sft.GradientSync(layers(2, 8), accumulation_steps=2, **dict(LOCAL, **kw))
        self.addCleanup(sync.close)
        return sync

    def test_sf_shard_flat_with_shard_optimizer_false_is_refused(self):
        with self.assertRaises(ValueError) as e:
            self.attach({"SF_SHARD": "flat"})
        self.assertIn("shard_optimizer=False", str(e.exception))
        self.assertIn("SF_SHARD=flat in the environment", str(e.exception))

    def test_sf_shard_parameter_with_shard_layout_flat_is_refused(self):
        with self.assertRaises(ValueError) as e:
            self.attach({"SF_SHARD": "parameter"}, shard_optimizer=True, shard_layout="flat")
        self.assertIn("shard_layout='flat'", str(e.exception))
        self.assertIn("SF_SHARD=parameter in the environment", str(e.exception))

    def test_agreeing_or_unset_settings_attach(self):
        sync = self.attach({"SF_SHARD": "parameter"}, shard_optimizer=True,
                           shard_layout="parameter")
        self.assertEqual(sync.context.options()["shard_layout"], shard.LAYOUTS["parameter"])
        sync = self.attach({"SF_SHARD": "none"})
        self.assertEqual(sync.context.options()["shard_layout"], shard.LAYOUTS["none"])


class ShardSettingHasOneHolder(unittest.TestCase):
    """The context holds the shard layout; GradientSync (``shard_optimizer``,
    ``shard_layout``), its driver, store and optimizer and the shard map ask
    it and keep no copy (issue 44, item 1)."""

    def check(self, model, sync, opt, layout):
        self.assertEqual(sync.context.shard_layout, layout)
        self.assertEqual((sync.shard_optimizer, sync.shard_layout), (layout != "none", layout))
        readers = (sync, sync._driver, sync.store, opt, opt.shard_map)
        for obj in readers:
            held = {"sharded", "_sharded", "shard_optimizer", "shard_layout"} & set(vars(obj))
            self.assertEqual(held, set(), "%s keeps a copy" % type(obj).__name__)
        for obj in readers[1:]:
            self.assertEqual(obj.sharded, layout != "none", type(obj).__name__)

    def test_sharded(self):
        model = layers(2, 8)
        sync = sft.GradientSync(model, accumulation_steps=2, shard_optimizer=True,
                                shard_layout="parameter", **LOCAL)
        self.addCleanup(sync.close)
        opt = sync.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
        self.check(model, sync, opt, "parameter")

    def test_unsharded(self):
        model = layers(2, 8)
        sync = sft.GradientSync(model, accumulation_steps=2, **LOCAL)
        self.addCleanup(sync.close)
        opt = sync.optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
        self.check(model, sync, opt, "none")

if __name__ == "__main__":
    unittest.main()
