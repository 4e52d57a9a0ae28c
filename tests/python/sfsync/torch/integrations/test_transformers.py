"""The HF ``Trainer(gradient_accumulation_steps=N, max_grad_norm=...)`` with
sfsync (sfsync.integrations.transformers.SfsyncTrainer) against the plain
Trainer, whose Accelerator wraps the model in DDP, 2 ranks on gloo, one
torchrun launch, several trainings of a tiny GPT-2 built from a config:

    ddp       transformers.Trainer
    sfsync    SfsyncTrainer(sync_options=dict(verify_every=1))
    sharded   SfsyncTrainer(sync_options=dict(shard_optimizer=True, verify_every=2)):
              the Trainer's AdamW (optim="adamw_torch") rebuilt sharded, the
              clip through its global clip_grad_norm_
    sharded-overlap  ... dict(shard_optimizer=True, overlap_step=True): no
              gradient gather
    sharded-parameter  ... dict(shard_optimizer=True, shard_layout="parameter"),
              with the byte counter's on_pre_optimizer_step callback: a reader
              the Trainer does not own, so the gradient gather stays (1.5x)
    sharded-owned  the same with a counter that marks windows at on_step_end
              only: nothing but sfsync reads .grad, so no gradient gather
              (1x) and the clip from the owned whole gradients: the weights
              bitwise sharded-parameter's
    bf16      SfsyncTrainer(sync_options=dict(wire_dtype=bf16))
    attach    SfsyncTrainer(sync_options=dict(keep_ddp=True, verify_every=1)): the
              Trainer's DDP kept, sfsync.torch.attach on it

30 sequences, batch 2 per rank, N = 3, 2 epochs: 8 batches per rank and
epoch (the last of 1), windows 3, 3, 2 (the Trainer's short last window),
twice. AdamW lr 1e-3, constant schedule, max_grad_norm 0.5. Judged per case:
final weights vs DDP's (1e-6; bf16: 2 lr steps and the update within 5 %
of DDP's), ranks identical, bytes written per window / gradient bytes in
[0.95, 1.10] (bf16 [0.45, 0.60], sharded see SHARDED) for every window but the first, the
windows DDP had.
"""

import os
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

import sfsync  # noqa: E402
from sfsync.integrations._module import sync_optimizer  # noqa: E402
from sfsync.integrations.transformers import SfsyncTrainer  # noqa: E402

# FW_CLIP=x sets max_grad_norm (0: no clipping: sharded-overlap is then 0 off DDP too)
N, BATCH, SAMPLES, EPOCHS, LR, SEQ = 3, 2, 30, 2, 1e-3, 16
CLIP = float(os.environ.get("FW_CLIP", 0.5))
STEPS = C.STEPS
BF16_TOL, BF16_REL = C.bf16_tol(LR), C.BF16_REL
SHARDED, OVERLAP_TOL = C.SHARDED, C.OVERLAP_TOL

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()


def make_model():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (SAMPLES, SEQ), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Windows(TrainerCallback):
    """The micro-batch count and the window marks the counters share."""

    def __init__(self):
        self.windows = C.Windows()

    def on_train_begin(self, args, state, control, **kw):
        self.windows.start()

    def on_substep_end(self, args, state, control, **kw):
        self.windows.micro()


class Bytes(_Windows):
    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.windows.micro()
        self.windows.step()


class StepEndBytes(_Windows):
    """Bytes's windows marked after the step (no hook between the window's
    last backward and the step: the Trainer owns every .grad reader)."""

    def on_step_end(self, args, state, control, **kw):
        # a sharded model's parameters() waits for the gathers in flight: the
        # mark then follows the window's parameter gather (it would race it)
        list(kw["model"].parameters())
        self.windows.micro()
        self.windows.step()


def train(cls, out, counter_class=Bytes, **kw):
    counter = counter_class()
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=N, num_train_epochs=EPOCHS,
                             learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                             weight_decay=0.0, max_grad_norm=CLIP, optim="adamw_torch",
                             logging_strategy="no", save_strategy="no", report_to="none",
                             disable_tqdm=True, use_cpu=True, seed=0,
                             dataloader_num_workers=0)
    trainer = cls(model=make_model(), args=args, train_dataset=Data(), callbacks=[counter],
                  **kw)
    trainer.train()
    return trainer, counter.windows


