"""Weighted windows (issue 31): GradientSync(reduce="weighted") with
``sync.weigh(tokens)`` per micro-batch and a summed loss gives every rank
the window's token-mean gradient, the gradient of one process that takes
the whole window (every rank's micro-batches) as one batch with loss =
sum of per-token losses / total tokens.

A tiny causal LM built here (embedding, a mix of each token with the one
before it, a vocabulary head) on variable-length sequences padded with -100
labels; windows of MICRO = 4 micro-batches, ranks as threads (memory://,
Gloo), several buckets (a 2 KB cap). Judged:

* float64: weights after WINDOWS AdamW steps (clipped by the global norm:
  torch's clip unsharded, the sharded optimizer's own sharded) within 1e-9
  of the one-process reference; 2 and 3 ranks; unsharded (the flat buffer
  and the parameters' own .grad), sharded with both layouts;
* float32: each window's gradients within 1e-5 of the largest gradient
  (the reference in float64 at the run's own weights of that window);
* plain per-micro-batch averaging (DDP's way) on the same data: its
  distance from the reference, printed, must be far outside the tolerance;
* window_sums(): weight, loss and token sums equal the sums over ranks and
  micro-batches, the found-inf flag and the user metric too, in every
  window; also read at is_step() of sfsync's optimizer with
  overlap_step=True (unsharded and sharded flat; the reductions still in
  flight there, so it must wait), whose weights are judged as above;
* a window of global weight 0: the named error from backward() on every
  rank, the gradients left as the plain sums, no step, and the next window
  right (unsharded and sharded); a weight added after the last pass's first
  bucket started reducing: the error naming the bucket, the weight not
  added; a bf16 wire (float32 model) within a stated tolerance and the
  weight exact; accumulate_dtype=float32 on a bf16 model; world size 1;
  the option's and the methods' errors;
* totals near the limb codec's bounds (3 ranks, each weighing 2^51 - 1 - r:
  all-ones limbs, the global total 3 * 2^51 - 6; all-ones fraction bits;
  a negative sum) exact on float32, bf16 and float16 wires.

Each comparison prints its measured distance.

    PYTHONPATH=python SFSYNC_LIBRARY=build/plugin/libsfsync.so.1 \\
    python3 tests/python/sfsync/torch/test_weighted.py -v
"""

import math
import os
import sys
import unittest
import uuid

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "..", "..", "..", ".."))
if not any(os.path.exists(os.path.join(p, "sfsync", "__init__.py")) for p in sys.path if p):
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import sfsync  # noqa: E402
import sfsync.torch as sft  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "support"))  # thread_ranks
from thread_ranks import run_thread_ranks  # noqa: E402

VOCAB, DIM, SEQ, BATCH = 29, 12, 16, 8
MICRO, WINDOWS = 4, 3
LR, DECAY, CLIP = 0.02, 0.01, 0.15  # (the window norms are 0.14-0.18: most steps clip)
CAP_MB = 0.002  # a few KB: several buckets
F64_TOL, F32_REL = 1e-9, 1e-5
SAME_ARITHMETIC = 1e-13  # float64, one computation in two summation orders
BF16_REL, BF16_SCALE = 2 ** -6, 1e-3


def say(text):
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.mix = torch.nn.Linear(2 * DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        e = self.emb(ids)
        before = F.pad(e[:, :-1], (0, 0, 1, 0))  # each position sees itself and the one before
        return self.head(torch.tanh(self.mix(torch.cat([e, before], -1))))


def make_model(dtype=torch.float64):
    """The same weights on every call, also from threads at once (its own
    generator: torch's global one is shared by the rank threads)."""
    model = TinyLM()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model.to(dtype)


def batch(rank, window, micro):
    """BATCH sequences of 2..SEQ tokens (a micro-batch-wide cap varies
    too, so the token counts differ a lot), padded; labels -100 there."""
    g = torch.Generator().manual_seed(1000 * rank + 37 * window + micro)
    cap = int(torch.randint(3, SEQ + 1, (1,), generator=g))
    lengths = torch.randint(2, cap + 1, (BATCH,), generator=g)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
    labels = ids.masked_fill(pad, -100)
    return ids.masked_fill(pad, 0), labels


def loss_sum(model, ids, labels):
    """The sum of the per-token losses (next-token prediction), and the
    tokens it sums."""
    logits = model(ids)[:, :-1]
    target = labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100,
                           reduction="sum")
    return loss, (target != -100).sum()


