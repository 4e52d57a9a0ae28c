"""sfsync.torch's DDP-like behaviour, one process and ranks as threads:
counting windows (accumulation_steps), unused parameters (.grad None),
parameters changed after attach, frozen parameters, initial broadcast and
verify_every.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 \
        /usr/bin/python3 tests/python/sfsync/torch/test_torch_features.py -v
"""

import os
import sys
import threading
import unittest
import uuid

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "..", ".."))
if not any(os.path.exists(os.path.join(p, "sfsync", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

import sfsync  # noqa: E402
from sfsync import torch as sft  # noqa: E402

LOCAL = dict(rank=0, world_size=1, rendezvous="")


class Net(torch.nn.Module):
    """A BatchNorm, an unused parameter, a frozen one, and a branch that only
    some passes use."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 3)
        self.side = torch.nn.Linear(6, 3)          # used only when side=True
        self.unused = torch.nn.Parameter(torch.randn(4))
        self.frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x, side=False):
        y = self.fc2(torch.tanh(self.bn(self.fc1(x)))) + self.frozen
        if side:
            y = y + self.side(x)
        return y


def data(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(5, 6, generator=g)


def run_threads(fn, n=2):
    errors = [None] * n
    out = [None] * n

    def run(rank):
        try:
            out[rank] = fn(rank)
        except BaseException as e:  # noqa: B902
            errors[rank] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out, errors


class Counting(unittest.TestCase):
    def test_accumulation_steps_matches_local_reference(self):
        """The loop is backward; if is_step(): step. Windows of 3, one rank:
        the weights equal plain local accumulation of 3 passes per step."""
        model, twin = Net(), Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        topt = torch.optim.SGD(twin.parameters(), lr=0.1)
        sync = sft.GradientSync(model, accumulation_steps=3, **LOCAL)
        steps = []
        for i in range(9):
            (model(data(i)).pow(2).mean() / 3).backward()
            steps.append(sync.is_step())
            if sync.is_step():
                opt.step()
                opt.zero_grad()
            (twin(data(i)).pow(2).mean() / 3).backward()
            if i % 3 == 2:
                topt.step()
                topt.zero_grad()
        self.assertEqual(steps, [False, False, True] * 3)
        s = sync.stats()
        self.assertEqual(s["windows_completed"], 3)
        self.assertEqual(s["windows_begun"], 3)
        self.assertEqual(s["deferred_passes"], 6)
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        sync.close()

    def test_accumulation_steps_one_synchronizes_every_pass(self):
        model = Net()
        with sft.GradientSync(model, accumulation_steps=1, **LOCAL) as sync:
            for i in range(3):
                model(data(i)).sum().backward()
                self.assertTrue(sync.is_step())
            self.assertEqual(sync.stats()["windows_completed"], 3)
            self.assertEqual(sync.stats()["windows_begun"], 0)

    def test_counting_follows_an_agreeing_host_and_refuses_bad_values(self):
        """A host's no_sync() that agrees with accumulation_steps is
        followed (0.3 refused it; the frameworks use it); one that keeps
        deferring past N in the first window is a RuntimeError naming both;
        synchronize() in counting mode stays an error."""
        model = Net()
        with sft.GradientSync(model, accumulation_steps=2, **LOCAL) as sync:
            with self.assertRaisesRegex(RuntimeError, r"do not call synchronize\(\)"):
                sync.synchronize()
            self.assertFalse(sync.is_step())
            with sync.no_sync():
                model(data(0)).sum().backward()
            self.assertFalse(sync.is_step())
            model(data(1)).sum().backward()
            self.assertTrue(sync.is_step())
            self.assertEqual(sync.stats()["windows_completed"], 1)
        with sft.GradientSync(Net(), accumulation_steps=2, **LOCAL) as sync:
            with sync.no_sync():
                sync(data(0)).sum().backward()
                with self.assertRaisesRegex(RuntimeError, r"accumulation_steps=2, but the host "
                                            r"keeps micro-batch 2 of its first window inside"):
                    sync(data(1))
            self.assertEqual(sync.stats()["windows_completed"], 0)
        for bad in (0, -1, 2.5, "4"):
            with self.assertRaisesRegex(ValueError, "accumulation_steps must be an integer"):
                sft.GradientSync(Net(), accumulation_steps=bad, **LOCAL)
        with self.assertRaisesRegex(ValueError, "verify_every must be"):
            sft.GradientSync(Net(), verify_every=0, **LOCAL)


class UnusedAndFrozen(unittest.TestCase):
    def test_unused_parameter_grad_is_none(self):
        """DDP(find_unused_parameters=True) leaves .grad None for a parameter
        no rank used in the window; sfsync did give it a zero tensor."""
        model = Net()
        with sft.GradientSync(model, accumulation_steps=2, **LOCAL) as sync:
            self.assertNotIn("frozen", sync.names)
            for i in range(2):
                (model(data(i)).sum() / 2).backward()
            self.assertTrue(sync.is_step())
            self.assertIsNone(model.unused.grad)
            self.assertIsNone(model.side.weight.grad)
            self.assertIsNone(model.frozen.grad)
            self.assertIsNotNone(model.fc1.weight.grad)
            # Weight decay leaves a parameter without a gradient untouched.
            before = model.unused.detach().clone()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
            opt.step()
            opt.zero_grad()
            self.assertTrue(torch.equal(before, model.unused))
            # The next window: a pass that uses `side` gives it a gradient
            # again (in the plugin's buffer), the others stay None.
            model(data(2)).sum().backward()
            model(data(3), side=True).sum().backward()
            self.assertTrue(sync.is_step())
            self.assertIsNotNone(model.side.weight.grad)
            ids = dict(zip(sync.names, sync._ids))
            self.assertEqual(model.side.weight.grad.data_ptr(),
                             sync.context.gradient_data(ids["side.weight"]))
            twin = Net()
            twin(data(3), side=True).sum().backward()
            torch.testing.assert_close(model.side.weight.grad, twin.side.weight.grad)
            self.assertIsNone(model.unused.grad)

    def test_frozen_parameters_are_not_registered(self):
        model = Net()
        with sft.GradientSync(model, **LOCAL) as sync:
            self.assertEqual(sorted(sync.names), sorted(
                n for n, p in model.named_parameters() if p.requires_grad))
            numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
            self.assertEqual(sync.stats()["gradient_bytes"], 4 * (numel + len(sync.names)))


class ChangedAfterAttach(unittest.TestCase):
    def window(self, model, sync):
        with sync.accumulate():
            model(data(0)).sum().backward()
        model(data(1)).sum().backward()
        sync.synchronize()

    def test_parameter_added_after_attach_is_an_error(self):
        """A parameter added after GradientSync(model) went unsynchronized
        without an error."""
        model = Net()
        with sft.GradientSync(model, **LOCAL) as sync:
            self.window(model, sync)
            model.extra = torch.nn.Linear(2, 2)
            with self.assertRaisesRegex(RuntimeError, r"parameter 'extra\.weight' \(shape \[2, 2\]"
                                        r"\) was added or replaced after GradientSync attached"):
                self.window(model, sync)

    def test_parameter_replaced_or_resized_after_attach_is_an_error(self):
        model = Net()
        with sft.GradientSync(model, **LOCAL) as sync:
            model.fc2.bias = torch.nn.Parameter(torch.zeros(3))
            with self.assertRaisesRegex(RuntimeError, r"'fc2\.bias' .* was added or replaced"):
                self.window(model, sync)
        model = Net()
        with sft.GradientSync(model, hooks=False, **LOCAL) as sync:
            model.unused.data = torch.zeros(7)
            with self.assertRaisesRegex(RuntimeError, r"parameter 'unused' changed from shape "
                                        r"\[4\] torch\.float32 to \[7\]"):
                sync.synchronize()

    def test_parameter_frozen_after_attach_is_an_error_in_counting_mode(self):
        model = Net()
        with sft.GradientSync(model, accumulation_steps=2, **LOCAL) as sync:
            model.fc1.bias.requires_grad_(False)
            model(data(0)).sum().backward()
            with self.assertRaisesRegex(RuntimeError, r"'fc1\.bias' was removed, replaced or "
                                        r"frozen"):
                model(data(1)).sum().backward()


class Verify(unittest.TestCase):
    def test_world_size_one_check_is_free_and_ok(self):
        model = Net()
        with sft.GradientSync(model, accumulation_steps=2, verify_every=1, **LOCAL) as sync:
            for i in range(6):
                model(data(i)).sum().backward()
            self.assertEqual(sync._verifier.checks, 2)  # before windows 2 and 3
            sync.verify()


class Logging(unittest.TestCase):
    def test_package_messages_go_through_sfsyncs_logger(self):
        """SF_DEBUG=INFO: the package's lines have the library's shape
        (sfsync <host>:<pid>:<rank> <LEVEL> <subsystem> message); silent at
        the default WARN."""
        import subprocess
        code = ("import torch; from sfsync import torch as sft; "
                "sft.GradientSync(torch.nn.Linear(3, 2), accumulation_steps=2, rank=0, "
                "world_size=1, rendezvous='')")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.pop("SF_DEBUG", None)
        quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                               text=True)
        self.assertEqual(quiet.returncode, 0, quiet.stderr)
        self.assertNotIn("GradientSync", quiet.stderr)
        env["SF_DEBUG"] = "INFO"
        loud = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True)
        self.assertEqual(loud.returncode, 0, loud.stderr)
        self.assertRegex(loud.stderr, r"(?m)^sfsync \S+:\d+:\S+ INFO torch GradientSync: 2 "
                         r"parameters \(32 bytes\), accumulation_steps=2, rank 0/1$")


class TwoRanksAsThreads(unittest.TestCase):
    """memory:// rendezvous: both ranks are threads of this process."""

    def test_initial_weights_broadcast_and_unused_agree(self):
        """Ranks seeded differently ended 5.15 apart: nothing broadcast the
        initial weights (nor the BatchNorm buffers)."""
        name = "memory://feat-%s" % uuid.uuid4().hex
        models = [Net(seed=1), Net(seed=2)]
        models[1].bn.running_mean.fill_(3.0)
        self.assertFalse(torch.equal(models[0].fc1.weight, models[1].fc1.weight))

        def rank_fn(rank):
            model = models[rank]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with sft.GradientSync(model, accumulation_steps=2, rank=rank, world_size=2,
                                  rendezvous=name, timeout_ms=30000) as sync:
                after_attach = [t.detach().clone() for t in model.state_dict().values()]
                for i in range(4):
                    # rank 1 uses `side` in window 1 only: every rank must
                    # keep its gradient; nobody uses `unused`.
                    x = data(10 * rank + i)
                    (model(x, side=(rank == 1 and i == 1)).pow(2).mean() / 2).backward()
                    if sync.is_step():
                        grads = {n: (None if p.grad is None else p.grad.clone())
                                 for n, p in model.named_parameters()}
                        opt.step()
                        opt.zero_grad()
                        if i == 1:
                            first = grads
                return after_attach, first, [p.detach().clone() for p in model.parameters()]
        out, errors = run_threads(rank_fn)
        self.assertEqual(errors, [None, None])
        for a, b in zip(out[0][0], out[1][0]):
            self.assertTrue(torch.equal(a, b))  # parameters and buffers from rank 0
        g0, g1 = out[0][1], out[1][1]
        self.assertIsNone(g0["unused"])
        self.assertIsNone(g1["unused"])
        self.assertIsNotNone(g0["side.weight"])  # used on rank 1 only: kept everywhere
        self.assertTrue(torch.equal(g0["side.weight"], g1["side.weight"]))
        for a, b in zip(out[0][2], out[1][2]):
            self.assertTrue(torch.equal(a, b))

    def test_wrong_world_size_fails_at_attach_not_in_backward(self):
        """WORLD_SIZE 3 with 2 ranks surfaced only at the timeout, from
        inside backward: GradientSync connects at attach."""
        import time
        name = "memory://ws-%s" % uuid.uuid4().hex
        models = [Net(), Net()]

        def rank_fn(rank):
            t0 = time.monotonic()
            try:
                sft.GradientSync(models[rank], rank=rank, world_size=3, rendezvous=name,
                                 timeout_ms=1500)
            except sfsync.SfError as e:
                return time.monotonic() - t0, e
            return time.monotonic() - t0, None
        out, errors = run_threads(rank_fn)
        self.assertEqual(errors, [None, None])
        for rank in (0, 1):
            elapsed, e = out[rank]
            self.assertIsInstance(e, (sfsync.SfTimeoutError, sfsync.BackendError,
                                      sfsync.MismatchError), "rank %d: %r" % (rank, e))
            self.assertIn("sf_connect", str(e))
            self.assertLess(elapsed, 1.5 + 10.0)  # the timeout plus generous slack

    def test_verify_every_names_the_first_differing_parameter(self):
        """One flipped bit in one parameter on one rank is caught on every
        rank at the next check, naming that parameter."""
        name = "memory://verify-%s" % uuid.uuid4().hex
        models = [Net(), Net()]

        def rank_fn(rank):
            model = models[rank]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            sync = sft.GradientSync(model, accumulation_steps=2, verify_every=2, rank=rank,
                                    world_size=2, rendezvous=name, timeout_ms=30000)
            try:
                for i in range(12):
                    model(data(10 * rank + i)).sum().backward()
                    if sync.is_step():
                        opt.step()
                        opt.zero_grad()
                        if sync.windows == 3 and rank == 1:
                            with torch.no_grad():  # one bit of one element
                                bits = model.fc2.bias.view(torch.int32)
                                bits[1] ^= 1
                return None
            except sft.ReplicaMismatchError as e:
                return (i, e.name, e.step, str(e))
            finally:
                sync.close()
        out, errors = run_threads(rank_fn)
        self.assertEqual(errors, [None, None])
        for rank in (0, 1):
            self.assertIsNotNone(out[rank], "rank %d saw no mismatch" % rank)
            i, pname, step, text = out[rank]
            self.assertEqual(pname, "fc2.bias")
            self.assertEqual(step, 4)     # windows 3 and 4 passed; checked before window 5's step
            self.assertEqual(i, 8)        # the forward of window 5's first pass
            self.assertIn("first differing tensor is 'fc2.bias'", text)

    def test_verify_buffers_passes_with_batchnorm_and_names_a_buffer_that_differs(self):
        """verify_buffers=True with a BatchNorm raised on equal replicas: the
        check ran at the window's last forward, after the window's earlier
        forwards had moved each rank's statistics (its own batches). It runs
        before the window's first forward now (counting mode) or on entering
        accumulate() (explicit windows); a buffer that really differs on one
        rank is named at the next check."""
        import contextlib
        for explicit in (False, True):
            name = "memory://vbuf-%s" % uuid.uuid4().hex
            models = [Net(), Net()]

            def rank_fn(rank):
                model = models[rank]
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                sync = sft.GradientSync(model, accumulation_steps=None if explicit else 2,
                                        verify_every=1, verify_buffers=True, rank=rank,
                                        world_size=2, rendezvous=name, timeout_ms=30000)
                try:
                    for w in range(4):
                        if w == 3 and rank == 1:
                            with torch.no_grad():
                                model.bn.running_mean[0] += 1.0
                        for i in range(2):
                            inside = sync.accumulate() if explicit and i == 0 else None
                            with inside or contextlib.nullcontext():
                                model(data(10 * rank + 2 * w + i)).pow(2).mean().backward()
                        if explicit:
                            sync.synchronize()
                        opt.step()
                        opt.zero_grad()
                    return None
                except sft.ReplicaMismatchError as e:
                    return (w, e.name)
                finally:
                    sync.close()
            out, errors = run_threads(rank_fn)
            self.assertEqual(errors, [None, None])
            self.assertEqual(out, [(3, "bn.running_mean")] * 2, "explicit windows: %s" % explicit)


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main()
