"""The wire protocol: every message that crosses a socket, as msgspec structs, under one name.

Two conversations, each in its own module:

* client <-> scheduler (:mod:`ipc.client_protocol`: untrusted bytes, decoded with a size limit and a closed
  union of types, unknown fields rejected);
* scheduler <-> executor (:mod:`ipc.executor_protocol`: trusted, but still msgspec: nothing is ever pickled).

Messages are tagged unions (``{"type": "generate", ...}`` on the wire) encoded with msgpack
(:mod:`ipc.message`).  Code imports this module (``from ipc import protocol as p``) and names messages as
``p.Generate``, ``p.StepPlan``.
"""

from ipc.client_protocol import *  # noqa: F401,F403
from ipc.client_protocol import client_request_decoder, server_reply_decoder  # noqa: F401
from ipc.executor_protocol import *  # noqa: F401,F403
from ipc.executor_protocol import executor_input_decoder, executor_output_decoder  # noqa: F401
from ipc.message import encode  # noqa: F401