def window_data(world, window):
    return [batch(r, window, m) for r in range(world) for m in range(MICRO)]


def tokens_of(world, window):
    return sum(int((lab[:, 1:] != -100).sum()) for _, lab in window_data(world, window))


# ---- the one-process reference ------------------------------------------------

def reference_grads(model, world, window):
    """The window's token-mean gradient (float64) at ``model``'s weights:
    every rank's micro-batches as one batch."""
    ids = torch.cat([i for i, _ in window_data(world, window)])
    labels = torch.cat([lab for _, lab in window_data(world, window)])
    model.zero_grad(set_to_none=True)
    loss, tokens = loss_sum(model, ids, labels)
    (loss / tokens).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def reference_weights(world):
    """float64 AdamW over WINDOWS windows of the token-mean loss, clipped
    at CLIP; returns (weights, the norms before clipping)."""
    model = make_model(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    norms = []
    for w in range(WINDOWS):
        reference_grads(model, world, w)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], norms


def at_weights(weights):
    model = make_model(torch.float64)
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w.double())
    return model


# ---- ranks as threads ---------------------------------------------------------

def run_ranks(world, fn):
    name = "memory://weighted-%s" % uuid.uuid4().hex
    return run_thread_ranks(world, lambda r: fn(r, name if world > 1 else ""))


def attach(model, r, world, name, reduce="weighted", how="reduce", **kw):
    """GradientSync on its own context (``how``: the reduce= argument, the
    reduce_op option, or a context made by the caller)."""
    opts = dict(rank=r, world_size=world, rendezvous=name, backend="gloo", timeout_ms=60000)
    if how == "context":
        ctx = sfsync.Context(reduce_op=reduce, **opts)
        sync = sft.GradientSync(model, context=ctx, reduce=reduce, bucket_cap_mb=CAP_MB,
                                first_bucket_cap_mb=CAP_MB, accumulation_steps=MICRO, **kw)
        return sync, ctx
    opts["reduce" if how == "reduce" else "reduce_op"] = reduce
    opts.update(kw)
    return sft.GradientSync(model, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB,
                            accumulation_steps=MICRO, **opts), None


def train(r, world, name, dtype=torch.float64, shard=None, reduce="weighted", how="reduce",
          step=True, overlap_step=False, **kw):
    """WINDOWS windows of MICRO micro-batches on rank r; per window the
    weights at its start, the gradients at is_step() (float64 copies) and
    window_sums(); the final weights; what this rank added to the sums.
    ``overlap_step``: sfsync's optimizer with overlap_step=True, whose last
    pass only starts the reductions: window_sums() is read first thing at
    is_step() (it must wait for them), the gradients only after it (sharded:
    not at all, they are ranges), the clip the optimizer's own."""
    model = make_model(dtype)
    if shard:
        kw.update(shard_optimizer=True, shard_layout=shard)
    sync, ctx = attach(model, r, world, name, reduce, how, **kw)
    if shard or overlap_step:
        opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=LR, weight_decay=DECAY,
                             overlap_step=overlap_step)
        assert opt.overlap_step == overlap_step, "overlap_step did not take (one bucket?)"
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    rec = {"starts": [], "grads": [], "sums": [], "added": [], "stats": None}
    try:
        for w in range(WINDOWS):
            if shard:
                opt.wait_parameters()
            rec["starts"].append([p.detach().double().clone() for p in model.parameters()])
            added = [0.0, 0, 0, 0]
            for m in range(MICRO):
                loss, tokens = loss_sum(sync, *batch(r, w, m))
                if reduce == "weighted":
                    # a tensor, an int and a float: each a weight
                    sync.weigh(tokens if m == 0 else int(tokens) if m == 1 else float(tokens))
                    found_inf = 1 if (r, w, m) == (0, 1, 1) else None
                    sync.add_window_sums(loss=loss, tokens=tokens, found_inf=found_inf,
                                         metric=r + 1)
                    added = [added[0] + float(loss.detach()), added[1] + int(tokens),
                             added[2] + (found_inf or 0), added[3] + r + 1]
                    loss.backward()
                else:  # DDP's way: each micro-batch's token mean, / MICRO
                    (loss / tokens / MICRO).backward()
            assert sync.is_step(), "window %d did not synchronize" % w
            if overlap_step:  # nothing has waited for the reductions yet
                try:
                    rec["sums"].append(sync.window_sums())
                except sfsync.InvalidStateError as e:  # (judged by the test: every window)
                    rec["sums"].append({"error": e.message})
            if not (overlap_step and shard):
                rec["grads"].append([p.grad.detach().double().clone()
                                     for p in model.parameters()])
            if reduce == "weighted":
                if not overlap_step:
                    rec["sums"].append(sync.window_sums())
                rec["added"].append(added)
            if step:
                if shard or overlap_step:
                    opt.clip_grad_norm_(CLIP)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
            opt.zero_grad()
        if shard:
            opt.wait_parameters()
        rec["weights"] = [p.detach().double().clone() for p in model.parameters()]
        rec["stats"] = sync.stats()
        rec["windows"] = sync.windows
        return rec
    finally:
        sync.close()
        if ctx is not None:
            ctx.close()


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def largest(grads):
    return max(float(g.abs().max()) for g in grads)


