"""Hand-made step plans for tests and benchmarks: a minimal planner for a fixed set of requests.

No scheduler, no sockets: :class:`SyntheticPlanner` admits requests into slots
(first come, first served, within a prompt-token budget per step), gives them
blocks from a simple pool, frees both as soon as a request has its
``max_new_tokens`` (the executor runs steps in order, so this is safe here), and
writes :class:`StepPlan` messages the way the real planner does (one decode row
per request per step, then prefill rows: whole prompts, or chunks of at most
``chunk_size`` tokens, the last of which samples).  It never needs the sampled
tokens: decode rows read ``last_token[slot]`` on the device.
:class:`DecodeLoop` runs its plans through a worker the way the executor process does.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from ipc.protocol import Admit, SlotSampling, StepPlan

GREEDY = SlotSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)


@dataclass
class _Request:
    slot: int
    prompt: list[int]
    sampling: SlotSampling
    max_new_tokens: Optional[int] = None
    computed: int = 0  # tokens whose KV is written (or enqueued)
    sampled: int = 0  # tokens sampled (or enqueued)
    blocks: list[int] = field(default_factory=list)


class SyntheticPlanner:
    def __init__(self, num_slots: int, block_size: int, num_blocks: int, max_prefill_tokens: Optional[int] = None,
                 chunk_size: Optional[int] = None):
        """``max_prefill_tokens`` caps the prompt tokens admitted per step (None: admit every waiting request);
        ``chunk_size`` the tokens of one prefill row (None: whole prompts)."""
        self.block_size = block_size
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size
        self.free_slots = list(range(num_slots))
        self.free_blocks = list(range(num_blocks))
        self.running: list[_Request] = []
        self.pending: list[_Request] = []  # added, no slot yet
        self.waiting: list[_Request] = []  # admitted by the coming step
        self.releases: list[int] = []
        self.step_id = 0

    def add(self, prompt: list[int], sampling: SlotSampling = GREEDY, max_new_tokens: Optional[int] = None) -> None:
        """Queue a request; it gets a slot and is prefilled when a :meth:`step` admits it.

        With ``max_new_tokens`` it leaves (slot and blocks freed) after sampling that many tokens.
        """
        self.pending.append(_Request(-1, list(prompt), sampling, max_new_tokens))

    @property
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def _admit(self) -> None:
        budget = self.max_prefill_tokens
        while self.pending and self.free_slots and (budget is None or len(self.pending[0].prompt) <= budget):
            need = -(-len(self.pending[0].prompt) // self.block_size)
            if need > len(self.free_blocks):
                break
            req = self.pending.pop(0)
            req.slot = self.free_slots.pop(0)
            self.waiting.append(req)
            if budget is not None:
                budget -= len(req.prompt)

    def release(self, slot: int) -> None:
        """Drop a running request (its slot and blocks go back with the next plan)."""
        req = next(r for r in self.running if r.slot == slot)
        self.running.remove(req)
        self.free_blocks.extend(req.blocks)
        self.free_slots.append(slot)
        self.releases.append(slot)

    def step(self) -> StepPlan:
        """Decode rows of the running requests, then prefill rows (chunks) of those still prefilling."""
        self._admit()
        admits = [Admit(r.slot, r.sampling, r.prompt if r.sampling.reads_tokens else []) for r in self.waiting]
        self.running += self.waiting
        self.waiting = []
        decoding = [r for r in self.running if r.computed >= len(r.prompt)]
        prefilling = [r for r in self.running if r.computed < len(r.prompt)]
        rows, prefill_tokens, appends = [], [], []
        for req in decoding + prefilling:
            left = len(req.prompt) - req.computed
            n = 1 if left <= 0 else min(left, self.chunk_size or left)
            if left > 0:
                prefill_tokens += req.prompt[req.computed:req.computed + n]
            rows.append((req.slot, n, req.computed, left > 0, left <= n))
            req.computed += n
            req.sampled += left <= n
            while len(req.blocks) * self.block_size < req.computed:
                block = self.free_blocks.pop(0)
                appends += [req.slot, len(req.blocks), block]
                req.blocks.append(block)
        slots, num_tokens, positions, is_prefill, sample = (list(c) for c in zip(*rows)) if rows else [[]] * 5
        plan = StepPlan(self.step_id, slots, num_tokens, positions, is_prefill, sample,
                        prefill_tokens=prefill_tokens, block_appends=appends, admits=admits,
                        releases=self.releases)
        self.releases = []
        self.step_id += 1
        for req in [r for r in self.running if r.max_new_tokens is not None and r.sampled >= r.max_new_tokens]:
            self.release(req.slot)
        return plan


class DecodeLoop:
    """The executor's hot loop without sockets: at most ``depth`` steps in flight."""

    def __init__(self, worker, planner, depth: int = 2):
        self.worker, self.planner, self.depth = worker, planner, depth
        self.in_flight: deque = deque()
        self.host_s = 0.0
        self.tokens: list[list[int]] = []

    def step(self) -> None:
        t0 = time.perf_counter()
        plan = self.planner.step()
        w = self.worker
        step = w.prepare(plan)
        host, copy = w.copy_out(w.launch(step), step)  # with the step: its logprobs travel too
        self.host_s += time.perf_counter() - t0
        self.in_flight.append((host, copy))
        while len(self.in_flight) > self.depth:
            self.retire()

    def retire(self) -> None:
        host, copy = self.in_flight.popleft()
        if copy is not None:
            copy.synchronize()
        self.tokens.append(host if isinstance(host, list) else host.tolist())
        if copy is not None:
            copy.release()

    def drain(self) -> None:
        while self.in_flight:
            self.retire()
