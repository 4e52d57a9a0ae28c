"""The 0.3 location of the framework integrations: ``sfsync.integrations``
and its modules re-export ``sfsync.torch.integrations`` (accelerate,
lightning, transformers, _module), where they live now. Importing this
package needs no torch and no framework (SyncedModule is resolved when
asked for)."""

__all__ = ["SyncedModule"]


def __getattr__(name):  # torch only when asked for
    if name == "SyncedModule":
        from sfsync.torch.integrations._module import SyncedModule
        return SyncedModule
    raise AttributeError("module 'sfsync.integrations' has no attribute %r" % name)
