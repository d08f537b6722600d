"""What the data-parallel router keeps about requests, and how it rewrites messages (no sockets here).

A client's request is a :class:`Job`; each ``Generate`` the router sends to a replica for it is a :class:`Leg`,
under an id of the router's (clients' ids may collide, and the router is one client of every replica).  The
first leg carries every completion; when its replica dies, each unfinished completion gets a leg of its own on
another replica: :func:`resume_generate`, the same prompt and sampling with the tokens already streamed, so the
replica continues it exactly (``Generate.resume_output_ids``, ``completion_index``).  The router fixes a seed
for a request that has none before its first leg, so that a resumed completion samples as the lost one would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any, Optional

import msgspec

from ipc import protocol as p


@dataclass(eq=False)
class Job:
    """A client's request: what to send again, what each completion (by index) has streamed so far."""

    client: bytes
    request_id: str
    generate: p.Generate  # as the client sent it, with a seed
    hashes: list[int]  # its prompt's block-prefix hashes (scheduler_proc/routing.py)
    outputs: dict[int, list[int]]  # completion index -> tokens relayed to the client
    legs: dict[str, "Leg"] = field(default_factory=dict)
    prompt_logprobs_sent: set[int] = field(default_factory=set)
    aborted: bool = False  # the client aborted it: a lost leg ends with "abort" instead of being re-sent

    @classmethod
    def of(cls, client: bytes, msg: p.Generate, hashes: list[int]) -> "Job":
        first, resumed = msg.completion_index, msg.resume_output_ids
        outputs = {i: list(resumed) for i in range(first, first + msg.sampling.n)}
        return cls(client, msg.request_id, msg, hashes, outputs)

    def first_prompt_logprobs(self, index: int) -> bool:
        """Whether a completion's prompt logprobs go to the client now (once: a resumed leg sends them again)."""
        if index in self.prompt_logprobs_sent:
            return False
        self.prompt_logprobs_sent.add(index)
        return True

    def finished(self, index: int, reason: str) -> p.Finished:
        """The Finished the router sends itself for a completion no replica holds (aborted while re-sent)."""
        return p.Finished(self.request_id, reason, len(self.generate.prompt_token_ids), len(self.outputs[index]),
                          index=index)


@dataclass(eq=False)
class Leg:
    """One Generate on one replica (``replica`` None: waiting for one to be up)."""

    leg_id: str
    job: Job
    generate: p.Generate  # the message to send, under leg_id
    indices: set[int]  # its completions not finished yet
    replica: Any = None


def first_generate(msg: p.Generate, leg_id: str) -> p.Generate:
    return msgspec.structs.replace(msg, request_id=leg_id)


def resume_generate(job: Job, index: int, leg_id: str) -> p.Generate:
    """Completion ``index`` of ``job`` again, after the tokens the client has."""
    g = job.generate
    return p.Generate(leg_id, g.prompt_token_ids, msgspec.structs.replace(g.sampling, n=1),
                      resume_output_ids=list(job.outputs[index]), completion_index=index)


class ClientDeltas:
    """One client's share of a replica's TokenDeltas, under the client's request ids."""

    __slots__ = ("request_ids", "token_ids", "indices", "logprobs", "prompt_logprobs")

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.token_ids: list[list[int]] = []
        self.indices: list[int] = []
        self.logprobs: list[list[p.TokenLogprobs]] = []
        self.prompt_logprobs: list[Optional[list]] = []

    def add(self, request_id: str, tokens: list[int], index: int, logprobs: list, prompt_logprobs) -> None:
        self.request_ids.append(request_id)
        self.token_ids.append(tokens)
        self.indices.append(index)
        self.logprobs.append(logprobs)
        self.prompt_logprobs.append(prompt_logprobs)

    def batch(self) -> p.TokenDeltas:
        """As one TokenDeltas (a client whose Hello set batch_deltas); empty extras are left out."""
        return p.TokenDeltas(self.request_ids, self.token_ids, indices=self.indices if any(self.indices) else [],
                             logprobs=self.logprobs if any(self.logprobs) else [],
                             prompt_logprobs=self.prompt_logprobs
                             if any(x is not None for x in self.prompt_logprobs) else [])

    def singles(self) -> list[p.TokenDelta]:
        """As one TokenDelta per request (a client that reads no batches)."""
        return [p.TokenDelta(*entry) for entry in zip(self.request_ids, self.token_ids, self.indices, self.logprobs,
                                                      self.prompt_logprobs)]


_STATS_FIELDS = p.ServerStats.__struct_fields__
_REQUIRED_STATS = _STATS_FIELDS[: len(_STATS_FIELDS) - len(p.ServerStats.__struct_defaults__)]


def sum_stats(replies: list[p.ServerStats], draining: bool, down: list[int] = (),
              restarts: list[int] = ()) -> p.ServerStats:
    """The replicas' stats as one server's: counts and times summed (bucket lists element-wise), the memory
    extremes taken, each reply kept in ``replicas`` (a replica that is down has none), with the router's own:
    the replicas ``down`` and each one's ``restarts``."""
    out = p.ServerStats(**dict.fromkeys(_REQUIRED_STATS, 0))
    for name in _STATS_FIELDS:
        values = [getattr(s, name) for s in replies]
        if name in ("replica", "replicas", "replicas_down", "replica_restarts") or not values:
            continue
        if name == "device_peak_bytes":
            value = max(values)
        elif name == "device_free_min_bytes":
            value = min((v for v in values if v), default=0)
        elif isinstance(values[0], bool):
            value = any(values)
        elif isinstance(values[0], list):
            value = [sum(column) for column in zip_longest(*values, fillvalue=0)]
        else:
            value = sum(values)
        setattr(out, name, value)
    out.draining = out.draining or draining
    out.replicas = sorted(replies, key=lambda s: -1 if s.replica is None else s.replica)
    out.replicas_down, out.replica_restarts = list(down), list(restarts)
    return out