_cache = {}


def cached(key, fn):
    if key not in _cache:
        _cache[key] = fn()
    return _cache[key]


def weighted_run(world, dtype, shard=None, **kw):
    key = (world, str(dtype), shard, tuple(sorted(kw.items())))
    return cached(key, lambda: run_ranks(world, lambda r, name: train(r, world, name, dtype,
                                                                      shard, **kw)))


MODES = [("unsharded", None, {}), ("unsharded-own-grad", None, {"flat_buffer": False}),
         ("sharded-flat", "flat", {}), ("sharded-parameter", "parameter", {})]
# overlap_step=True: the window's reductions still in flight at is_step()
OVERLAP_MODES = [("unsharded-overlap-step", None, {"overlap_step": True}),
                 ("sharded-flat-overlap-step", "flat", {"overlap_step": True})]


class TokenMeanReference(unittest.TestCase):
    def test_float64_weights_after_adamw_steps(self):
        for world in (2, 3):
            ref, norms = reference_weights(world)
            self.assertTrue(any(n > CLIP for n in norms), "the reference never clipped "
                            "(norms %s): the clip is not tested" % norms)
            for label, shard, kw in MODES + OVERLAP_MODES:
                if world == 3 and label == "unsharded-own-grad":
                    continue
                out = weighted_run(world, torch.float64, shard, **kw)
                diff = max(max_diff(o["weights"], ref) for o in out)
                apart = max(max_diff(o["weights"], out[0]["weights"]) for o in out)
                say("float64 %d ranks %s: max |w - w_ref| after %d AdamW steps = %.3g "
                    "(tol %g), ranks apart %.3g, buckets %d" % (
                        world, label, WINDOWS, diff, F64_TOL, apart,
                        out[0]["stats"]["bucket_count"]))
                self.assertLessEqual(diff, F64_TOL, "%d ranks %s" % (world, label))
                self.assertEqual(apart, 0.0, "%d ranks %s: ranks differ" % (world, label))
                self.assertGreater(out[0]["stats"]["bucket_count"], 2)
                self.assertEqual(out[0]["stats"]["windows_completed"], WINDOWS)
                # Sharded and unsharded do the same arithmetic but for the
                # order of the sums: far closer than the tolerance (the
                # sharded clip's float32 coefficient was 9.7e-10 apart).
                apart = max_diff(out[0]["weights"],
                                 weighted_run(world, torch.float64)[0]["weights"])
                self.assertLessEqual(apart, SAME_ARITHMETIC, "%d ranks %s vs unsharded"
                                     % (world, label))

    def test_float32_window_gradients(self):
        for world in (2, 3):
            for label, shard, kw in MODES:
                if world == 3 and label == "unsharded-own-grad":
                    continue
                out = weighted_run(world, torch.float32, shard, **kw)
                worst = 0.0
                for w in range(WINDOWS):
                    ref = reference_grads(at_weights(out[0]["starts"][w]), world, w)
                    scale = largest(ref)
                    for r, o in enumerate(out):
                        rel = max_diff(o["grads"][w], ref) / scale
                        worst = max(worst, rel)
                        self.assertLessEqual(rel, F32_REL, "float32 %d ranks %s rank %d window %d"
                                             % (world, label, r, w))
                say("float32 %d ranks %s: window gradients within %.3g of the largest "
                    "(tol %g)" % (world, label, worst, F32_REL))

    def test_plain_per_micro_batch_averaging_differs(self):
        world = 2
        ref, _ = reference_weights(world)
        plain = run_ranks(world, lambda r, name: train(r, world, name, reduce="average"))
        weighted = weighted_run(world, torch.float64)
        update = max_diff(ref, [p.detach().double() for p in make_model().parameters()])
        diff = max_diff(plain[0]["weights"], ref)
        gref = reference_grads(make_model(), world, 0)
        gdiff = max_diff(plain[0]["grads"][0], gref) / largest(gref)
        say("plain per-micro-batch averaging, 2 ranks: max |w - w_ref| = %.3g after %d steps "
            "(the reference's whole update: %.3g; weighted: %.3g); window 0's gradient %.3g of "
            "the largest off" % (diff, WINDOWS, update, max_diff(weighted[0]["weights"], ref),
                                 gdiff))
        self.assertGreater(diff, 1e4 * F64_TOL)
        self.assertGreater(gdiff, 100 * F32_REL)

    def test_window_sums_are_the_sums_over_ranks_and_micro_batches(self):
        """Every window's own totals, also where window_sums() is read at
        is_step() with the reductions still in flight (overlap_step=True:
        it must wait for them, or it would raise in window 0 and hand each
        later window the previous one's totals)."""
        for world in (2, 3):
            for label, shard, kw in [("unsharded", None, {})] + OVERLAP_MODES:
                out = weighted_run(world, torch.float64, shard, **kw)
                wrong = []  # every window's, so that a lag shows as one
                for w in range(WINDOWS):
                    want = [sum(o["added"][w][i] for o in out) for i in range(4)]
                    tokens = tokens_of(world, w)
                    self.assertEqual(want[1], tokens)
                    say("%d ranks %s window %d: window_sums %s (loss %.12g expected)" % (
                        world, label, w, out[0]["sums"][w], want[0]))
                    for r, o in enumerate(out):
                        s = o["sums"][w]
                        if "error" in s or not (
                                s["weight"] == tokens and s["tokens"] == tokens and
                                abs(s["loss"] - want[0]) <= 1e-8 * max(1, want[0]) and
                                s["found_inf"] == (1 if w == 1 else 0) and
                                s["metric"] == MICRO * sum(range(1, world + 1))):
                            wrong.append("rank %d window %d: %s, not weight = tokens = %d, "
                                         "loss %.12g" % (r, w, s, tokens, want[0]))
                if wrong:
                    self.fail("%d ranks %s: window_sums() of %d rank-windows wrong:\n%s"
                              % (world, label, len(wrong), "\n".join(wrong)))
                # the windows' counts differ, so a window's sums read as the
                # one before's cannot pass
                self.assertEqual(len({tokens_of(world, w) for w in range(WINDOWS)}), WINDOWS)