def main():
    checks = C.Checks()
    C.check_refusal(checks, "SfsyncTrainer",
                    lambda: SfsyncTrainer(sync_options=dict(accumulation_steps=N)),
                    "SfsyncTrainer: accumulation_steps is the Trainer's "
                    "(TrainingArguments(gradient_accumulation_steps=N))")
    out = tempfile.mkdtemp(prefix="sfsync-hf-")
    trainer, ref_windows = train(Trainer, out)
    checks.that(isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel),
                "reference: the Trainer wrapped the model in DDP")
    ref = C.flat(trainer.model)
    gbytes = C.grad_bytes(trainer.model)
    cases = [("sfsync", dict(verify_every=1), 1e-6, (0.95, 1.10)),
             ("sharded", dict(shard_optimizer=True, verify_every=2), 1e-6, SHARDED),
             ("sharded-overlap", dict(shard_optimizer=True, overlap_step=True), OVERLAP_TOL,
              (0.95, 1.10)),
             ("sharded-parameter", dict(shard_optimizer=True, shard_layout="parameter"), 1e-6,
              SHARDED),
             ("sharded-owned", dict(shard_optimizer=True, shard_layout="parameter"), 1e-6,
              (0.95, 1.10)),
             ("bf16", dict(wire_dtype=sfsync.DTYPE_BFLOAT16, verify_every=3), BF16_TOL,
              (0.45, 0.60)),
             ("attach", dict(keep_ddp=True, verify_every=1), 1e-6, (0.95, 1.10))]
    weights = {}
    for name, options, tol, ratio in C.selected(cases):
        trainer, windows = train(SfsyncTrainer, out, sync_options=options,
                                 counter_class=StepEndBytes if name == "sharded-owned" else Bytes)
        sync = trainer.sync
        if options.get("keep_ddp"):
            checks.that(isinstance(trainer.model_wrapped,
                                   torch.nn.parallel.DistributedDataParallel) and
                        sync.ddp is trainer.model_wrapped,
                        "%s: sfsync attached to the Trainer's DDP" % name)
        opt = sync_optimizer(sync)
        if opt is not None:
            opt.wait_parameters()
        if options.get("keep_ddp"):  # DDPSync counts the buckets its hook saw
            C.say("%s: comm hook buckets reduced %d, kept local %d" % (
                name, sync.reduced_buckets, sync.deferred_buckets))
            stats = dict(windows_completed=sync.windows, collectives_issued=-1,
                         reduce_scatters=0, bytes_reduced=-1)
        else:
            stats = sync.stats()
        bf16 = "wire_dtype" in options
        C.report(checks, name, C.flat(trainer.model), ref, windows, ref_windows, gbytes, tol,
                 ratio, skip_first=True, init=C.flat(make_model()) if bf16 else None,
                 rel_tol=BF16_REL if bf16 else None)
        checks.that(sync.windows == len(ref_windows.lengths),
                    "%s: %d sfsync windows (DDP steps %d), optimizer %s" % (
                        name, sync.windows, len(ref_windows.lengths),
                        type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__))
        C.say("%s: plugin stats windows_completed %d, collectives %d, reduce_scatters %d, "
              "bytes_reduced %d" % (name, stats["windows_completed"],
                                    stats["collectives_issued"], stats["reduce_scatters"],
                                    stats["bytes_reduced"]))
        if options.get("shard_optimizer"):
            checks.that(opt is not None and trainer.optimizer.optimizer is opt and
                        stats["reduce_scatters"] > 0,
                        "%s: the Trainer steps sfsync's sharded optimizer" % name)
        weights[name] = C.flat(trainer.model)
        if name == "sharded-owned":
            # one all-gather per bucket per window: the parameters only
            buckets = stats["bucket_count"]
            checks.that(stats["all_gathers"] == buckets * sync.windows,
                        "%s: %d all-gathers in %d windows of %d buckets (no gradient gather)"
                        % (name, stats["all_gathers"], sync.windows, buckets))
            if "sharded-parameter" in weights:
                checks.that(torch.equal(weights[name], weights["sharded-parameter"]),
                            "%s: weights bitwise those of the gradient-gather run (max diff "
                            "%.3g)" % (name, (weights[name] - weights["sharded-parameter"])
                                       .abs().max().item()))
        sync.close()
    checks.finish("test_transformers")


if __name__ == "__main__":
    main()
