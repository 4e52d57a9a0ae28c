"""The weighted-window recipes of the Accelerate and Lightning integration
docstrings (issue 31; sfsync/torch/integrations/accelerate.py and
lightning.py), run as a user writes them, against a one-process token-mean
reference; 2 ranks on gloo under torchrun, one launch for both frameworks:

    accelerate  prepare_model(accelerator, model, reduce="weighted") and the
                docstring's accelerator.accumulate() loop (sum loss, weigh,
                add_window_sums, backward of loss * gradient_accumulation_steps,
                clip_grad_norm_ 1.0, window_sums)
    lightning   SfsyncStrategy(reduce="weighted") and the docstring's
                training_step (returns loss * accumulate_grad_batches) and
                on_before_optimizer_step (window_sums, self.log)

A tiny causal LM built in code (embedding, one causal attention block, LM
head; it returns the logits, as the recipes' ``model(input_ids)`` takes
them) on 28 sequences of 2..16 tokens right-padded, labels the next token
(already shifted, as the recipes' loss takes them) and -100 on the padding
and the last real position. Batch 2 per rank, N = 3, one epoch: 7 batches
per rank, windows 3, 3, 1 (the short last window both frameworks cut).
The test adds only recording lines, marked "(test)", to the recipes: each
micro-batch's batch, and at the window's end (before the clip and the step)
the weights, .grad and window_sums(), and .grad after the clip; it checks
first that every line of each docstring's recipe is a line of its code here.

Reference, per window, in float64 on one process: the recorded weights,
every rank's micro-batches of the window as one batch, loss = the sum of
per-token cross entropies / the window's tokens. Judged per framework and
window: the float32 .grad within 1e-5 of the largest reference gradient;
window_sums()["tokens"] and ["weight"] the window's global token count
exactly, loss / tokens the reference loss (1e-5 relative); ranks identical;
the windows 3, 3, 1; the plugin issued one collective per bucket per window
(nothing added for the counts); .grad after Accelerate's clip (1.0; it
clips the short window, norm 1.48) is the reference's clipped by the
reference's norm (1e-5 of the largest); Lightning's logged train_loss is
the last window's (float32). And plain per-micro-batch averaging on the
same data (the mean over ranks and micro-batches of each micro-batch's
token mean) is off the reference by more than 100x the tolerance in every
window (printed: 0.1..0.9 of the largest gradient), so a recipe that
averages fails. About 15 s idle, 21 s on 2 loaded cores.
"""

import inspect
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

from accelerate import Accelerator  # noqa: E402
import lightning  # noqa: E402

import sfsync.torch.integrations.accelerate as sf_accelerate  # noqa: E402
import sfsync.torch.integrations.lightning as sf_lightning  # noqa: E402
from sfsync.torch.integrations.accelerate import prepare_model  # noqa: E402
from sfsync.torch.integrations.lightning import SfsyncStrategy  # noqa: E402

N, BATCH, SAMPLES, LR, SEQ, VOCAB, DIM = 3, 2, 28, 1e-3, 16, 64, 32
GRAD_REL, LOSS_REL = 1e-5, 1e-5
WINDOWS = [3, 3, 1]

warnings.filterwarnings("ignore")


