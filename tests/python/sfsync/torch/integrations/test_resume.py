"""Stop and resume through the frameworks' own checkpoints (issue 32), 2
ranks on gloo under torchrun, in two launches (a preempted job's restart is
a new process pair):

    --phase save    for each framework and case: the uninterrupted run (its
                    final weights and window count to DIR), then the same run
                    stopped after its checkpoint
    --phase resume  for each: a new run resumed from that checkpoint the
                    framework's way, finished, compared with the
                    uninterrupted one

The frameworks and the user's loop are untouched: the HF Trainer
(``save_steps``, stopped at step 4 of 6 mid-epoch, ``train(resume_from_checkpoint=...)``),
Lightning (``ModelCheckpoint(save_last=True)``, stopped after epoch 1,
``fit(ckpt_path=...)``), Accelerate (``save_state`` after epoch 1,
``load_state``). Cases: the framework's DDP, sfsync (GradientSync), sfsync
sharded (``shard_optimizer=True``, the optimizer the framework builds rebuilt
sharded; each framework saves it from one rank); the HF Trainer also on a
bf16 model: DDP, sharded (float32 master shards), accumulate_dtype.
Judged: the final weights
equal the uninterrupted run's bitwise (each framework's own DDP resumes
bitwise here, so sfsync must too), the ranks identical, sfsync's window count
(``sync.state_dict()``, saved with the framework's checkpoint) continued.
"""

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

warnings.filterwarnings("ignore")

CASES = [("ddp", None), ("sfsync", dict(verify_every=2)),
         ("sharded", dict(shard_optimizer=True, verify_every=2))]
# The HF Trainer also on a bf16 model: its DDP, sfsync sharded (the float32
# master shards travel in the full form) and unsharded with
# accumulate_dtype=float32. The last one left the uninterrupted run by 7.3e-4
# before store.attach_grads started each window's accumulators from the
# host's .grad (None after the Trainer's zero_grad: from zero); they had kept
# every earlier window's sum.
BF16_CASES = [("ddp-bf16", None), ("sharded-bf16", dict(shard_optimizer=True)),
              ("accumulate-bf16", dict(accumulate_dtype=torch.float32))]


# -- the HF Trainer

def hf_run(out, options, stop=None, resume=None, bf16=False):
    import test_transformers as T
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from sfsync.integrations.transformers import SfsyncTrainer

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if stop is not None and state.global_step == stop:
                control.should_training_stop = True

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=T.BATCH,
                             gradient_accumulation_steps=T.N, num_train_epochs=T.EPOCHS,
                             learning_rate=T.LR, lr_scheduler_type="linear", warmup_steps=1,
                             weight_decay=0.01, max_grad_norm=T.CLIP, optim="adamw_torch",
                             logging_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=True, seed=0, dataloader_num_workers=0,
                             save_strategy="steps" if stop else "no", save_steps=stop or 500)
    kw = {} if options is None else dict(sync_options=options)
    cls = Trainer if options is None else SfsyncTrainer
    model = T.make_model().to(torch.bfloat16) if bf16 else T.make_model()
    trainer = cls(model=model, args=args, train_dataset=T.Data(), callbacks=[Stop()],
                  **kw)
    trainer.train(resume_from_checkpoint=resume)
    return trainer.model, getattr(trainer, "sync", None)


def hf(phase, where, options, bf16=False):
    if phase == "save":
        full = hf_run(os.path.join(where, "full"), options, bf16=bf16)
        hf_run(os.path.join(where, "run"), options, stop=4, bf16=bf16)
        return full
    return hf_run(os.path.join(where, "resumed"), options, bf16=bf16,
                  resume=os.path.join(where, "run", "checkpoint-4"))


# -- Lightning

def lightning_run(where, options, epochs, checkpoint=False, resume=None):
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    import test_lightning as L
    from sfsync.integrations.lightning import SfsyncStrategy

    model = L.Net()
    model.windows = C.Windows()
    strategy = DDPStrategy() if options is None else SfsyncStrategy(**options)
    seen = {}
    original = strategy.teardown

    def teardown():
        sync = getattr(strategy, "sync", None)
        if sync is not None and sync.context is not None:
            seen["windows"] = sync.windows
        original()
    strategy.teardown = teardown
    callbacks = [ModelCheckpoint(dirpath=where, save_last=True)] if checkpoint else []
    trainer = lightning.Trainer(accelerator="cpu", devices=C.WORLD, strategy=strategy,
                                max_epochs=epochs, accumulate_grad_batches=L.N,
                                gradient_clip_val=L.CLIP, callbacks=callbacks, logger=False,
                                enable_checkpointing=checkpoint, enable_progress_bar=False,
                                enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, L.loader(), ckpt_path=resume)
    return model, seen.get("windows")


