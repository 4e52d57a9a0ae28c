"""Restarts without torchrun, and the smaller items of issue 18:

* attempt scoping (TORCHELASTIC_RESTART_COUNT): a restarted job meets again
  in a store that still holds the earlier attempt's keys, and a process of
  the earlier attempt is refused with a message saying so (not admitted, not
  timed out); the status text of a membership clash speaks of membership;
* GradientSync / DDPSync state_dict() and load_state_dict();
* a zero-size parameter, a second GradientSync on one module.

Ranks are threads in this process sharing one DictStore (test_binding.py's);
the environment variable is set before each attempt's contexts meet and is
process-wide, so attempts run one after the other, never at once.
"""

import os
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # test_binding
import torch  # noqa: E402

import sfsync  # noqa: E402
from sfsync import torch as sft  # noqa: E402
from test_binding import DictStore, run_thread_ranks  # noqa: E402

LOCAL = dict(rank=0, world_size=1, rendezvous="")


def with_attempt(count):
    os.environ.pop("SLURM_RESTART_COUNT", None)
    os.environ["TORCHELASTIC_RUN_ID"] = "test-run"
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(count)


class AttemptScope(unittest.TestCase):
    def tearDown(self):
        for k in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
            os.environ.pop(k, None)

    def meet(self, store, ranks=(0, 1), timeout_ms=20000):
        """Every rank in `ranks` connects (world 2) and returns its error or
        None; also the seconds it took."""
        def open_context(rank):
            ctx = sfsync.Context(rank=rank, world_size=2, rendezvous="host://",
                                 timeout_ms=timeout_ms)
            ctx.set_store(store.set, store.get, "job")
            return ctx
        start = time.monotonic()
        _, errors = run_thread_ranks(self, len(ranks), lambda i: open_context(ranks[i]),
                                     lambda ctx, i: ctx.connect())
        return errors, time.monotonic() - start

    def test_restarted_job_meets_again_in_the_same_store(self):
        store = DictStore()
        with_attempt(0)
        self.assertEqual(self.meet(store)[0], [None, None])
        with_attempt(1)  # the store still holds attempt 0's roster and claims
        errors, _ = self.meet(store)
        self.assertEqual(errors, [None, None])
        self.assertTrue(any("/attempt/1/roster" in k for k in store.data), sorted(store.data))
        self.assertIn("job/sfsync/torchrun/test-run/superseded/0", store.data)

    def test_process_of_an_earlier_attempt_is_refused(self):
        store = DictStore()
        with_attempt(3)
        self.assertEqual(self.meet(store)[0], [None, None])
        with_attempt(1)  # a rank 1 left over from attempt 1, alive after attempt 3 started
        errors, took = self.meet(store, ranks=(1,), timeout_ms=15000)
        self.assertIsInstance(errors[0], sfsync.MismatchError, errors)
        text = str(errors[0])
        self.assertIn("refused", text)
        self.assertIn("belongs to attempt 1 of torchrun run 'test-run' "
                      "(TORCHELASTIC_RESTART_COUNT=1), but attempt 3", text)
        self.assertNotIn("ranks disagree on the gradient layout", text)
        self.assertLess(took, 10.0, "refused at once, not after timeout_ms = 15000")

    def test_earlier_rank_waiting_for_its_roster_is_refused(self):
        # Attempt 0's rank 1 waits for a roster that never comes; attempt 1's
        # rank 0 then marks attempt 0 superseded: the waiting rank is refused
        # before its timeout_ms.
        store = DictStore()
        with_attempt(0)
        ctx = sfsync.Context(rank=1, world_size=2, rendezvous="host://", timeout_ms=30000)
        ctx.set_store(store.set, store.get, "job")
        store.set("job/sfsync/torchrun/test-run/superseded/0", b"1")  # as attempt 1's rank 0
        start = time.monotonic()
        with self.assertRaisesRegex(sfsync.MismatchError, "rank 1 refused .*attempt 0.*"
                                    "but attempt 1 of that run has started"):
            ctx.connect()
        self.assertLess(time.monotonic() - start, 10.0)
        ctx.close()

    def test_bad_restart_count_names_the_variable(self):
        store = DictStore()
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "one"
        errors, _ = self.meet(store)
        for e in errors:
            self.assertIsInstance(e, sfsync.InvalidArgumentError)
            self.assertIn("TORCHELASTIC_RESTART_COUNT='one'", str(e))

    def test_membership_clash_status_text(self):
        text = sfsync.status_string(sfsync.ERR_MISMATCH)
        self.assertIn("which process holds a rank", text)
        self.assertNotEqual(text.split("(")[0].strip(), "ranks disagree on the gradient layout")


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def train(sync, model, windows, n):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for w in range(windows):
        for i in range(n):
            g = torch.Generator().manual_seed(w * 10 + i)
            model(torch.randn(4, 6, generator=g)).square().mean().backward()
        assert sync.is_step()
        opt.step()
        opt.zero_grad()


