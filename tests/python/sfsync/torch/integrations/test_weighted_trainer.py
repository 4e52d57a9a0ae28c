"""The HF Trainer's per-token loss over whole windows (issue 31): the
integration's weighted windows, ``SfsyncTrainer(sync_options=dict(reduce=
"weighted"))``, against the Trainer's own ``average_tokens_across_devices=
True`` run (DDP), 2 ranks on gloo under torchrun, a tiny GPT-2 built from a
config on variable-length sequences padded with -100 labels:

    exact     transformers.Trainer, model.loss_type = "ForCausalLM": the
              Trainer counts the shifted labels (the exact count)
    default   transformers.Trainer, GPT2LMHeadModel as it comes (loss_type
              None): transformers 5.24 counts the labels before the shift,
              one token too many per sequence
    weighted  SfsyncTrainer(reduce="weighted"), the model as it comes: each
              micro-batch weighs itself with the exact count
    sharded   ... dict(reduce="weighted", shard_optimizer=True)

28 sequences, batch 2 per rank, N = 3, one epoch: windows 3, 3, 1 (the
Trainer's short last window). AdamW lr 1e-3, no clipping (the gradients
are compared as the optimizer gets them). Judged: every window's gradients
of weighted and sharded within 1e-5 of the largest gradient of exact's; the
default count measurably apart (printed); the Trainer's training loss (the
mean over ranks) equal to exact's; ranks identical; collectives per window:
the Trainer's run gathers the counts once per window, the weighted runs
never (accelerator.gather counted), and the plugin issued one collective per
bucket per window; bytes written per window / gradient bytes in
[0.95, 1.10] for the weighted run (windows after the first).

Then the count each micro-batch is weighed by, on packed rows whose batch
carries ``shift_labels`` (-100 at the seam of the two sequences: the
``labels[..., 1:]`` count is one too many per row), per window exactly the
collator's own count summed over ranks (packed_runs):

    shift_labels  dict(reduce="weighted"): the shift_labels count
    count_items   dict(reduce="weighted", count_items=fn, shard_optimizer=True,
                  overlap_step=True): fn's (the attention mask's tokens), and
                  window_sums() read in training_step with the reductions
                  still in flight

and the Trainer's training loss the mean of the windows' loss / tokens.
"""

import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from sfsync.integrations._module import sync_optimizer  # noqa: E402
from sfsync.integrations.transformers import SfsyncTrainer, exact_count  # noqa: E402

N, BATCH, SAMPLES, LR, SEQ, VOCAB = 3, 2, 28, 1e-3, 16, 64
GRAD_REL, LOSS_REL = 1e-5, 1e-5
CAP_MB = 0.05  # a few buckets

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()


def make_model(loss_type=None):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    if loss_type is not None:
        model.loss_type = loss_type
    return model


