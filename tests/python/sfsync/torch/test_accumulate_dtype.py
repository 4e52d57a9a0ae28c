"""GradientSync(accumulate_dtype=torch.float32) (issue 23, item 3; FSDP2's
MixedPrecisionPolicy.reduce_dtype): a bf16 model's gradients accumulated over
a window's micro-batches and reduced in float32. On the CPU (host buffers,
Gloo): world size 1 and 2 ranks as threads. The float32 sums must equal,
bit for bit, a float32 reference loop (``acc += p.grad.float()`` per
micro-batch, then the average over ranks), ``.grad`` must be their bf16
cast, and bf16 accumulation (no accumulate_dtype) must differ from it (so
the comparison can fail). Bad values are errors naming the argument.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 \\
    python3 tests/python/sfsync/torch/test_accumulate_dtype.py -v
"""

import os
import sys
import unittest
import uuid

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "..", ".."))
if not any(os.path.exists(os.path.join(p, "sfsync", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

import sfsync  # noqa: E402
import sfsync.torch as sft  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "support"))  # thread_ranks
from thread_ranks import run_thread_ranks  # noqa: E402

MICRO, WINDOWS = 4, 2


def make_model(seed=7):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8)).to(torch.bfloat16)


def batch(rank, window, micro):
    g = torch.Generator().manual_seed(100 * rank + 10 * window + micro)
    return (torch.randn(6, 16, generator=g).to(torch.bfloat16),
            torch.randn(6, 8, generator=g).to(torch.bfloat16))


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y.float()) / MICRO


def reference(models, window):
    """Per rank: sum over micro-batches of autograd's bf16 .grad, in float32;
    then the average over ranks (float32)."""
    sums = []
    for r, model in enumerate(models):
        acc = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
        for m in range(MICRO):
            for p in model.parameters():
                p.grad = None
            loss_of(model, *batch(r, window, m)).backward()
            for a, p in zip(acc, model.parameters()):
                a += p.grad.float()
        sums.append(acc)
    world = len(models)
    return [sum(parts[1:], parts[0].clone()) / world if world > 1 else parts[0]
            for parts in zip(*sums)]


def run(world, accumulate_dtype, zero="sync"):
    """WINDOWS windows of MICRO micro-batches, no step (the same weights every
    window); per rank and window: (accumulated_grads() copies, .grad copies).
    ``zero``: how the host zeroes between windows: "sync" (sync.zero_grad,
    both ways), "torch" (what a torch optimizer's zero_grad() and
    model.zero_grad() do by default: every .grad set to None), "inplace"
    (zero_grad(set_to_none=False): every .grad zeroed in place)."""
    name = "memory://acc-dtype-%s" % uuid.uuid4().hex
    models = [make_model() for _ in range(world)]

    def rank(r):
        ctx = sfsync.Context(rank=r, world_size=world, rendezvous=name if world > 1 else "",
                             backend="gloo", timeout_ms=60000)
        sync = sft.GradientSync(models[r], context=ctx, accumulation_steps=MICRO,
                                accumulate_dtype=accumulate_dtype)
        got = []
        try:
            for w in range(WINDOWS):
                for m in range(MICRO):
                    loss_of(sync, *batch(r, w, m)).backward()
                assert sync.is_step()
                got.append(([a.clone() for a in sync.accumulated_grads()],
                            [p.grad.clone() for p in models[r].parameters()]))
                if zero == "sync":
                    sync.zero_grad(set_to_none=(w % 2 == 0))  # both ways of zeroing
                elif zero == "torch":
                    models[r].zero_grad()
                else:
                    for p in models[r].parameters():
                        p.grad.zero_()
            return got
        finally:
            sync.close()
            ctx.close()

    return run_thread_ranks(world, rank)


