"""forerun's Python SDK under its natural name: ``from forerun import Client, SamplingParams``.

A thin re-export of :mod:`ipc.client`, whose ``__all__`` is the list of public
names (the SDK lives there, next to the wire protocol it speaks).
"""

from ipc.client import *  # noqa: F401,F403
from ipc.client import __all__  # noqa: F401