class Data(torch.utils.data.Dataset):
    """Sequences of 2..SEQ tokens, right-padded; labels -100 on the padding."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, VOCAB, (SAMPLES, SEQ), generator=g)
        self.lengths = torch.randint(2, SEQ + 1, (SAMPLES,), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        real = torch.arange(SEQ) < self.lengths[i]
        return {"input_ids": self.ids[i].masked_fill(~real, 0),
                "attention_mask": real.long(),
                "labels": self.ids[i].masked_fill(~real, -100)}


class Packed(Data):
    """Data as packed sequences carry it (padding-free collators, context
    parallelism): two sequences in one row, so the batch brings its own
    ``shift_labels`` (each position's next-token target) with -100 at the
    seam, where the next token starts the second sequence; the count of
    ``labels[..., 1:]`` is one too many per row."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        labels = item["labels"]
        seam = 1 + i % max(1, int(self.lengths[i]) - 1)  # the second sequence's first token
        shift = torch.cat([labels[1:], labels.new_full((1,), -100)])
        shift[seam - 1] = -100
        return {**item, "shift_labels": shift}


class Counted:
    """The Trainer's data collator (torch's default) that notes each batch's
    counts on this rank, in the order the Trainer takes the batches: the
    reference the weights are checked against, computed apart from
    sfsync."""

    def __init__(self):
        self.batches = []

    def __call__(self, features):
        from transformers import default_data_collator
        batch = default_data_collator(features)
        self.batches.append({
            "shift_labels": int(batch["shift_labels"].ne(-100).sum()),
            "labels[1:]": int(batch["labels"][..., 1:].ne(-100).sum()),
            "attention_mask": int(batch["attention_mask"].sum())})
        return batch

    def per_window(self, lengths, key):
        """The global count of ``key`` per window (summed over ranks)."""
        it = iter(b[key] for b in self.batches)
        local = torch.tensor([float(sum(next(it) for _ in range(n))) for n in lengths],
                             dtype=torch.float64)
        dist.all_reduce(local)
        return local.tolist()


class Sums(TrainerCallback):
    """Per window: window_sums() after the step (valid until the next window
    synchronizes), and the window's micro-batches. Reads no ``.grad``."""

    def __init__(self):
        self.sums, self.lengths, self._micro, self.trainer = [], [], 0, None

    def on_substep_end(self, args, state, control, **kw):
        self._micro += 1

    def on_step_end(self, args, state, control, **kw):
        self.sums.append(self.trainer.sync.window_sums())
        self.lengths.append(self._micro + 1)
        self._micro = 0


def packed_runs(checks, out):
    """The count SfsyncTrainer weighs each micro-batch by, judged exactly
    per window against the collator's own count: ``shift_labels != -100``
    for batches that carry shift_labels (unsharded), and ``count_items=fn``'s
    (here the attention mask's tokens; sharded with overlap_step=True, so
    that training_step reads window_sums() with the reductions in flight).
    The Trainer's training loss must be the mean of the windows' loss /
    tokens (a window_sums() lagging one window would log the one before)."""
    def attended(inputs):
        return int(inputs["attention_mask"].sum())

    for name, key, options in (
            ("shift_labels", "shift_labels", dict(reduce="weighted")),
            ("count_items", "attention_mask", dict(reduce="weighted", count_items=attended,
                                                   shard_optimizer=True, overlap_step=True))):
        counted, sums = Counted(), Sums()
        trainer, _, gathers, loss = train(
            SfsyncTrainer, out, record=sums, data=Packed(), data_collator=counted,
            remove_unused_columns=False,  # (keeps shift_labels, not in forward's signature)
            sync_options=dict(options, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB))
        want = counted.per_window(sums.lengths, key)
        other = counted.per_window(sums.lengths, "labels[1:]")
        weights = [s["weight"] for s in sums.sums]
        tokens = [s["tokens"] for s in sums.sums]
        means = [s["loss"] / s["tokens"] for s in sums.sums]
        logged = sum(means) / len(means)
        C.say("%s: windows %s, window weights %s, tokens %s, the collator's %s count %s "
              "(labels[..., 1:]: %s), training loss %.8g, mean of the windows' loss / tokens "
              "%.8g, count gathers %d" % (name, sums.lengths, weights, tokens, key, want, other,
                                          loss, logged, len(gathers)))
        checks.that(len(weights) == 3 and weights == want and tokens == want,
                    "%s: every window weighed by the %s count (%s)" % (name, key, want))
        checks.that(all(a != b for a, b in zip(want, other)),
                    "%s: the labels[..., 1:] count differs in every window (%s)" % (name, other))
        checks.that(abs(loss - logged) <= LOSS_REL * abs(logged),
                    "%s: the training loss is the windows' own token means (%.8g, %.8g)"
                    % (name, loss, logged))
        checks.that(gathers == [], "%s: no count gather" % name)
        trainer.sync.close()


class Record(TrainerCallback):
    """Per window: the gradients the optimizer gets (float64 copies), the
    plugin's collectives so far, wchar."""

    def __init__(self):
        self.windows = C.Windows()
        self.grads, self.collectives, self.trainer = [], [], None

    def _collectives(self):
        sync = getattr(self.trainer, "sync", None)
        if sync is not None and sync.context is not None:
            self.collectives.append(sync.stats()["collectives_issued"])

    def on_train_begin(self, args, state, control, **kw):
        self.windows.start()
        self._collectives()  # (the GradientSync exists: the Trainer wrapped the model)

    def on_substep_end(self, args, state, control, **kw):
        self.windows.micro()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.windows.micro()
        self.windows.step()
        self.grads.append([p.grad.detach().double().clone() for p in model.parameters()])
        self._collectives()


def train(cls, out, loss_type=None, record=None, data=None, remove_unused_columns=True, **kw):
    record = Record() if record is None else record
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=N, num_train_epochs=1,
                             learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                             weight_decay=0.0, max_grad_norm=0.0, optim="adamw_torch",
                             average_tokens_across_devices=True,
                             logging_strategy="no", save_strategy="no", report_to="none",
                             disable_tqdm=True, use_cpu=True, seed=0, dataloader_num_workers=0,
                             remove_unused_columns=remove_unused_columns)
    trainer = cls(model=make_model(loss_type), args=args,
                  train_dataset=Data() if data is None else data, callbacks=[record], **kw)
    gathers = []
    gather = trainer.accelerator.gather

    def counted(tensor):  # the count gather of average_tokens_across_devices
        gathers.append(tensor.numel())
        return gather(tensor)
    trainer.accelerator.gather = counted
    record.trainer = trainer
    result = trainer.train()
    return trainer, record, gathers, result.training_loss


def rank_mean(value):
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def window_gap(a, b):
    """Per window: max |a - b| / the largest |b|."""
    return [max(float((x - y).abs().max()) for x, y in zip(ga, gb)) /
            max(float(y.abs().max()) for y in gb) for ga, gb in zip(a, b)]


