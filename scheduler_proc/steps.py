"""Records of the planner's steps: one per step in flight, one per request a reconcile touched."""

from __future__ import annotations

from typing import Optional

import time

import msgspec

from ipc.protocol import Admit
from scheduler_proc.request import Request


class InflightStep:
    """A step that was sent and has not come back: who is in it, who samples, what it completes."""

    __slots__ = ("step_id", "requests", "samplers", "written", "onloaded", "resumed", "num_prefill", "num_backups",
                 "spec")

    def __init__(self, step_id: int, requests: list[Request], samplers: list[Request],
                 written: list[tuple[Request, int]], onloaded: list[int] = (), resumed: list[Request] = (),
                 num_prefill: int = 0, num_backups: int = 0, spec: list[tuple[Request, int]] = ()):
        self.step_id = step_id
        self.num_prefill = num_prefill  # prefill tokens computed (the step log's record of what the step did)
        self.num_backups = num_backups  # blocks the host KV tier backs up after it
        self.requests = requests  # every request with a row in this step, row order
        self.samplers = samplers  # requests whose row is sampled, in row order
        # (request, n): once this step is back, the request's first n tokens of KV are all written
        # (prefix caching only; one per prefill chunk, and with the host tier one per decode row that fills a
        # block; other generated blocks are published at drain).
        self.written = written
        self.onloaded = onloaded  # host blocks this step copies to the device (busy until it is back)
        self.resumed = resumed  # preempted requests whose first token since readmission this step samples
        self.spec = spec  # (request, drafts) of its speculative rows, row order (scheduler_proc/speculation.py)


class ResumeClock:
    """How long preempted requests take to come back: from the plan that readmits one to the reconcile
    of its next token (a recompute of its context, or a copy from the host tier, plus the pipeline)."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0

    def record(self, requests: list[Request]) -> None:
        now = time.perf_counter()
        for req in requests:
            self.count += 1
            self.seconds += now - req.t_readmit
            req.t_readmit = 0.0


class Output(msgspec.Struct, gc=False):
    """What a reconcile produced for one request: new tokens and maybe a finish.

    A msgspec struct because one is made per sampled row: its C constructor is
    several times cheaper than a dataclass's, and it is not tracked by the GC.
    """

    request: Request
    new_tokens: list[int]
    finish_reason: Optional[str] = None
    logprobs: Optional[list] = None  # one TokenLogprobs per new token, when the request asked
    prompt_logprobs: Optional[list] = None  # the whole prompt's, once, when the request asked
    stop_str: Optional[str] = None  # the stop string that finished it
    error: Optional[str] = None  # finish_reason "error": why (sent to the client as the request's Error)


class StepDraft:
    """The plan being built: its rows' requests and the StepPlan's lists, filled in one pass."""

    __slots__ = ("budget", "step_id", "blocked", "rows", "slots", "positions", "appends", "admits", "num_decode",
                 "chunk_lens", "chunk_sample", "chunk_tokens", "written", "onloads", "onloaded", "resumed", "spec")

    def __init__(self, budget: int, step_id: int = 0):
        self.budget = budget  # tokens left in the step
        self.step_id = step_id
        self.blocked = False  # a running request is short of blocks: no admissions
        self.rows: list[Request] = []  # every row's request, row order (decode rows first)
        self.slots: list[int] = []
        self.positions: list[int] = []
        self.appends: list[int] = []  # (slot, index, block) triples
        self.admits: list[Admit] = []
        self.num_decode = 0
        self.chunk_lens: list[int] = []  # per prefill row
        self.chunk_sample: list[bool] = []
        self.chunk_tokens: list[int] = []
        self.written: list[tuple[Request, int]] = []
        self.onloads: list[int] = []  # (host block, device block) pairs, flat
        self.onloaded: list[int] = []  # the host blocks of ``onloads``
        self.resumed: list[Request] = []  # readmitted preempted requests whose chunk samples
        self.spec: list[tuple[Request, int]] = []  # speculative rows (after the decode rows): request, drafts

    def add_blocks(self, slot: int, start: int, blocks: list[int]) -> None:
        """Append ``blocks`` to ``slot``'s block table from index ``start``: ``(slot, index, block)`` triples."""
        n = len(blocks)
        triples = [slot] * (3 * n)  # filled by slice (no loop in Python)
        triples[1::3] = range(start, start + n)
        triples[2::3] = blocks
        self.appends += triples
