"""sfsync as a Lightning strategy: ``Trainer(accumulate_grad_batches=N)``
decides the windows, sfsync carries the gradients::

    from sfsync.torch.integrations.lightning import SfsyncStrategy

    trainer = lightning.Trainer(accelerator="cpu", devices=2,
                                strategy=SfsyncStrategy(verify_every=100),
                                accumulate_grad_batches=4, gradient_clip_val=1.0)
    trainer.fit(model, loader)

``SfsyncStrategy(shard_optimizer=True)``: the optimizers that
``configure_optimizers`` returns are rebuilt as sfsync's sharded optimizer of
the same class and parameter groups (its state 1/W per rank); with an LR
scheduler, return ``self.trainer.strategy.optimizer(torch.optim.AdamW,
self.parameters(), lr=...)`` from ``configure_optimizers`` instead, and build
the scheduler on it. ``overlap_step=True`` (sync.optimizer's opt-in, also
``overlap_gather``) is passed to that optimizer: each bucket's shard steps as
its reduction lands and no gradient gather is sent (1x the bytes instead of
1.5x at W = 2), but ``.grad`` is final only inside the clip and the step
(callbacks that read it in between see partial values). Without it the
sharded optimizer leaves out the gradient gather too
(``whole_gradients=False``) whenever nothing but sfsync reads ``.grad``
between the window's last backward and the step: no GradScaler (16-mixed),
and neither the LightningModule nor a callback replaces a hook that runs
there (``on_after_backward``, ``on_before_optimizer_step``,
``configure_gradient_clipping``, ``optimizer_step``, ``on_before_zero_grad``,
...; decided at each window's end); ``gradient_clip_val`` then clips by
torch's norm bit for bit wherever each rank owns its gradients whole
(``shard_layout="parameter"``), else it gathers first.
``SfsyncStrategy(whole_gradients=True)`` keeps the gather always
(``False``: never, for hooks known not to read ``.grad``). A 16-bit wire: ``SfsyncStrategy(wire_dtype=
sfsync.DTYPE_BFLOAT16)`` (or ``SF_WIRE_DTYPE=bf16``). Other keyword
arguments go to ``sfsync.torch.GradientSync`` (bucket_cap_mb, ...), those of
DDPStrategy's constructor (process_group_backend, timeout, ...) to it.

Per-token loss over the whole window and every rank (weighted windows,
0.4), with no ``self.log(..., sync_dist=True)`` collective:
``SfsyncStrategy(reduce="weighted")`` and, in the LightningModule (with
``batch["labels"]`` each position's target, -100 where there is none; for
a causal LM already shifted, so that the count is the number of terms the
loss sums)::

    def training_step(self, batch, batch_idx):
        sync = self.trainer.strategy.sync
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=-100, reduction="sum")
        tokens = (batch["labels"] != -100).sum()
        sync.weigh(tokens)                                 # before its backward
        sync.add_window_sums(loss=loss, tokens=tokens)
        # Lightning divides the loss by accumulate_grad_batches: undo it
        return loss * self.trainer.accumulate_grad_batches

    def on_before_optimizer_step(self, optimizer):         # the window synchronized
        sums = self.trainer.strategy.sync.window_sums()    # every rank's, summed
        self.log("train_loss", sums["loss"] / sums["tokens"])  # no sync_dist needed

How it fits: Lightning runs micro-batches 1..N-1 (forward and backward)
inside ``strategy.block_backward_sync()``, and ParallelStrategy's acts only
on a DistributedDataParallel model. This strategy is DDPStrategy (processes,
process group, samplers, launch) with the DDP wrap replaced: the
LightningModule is attached to a GradientSync (``strategy.sync``), the
strategy's ``model`` is a ``SyncedModule`` over it, and
``block_backward_sync()`` is ``sync.no_sync()``. The pass after the window
(also the epoch's short last window, on which Lightning steps) synchronizes
inside its ``backward()``, before ``on_before_optimizer_step`` and the
clipping. ``gradient_clip_val`` (norm) clips by the global norm over the
model's final gradients (``SyncedModule.clip_grad_norm_``; Lightning's own
would clip a sharded optimizer's shards by their local norm).
"""

import contextlib
import inspect

from lightning.pytorch.strategies import DDPStrategy

from sfsync.torch.integrations._adapter import (FrameworkAdapter, overrides, patch_method,
                                                refuse_window_count, sync_optimizer)
from sfsync.torch.integrations._module import SyncedModule

__all__ = ["SfsyncStrategy"]

_STRATEGY_ARGS = set(inspect.signature(DDPStrategy.__init__).parameters) - {"self", "kwargs"}


