"""Tests of the PyTorch integration (sfsync.torch) on one rank, plus two
ranks as threads of this process (memory:// rendezvous).

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 /usr/bin/python3 tests/python/sfsync/torch/test_torch_single.py
"""

import os
import sys
import threading
import unittest
import unittest.mock
import uuid

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "..", ".."))
if not any(os.path.exists(os.path.join(p, "sfsync", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.join(ROOT, "python"))  # the package from the source tree

import torch  # noqa: E402

import sfsync  # noqa: E402
from sfsync import torch as sfsync_torch  # noqa: E402

LOCAL = dict(rank=0, world_size=1, rendezvous="")
# Without the "used" mask gradient: the counts below are the parameters' alone.
PLAIN = dict(LOCAL, find_unused_parameters=False)


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 3)).to(dtype)


def data(i, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(5, 6, generator=g).to(dtype)


def grads_of(model):
    return [p.grad.detach().clone() for p in model.parameters()]


class FlatBufferViews(unittest.TestCase):
    def test_grads_are_views_into_the_flat_buffer(self):
        model = mlp()
        with sfsync_torch.GradientSync(model, **PLAIN) as sync:
            for gid, p in zip(sync._ids, model.parameters()):
                self.assertEqual(p.grad.data_ptr(), sync.context.gradient_data(gid))
                self.assertEqual(p.grad.shape, p.shape)
                self.assertEqual(float(p.grad.abs().sum()), 0.0)
            self.assertEqual(sync.names, ["0.weight", "0.bias", "2.weight", "2.bias"])
            self.assertEqual(sync.stats()["gradient_bytes"],
                             4 * sum(p.numel() for p in model.parameters()))

    def test_backward_accumulates_in_place(self):
        """torch 1.13 adds into a preassigned .grad in place (no new tensor),
        so micro-batch gradients sum inside the plugin's buffer."""
        model, twin = mlp(), mlp()
        with sfsync_torch.GradientSync(model, **PLAIN) as sync:
            ptrs = [p.grad.data_ptr() for p in model.parameters()]
            with sync.accumulate():
                for i in range(3):
                    model(data(i)).pow(2).sum().backward()
            self.assertEqual([p.grad.data_ptr() for p in model.parameters()], ptrs)
            for i in range(3):
                twin(data(i)).pow(2).sum().backward()
            for a, b in zip(grads_of(model), grads_of(twin)):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            arrays = [sync.context.gradient_array(g) for g in sync._ids]
            for a, p in zip(arrays, model.parameters()):  # the same memory, seen from numpy
                self.assertEqual(a.tolist(), p.grad.reshape(-1).tolist())
            s = sync.stats()
            self.assertEqual(s["deferred_ready_calls"], 3 * 4)
            self.assertEqual(s["deferred_passes"], 3)
            self.assertEqual(s["collectives_issued"], 0)

    def test_hooks_report_after_accumulation_and_launch_early(self):
        model = mlp()
        # Tiny caps: one bucket per parameter, so each hook can launch one.
        with sfsync_torch.GradientSync(model, bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6,
                                       reduce_op="prescaled_sum", prescale=0.5, **PLAIN) as sync:
            self.assertEqual(len(sync.buckets()), 4)
            with sync.accumulate():
                model(data(0)).sum().backward()
            model(data(1)).sum().backward()
            s = sync.stats()
            self.assertEqual(s["early_launches"], 4)  # every bucket started during backward
            self.assertEqual(s["collectives_issued"], 4)
            before = [g * 0.5 for g in grads_of(model)]
            sync.synchronize()
            # One rank, prescaled sum 0.5: the result is exactly half of the
            # accumulated two micro-batches, so both were in when the bucket went.
            twin = mlp()
            for i in range(2):
                twin(data(i)).sum().backward()
            for got, want in zip(grads_of(model), grads_of(twin)):
                torch.testing.assert_close(got, want * 0.5, rtol=1e-6, atol=1e-7)
            del before

    def test_no_hooks(self):
        model = mlp()
        with sfsync_torch.GradientSync(model, hooks=False, **LOCAL) as sync:
            model(data(0)).sum().backward()
            self.assertEqual(sync.stats()["collectives_issued"], 0)
            sync.synchronize()
            s = sync.stats()
            self.assertEqual((s["collectives_issued"], s["early_launches"]), (1, 0))

    def test_optimizer_and_zero_grad(self):
        model, twin = mlp(), mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        topt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
        with sfsync_torch.GradientSync(model, **LOCAL) as sync:
            for window in range(3):
                with sync.accumulate():
                    model(data(2 * window)).pow(2).mean().backward()
                model(data(2 * window + 1)).pow(2).mean().backward()
                sync.synchronize()
                opt.step()
                if window == 1:
                    opt.zero_grad(set_to_none=False)  # in place: also fine
                else:
                    sync.zero_grad()
                for i in (2 * window, 2 * window + 1):
                    twin(data(i)).pow(2).mean().backward()
                topt.step()
                topt.zero_grad()
            for a, b in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            self.assertEqual(sync.stats()["windows_completed"], 3)

    def test_grad_set_to_none_between_windows_is_reattached(self):
        """zero_grad(set_to_none=True) (torch 2's default) between windows:
        the next window starts from zero in the plugin's buffer again."""
        model, twin = mlp(), mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        topt = torch.optim.SGD(twin.parameters(), lr=0.1)
        with sfsync_torch.GradientSync(model, **LOCAL) as sync:
            for window in range(3):
                with sync.accumulate():
                    model(data(2 * window)).sum().backward()
                model(data(2 * window + 1)).sum().backward()
                sync.synchronize()
                opt.step()
                opt.zero_grad(set_to_none=True)
                for i in (2 * window, 2 * window + 1):
                    twin(data(i)).sum().backward()
                topt.step()
                topt.zero_grad(set_to_none=True)
            for gid, p in zip(sync._ids, model.parameters()):
                self.assertIsNone(p.grad)
            model(data(0)).sum().backward()  # re-attached by the forward
            for gid, p in zip(sync._ids, model.parameters()):
                self.assertEqual(p.grad.data_ptr(), sync.context.gradient_data(gid))
            sync.synchronize()
            for a, b in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

    def test_first_pass_adopts_fresh_gradients(self):
        """After zero_grad(set_to_none=True) the next window's .grad stays
        None through its first forward (nothing zeroed); each gradient of the
        first pass is copied into its view at its hook (as DDP's first pass
        does), and a parameter that pass did not use starts from zero at the
        pass's end: a branch used only from the second micro-batch on sums
        as torch's own accumulation, over windows whose buffer held the last
        window's reduced gradients."""
        class TwoBranches(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(3)
                self.a, self.b = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)

            def forward(self, x, use_b):
                return self.a(x) + (self.b(x) if use_b else 0)

        for kwargs in (LOCAL, PLAIN):
            model, twin = TwoBranches(), TwoBranches()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            topt = torch.optim.SGD(twin.parameters(), lr=0.1)
            with sfsync_torch.GradientSync(model, accumulation_steps=3, **kwargs) as sync:
                for window in range(3):
                    for micro in range(3):
                        x = data(3 * window + micro)
                        out = model(x, use_b=micro > 0)
                        if micro == 0 and window > 0:
                            for p in model.parameters():
                                self.assertIsNone(p.grad)  # not attached at the forward
                        out.sum().backward()
                        twin(x, use_b=micro > 0).sum().backward()
                    self.assertTrue(sync.is_step())
                    for gid, p, q in zip(sync._ids, model.parameters(), twin.parameters()):
                        self.assertEqual(p.grad.data_ptr(), sync.context.gradient_data(gid))
                        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)
                    opt.step()
                    topt.step()
                    opt.zero_grad(set_to_none=True)
                    topt.zero_grad(set_to_none=True)
                for a, b in zip(model.parameters(), twin.parameters()):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

    @unittest.skipUnless(hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
                         "torch < 2.1: the hooks are AccumulateGrad post hooks, one path")
    def test_plain_gradients_are_reported_by_their_hook_alone(self):
        """Issue 46: while a pass runs, a host gradient whose .grad is its
        view is reported by its own hook (one grad_ready), without
        GradientSync's frames, and so is the window's first pass's fresh
        .grad after zero_grad(set_to_none=True): adopted into its view by
        the hook. Only a pass's first hook takes the long way. The plugin
        still counts every grad-ready call, every local pass and every
        collective."""
        from sfsync.torch.gradient_sync import GradientSync
        seen = []
        long_way = GradientSync._hook_grad

        def counted(self, i):
            seen.append(i)
            return long_way(self, i)
        model, twin = mlp(), mlp()
        n = len(list(model.parameters()))
        with unittest.mock.patch.object(GradientSync, "_hook_grad", counted):
            sync = sfsync_torch.GradientSync(model, accumulation_steps=3, **PLAIN)
        with sync:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            topt = torch.optim.SGD(twin.parameters(), lr=0.1)
            for window in range(2):
                for micro in range(3):
                    seen.clear()
                    x = data(3 * window + micro)
                    model(x).sum().backward()
                    twin(x).sum().backward()
                    # the first window's .grad are views from the start; the
                    # second's were set to None: its first pass's hooks adopt
                    # each (the long way: only the pass's first hook)
                    self.assertEqual(len(seen), 1, (window, micro, seen))
                    for gid, p in zip(sync._ids, model.parameters()):
                        self.assertEqual(p.grad.data_ptr(), sync.context.gradient_data(gid))
                self.assertTrue(sync.is_step())
                for p, q in zip(model.parameters(), twin.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)
                opt.step()
                topt.step()
                opt.zero_grad(set_to_none=window == 0)
                topt.zero_grad(set_to_none=window == 0)
            s = sync.stats()
            self.assertEqual((s["deferred_ready_calls"], s["deferred_passes"]), (2 * 2 * n, 4))
            self.assertEqual(s["windows_completed"], 2)
            self.assertEqual(s["collectives_issued"], 2 * s["bucket_count"])
            self.assertIsNone(sync._report.ready)  # off between passes

    def test_grad_replaced_inside_a_window_fails_loudly(self):
        model = mlp()
        with sfsync_torch.GradientSync(model, **LOCAL) as sync:
            with sync.accumulate():
                model(data(0)).sum().backward()
                model[2].bias.grad = torch.zeros(3)
                with self.assertRaisesRegex(RuntimeError, r"2\.bias\.grad is no longer the "
                                            r"buffer registered with sfsync \(it is another tensor"):
                    model(data(1)).sum().backward()
            model[0].weight.grad = None
            with self.assertRaisesRegex(RuntimeError, r"0\.weight\.grad .*\(it is None"):
                sync.synchronize()
            self.assertEqual(sync.stats()["collectives_issued"], 0)
            sync.zero_grad(set_to_none=False)  # (torch 2.x's default is True)
            for gid, p in zip(sync._ids, model.parameters()):
                self.assertEqual(p.grad.data_ptr(), sync.context.gradient_data(gid))

    def test_two_backwards_outside_a_window_are_two_windows(self):
        """As DDP: each backward pass outside no_sync() synchronizes at its
        end (0.3 made the second one an error and needed synchronize()):
        two windows, one collective per bucket each, is_step() after each;
        an explicit synchronize() after it sends nothing."""
        model = mlp()
        with sfsync_torch.GradientSync(model, **PLAIN) as sync:
            buckets = sync.stats()["bucket_count"]
            for i in range(2):
                model(data(i)).sum().backward()
                self.assertTrue(sync.is_step())
                self.assertEqual(sync.stats()["windows_completed"], i + 1)
                self.assertEqual(sync.stats()["collectives_issued"], (i + 1) * buckets)
            sync.synchronize()
            self.assertEqual(sync.stats()["windows_completed"], 2)
            self.assertEqual(sync.stats()["collectives_issued"], 2 * buckets)

    def test_abandoned_sync_is_collected(self):
        import gc
        import weakref
        model = mlp()
        sync = sfsync_torch.GradientSync(model, **LOCAL)
        ctx_ref = weakref.ref(sync.context)
        del sync
        gc.collect()
        self.assertIsNotNone(ctx_ref())  # the .grad views still use its memory
        for p in model.parameters():
            p.grad = None
        gc.collect()
        self.assertIsNone(ctx_ref())  # nothing else held it: destroyed

    def test_existing_grads_are_kept(self):
        model = mlp()
        model(data(0)).sum().backward()
        before = grads_of(model)
        with sfsync_torch.GradientSync(model, **LOCAL) as sync:
            for gid, p, g in zip(sync._ids, model.parameters(), before):
                self.assertEqual(p.grad.data_ptr(), sync.context.gradient_data(gid))
                self.assertTrue(torch.equal(p.grad, g))

    def test_close_gives_private_copies(self):
        model = mlp()
        sync = sfsync_torch.GradientSync(model, **LOCAL)
        model(data(0)).sum().backward()
        sync.synchronize()
        before = grads_of(model)
        ctx = sync.context
        sync.close()
        self.assertTrue(ctx.closed)
        for p, g in zip(model.parameters(), before):
            self.assertTrue(torch.equal(p.grad, g))
        model(data(1)).sum().backward()  # no hook left, no plugin memory used
        sync.close()  # idempotent

    def test_other_dtypes(self):
        class Scale(torch.nn.Module):  # elementwise only: CPU has no float16 matmul
            def __init__(self, dtype):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.linspace(-1, 1, 7).to(dtype))

            def forward(self, x):
                return (x * self.weight * self.weight).float().sum()

        for dtype in (torch.float16, torch.bfloat16, torch.float64):
            model = Scale(dtype)
            x = torch.linspace(0.5, 2, 7).to(dtype)
            with sfsync_torch.GradientSync(model, **PLAIN) as sync:
                self.assertEqual(sync.stats()["gradient_bytes"], 7 * model.weight.element_size())
                with sync.accumulate():
                    model(x).backward()
                model(x).backward()
                sync.synchronize()
                self.assertEqual(model.weight.grad.dtype, dtype)
                want = (2 * x * model.weight.detach()) * 2  # d/dw (x w^2), twice
                torch.testing.assert_close(model.weight.grad, want)
                self.assertEqual(sync.stats()["early_launches"], 1)

    def test_unsupported_dtype(self):
        import warnings
        warnings.simplefilter("ignore", UserWarning)  # torch: "Complex modules are new"
        model = torch.nn.Linear(2, 2)
        model.weight.requires_grad_(False)  # frozen: not synchronized
        with sfsync_torch.GradientSync(model, **LOCAL) as sync:
            self.assertEqual(sync.names, ["bias"])
        model = torch.nn.Linear(2, 2).to(torch.complex64)
        with self.assertRaisesRegex(TypeError, "complex64"):
            sfsync_torch.GradientSync(model, **LOCAL)


