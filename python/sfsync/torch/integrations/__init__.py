"""sfsync inside trainer frameworks that decide their own accumulation
windows (docs/frameworks.md; the rule: docs/python.md, "Windows from the host").

One module per framework, each importing its framework only when used, so
``import sfsync`` never needs any of them:

* ``sfsync.torch.integrations.accelerate``: HF Accelerate's ``accelerator.accumulate()``
  loop (``prepare_model``).
* ``sfsync.torch.integrations.lightning``: ``SfsyncStrategy`` for a Lightning
  ``Trainer(accumulate_grad_batches=N)``.
* ``sfsync.torch.integrations.transformers``: ``SfsyncTrainer`` (or the mixin
  ``SfsyncTrainerMixin``) for the HF ``Trainer(gradient_accumulation_steps=N)``.

Each follows the host's ``no_sync()``: micro-batches 1..N-1 accumulate
locally, the pass after them synchronizes (also an epoch's short last
window), so the gradient bytes per window are one model's worth.
``SyncedModule`` is the DDP-shaped nn.Module they share (``.module``,
``forward``, ``no_sync()``, ``.sync``; _module.py); what else they share
(the option split, the refusal of ``accumulation_steps``, the open-sync
check, the ``whole_gradients`` decision, patching a framework's method) is
written once in _adapter.py, ``FrameworkAdapter`` the base of Lightning's
strategy and the HF Trainer's mixin.
"""

__all__ = ["SyncedModule"]


def __getattr__(name):  # torch only when asked for
    if name == "SyncedModule":
        from sfsync.torch.integrations._module import SyncedModule
        return SyncedModule
    raise AttributeError("module 'sfsync.torch.integrations' has no attribute %r" % name)
