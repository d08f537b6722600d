"""Records of the planner's steps: one per step in flight, one per request a reconcile touched."""

from __future__ import annotations

from typing import Optional

import msgspec

from scheduler_proc.request import Request


class InflightStep:
    """A step that was sent and has not come back: who is in it, who samples, what it completes."""

    __slots__ = ("step_id", "requests", "samplers", "written")

    def __init__(self, step_id: int, requests: list[Request], samplers: list[Request],
                 written: list[tuple[Request, int]]):
        self.step_id = step_id
        self.requests = requests  # every request with a row in this step, row order
        self.samplers = samplers  # requests whose row is sampled, in row order
        # (request, n): once this step is back, the request's first n tokens of KV are all written
        # (prefix caching only; one per prefill chunk: generated tokens' blocks are published at drain).
        self.written = written


class Output(msgspec.Struct, gc=False):
    """What a reconcile produced for one request: new tokens and maybe a finish.

    A msgspec struct because one is made per sampled row: its C constructor is
    several times cheaper than a dataclass's, and it is not tracked by the GC.
    """

    request: Request
    new_tokens: list[int]
    finish_reason: Optional[str] = None
