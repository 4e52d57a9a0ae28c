"""The 0.3 location: re-exports sfsync.torch.integrations._module."""

from sfsync.torch.integrations._module import *  # noqa: F401,F403
from sfsync.torch.integrations._module import __all__  # noqa: F401