class LargeTotals(unittest.TestCase):
    """Totals near the codec's bounds, end to end (3 ranks): each rank's
    window weight 2^51 - 1 - r (a count whose limbs are all ones: every
    digit at its largest, so that the sum of 3 ranks' digits needs the
    headroom of ceil(log2 3) bits, and the global total 3 * 2^51 - 6 needs
    all of the codec's T bits), a loss slot of all-ones fraction bits
    (2^18 - 2^-32 per rank) and a negative metric (two's complement: its
    high limbs all ones), on a float32 wire (22-bit digits), a bf16 wire
    (6-bit) and a float16 wire (9-bit). The totals must be exact (float64
    ==), the gradients the plain sums / that total."""

    WEIGHT = 2.0 ** 51 - 1
    FRACTION = 2.0 ** 18 - 2.0 ** -32

    def window(self, wire):
        world = 3

        def fn(r, name):
            model = make_model(torch.float32)
            kw = {} if wire is None else {"wire_dtype": wire}
            sync, _ = attach(model, r, world, name, **kw)
            try:
                left = self.WEIGHT - r
                for m in range(MICRO):
                    loss, tokens = loss_sum(sync, *batch(r, 0, m))
                    n = left if m == MICRO - 1 else int(tokens)  # the last: the rest
                    left -= n
                    sync.weigh(n)
                    sync.add_window_sums(loss=self.FRACTION if m == 0 else 0.0, tokens=n,
                                         metric=-self.FRACTION * (r + 1) if m == 1 else 0.0)
                    loss.backward()
                assert sync.is_step() and left == 0
                return sync.window_sums(), [p.grad.detach().double().clone()
                                            for p in model.parameters()]
            finally:
                sync.close()
        return run_ranks(world, fn)

    def test_totals_near_the_bounds_are_exact_3_ranks(self):
        total = 3 * self.WEIGHT - 3  # (2^51 - 1) + (2^51 - 2) + (2^51 - 3)
        self.assertEqual(total, 3 * 2 ** 51 - 6)  # (float64 holds it exactly)
        model = make_model(torch.float32).double()
        plain = [torch.zeros_like(p) for p in model.parameters()]
        for ids, labels in window_data(3, 0):
            model.zero_grad(set_to_none=True)
            loss_sum(model, ids, labels)[0].backward()
            for acc, p in zip(plain, model.parameters()):
                acc += p.grad
        want = {"weight": total, "tokens": total, "loss": 3 * self.FRACTION, "found_inf": 0.0,
                "metric": -6 * self.FRACTION}
        for wire, rel_tol in ((None, F32_REL), ("bfloat16", BF16_REL), ("float16", BF16_REL)):
            ref = [g / total for g in plain]
            for r, (sums, grads) in enumerate(self.window(wire)):
                rel = max_diff(grads, ref) / largest(ref)
                if r == 0:
                    say("large totals, 3 ranks, %s wire: window_sums %r (want %r), gradients "
                        "within %.3g of the largest of sums / total" % (
                            wire or "float32", sums, want, rel))
                self.assertEqual(sums, want, "%s wire, rank %d" % (wire or "float32", r))
                self.assertLessEqual(rel, rel_tol, "%s wire, rank %d" % (wire or "float32", r))