class TinyLM(torch.nn.Module):
    """Token and position embeddings, one causal self-attention block with
    an MLP, an LM head: (B, T) ids -> (B, T, VOCAB) logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Embedding(SEQ, DIM)
        self.norm1 = torch.nn.LayerNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.norm2 = torch.nn.LayerNorm(DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(),
                                       torch.nn.Linear(2 * DIM, DIM))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


class Data(torch.utils.data.Dataset):
    """Sequences of 2..SEQ tokens, right-padded with 0; labels[t] = ids[t+1]
    on the real positions but the last, -100 elsewhere (1..SEQ-1 tokens)."""

    def __init__(self):
        # seed 2: in every window of both frameworks (Accelerate hands out
        # whole batches in turn, Lightning's DistributedSampler shuffles with
        # seed 0) the micro-batches carry different token counts, so plain
        # averaging is off in every window (seed 1: 16 and 16 in Lightning's
        # last window, where the two agree)
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(1, VOCAB, (SAMPLES, SEQ), generator=g)
        self.lengths = torch.randint(2, SEQ + 1, (SAMPLES,), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        real = torch.arange(SEQ) < self.lengths[i]
        ids = self.ids[i].masked_fill(~real, 0)
        labels = torch.full((SEQ,), -100, dtype=torch.long)
        n = int(self.lengths[i])
        labels[:n - 1] = ids[1:n]
        return {"input_ids": ids, "labels": labels}


def make_loader():
    return torch.utils.data.DataLoader(Data(), batch_size=BATCH, shuffle=False)


class Record:
    """What the run saw: each window's micro-batches (this rank's), and at
    its end the weights and .grad (float64 copies), window_sums(), .grad
    after the clip."""

    def __init__(self):
        self.batches, self.current = [], []
        self.weights, self.grads, self.sums, self.clipped = [], [], [], []

    def micro(self, batch):
        self.current.append((batch["input_ids"].detach().clone(),
                             batch["labels"].detach().clone()))

    def window(self, module, sums):
        self.batches.append(self.current)
        self.current = []
        self.weights.append([p.detach().double().clone() for p in module.parameters()])
        self.grads.append([p.grad.detach().double().clone() for p in module.parameters()])
        self.sums.append(dict(sums))


# -- the Accelerate recipe (accelerate.py's docstring; the test's lines marked)

def run_accelerate():
    rec = Record()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=N)
    model = TinyLM()
    loader = make_loader()
    model = prepare_model(accelerator, model, reduce="weighted")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer, loader = accelerator.prepare(optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                   ignore_index=-100, reduction="sum")
            tokens = (batch["labels"] != -100).sum()
            model.sync.weigh(tokens)                       # before its backward
            model.sync.add_window_sums(loss=loss, tokens=tokens)
            # Accelerate divides the loss by gradient_accumulation_steps: undo it
            accelerator.backward(loss * accelerator.gradient_accumulation_steps)
            rec.micro(batch)                                                  # (test)
            if accelerator.sync_gradients:                 # .grad: the window's token mean
                rec.window(model.module, model.sync.window_sums())           # (test)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                rec.clipped.append([p.grad.detach().double().clone()         # (test)
                                    for p in model.module.parameters()])
                sums = model.sync.window_sums()            # every rank's, summed: no gather
                mean_loss = sums["loss"] / sums["tokens"]
                rec.sums[-1]["mean_loss"] = mean_loss                         # (test)
            optimizer.step()
            optimizer.zero_grad()
    rec.stats = model.sync.stats()
    rec.sync_windows = model.sync.windows
    model.sync.close()
    return rec


# -- the Lightning recipe (lightning.py's docstring; the test's lines marked)

class LitLM(lightning.LightningModule):
    def __init__(self, rec):
        super().__init__()
        self.net = TinyLM()
        self.rec = rec

    def forward(self, ids):
        return self.net(ids)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def training_step(self, batch, batch_idx):
        sync = self.trainer.strategy.sync
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=-100, reduction="sum")
        tokens = (batch["labels"] != -100).sum()
        sync.weigh(tokens)                                 # before its backward
        sync.add_window_sums(loss=loss, tokens=tokens)
        self.rec.micro(batch)                                                 # (test)
        # Lightning divides the loss by accumulate_grad_batches: undo it
        return loss * self.trainer.accumulate_grad_batches

    def on_before_optimizer_step(self, optimizer):         # the window synchronized
        sums = self.trainer.strategy.sync.window_sums()    # every rank's, summed
        self.log("train_loss", sums["loss"] / sums["tokens"])  # no sync_dist needed
        self.rec.window(self.net, sums)                                       # (test)
        self.rec.sums[-1]["mean_loss"] = sums["loss"] / sums["tokens"]        # (test)

    def on_train_end(self):                                                   # (test)
        sync = self.trainer.strategy.sync
        self.rec.stats, self.rec.sync_windows = sync.stats(), sync.windows


def run_lightning():
    rec = Record()
    trainer = lightning.Trainer(accelerator="cpu", devices=C.WORLD,
                                strategy=SfsyncStrategy(reduce="weighted"),
                                max_epochs=1, accumulate_grad_batches=N, gradient_clip_val=1.0,
                                logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                num_sanity_val_steps=0)
    trainer.fit(LitLM(rec), make_loader())
    rec.logged = float(trainer.callback_metrics["train_loss"])
    return rec


# -- the reference and the checks

def recipe_lines(module):
    """The lines of ``module``'s weighted-window recipe: the literal block
    after "Per-token loss over the whole window" in its docstring."""
    doc = module.__doc__
    start = doc.index("::\n\n", doc.index("Per-token loss over the whole window")) + 3
    lines = []
    for line in doc[start:].split("\n"):
        if line.strip() and not line.startswith("    "):
            break
        if line.strip():
            lines.append(line.strip())
    return lines


def runs_the_recipe(checks, name, module, code):
    """Every line of the docstring's recipe is a line of the test's ``code``
    (the test adds only its recording lines)."""
    mine = {line.strip() for line in inspect.getsource(code).split("\n")}
    missing = [line for line in recipe_lines(module) if line not in mine]
    checks.that(not missing, "%s: the test runs the docstring's %d recipe lines%s" % (
        name, len(recipe_lines(module)), " (missing: %s)" % missing if missing else ""))


def reference(weights, batches):
    """(loss, grads, norm) of the token mean over ``batches`` as one batch,
    and the grads of plain per-micro-batch averaging (the mean of each
    batch's token-mean gradients), in float64 at ``weights``."""
    model = TinyLM().double()
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)

    def grads_of(ids, labels):
        model.zero_grad()
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                               reduction="sum") / (labels != -100).sum()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    loss, grads = grads_of(torch.cat([b[0] for b in batches]),
                           torch.cat([b[1] for b in batches]))
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                 for g in grads])).item()
    each = [grads_of(ids, labels)[1] for ids, labels in batches]
    plain = [sum(gs) / len(each) for gs in zip(*each)]
    return loss, grads, norm, plain