class SfsyncStrategy(FrameworkAdapter, DDPStrategy):
    """DDPStrategy with sfsync's GradientSync in place of the DDP wrap; see
    the module docstring."""

    strategy_name = "sfsync"

    def __init__(self, **options):
        refuse_window_count(options, "SfsyncStrategy", "Lightning's (Trainer("
                            "accumulate_grad_batches=N)): sfsync follows it")
        strategy = {k: options.pop(k) for k in list(options) if k in _STRATEGY_ARGS}
        super().__init__(**strategy)
        self._take_options(options)

    # -- the wrap

    def configure_ddp(self):
        from sfsync.torch import GradientSync
        if self.sync is not None:  # a second fit(): a new attach
            self._close_sync()
        self.sync = GradientSync(self.model, **self._sync_options)
        self.model = SyncedModule(self.sync)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Lightning's micro-batches 1..N-1: sfsync's window."""
        if not self._sync_open():
            yield None
            return
        with self.sync.no_sync():
            yield None

    def optimizer(self, optimizer_class, params, **defaults):
        """``configure_optimizers`` may return this: sfsync's optimizer
        (sharded with shard_optimizer=True) of ``optimizer_class``."""
        if self.sync is None:
            raise RuntimeError("SfsyncStrategy.optimizer: no GradientSync yet (call it from "
                               "configure_optimizers, during fit)")
        return self.sync.optimizer(optimizer_class, params,
                                   **dict(self._owned_options(), **defaults))

    #: Hooks that run between a window's last backward and the step's end
    #: (where .grad is read, e.g. to log its norm): a LightningModule's, a
    #: Callback's.
    MODULE_READERS = ("backward", "on_after_backward", "on_before_optimizer_step",
                      "configure_gradient_clipping", "optimizer_step", "on_before_zero_grad",
                      "optimizer_zero_grad")
    CALLBACK_READERS = ("on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")

    def _owns_gradient_readers(self):
        """True when nothing but sfsync reads ``.grad`` between a window's
        last backward and the step's end, so that the sharded optimizer
        needs no gradient gather: no GradScaler in the precision plugin, and
        none of MODULE_READERS / CALLBACK_READERS replaced by the
        LightningModule or a callback."""
        import lightning.pytorch as pl
        if getattr(self.precision_plugin, "scaler", None) is not None:
            return False
        module = self.lightning_module
        if module is None or overrides(module, pl.LightningModule, self.MODULE_READERS):
            return False
        try:
            callbacks = module.trainer.callbacks
        except RuntimeError:  # (not attached to a Trainer)
            callbacks = ()
        return not any(overrides(cb, pl.Callback, self.CALLBACK_READERS) for cb in callbacks)

    def setup_optimizers(self, trainer):
        super().setup_optimizers(trainer)
        if not self._shards_optimizer() or self.sync is None:
            return
        mine = sync_optimizer(self.sync)
        for i, opt in enumerate(self.optimizers):
            if opt is mine:
                continue
            if mine is not None or len(self.optimizers) > 1:
                raise RuntimeError("SfsyncStrategy(shard_optimizer=True): one optimizer over "
                                   "the model's parameters (configure_optimizers returned %d)"
                                   % len(self.optimizers))
            if any(c.scheduler.optimizer is opt for c in self.lr_scheduler_configs):
                raise RuntimeError("SfsyncStrategy(shard_optimizer=True): an LR scheduler is "
                                   "bound to the %s that configure_optimizers made; return "
                                   "self.trainer.strategy.optimizer(%s, params, ...) and build "
                                   "the scheduler on it" % (type(opt).__name__,
                                                             type(opt).__name__))
            self.optimizers[i] = self._rebuilt(opt)
            mine = self.optimizers[i]

    def setup(self, trainer):
        super().setup(trainer)
        _route_clip(self)

    # -- checkpoints: Lightning gathers ``optimizer_state`` on every rank
    # (consolidate_state_dict first, which sfsync's sharded optimizer has: the
    # full form on global zero) and global zero writes the file that every
    # rank loads; sfsync's window state travels in it as "sfsync"

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        if self._sync_open():
            checkpoint["sfsync"] = self.sync.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint):
        super().load_optimizer_state_dict(checkpoint)
        if "sfsync" in checkpoint and self._sync_open():
            self.sync.load_state_dict(checkpoint["sfsync"])

    # -- teardown

    def _close_sync(self):
        if self.sync is not None:
            self.sync.close()
        self.sync = None

    def teardown(self):
        if isinstance(self.model, SyncedModule):
            self.model = self.lightning_module
        self._close_sync()
        super().teardown()


def _route_clip(strategy):
    """gradient_clip_val (norm) of sfsync's optimizer -> SyncedModule's
    clip_grad_norm_: Lightning's own clips the optimizer's parameters, which
    in a sharded context are this rank's shards (a local norm)."""
    def route(original):
        def clip_grad_by_norm(optimizer, clip_val):
            mine = sync_optimizer(strategy.sync)
            if mine is not None and optimizer is mine and \
                    isinstance(strategy.model, SyncedModule):
                return strategy.model.clip_grad_norm_(clip_val)
            return original(optimizer, clip_val)
        return clip_grad_by_norm

    patch_method(strategy.precision_plugin, "clip_grad_by_norm", route)
