"""HF Accelerate's ``accelerator.accumulate()`` loop with sfsync
(sfsync.integrations.accelerate.prepare_model) against the same loop on
Accelerate's own DDP (``accelerator.prepare(model)``), 2 ranks on gloo,
one torchrun launch:

    ddp       accelerator.prepare(model, AdamW, loader), clip_grad_norm_
    sfsync    prepare_model(verify_every=1), torch AdamW, clip_grad_norm_
    sharded   prepare_model(shard_optimizer=True, verify_every=2),
              model.sync.optimizer(AdamW), clip_grad_norm_ (global norm)
    sharded-overlap  the same with sync.optimizer(..., overlap_step=True):
              no gradient gather (the clip is the optimizer's own, global)
    bf16      prepare_model(wire_dtype=bf16), torch AdamW, clip_grad_norm_

52 samples, batch 4 per rank, N = 3, 2 epochs: 7 batches per rank and
epoch (Accelerate evens the ranks), windows 3, 3, 1 (the short last window
Accelerate cuts at the end of the dataloader), twice. Judged per case:
final weights vs DDP's (1e-6; bf16: AdamW steps of lr 1e-2 whose
direction a 16-bit gradient can flip where it is tiny, so 2 lr steps = 0.12, and
the update within 5 % of DDP's), ranks identical,
every window's written bytes / gradient bytes in [0.95, 1.10] (bf16:
[0.45, 0.60]; sharded: see SHARDED, window 1 not judged), the windows DDP
had.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

from accelerate import Accelerator  # noqa: E402

import sfsync  # noqa: E402
from sfsync.integrations._module import split_options  # noqa: E402
from sfsync.integrations.accelerate import prepare_model  # noqa: E402

N, BATCH, SAMPLES, EPOCHS, LR, CLIP = 3, 4, 52, 2, 1e-2, 0.5
STEPS = C.STEPS
BF16_TOL, BF16_REL = C.bf16_tol(LR), C.BF16_REL
SHARDED, OVERLAP_TOL = C.SHARDED, C.OVERLAP_TOL


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 8))


def make_loader():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, 64, generator=g), torch.randn(SAMPLES, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                       batch_size=BATCH, shuffle=False)


def train(accelerator, model, opt, loader, windows, sync=None, agree=None):
    """The loop; returns the gradient norms the clip saw."""
    norms = []
    windows.start()
    for _ in range(EPOCHS):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                windows.micro()
                if sync is not None:
                    agree.append(sync.is_step() == accelerator.sync_gradients)
                if accelerator.sync_gradients:
                    # the mark after the clip: the window's gradients are
                    # final there in every mode (overlap_step: the clip waits)
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                    windows.step()
                opt.step()
                opt.zero_grad()
    return norms


def main():
    accelerator = Accelerator(cpu=C.DEVICE == "cpu", gradient_accumulation_steps=N)
    checks = C.Checks()
    C.check_refusal(checks, "prepare_model",
                    lambda: prepare_model(accelerator, make_model(), accumulation_steps=N),
                    "prepare_model: accumulation_steps is Accelerate's (Accelerator("
                    "gradient_accumulation_steps=N)): sfsync follows accelerator.accumulate()")
    C.say("accelerate: distributed_type %s, %d processes"
          % (accelerator.distributed_type, accelerator.num_processes))

    model = make_model()
    gbytes = C.grad_bytes(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ddp, opt, loader = accelerator.prepare(model, opt, make_loader())
    if C.WORLD > 1:  # (one process: Accelerate wraps nothing)
        checks.that(isinstance(ddp, torch.nn.parallel.DistributedDataParallel),
                    "reference: Accelerate wrapped the model in DDP")
    ref_windows = C.Windows()
    ref_norms = train(accelerator, ddp, opt, loader, ref_windows)
    C.say("ddp: clip norms %s" % " ".join("%.9g" % n for n in ref_norms))
    ref = C.flat(accelerator.unwrap_model(ddp))  # (one process: no DDP, no .module)

    cases = [("sfsync", dict(verify_every=1), False, 1e-6, (0.95, 1.10)),
             ("sharded", dict(shard_optimizer=True, verify_every=2), True, 1e-6, SHARDED),
             ("sharded-overlap", dict(shard_optimizer=True, overlap_step=True), True, OVERLAP_TOL,
              (0.95, 1.10)),
             ("bf16", dict(wire_dtype=sfsync.DTYPE_BFLOAT16, verify_every=3), False, BF16_TOL,
              (0.45, 0.60))]
    for name, options, sharded, tol, ratio in C.selected(cases):
        sync_options, optimizer_options = split_options(options)
        model = prepare_model(accelerator, make_model(), **sync_options)
        sync = model.sync
        if sharded:
            opt = sync.optimizer(torch.optim.AdamW, model.parameters(), lr=LR,
                                 **optimizer_options)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
        opt, loader = accelerator.prepare(opt, make_loader())
        windows, agree = C.Windows(), []
        norms = train(accelerator, model, opt, loader, windows, sync, agree)
        C.say("%s: clip norms %s" % (name, " ".join("%.9g" % n for n in norms)))
        if sharded:
            opt.optimizer.wait_parameters()
        stats = sync.stats()
        bf16 = "wire_dtype" in options
        C.report(checks, name, C.flat(model.module), ref, windows, ref_windows, gbytes, tol,
                 ratio, skip_first=sharded, init=C.flat(make_model()) if bf16 else None,
                 rel_tol=BF16_REL if bf16 else None)
        checks.that(all(agree), "%s: sync.is_step() == accelerator.sync_gradients on every "
                    "micro-batch" % name)
        checks.that(sync.windows == len(ref_windows.lengths),
                    "%s: %d sfsync windows (DDP steps %d)" % (name, sync.windows,
                                                               len(ref_windows.lengths)))
        C.say("%s: plugin stats windows_completed %d, collectives %d, bytes_reduced %d "
              "(%.4f x gradient bytes per window), reduce_scatters %d" % (
                  name, stats["windows_completed"], stats["collectives_issued"],
                  stats["bytes_reduced"], stats["bytes_reduced"] / gbytes / max(1, sync.windows),
                  stats["reduce_scatters"]))
        sync.close()
    checks.finish("test_accelerate")


if __name__ == "__main__":
    main()
