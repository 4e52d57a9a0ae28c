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
and the step, which is all the Trainer reads). Without it the sharded
optimizer leaves out the gradient gather too (``whole_gradients=False``)
whenever nothing but sfsync reads ``.grad`` between the window's last
backward and the step: no fp16 GradScaler, no callback with
``on_pre_optimizer_step`` / ``on_optimizer_step``, no Trainer subclass
replacing ``training_step`` or the clip and norm methods (decided at each
window's end); the clip and the logged grad norm are then torch's bit for
bit wherever each rank owns its gradients whole
(``shard_layout="parameter"``), else the clip gathers first.
``sync_options=dict(whole_gradients=True)`` keeps the gather always
(``False``: never, for callbacks known not to read ``.grad``).
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

Weighted windows (0.4, issue 31): ``sync_options=dict(reduce="weighted")``
gives the gradients of the Trainer's ``average_tokens_across_devices=True``
(each window's sum of per-token gradients over every rank and micro-batch,
divided by the window's global token count) with no count gather: no
collective beyond one per bucket per window. Each micro-batch's loss is the
model's own loss as a plain token sum (``num_items_in_batch=1`` handed to
the model), and its ``training_step`` weighs it by its exact token count
(``sync.weigh``) before its backward; the count and the loss sum ride in
the gradients' own collective (``sync.window_sums()``). Which count: the
tokens the loss sums, i.e. ``shift_labels != -100`` when the batch carries
``shift_labels``, else ``labels[..., 1:] != -100`` when the model's loss
function is transformers' ``ForCausalLMLoss`` (which shifts; decoder-only
models), else ``labels != -100``; ``sync_options=dict(reduce="weighted",
count_items=fn)`` takes ``fn(inputs) -> number`` instead. (transformers 5.24
counts a ``GPT2LMHeadModel`` without a ``loss_type`` before the shift, one
token too many per sequence; with ``model.loss_type = "ForCausalLM"`` its
count is the exact one used here.) No look-ahead: nothing counts the
window's batches before its first forward (each micro-batch weighs itself
in its own training_step); the Trainer's loop itself still takes the
window's batches as a list before the first forward (``get_batch_samples``,
here without counting them), which sfsync does not need. The loss the
Trainer logs is the window's token mean (``window_sums``: loss / tokens),
the value its ``average_tokens_across_devices`` run logs;
``args.average_tokens_across_devices`` itself does not matter then. Needs
the model's own loss (a model that takes loss kwargs, no
``compute_loss_func``, no label smoothing: ValueError otherwise); not with
``keep_ddp``. On a GPU each micro-batch's count and loss sum are read back
to the host (as the Trainer's own NaN filter reads the loss).
"""

import itertools
import math
import os
import weakref

from transformers import Trainer, TrainerCallback

from sfsync.torch.integrations._adapter import (FrameworkAdapter, consolidate_for_save,
                                                overrides, refuse_window_count, sync_open,
                                                sync_optimizer)
from sfsync.torch.integrations._module import SyncedModule

#: sfsync's own window state (sync.state_dict()) in a Trainer checkpoint folder.
SYNC_STATE_NAME = "sfsync_sync.pt"

__all__ = ["SfsyncTrainer", "SfsyncTrainerMixin", "exact_count", "loss_shifts_labels"]


class SfsyncTrainerMixin(FrameworkAdapter):
    """The Trainer methods that put sfsync in place of DDP; see the module
    docstring. ``sync_options``: GradientSync's keyword arguments."""

    def __init__(self, *args, sync_options=None, **kwargs):
        options = dict(sync_options or {})
        refuse_window_count(options, "SfsyncTrainer", "the Trainer's "
                            "(TrainingArguments(gradient_accumulation_steps=N))")
        self._keep_ddp = bool(options.pop("keep_ddp", False))
        self._count_items = options.pop("count_items", None)
        self._weighted = False  # reduce="weighted" (known once the GradientSync is made)
        self._in_weighted_step = False
        self._loss_shifts = None
        beyond_ddp = set(options) - {"verify_every", "verify_buffers"}
        if self._keep_ddp and beyond_ddp:
            raise ValueError("SfsyncTrainer(keep_ddp=True) attaches to the Trainer's DDP, which "
                             "takes verify_every and verify_buffers only, not %s"
                             % sorted(beyond_ddp))
        self._take_options(options)
        super().__init__(*args, **kwargs)
        if self._keep_ddp:
            self.add_callback(_AttachAtTrainBegin(weakref.WeakMethod(self._attach_ddp)))

    def _sfsync(self):
        if not self._sync_open():
            from sfsync.torch import GradientSync
            self.model.train()
            self.sync = GradientSync(self.model, **self._sync_options)
            self._weighted = self.sync.reduce == "weighted"
        return self.sync

    def _attach_ddp(self):
        """keep_ddp: sfsync's comm hook on the DDP the Trainer's Accelerator made."""
        import torch
        from sfsync.torch import attach
        ddp = self.model_wrapped
        if self._sync_open() and self.sync.ddp is ddp:
            return
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            return  # one process: nothing to synchronize
        self.sync = attach(ddp, **self._sync_options)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self._shards_optimizer() and sync_optimizer(self._sfsync()) is not optimizer:
            optimizer = self._rebuilt(optimizer)
            self.optimizer = optimizer
        return optimizer

    def _owns_gradient_readers(self):
        """True when nothing but sfsync reads ``.grad`` between a window's
        last backward and the step's end, so that the sharded optimizer
        needs no gradient gather (the module docstring): no GradScaler
        (fp16), no callback with on_pre_optimizer_step / on_optimizer_step,
        and no Trainer class of the user's replacing training_step or the
        clip and norm methods."""
        if getattr(self.accelerator, "scaler", None) is not None:
            return False
        if any(overrides(cb, TrainerCallback, ("on_pre_optimizer_step", "on_optimizer_step"))
               for cb in self.callback_handler.callbacks):
            return False
        return not any(name in vars(klass) for klass in type(self).__mro__
                       if klass not in (SfsyncTrainerMixin, Trainer, object)
                       for name in ("training_step", "_clip_grad_norm", "_get_grad_norm"))

    def _wrap_model(self, model, training=True, dataloader=None):
        if not training or self._keep_ddp:
            return super()._wrap_model(model, training, dataloader)
        if isinstance(model, SyncedModule) and sync_open(model.sync):
            return model
        return SyncedModule(self._sfsync())

    # -- checkpoints: the Trainer saves the optimizer from its main process
    # alone and loads that one file on every process

    def _save_optimizer_and_scheduler(self, output_dir):
        if self._sync_open():
            consolidate_for_save(self.sync)  # every process: the full form on rank 0
        super()._save_optimizer_and_scheduler(output_dir)
        if self._sync_open() and self.args.should_save:
            import torch
            torch.save(self.sync.state_dict(), os.path.join(output_dir, SYNC_STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not self._sync_open():
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


    # -- weighted windows (reduce="weighted"; the module docstring)

    def _weighing(self):
        return self._weighted and self._sync_open()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Weighted: the window's batches as the Trainer's loop wants them,
        with no ``num_items_in_batch`` (no count, no gather across ranks)."""
        if not self._weighing():
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        return list(itertools.islice(epoch_iterator, num_batches)), None

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Weighted: the micro-batch's loss as a plain sum, weighed by its
        count (compute_loss); returns 0 for the window's micro-batches but the
        last (NaN stays NaN) and the window's token mean for the last, so the
        Trainer's logged loss is the window's mean as in its own
        average_tokens_across_devices run."""
        if not self._weighing():
            return super().training_step(model, inputs, num_items_in_batch)
        if not self.model_accepts_loss_kwargs or self.compute_loss_func is not None or \
                self.label_smoother is not None:
            raise ValueError("SfsyncTrainer(reduce='weighted') makes the model's own loss a token "
                             "sum through num_items_in_batch: it needs a model whose forward "
                             "takes loss kwargs (model_accepts_loss_kwargs is %s), no "
                             "compute_loss_func and no label smoothing"
                             % self.model_accepts_loss_kwargs)
        self._in_weighted_step = True
        try:
            # num_items_in_batch=1: the Trainer takes the loss as normalized
            # already (it does not divide it by the accumulation steps)
            loss = super().training_step(model, inputs, 1)
        finally:
            self._in_weighted_step = False
        if not self.sync.is_step():
            return loss * 0.0
        sums = self.sync.window_sums()
        mean = sums["loss"] / sums["tokens"] if sums["tokens"] and not sums["found_inf"] \
            else float("nan")
        return loss.new_full((), mean)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Weighted (inside training_step): weigh the micro-batch by its count
        before its backward, and compute the model's loss as a plain sum
        (num_items_in_batch=1 handed to the model in its inputs, so that the
        Trainer does not scale it by the process count)."""
        if not self._in_weighted_step:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        count = self._count(inputs)
        self.sync.weigh(count)
        out = super().compute_loss(model, {**inputs, "num_items_in_batch": 1}, return_outputs)
        value = float((out[0] if return_outputs else out).detach())
        if math.isfinite(value):
            self.sync.add_window_sums(loss=value, tokens=count)
        else:  # (the library takes finite values only; the Trainer's NaN filter sees it)
            self.sync.add_window_sums(tokens=count, found_inf=1)
        return out

    def _count(self, inputs):
        """The micro-batch's weight: the tokens its loss sums (the module
        docstring), or count_items(inputs)."""
        if self._count_items is not None:
            return self._count_items(inputs)
        if self._loss_shifts is None:
            self._loss_shifts = loss_shifts_labels(self.model)
        return exact_count(inputs, self._loss_shifts)


def loss_shifts_labels(model):
    """True when ``model``'s loss shifts its labels by one position: its loss
    function is transformers' ForCausalLMLoss (a GPT2LMHeadModel without a
    loss_type too: that is its default) and it is not an encoder-decoder."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    return getattr(model, "loss_function", None) is ForCausalLMLoss


def exact_count(inputs, shifts):
    """The targets a loss over ``inputs`` sums: ``shift_labels != -100`` when
    given, else ``labels[..., 1:] != -100`` when the loss shifts, else
    ``labels != -100`` (an int)."""
    if "shift_labels" in inputs:
        labels = inputs["shift_labels"]
    elif "labels" in inputs:
        labels = inputs["labels"][..., 1:] if shifts else inputs["labels"]
    else:
        raise ValueError("SfsyncTrainer(reduce='weighted'): the batch has no labels to count "
                         "(keys %s); pass sync_options=dict(reduce='weighted', count_items=fn)"
                         % sorted(inputs))
    return int(labels.ne(-100).sum())


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
