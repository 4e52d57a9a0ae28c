"""The 0.3 location of the GradientSync optimizer: ``sfsync.optim`` re-exports
``sfsync.torch.optim`` (SyncOptimizer, Phase), where it lives now."""

from sfsync.torch.optim import Phase, SyncOptimizer

__all__ = ["SyncOptimizer", "Phase"]
