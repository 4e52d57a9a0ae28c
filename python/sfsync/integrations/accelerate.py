"""The 0.3 location: re-exports sfsync.torch.integrations.accelerate."""

from sfsync.torch.integrations.accelerate import *  # noqa: F401,F403
from sfsync.torch.integrations.accelerate import __all__  # noqa: F401