class StateDict(unittest.TestCase):
    def test_gradient_sync_round_trip_continues_the_cadence(self):
        model = mlp()
        with sft.GradientSync(model, accumulation_steps=2, verify_every=3, **LOCAL) as sync:
            train(sync, model, 4, 2)
            state = sync.state_dict()
        self.assertEqual(state["windows"], 4)
        self.assertEqual(state["accumulation_steps"], 2)
        self.assertEqual(state["verify_every"], 3)
        self.assertEqual(state["last_verified"], 3)  # checked at window 3's forward
        self.assertEqual(state["checks"], 1)
        model2 = mlp()
        with sft.GradientSync(model2, accumulation_steps=2, verify_every=3, **LOCAL) as sync2:
            sync2.load_state_dict(state)
            self.assertEqual(sync2.windows, 4)
            train(sync2, model2, 3, 2)  # windows 4, 5, 6: the next check is at 6
            self.assertEqual(sync2.state_dict()["last_verified"], 6)
            self.assertEqual(sync2.state_dict()["checks"], 2)
            self.assertEqual(sync2.windows, 7)

    def test_state_dict_inside_a_window_is_an_error(self):
        model = mlp()
        with sft.GradientSync(model, accumulation_steps=2, **LOCAL) as sync:
            model(torch.ones(1, 6)).sum().backward()
            with self.assertRaisesRegex(RuntimeError, "inside a window .1 backward passes"):
                sync.state_dict()

    def test_load_state_dict_checks_what_it_is_given(self):
        model = mlp()
        with sft.GradientSync(model, accumulation_steps=2, **LOCAL) as sync:
            good = sync.state_dict()
            with self.assertRaisesRegex(ValueError, "accumulation_steps=4.*accumulation_steps=2"):
                sync.load_state_dict(dict(good, accumulation_steps=4))
            with self.assertRaisesRegex(ValueError, r"state\['windows'\] = -1"):
                sync.load_state_dict(dict(good, windows=-1))
            with self.assertRaisesRegex(ValueError, "not an sfsync state"):
                sync.load_state_dict({"windows": 3})
            with self.assertRaisesRegex(TypeError, "expected the dict"):
                sync.load_state_dict([1])
            self.assertEqual(sync.windows, 0)


class SmallItems(unittest.TestCase):
    def test_zero_size_parameter_is_accepted(self):
        model = mlp()
        model.empty = torch.nn.Parameter(torch.empty(0))  # DDP accepts it
        ref = mlp()
        with sft.GradientSync(model, accumulation_steps=2, **LOCAL) as sync:
            train(sync, model, 2, 2)
        train(_NoSync(), ref, 2, 2)
        kept = [p for n, p in model.named_parameters() if n != "empty"]
        self.assertEqual(len(kept), 4)
        for a, b in zip(kept, ref.parameters()):
            self.assertTrue(torch.equal(a, b))
        self.assertEqual(model.empty.numel(), 0)

    def test_second_gradient_sync_on_one_module_is_an_error_at_once(self):
        model = mlp()
        first = sft.GradientSync(model, accumulation_steps=2, **LOCAL)
        with self.assertRaisesRegex(RuntimeError, "already attached to a GradientSync.*close"):
            sft.GradientSync(model, accumulation_steps=2, **LOCAL)
        # The first one still works, and after close() a new one may attach.
        train(first, model, 1, 2)
        first.close()
        with sft.GradientSync(model, accumulation_steps=2, **LOCAL) as again:
            train(again, model, 1, 2)


class _NoSync:
    def is_step(self):
        return True


if __name__ == "__main__":
    unittest.main()
