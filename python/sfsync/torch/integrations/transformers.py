"""sfsync in the HF Trainer: ``TrainingArguments(gradient_accumulation_steps=N)``
decides the windows, sfsync carries the gradients (instead of the DDP that
the Trainer's Accelerator would wrap)::

    from sfsync.torch.integrations.transformers import SfsyncTrainer

    trainer = SfsyncTrainer(model=model, args=TrainingArguments(
                                gradient_accumulation_steps=4, max_grad_norm=1.0, ...),
                            train_dataset=data, sync_options=dict(verify_every=100))
    trainer.train()

``sync_options`` go to ``sfsync.torch.GradientSync``: ``shard_optimizer=True``
makes the optimizer the Trainer builds (``args.optim``, or
``optimizer_cls_and_kwargs``) sfsync's sharded optimizer of the same class
and parameter groups; ``wire_dtype=sfsync.DTYPE_BFLOAT16`` (or
``SF_WIRE_DTYPE=bf16``) a 16-bit wire; verify_every, bucket_cap_mb, ...;
``overlap_step=True`` goes to the sharded optimizer (no gradient gather: 1x
the bytes instead of 1.5x at W = 2; ``.grad`` final only inside the clip
and the step, which is all the Trainer reads).
``sync_options=dict(keep_ddp=True, verify_every=K)`` keeps the Trainer's
DDP instead and attaches sfsync to it (``sfsync.torch.attach``: sfsync's
comm hook follows DDP's ``no_sync()``; verify_every; no sharding or 16-bit
wire, which need GradientSync). Mixing into a Trainer subclass of your
own: ``class MyTrainer(SfsyncTrainerMixin, YourTrainer)``. ``trainer.sync``
is the GradientSync (the DDPSync with keep_ddp).

How it fits: the Trainer asks ``_wrap_model`` for the training model and,
when that returns another object than the model, prepares only the optimizer
with Accelerate (its path for wrappers it does not know). Here it returns a
``SyncedModule`` (DDP's shape over a GradientSync); the Trainer runs
micro-batches 1..N-1 inside ``accelerator.no_sync(model)``, which finds
``no_sync`` on it by name, and the last one outside (also the epoch's short
last window), which synchronizes inside its ``backward()``. ``max_grad_norm``
clips by the global norm through ``SyncedModule.clip_grad_norm_`` (sfsync's
optimizer's own when it has one).
"""

import os
import weakref

from transformers import Trainer, TrainerCallback

from sfsync.torch.integrations._module import (SyncedModule, consolidate_for_save,
                                               rebuild_optimizer, split_options, sync_optimizer)

#: sfsync's own window state (sync.state_dict()) in a Trainer checkpoint folder.
SYNC_STATE_NAME = "sfsync_sync.pt"

__all__ = ["SfsyncTrainer", "SfsyncTrainerMixin"]


class SfsyncTrainerMixin:
    """The Trainer methods that put sfsync in place of DDP; see the module
    docstring. ``sync_options``: GradientSync's keyword arguments."""

    def __init__(self, *args, sync_options=None, **kwargs):
        options = dict(sync_options or {})
        if "accumulation_steps" in options:
            raise TypeError("SfsyncTrainer: accumulation_steps is the Trainer's "
                            "(TrainingArguments(gradient_accumulation_steps=N))")
        self._keep_ddp = bool(options.pop("keep_ddp", False))
        if self._keep_ddp and set(options) - {"verify_every", "verify_buffers"}:
            raise ValueError("SfsyncTrainer(keep_ddp=True) attaches to the Trainer's DDP, which "
                             "takes verify_every and verify_buffers only, not %s"
                             % sorted(set(options) - {"verify_every", "verify_buffers"}))
        self._sync_options, self._optimizer_options = split_options(options)
        self.sync = None
        super().__init__(*args, **kwargs)
        if self._keep_ddp:
            self.add_callback(_AttachAtTrainBegin(weakref.WeakMethod(self._attach_ddp)))

    def _sfsync(self):
        if self.sync is None or self.sync.context is None:
            from sfsync.torch import GradientSync
            self.model.train()
            self.sync = GradientSync(self.model, **self._sync_options)
        return self.sync

    def _attach_ddp(self):
        """keep_ddp: sfsync's comm hook on the DDP the Trainer's Accelerator made."""
        import torch
        from sfsync.torch import attach
        ddp = self.model_wrapped
        if self.sync is not None and self.sync.context is not None and self.sync.ddp is ddp:
            return
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            return  # one process: nothing to synchronize
        self.sync = attach(ddp, **self._sync_options)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self._sync_options.get("shard_optimizer") and \
                sync_optimizer(self._sfsync()) is not optimizer:
            optimizer = rebuild_optimizer(self.sync, optimizer, **self._optimizer_options)
            self.optimizer = optimizer
        return optimizer

    def _wrap_model(self, model, training=True, dataloader=None):
        if not training or self._keep_ddp:
            return super()._wrap_model(model, training, dataloader)
        if isinstance(model, SyncedModule) and model.sync.context is not None:
            return model
        return SyncedModule(self._sfsync())

    # -- checkpoints: the Trainer saves the optimizer from its main process
    # alone and loads that one file on every process

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.sync is not None and self.sync.context is not None:
            consolidate_for_save(self.sync)  # every process: the full form on rank 0
        super()._save_optimizer_and_scheduler(output_dir)
        if self.sync is not None and self.sync.context is not None and self.args.should_save:
            import torch
            torch.save(self.sync.state_dict(), os.path.join(output_dir, SYNC_STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.sync is None or self.sync.context is None:
            return
        path = os.path.join(checkpoint, SYNC_STATE_NAME)
        if os.path.isfile(path):
            import torch
            self.sync.load_state_dict(torch.load(path, weights_only=True))

    def _clip_grad_norm(self, model):
        if isinstance(model, SyncedModule):
            self.accelerator.unscale_gradients()
            return model.clip_grad_norm_(self.args.max_grad_norm)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and isinstance(model, SyncedModule):
            grad_norm = model.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)


class _AttachAtTrainBegin(TrainerCallback):
    """keep_ddp: the DDP exists from train()'s start (model_wrapped)."""

    def __init__(self, attach):
        self._attach = attach  # the trainer's _attach_ddp, as a WeakMethod

    def on_train_begin(self, args, state, control, **kwargs):
        attach = self._attach()
        if attach is not None:
            attach()


class SfsyncTrainer(SfsyncTrainerMixin, Trainer):
    """``transformers.Trainer`` with sfsync in place of DDP."""