def lightning(phase, where, options):
    import test_lightning as L
    if phase == "save":
        full = lightning_run(where, options, L.EPOCHS)
        lightning_run(where, options, 1, checkpoint=True)
        return full
    return lightning_run(where, options, L.EPOCHS, resume=os.path.join(where, "last.ckpt"))


# -- Accelerate

def accelerate_run(where, options, epochs, save=False, resume=False):
    from accelerate import Accelerator
    import test_accelerate as A
    from sfsync.integrations.accelerate import prepare_model

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=A.N)
    sync = None
    if options is None:
        model = A.make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=A.LR, weight_decay=0.01)
        model, opt, loader = accelerator.prepare(model, opt, A.make_loader())
    else:
        model = prepare_model(accelerator, A.make_model(), **options)
        sync = model.sync
        if options.get("shard_optimizer"):
            opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=A.LR,
                                 weight_decay=0.01)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=A.LR, weight_decay=0.01)
        opt, loader = accelerator.prepare(opt, A.make_loader())
    start = 0
    if resume:
        accelerator.load_state(where)
        start = 1
    for _ in range(start, epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), A.CLIP)
                opt.step()
                opt.zero_grad()
    if save:
        accelerator.save_state(where)
    if sync is not None and sync.sync_optimizer is not None:
        sync.sync_optimizer.wait_parameters()
    inner = model.module if hasattr(model, "module") else model
    return inner, sync


def accelerate(phase, where, options):
    import test_accelerate as A
    if phase == "save":
        full = accelerate_run(where, options, A.EPOCHS)
        accelerate_run(where, options, 1, save=True)
        return full
    return accelerate_run(where, options, A.EPOCHS, resume=True)


FRAMEWORKS = {"transformers": hf, "lightning": lightning, "accelerate": accelerate}


def windows_of(sync):
    if sync is None or isinstance(sync, int):
        return sync
    return sync.windows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=("save", "resume"), required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    args = p.parse_args()
    checks = C.Checks()
    rank = int(os.environ.get("RANK", "0"))
    done = []
    # a folder per save launch (its torchrun port), named in DIR/latest:
    # a checkpoint folder is never reused (Lightning would write last-v1.ckpt)
    latest = os.path.join(args.dir, "latest")
    if args.phase == "save":
        run = os.path.join(args.dir, "run-%s" % os.environ["MASTER_PORT"])
        if rank == 0:
            os.makedirs(run, exist_ok=True)
            with open(latest + ".tmp", "w") as f:
                f.write(run)
            os.replace(latest + ".tmp", latest)
    else:
        with open(latest) as f:
            run = f.read()
    for fw in args.frameworks.split(","):
        cases = CASES + (BF16_CASES if fw == "transformers" else [])
        for case, options in cases:
            where = os.path.join(run, "%s-%s" % (fw, case))
            kw = dict(bf16=True) if case.endswith("-bf16") else {}
            model, sync = FRAMEWORKS[fw](args.phase, where, options, **kw)
            vector = C.flat(model)
            windows = windows_of(sync)
            ref_file = os.path.join(where, "uninterrupted-rank%d.pt" % rank)
            if args.phase == "save":
                os.makedirs(where, exist_ok=True)
                torch.save({"weights": vector, "windows": windows}, ref_file)
                done.append("%s %s saved" % (fw, case))
                continue
            ref = torch.load(ref_file)
            diff = float((vector.double() - ref["weights"].double()).abs().max())
            name = "%s %s" % (fw, case)
            # bitwise: each framework's own DDP resumes bitwise here, and so must sfsync
            checks.that(diff == 0.0, "%s: resumed vs uninterrupted max |diff| %.3g (bitwise "
                        "expected)" % (name, diff))
            spread = C.rank_spread(vector)
            checks.that(spread == 0, "%s: the ranks differ by %.3g" % (name, spread))
            checks.that(windows == ref["windows"], "%s: sfsync windows %s after the resume, "
                        "the uninterrupted run %s" % (name, windows, ref["windows"]))
            done.append("%s %.1e" % (name, diff))
            C.say("%s: resumed vs uninterrupted %.3g, windows %s" % (name, diff, windows))
    checks.finish("test_resume " + args.phase)


if __name__ == "__main__":
    main()
