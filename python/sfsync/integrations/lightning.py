"""The 0.3 location: re-exports sfsync.torch.integrations.lightning."""

from sfsync.torch.integrations.lightning import *  # noqa: F401,F403
from sfsync.torch.integrations.lightning import __all__  # noqa: F401