class Refusals(unittest.TestCase):
    def zero_weight_run(self, shard):
        """Window 0 weighted, window 1 of weight 0 on every rank, window 2
        weighted; no step (the weights stay): per window the gradients or
        the error."""
        world = 2

        def fn(r, name):
            model = make_model()
            kw = dict(shard_optimizer=True, shard_layout=shard) if shard else {}
            sync, _ = attach(model, r, world, name, **kw)
            if shard:
                opt = sync.optimizer(torch.optim.SGD, model.parameters(), lr=0.0)
            rec = []
            try:
                for w in range(3):
                    error = None
                    for m in range(MICRO):
                        loss, tokens = loss_sum(sync, *batch(r, w, m))
                        sync.weigh(0 if w == 1 else tokens)
                        try:
                            loss.backward()
                        except sfsync.InvalidStateError as e:
                            error = e
                    grads = [p.grad.detach().clone() if p.grad is not None else None
                             for p in model.parameters()]
                    rec.append((error, sync.is_step(), grads, sync.windows,
                                sync.stats()["windows_completed"]))
                    if shard and sync.is_step():
                        opt.step()
                    sync.zero_grad()
                return rec
            finally:
                sync.close()
        return run_ranks(world, fn)

    def test_zero_weight_is_the_named_error_on_every_rank(self):
        for shard in (None, "flat"):
            out = self.zero_weight_run(shard)
            model = make_model()
            for r, rec in enumerate(out):
                say("zero weight (%s) rank %d: %s; windows %s, plugin windows_completed %s" % (
                    shard or "unsharded", r, rec[1][0], [x[3] for x in rec],
                    [x[4] for x in rec]))
                self.assertIsNone(rec[0][0])
                self.assertIsInstance(rec[1][0], sfsync.InvalidStateError, "rank %d" % r)
                # (the library numbers windows from 1: the second window is its window 2)
                self.assertRegex(rec[1][0].message, r"window 2: the global window weight is 0")
                self.assertFalse(rec[1][1], "is_step() after a refused window")
                self.assertTrue(rec[0][1] and rec[2][1])
                self.assertEqual([x[3] for x in rec], [x[4] for x in rec],
                                 "sync.windows and the plugin's count disagree")
                for w in (0, 2):  # the windows around it: the token mean
                    ref = reference_grads(make_model(), 2, w)
                    self.assertLessEqual(max_diff(rec[w][2], ref), F64_TOL,
                                         "rank %d window %d after a zero-weight window" % (r, w))
                if not shard:  # left as the plain sums, not divided by 0
                    plain = [torch.zeros_like(p) for p in model.parameters()]
                    for ids, labels in window_data(2, 1):
                        model.zero_grad(set_to_none=True)
                        loss_sum(model, ids, labels)[0].backward()
                        for acc, p in zip(plain, model.parameters()):
                            acc += p.grad
                    self.assertLessEqual(max_diff(rec[1][2], plain), 1e-9 * largest(plain))

    def test_late_weight_names_the_bucket_and_is_not_added(self):
        world = 2
        late_errors, hook_weight = [[] for _ in range(world)], 5.0

        def fn(r, name):
            model = make_model()
            sync, _ = attach(model, r, world, name)
            try:
                for m in range(MICRO):
                    loss, tokens = loss_sum(sync, *batch(r, 0, m))
                    sync.weigh(tokens)

                    def weigh_in_backward(grad):
                        # the embedding's gradient comes last in the backward:
                        # the head's bucket has started reducing in the last pass
                        try:
                            sync.weigh(hook_weight)
                        except sfsync.InvalidStateError as e:
                            late_errors[r].append((m, e))
                        return grad
                    handle = model.emb.weight.register_hook(weigh_in_backward)
                    loss.backward()
                    handle.remove()
                return sync.window_sums(), [p.grad.clone() for p in model.parameters()]
            finally:
                sync.close()
        out = run_ranks(world, fn)
        tokens = tokens_of(world, 0)
        on_time = world * (MICRO - 1) * hook_weight  # the hooks of passes 1..MICRO-1
        plain = [g * tokens for g in reference_grads(make_model(), world, 0)]  # the sums
        for r, (sums, grads) in enumerate(out):
            self.assertEqual([m for m, _ in late_errors[r]], [MICRO - 1],
                             "only the last pass's weight is late")
            e = late_errors[r][0][1]
            say("late weight, rank %d: %s" % (r, e))
            self.assertRegex(e.message, r"^sf_add_window_weight: bucket 0 of window 1 has started "
                             r"reducing")
            self.assertEqual(sums["weight"], tokens + on_time)
            want = [g / (tokens + on_time) for g in plain]
            self.assertLessEqual(max_diff(grads, want), F64_TOL)

    def test_bf16_wire_within_tolerance_and_the_weight_exact(self):
        """float32 model, bf16 wire, no step (every window at the initial
        weights): each window's gradients within BF16_REL of the largest, and
        their least-squares scale against the reference within BF16_SCALE
        of 1, which a weight rounded to bf16 would miss (a window whose token
        count is no bf16 value is required)."""
        rounded = 0
        for world in (2, 3):
            out = weighted_run(world, torch.float32, wire_dtype="bfloat16", step=False)
            ref0 = make_model(torch.float32).double()
            for w in range(WINDOWS):
                tokens = tokens_of(world, w)
                off = abs(float(torch.tensor(float(tokens)).bfloat16()) / tokens - 1)
                rounded += off > 2 * BF16_SCALE
                ref = reference_grads(ref0, world, w)
                got = out[0]["grads"][w]
                rel = max_diff(got, ref) / largest(ref)
                dot = sum(float((a * b).sum()) for a, b in zip(got, ref))
                scale = dot / sum(float((b * b).sum()) for b in ref)
                say("bf16 wire, %d ranks, window %d: gradients within %.3g of the largest (tol "
                    "%.3g), least-squares scale vs the reference %.6f (tol %g; %d tokens rounded "
                    "to bf16 would be %.2g off), weight %s" % (
                        world, w, rel, BF16_REL, scale, BF16_SCALE, tokens, off,
                        out[0]["sums"][w]["weight"]))
                self.assertLessEqual(rel, BF16_REL)
                self.assertLessEqual(abs(scale - 1), BF16_SCALE)
                self.assertEqual(out[0]["sums"][w]["weight"], tokens)
        self.assertGreater(rounded, 0, "every window's token count is a bf16 value (or near "
                           "one): a weight rounded to bf16 would pass")

    def test_accumulate_dtype_float32_on_a_bf16_model(self):
        world = 2

        def fn(r, name):
            model = make_model(torch.bfloat16)
            sync, _ = attach(model, r, world, name, accumulate_dtype=torch.float32)
            try:
                for m in range(MICRO):
                    loss, tokens = loss_sum(sync, *batch(r, 0, m))
                    sync.weigh(tokens)
                    loss.float().backward()
                return [a.clone() for a in sync.accumulated_grads()]
            finally:
                sync.close()
        out = run_ranks(world, fn)
        # bf16 gradients of each micro-batch, summed in float32, / the tokens
        model = make_model(torch.bfloat16)
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
        for ids, labels in window_data(world, 0):
            model.zero_grad(set_to_none=True)
            loss_sum(model, ids, labels)[0].float().backward()
            for s, p in zip(sums, model.parameters()):
                s += p.grad.float()
        ref = [s / tokens_of(world, 0) for s in sums]
        rel = max_diff(out[0], ref) / largest(ref)
        say("accumulate_dtype=float32, bf16 model, 2 ranks: float32 sums within %.3g of the "
            "largest" % rel)
        self.assertLessEqual(rel, F32_REL)
        self.assertEqual(out[0][0].dtype, torch.float32)

    def test_world_one_divides_by_its_own_weight(self):
        out = run_ranks(1, lambda r, name: train(r, 1, name, how="reduce_op"))
        ref, _ = reference_weights(1)
        diff = max_diff(out[0]["weights"], ref)
        say("world 1: max |w - w_ref| = %.3g" % diff)
        self.assertLessEqual(diff, F64_TOL)
        self.assertEqual(out[0]["sums"][0]["weight"], tokens_of(1, 0))

    def test_a_context_of_the_callers(self):
        out = run_ranks(2, lambda r, name: train(r, 2, name, how="context"))
        ref, _ = reference_weights(2)
        self.assertLessEqual(max_diff(out[0]["weights"], ref), F64_TOL)

    def test_option_and_method_errors(self):
        model = make_model()
        with self.assertRaisesRegex(ValueError, r"reduce='weighted' and reduce_op='sum' "
                                    r"disagree"):
            sft.GradientSync(model, rank=0, world_size=1, rendezvous="", reduce="weighted",
                             reduce_op="sum")
        with self.assertRaisesRegex(ValueError, r"reduce='mean' is not one of"):
            sft.GradientSync(model, rank=0, world_size=1, rendezvous="", reduce="mean")
        with sfsync.Context(rank=0, world_size=1, rendezvous="") as ctx:
            with self.assertRaisesRegex(ValueError, r"has reduce_op average"):
                sft.GradientSync(model, context=ctx, reduce="weighted")
        with sft.GradientSync(model, rank=0, world_size=1, rendezvous="") as sync:
            self.assertEqual(sync.reduce, "average")
            with self.assertRaises(sfsync.InvalidStateError) as cm:
                sync.weigh(3)
            self.assertIn("sf_add_window_weight", cm.exception.message)
            say("weigh() on an averaging GradientSync: %s" % cm.exception)
        with sft.GradientSync(model, rank=0, world_size=1, rendezvous="",
                              reduce="weighted") as sync:
            self.assertEqual(sync.reduce, "weighted")
            with self.assertRaises(sfsync.InvalidStateError):
                sync.window_sums()  # no window yet
            with self.assertRaisesRegex(sfsync.InvalidArgumentError, r"-2"):
                sync.weigh(-2)
            with self.assertRaises(sfsync.InvalidArgumentError):
                sync.weigh(math.nan)
            with self.assertRaisesRegex(ValueError, r"2 elements"):
                sync.weigh(torch.tensor([1.0, 2.0]))
            with self.assertRaisesRegex(TypeError, r"not str"):
                sync.weigh("3")
            with self.assertRaises(sfsync.InvalidArgumentError):
                sync.add_window_sums(loss=math.inf)
            sync.weigh(torch.tensor([2]))
            sync.add_window_sums(metric=torch.tensor(1.5))  # slots before it: 0
            loss, tokens = loss_sum(sync, *batch(0, 0, 0))
            loss.backward()  # (accumulation_steps None: every pass synchronizes)
            sums = sync.window_sums()
            self.assertEqual(sums, {"weight": 2.0, "loss": 0.0, "tokens": 0.0,
                                    "found_inf": 0.0, "metric": 1.5})
        self.assertEqual(sfsync.options(reduce_op="weighted").reduce_op, sfsync.REDUCE_WEIGHTED)
        self.assertEqual(sfsync.options(wire_dtype="bf16").wire_dtype, sfsync.DTYPE_BFLOAT16)
        with self.assertRaisesRegex(sfsync.InvalidArgumentError, r"wire_dtype = 'int8'"):
            sfsync.options(wire_dtype="int8")


if __name__ == "__main__":
    unittest.main()