def main():
    checks = C.Checks()
    out = tempfile.mkdtemp(prefix="sfsync-hf-weighted-")
    data = Data()
    shifted = sum(exact_count(data[i], True) for i in range(SAMPLES))
    unshifted = sum(exact_count(data[i], False) for i in range(SAMPLES))
    C.say("tokens in the data set: %d predicted (shifted labels), %d labels (the 5.24 default "
          "count for GPT2LMHeadModel: one more per sequence)" % (shifted, unshifted))
    checks.that(unshifted - shifted == SAMPLES, "one label per sequence is never predicted")

    exact, exact_rec, exact_gathers, exact_loss = train(Trainer, out, loss_type="ForCausalLM")
    checks.that(isinstance(exact.model_wrapped, torch.nn.parallel.DistributedDataParallel),
                "exact: the Trainer wrapped the model in DDP")
    windows = len(exact_rec.grads)
    gbytes = C.grad_bytes(exact.model)
    C.say("exact (the Trainer, average_tokens_across_devices, loss_type ForCausalLM): windows %s, "
          "count gathers %s (elements each), bytes/window / gradient bytes %s" % (
              exact_rec.windows.lengths, exact_gathers,
              " ".join("%.4f" % (b / gbytes) for b in exact_rec.windows.bytes())))
    checks.that(len(exact_gathers) == windows,
                "exact: the Trainer gathered the counts once per window (%d for %d windows)"
                % (len(exact_gathers), windows))
    exact_loss = rank_mean(exact_loss)

    default, default_rec, _, _ = train(Trainer, out)
    gap = window_gap(default_rec.grads, exact_rec.grads)
    C.say("default (the Trainer, GPT2LMHeadModel's loss_type None): window gradients %s of the "
          "largest from the exact count's" % " ".join("%.3g" % g for g in gap))
    checks.that(min(gap) > 100 * GRAD_REL, "the default count is measurably off (%.3g)" % min(gap))

    for name, options in (("weighted", dict(reduce="weighted", bucket_cap_mb=CAP_MB,
                                           first_bucket_cap_mb=CAP_MB)),
                          ("sharded", dict(reduce="weighted", shard_optimizer=True,
                                           bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB))):
        trainer, rec, gathers, loss = train(SfsyncTrainer, out, sync_options=options)
        sync = trainer.sync
        opt = sync_optimizer(sync)
        if opt is not None:
            opt.wait_parameters()
        stats = sync.stats()
        gap = window_gap(rec.grads, exact_rec.grads)
        per_window = [b - a for a, b in zip(rec.collectives, rec.collectives[1:])]
        weights = (C.flat(trainer.model) - C.flat(exact.model)).abs().max().item()
        loss = rank_mean(loss)
        C.say("%s: windows %s, window gradients %s of the largest from exact's (tol %g), "
              "weights after %d steps %.3g apart (float32, not judged), training loss %.8g "
              "(exact's %.8g), count gathers %d, plugin collectives per window %s with %d "
              "buckets, reduce_scatters %d, window_sums %s" % (
                  name, rec.windows.lengths, " ".join("%.3g" % g for g in gap), GRAD_REL,
                  windows, weights, loss, exact_loss, len(gathers), per_window,
                  stats["bucket_count"], stats["reduce_scatters"], sync.window_sums()))
        checks.that(rec.windows.lengths == exact_rec.windows.lengths,
                    "%s: the Trainer's windows (%s)" % (name, rec.windows.lengths))
        checks.that(len(gap) == windows and max(gap) <= GRAD_REL,
                    "%s: every window's gradients within %g of the largest (%.3g)"
                    % (name, GRAD_REL, max(gap)))
        checks.that(abs(loss - exact_loss) <= LOSS_REL * abs(exact_loss),
                    "%s: the training loss is the Trainer's own (%.8g, %.8g)"
                    % (name, loss, exact_loss))
        checks.that(gathers == [], "%s: no count gather (%s)" % (name, gathers))
        checks.that(C.rank_spread(C.flat(trainer.model)) == 0.0, "%s: ranks identical" % name)
        if not options.get("shard_optimizer"):
            checks.that(stats["bucket_count"] > 1 and
                        per_window == [stats["bucket_count"]] * windows,
                        "%s: one collective per bucket per window (%s, %d buckets)"
                        % (name, per_window, stats["bucket_count"]))
            ratios = [b / gbytes for b in rec.windows.bytes()[1:]]
            C.say("%s: bytes/window / gradient bytes %s" % (name, " ".join("%.4f" % r
                                                                          for r in ratios)))
            if C.bytes_judged() is None:
                checks.that(all(0.95 <= r <= 1.10 for r in ratios),
                            "%s: bytes per window 1x the gradients" % name)
        else:
            checks.that(opt is not None and stats["reduce_scatters"] > 0 and
                        trainer.optimizer.optimizer is opt,
                        "%s: the Trainer steps sfsync's sharded optimizer" % name)
        checks.that(sync.windows == windows, "%s: %d sfsync windows" % (name, sync.windows))
        sync.close()
    packed_runs(checks, out)
    checks.finish("test_weighted_trainer")


if __name__ == "__main__":
    main()
