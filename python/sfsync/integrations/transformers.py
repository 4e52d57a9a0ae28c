"""The 0.3 location: re-exports sfsync.torch.integrations.transformers."""

from sfsync.torch.integrations.transformers import *  # noqa: F401,F403
from sfsync.torch.integrations.transformers import __all__  # noqa: F401