def clipped(grads, norm, max_norm=1.0):
    """torch.nn.utils.clip_grad_norm_'s result on ``grads`` of total ``norm``."""
    return [g * min(1.0, max_norm / (norm + 1e-6)) for g in grads]


def gap(a, b):
    """max |a - b| / the largest |b|."""
    return (max(float((x - y).abs().max()) for x, y in zip(a, b)) /
            max(float(y.abs().max()) for y in b))


def judge(checks, name, rec):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rec.batches)
    lengths = [len(w) for w in rec.batches]
    checks.that(lengths == WINDOWS and all([len(w) for w in r] == lengths for r in everyone),
                "%s: windows %s on every rank (want %s)" % (name, lengths, WINDOWS))
    gaps, plain_gaps, loss_gaps, clip_gaps = [], [], [], []
    for w in range(min(len(rec.batches), len(WINDOWS))):
        batches = [b for r in everyone for b in r[w]]  # every rank's micro-batches
        tokens = sum(int((labels != -100).sum()) for _, labels in batches)
        loss, grads, norm, plain = reference(rec.weights[w], batches)
        sums = rec.sums[w]
        gaps.append(gap(rec.grads[w], grads))
        plain_gaps.append(gap(plain, grads))
        loss_gaps.append(abs(sums["mean_loss"] - loss) / abs(loss))
        C.say("%s: window %d (%d micro-batches x %d ranks, %d tokens): .grad %.3g of the largest "
              "from the reference (tol %g), plain per-micro-batch averaging %.3g; window_sums "
              "tokens %g weight %g, loss/tokens %.10g (reference %.10g)%s" % (
                  name, w + 1, len(rec.batches[w]), len(everyone), tokens, gaps[-1], GRAD_REL,
                  plain_gaps[-1], sums["tokens"], sums["weight"], sums["mean_loss"], loss,
                  "; reference norm %.10g, .grad after the clip %.3g from the reference's "
                  "clipped" % (norm, gap(rec.clipped[w], clipped(grads, norm)))
                  if rec.clipped else ""))
        checks.that(sums["tokens"] == tokens and sums["weight"] == tokens,
                    "%s: window %d: window_sums() tokens %g, weight %g = the global count %d"
                    % (name, w + 1, sums["tokens"], sums["weight"], tokens))
        if rec.clipped:
            clip_gaps.append(gap(rec.clipped[w], clipped(grads, norm)))
    checks.that(len(gaps) == len(WINDOWS) and max(gaps) <= GRAD_REL,
                "%s: every window's .grad within %g of the largest reference gradient (%s)"
                % (name, GRAD_REL, " ".join("%.3g" % g for g in gaps)))
    checks.that(min(plain_gaps) > 100 * GRAD_REL,
                "%s: plain per-micro-batch averaging differs on the same data (%s, > %g)"
                % (name, " ".join("%.3g" % g for g in plain_gaps), 100 * GRAD_REL))
    checks.that(max(loss_gaps) <= LOSS_REL,
                "%s: window_sums loss / tokens = the reference loss (%.3g relative)"
                % (name, max(loss_gaps)))
    if rec.clipped:
        checks.that(max(clip_gaps) <= GRAD_REL,
                    "%s: the clip (1.0) clipped by the reference norm: .grad after it within %g "
                    "of the largest (%s)" % (name, GRAD_REL, " ".join("%.3g" % g
                                                                     for g in clip_gaps)))
    if hasattr(rec, "logged"):
        last = rec.sums[-1]["mean_loss"]  # (self.log keeps it as a float32 tensor)
        checks.that(abs(rec.logged - last) <= LOSS_REL * abs(last),
                    "%s: the logged train_loss is the last window's (%.10g, %.10g)"
                    % (name, rec.logged, last))
    spread = C.rank_spread(torch.cat([g.reshape(-1) for ws in rec.grads for g in ws]))
    checks.that(spread == 0.0, "%s: ranks identical (.grad %.3g apart)" % (name, spread))
    st = rec.stats
    checks.that(rec.sync_windows == len(WINDOWS) and
                st["collectives_issued"] == st["bucket_count"] * len(WINDOWS),
                "%s: %d sfsync windows, %d plugin collectives = %d buckets x %d windows "
                "(no count collective)" % (name, rec.sync_windows, st["collectives_issued"],
                                           st["bucket_count"], len(WINDOWS)))


def main():
    checks = C.Checks()
    runs_the_recipe(checks, "accelerate", sf_accelerate, run_accelerate)
    runs_the_recipe(checks, "lightning", sf_lightning, LitLM)
    judge(checks, "accelerate", run_accelerate())
    judge(checks, "lightning", run_lightning())
    checks.finish("test_weighted_recipes")


if __name__ == "__main__":
    main()
