"""The base of every message on forerun's sockets, and the one encoder (msgpack; nothing is ever pickled).

Messages are tagged unions: ``{"type": "generate", ...}`` on the wire, each struct's tag its ``tag=``; unknown
fields are rejected and defaults are left out.  The messages themselves: :mod:`ipc.client_protocol` (client <->
scheduler) and :mod:`ipc.executor_protocol` (scheduler <-> executor); :mod:`ipc.protocol` names them all.
"""

from __future__ import annotations

import msgspec


class Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=True):
    pass


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One position: the chosen token's log-probability and the top alternatives, most likely first (both
    conversations carry them: a step's results, a client's deltas); ``rank``: the chosen token's place in the
    distribution, vLLM's (1: the most likely; a tie counts against it; 0: not known)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int = 0


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)