class AccumulateDtypeTests(unittest.TestCase):
    def check_exact(self, world, zero="sync"):
        out = run(world, torch.float32, zero)
        refs = [reference([make_model() for _ in range(world)], w) for w in range(WINDOWS)]
        for r in range(world):
            for w in range(WINDOWS):
                acc, grads = out[r][w]
                self.assertEqual(len(acc), len(refs[w]))
                for k, (a, ref, g) in enumerate(zip(acc, refs[w], grads)):
                    self.assertEqual(a.dtype, torch.float32)
                    self.assertEqual(g.dtype, torch.bfloat16)
                    self.assertTrue(torch.equal(a, ref), "world %d rank %d window %d tensor %d: "
                                    "max %g from the float32 reference"
                                    % (world, r, w, k, (a - ref).abs().max()))
                    self.assertTrue(torch.equal(g, ref.to(torch.bfloat16)))
        return refs

    def test_world1_exact_against_a_float32_reference(self):
        refs = self.check_exact(1)
        # Without accumulate_dtype the sum is bf16 (rounded at every micro-batch).
        plain = run(1, None)
        differs = sum(int(not torch.equal(g.float(), ref))
                      for w in range(WINDOWS) for g, ref in zip(plain[0][w][1], refs[w]))
        self.assertGreater(differs, 0, "bf16 accumulation matched float32's: the test "
                           "could not tell them apart")

    def test_two_ranks_exact_against_a_float32_reference(self):
        self.check_exact(2)

    def test_the_host_zeroing_the_torch_way(self):
        """A host that zeroes through its torch optimizer or model (issue 32's
        resume test found it): each window's gradient is that window's alone.
        Before the fix the accumulators kept the previous windows' sums
        (window 1 held twice window 0's gradient), so a resumed run, whose
        accumulators start empty, left the uninterrupted one by 7e-4."""
        self.check_exact(1, zero="torch")
        self.check_exact(2, zero="inplace")

    def test_bad_values_name_the_argument(self):
        model = make_model()
        for bad, msg in [(torch.bfloat16, r"accumulate_dtype must be None, torch.float32 or "
                          r"torch.float64, not torch.bfloat16"),
                         ("float32", r"accumulate_dtype must be .* not 'float32'"),
                         (torch.int32, r"not torch.int32")]:
            with self.assertRaisesRegex(ValueError, msg):
                sft.GradientSync(model, accumulate_dtype=bad)
        with self.assertRaisesRegex(ValueError, r"accumulate_dtype=torch.float32\) .* "
                                    "flat_buffer=False does not fit"):
            sft.GradientSync(model, accumulate_dtype=torch.float32, flat_buffer=False)
        with self.assertRaisesRegex(ValueError, "hooks=False does not fit"):
            sft.GradientSync(model, accumulate_dtype=torch.float32, hooks=False)
        with self.assertRaisesRegex(ValueError, "shard_optimizer=True\\): not supported"):
            sft.GradientSync(model, accumulate_dtype=torch.float32, shard_optimizer=True)
        wide = torch.nn.Linear(2, 2).double()
        with self.assertRaisesRegex(ValueError, "accumulate_dtype=torch.float32 is narrower than "
                                    "parameter weight's dtype torch.float64"):
            sft.GradientSync(wide, accumulate_dtype=torch.float32)
        with sft.GradientSync(model, accumulate_dtype=torch.float32) as sync:
            with self.assertRaisesRegex(ValueError, "overlap_step=True.*needs overlap_step=False"):
                sync.optimizer(torch.optim.SGD, model.parameters(), lr=0.1, overlap_step=True)

    def test_adamw_over_a_bf16_model_steps(self):
        """The optimizer path: AdamW over the bf16 parameters steps on the
        published bf16 .grad, window after window (world size 1)."""
        model = make_model()
        before = [p.detach().clone() for p in model.parameters()]
        with sft.GradientSync(model, accumulation_steps=MICRO,
                              accumulate_dtype=torch.float32) as sync:
            opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
            for w in range(WINDOWS):
                for m in range(MICRO):
                    loss_of(sync, *batch(0, w, m)).backward()
                opt.step()
                opt.zero_grad()
            self.assertEqual(sync.windows, WINDOWS)
        for a, b in zip(before, model.parameters()):
            self.assertFalse(torch.equal(a, b.detach()))
            self.assertEqual(b.dtype, torch.bfloat16)


if __name__ == "__main__":
    unittest.main()
