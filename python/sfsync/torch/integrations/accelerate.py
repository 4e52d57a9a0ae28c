"""sfsync under HF Accelerate: ``accelerator.accumulate(model)`` drives the
windows, sfsync carries the gradients (instead of the DDP that
``accelerator.prepare(model)`` would wrap). The loop is Accelerate's own::

    from sfsync.torch.integrations.accelerate import prepare_model

    accelerator = Accelerator(gradient_accumulation_steps=4)
    model = prepare_model(accelerator, model, verify_every=100)  # not prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer, loader = accelerator.prepare(optimizer, loader)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()

Sharded optimizer state (a distributed optimizer): ``prepare_model(...,
shard_optimizer=True)`` and ``optimizer = model.sync.optimizer(
torch.optim.AdamW, model.parameters(), lr=1e-3)`` before
``accelerator.prepare(optimizer, ...)``. A 16-bit wire: ``wire_dtype=
sfsync.DTYPE_BFLOAT16`` (or ``SF_WIRE_DTYPE=bf16``).

Per-token loss over the whole window and every rank (weighted windows,
0.4), with no ``accelerator.gather`` of counts or losses: the loss is a
plain sum, each micro-batch weighs itself, and the window's loss comes back
with the gradients (sfsync/torch/weighted.py). ``batch["labels"]`` holds
each position's target, -100 where there is none (for a causal LM already
shifted: ``labels[:, t]`` is the token at t + 1), so that the count is the
number of terms the loss sums::

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
            if accelerator.sync_gradients:                 # .grad: the window's token mean
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                sums = model.sync.window_sums()            # every rank's, summed: no gather
                mean_loss = sums["loss"] / sums["tokens"]
            optimizer.step()
            optimizer.zero_grad()

How it fits: ``prepare_model`` lets Accelerate place the model and apply
its mixed precision (``prepare_model(evaluation_mode=True)``: no DDP), then
attaches a ``GradientSync`` and returns it as a ``SyncedModule`` (``.module``
is your model, ``.sync`` the GradientSync). ``accelerator.accumulate`` finds
``no_sync`` on it by name, exactly as on DDP (and where it enters none,
with one process, the SyncedModule reads ``accelerator.sync_gradients``), so
micro-batches 1..N-1 stay local and the pass after them (also the short last window that Accelerate
cuts at the end of the dataloader) synchronizes inside its
``backward()``; ``accelerator.sync_gradients`` and sfsync's ``is_step()``
agree. ``accelerator.clip_grad_norm_(model.parameters(), ...)`` of this
model goes to ``SyncedModule.clip_grad_norm_`` (the global norm, also
sharded), as Accelerate does for FSDP models.
"""

from sfsync.torch.integrations._adapter import (consolidate_for_save, patch_method,
                                                refuse_window_count, sync_open)
from sfsync.torch.integrations._module import SyncedModule

__all__ = ["prepare_model", "SyncedModule"]


def prepare_model(accelerator, model, device_placement=None, **sync_options):
    """``model`` placed and prepared by ``accelerator`` without DDP, then
    attached to a ``sfsync.torch.GradientSync(model, **sync_options)``
    (verify_every, shard_optimizer, wire_dtype, bucket_cap_mb, ...); returns
    the SyncedModule to use as the model. No ``accumulation_steps``: the
    windows are Accelerate's. Unlike the Lightning and HF Trainer
    integrations this one leaves ``whole_gradients`` to the user
    (owned_gradients, _adapter.py): the user builds the optimizer
    (``model.sync.optimizer(...)``) and writes the loop that reads ``.grad``."""
    from sfsync.torch import GradientSync
    refuse_window_count(sync_options, "prepare_model",
                        "Accelerate's (Accelerator(gradient_accumulation_steps=N)): sfsync "
                        "follows accelerator.accumulate()")
    model = accelerator.prepare_model(model, device_placement=device_placement,
                                      evaluation_mode=True)
    model.train()
    # Accelerate enters no_sync() only with more than one process; its
    # sync_gradients flag says the same on every process count (False on
    # micro-batches 1..N-1 inside accelerator.accumulate(), True elsewhere).
    state = accelerator.gradient_state
    wrapped = SyncedModule(GradientSync(model, **sync_options),
                           host_defers=lambda: not state.sync_gradients)
    _route_clip(accelerator, wrapped)
    _route_checkpoints(accelerator, wrapped)
    return wrapped


def _route_checkpoints(accelerator, wrapped):
    """``accelerator.save_state`` / ``load_state``: Accelerate saves each
    optimizer's ``state_dict()`` from the main process and loads it on
    every process, so a sharded sfsync optimizer gathers its full form on
    rank 0 first (a save pre-hook: it runs on every process); the
    GradientSync's window state is a checkpointed object of Accelerate's own
    (``register_for_checkpointing``)."""
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: consolidate_for_save(wrapped.sync))
    accelerator.register_for_checkpointing(wrapped.sync)


def _route_clip(accelerator, wrapped):
    """accelerator.clip_grad_norm_(the parameters of a SyncedModule) goes to
    its clip_grad_norm_ (Accelerate's own branch for FSDP models does the
    same with the FSDP module's); other parameters to Accelerate's."""
    mine = accelerator.__dict__.setdefault("_sfsync_modules", [])
    mine.append(wrapped)

    def route(original):
        def clip_grad_norm_(parameters, max_norm, norm_type=2):
            parameters = list(parameters)
            ids = [id(p) for p in parameters]
            for m in mine:
                if sync_open(m.sync) and ids == [id(p) for p in m.parameters()]:
                    accelerator.unscale_gradients()
                    return m.clip_grad_norm_(max_norm, norm_type)
            return original(parameters, max_norm, norm_type)
        return clip_grad_norm_

    patch_method(accelerator, "clip_grad_norm_", route)
