"""A scripted executor: the real plan/result protocol, tokens from a script.

It keeps the same slot tables the real executor keeps (last token, block
table per slot) and checks, for every step, what the real one would silently
get wrong: a decode row whose input token is unknown, a row whose positions
are not covered by its block table, a block that sits in two slots' tables at
once (a block handed on while a step that used it was in flight).

The token sampled for a row depends only on the slot's seed and the position,
like the real executor's seeded sampling, so outputs must not depend on the
pipeline depth (or on preemption and recompute).  ``eos_at[seed] = p`` makes
the token sampled at position ``p`` (prompt length + k for the k-th generated
token) EOS.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ipc.protocol import StepPlan, StepResult


def default_token(seed: int, position: int, vocab: int) -> int:
    """A deterministic pseudo-random token that is never 0..3 (kept for EOS/stops)."""
    x = (seed * 0x9E3779B1 + position * 0x85EBCA77) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return 4 + x % (vocab - 4)


@dataclass
class ScriptedExecutor:
    num_slots: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int = 1000
    eos_token_id: int = 2
    # eos_at[seed] = p: the token at absolute position p of that seed is EOS.
    eos_at: dict[int, int] = field(default_factory=dict)
    token_fn: Optional[Callable[[int, int], int]] = None
    step_latency_s: float = 0.0
    seqs: dict[int, list[int]] = field(default_factory=dict)  # slot -> tokens by position
    seed: dict[int, int] = field(default_factory=dict)
    tables: dict[int, list[int]] = field(default_factory=dict)
    steps_run: int = 0

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self._apply_diffs(plan)
        tokens: list[int] = []
        cursor = 0
        for slot, n, start, prefill, sample in zip(
            plan.slots, plan.num_tokens, plan.positions, plan.is_prefill, plan.sample
        ):
            seq = self.seqs[slot]
            if prefill:
                chunk = plan.prefill_tokens[cursor : cursor + n]
                cursor += n
                assert start <= len(seq), f"slot {slot}: chunk at {start} leaves a gap ({len(seq)} known)"
                del seq[start:]
                seq.extend(chunk)
            else:
                assert n == 1, f"slot {slot}: decode row with {n} tokens"
                assert start == len(seq) - 1, f"slot {slot}: decode at {start}, last known token at {len(seq) - 1}"
            assert len(self.tables[slot]) * self.block_size >= start + n, f"slot {slot}: KV beyond its blocks"
            if sample:
                pos = start + n
                tok = self._token(slot, pos)
                seq.append(tok)
                tokens.append(tok)
        assert cursor == len(plan.prefill_tokens), "prefill tokens left over"
        if self.step_latency_s:
            _spin(self.step_latency_s - (time.perf_counter() - t0))
        self.steps_run += 1
        return StepResult(plan.step_id, tokens, t_start=t0, t_end=time.perf_counter())

    def _token(self, slot: int, position: int) -> int:
        seed = self.seed[slot]
        if self.eos_at.get(seed) == position:
            return self.eos_token_id
        if self.token_fn is not None:
            return self.token_fn(seed, position)
        return default_token(seed, position, self.vocab_size)

    def _apply_diffs(self, plan: StepPlan) -> None:
        for slot in plan.releases:
            assert slot in self.tables, f"release of free slot {slot}"
            del self.tables[slot], self.seqs[slot], self.seed[slot]
        for admit in plan.admits:
            assert 0 <= admit.slot < self.num_slots
            assert admit.slot not in self.tables, f"slot {admit.slot} admitted while still in use"
            self.tables[admit.slot] = []
            self.seqs[admit.slot] = []
            self.seed[admit.slot] = admit.sampling.seed
        a = plan.block_appends
        for i in range(0, len(a), 3):
            slot, index, block = a[i], a[i + 1], a[i + 2]
            assert 0 <= block < self.num_kv_blocks
            assert index == len(self.tables[slot]), f"slot {slot}: append at {index}, table has {len(self.tables[slot])}"
            self.tables[slot].append(block)
        seen: dict[int, int] = {}
        for slot, table in self.tables.items():
            for b in table:
                assert b not in seen, f"block {b} is in the tables of slots {seen[b]} and {slot}"
                seen[b] = slot


def _spin(seconds: float) -> None:
    """Busy-wait: sleep() overshoots by ~50-100 us, which would swamp a 1 ms step."""
    end = time.perf_counter() + max(0.0, seconds)
    while time.perf_counter() < end:
        pass


class ScriptedWorker:
    """Adapts a ScriptedExecutor to the executor process's prepare/launch/copy_out steps."""

    def __init__(self, executor: ScriptedExecutor):
        self.executor = executor

    def prepare(self, plan: StepPlan) -> StepPlan:
        return plan

    def launch(self, plan: StepPlan, batch) -> list[int]:
        return self.executor.execute(plan).token_ids

    def copy_out(self, tokens: list[int]):
        return tokens, None