class RegisteredGrads(unittest.TestCase):
    def test_register_mode_uses_the_params_own_grads(self):
        model, twin = mlp(), mlp()
        with sfsync_torch.GradientSync(model, flat_buffer=False, **LOCAL) as sync:
            for gid, p in zip(sync._ids, model.parameters()):
                self.assertEqual(p.grad.data_ptr(), sync.context.gradient_data(gid))
            with sync.accumulate():
                model(data(0)).sum().backward()
            model(data(1)).sum().backward()
            sync.synchronize()
            for i in range(2):
                twin(data(i)).sum().backward()
            for a, b in zip(grads_of(model), grads_of(twin)):
                torch.testing.assert_close(a, b)


class TwoRanksAsThreads(unittest.TestCase):
    def test_average_matches_reference(self):
        """Rank r trains on data(r, ...); after synchronize both ranks hold
        the average of both ranks' accumulated gradients."""
        name = "memory://torch-%s" % uuid.uuid4().hex
        out, errors = [None, None], [None, None]
        models = [mlp(), mlp()]  # here: torch's global RNG is not for threads

        def run(rank):
            try:
                model = models[rank]
                with sfsync_torch.GradientSync(model, rank=rank, world_size=2, rendezvous=name,
                                               timeout_ms=20000, bucket_cap_mb=1e-4,
                                               first_bucket_cap_mb=1e-4) as sync:
                    with sync.accumulate():
                        for i in range(2):
                            model(data(10 * rank + i)).pow(2).sum().backward()
                    model(data(10 * rank + 2)).pow(2).sum().backward()
                    sync.synchronize()
                    out[rank] = (grads_of(model), sync.stats())
            except BaseException as e:  # noqa: B902
                errors[rank] = e
        threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(errors, [None, None])
        ref = mlp()
        for rank in (0, 1):
            for i in range(3):
                (ref(data(10 * rank + i)).pow(2).sum() / 2).backward()
        for rank in (0, 1):
            grads, stats = out[rank]
            for got, want in zip(grads, grads_of(ref)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            self.assertEqual(stats["collectives_issued"], stats["bucket_count"])
            self.assertGreater(stats["bucket_count"], 1)
            self.assertEqual(stats["early_launches"], stats["bucket_count"])
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(out[0][0], out[1][0])))


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main()
