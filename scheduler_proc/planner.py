"""Plan steps ahead of the executor and reconcile their results late.

This module is pure: no sockets, no clocks, no asyncio.  The server feeds it
requests, aborts and step results, and sends the plans it makes.  Tests drive
it directly with a fake executor.

The rules (see docs/architecture.md, "Life of a step"):

* A plan assumes every request in the steps still in flight goes on.  A
  request whose ``max_tokens`` (or the context) is reached by the tokens
  already in flight is left out: length finishes cost nothing.
* KV blocks for a row are reserved when the row is planned.
* A request that finishes (EOS, stop token), is aborted or is preempted
  leaves future plans at once.  Its slot and blocks go back to the pools only
  when every in-flight step that used them has returned.
* A sampled token for a request that has finished or been aborted is dropped.
  A preempted request keeps receiving the tokens of its in-flight steps (they
  are valid) and is re-queued, to be recomputed, once they have all returned.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from ipc.protocol import Admit, SlotSampling, StepPlan, StepResult
from scheduler_proc.block_allocator import BlockAllocator, Pool
from scheduler_proc.request import Request, Status


@dataclass(frozen=True)
class PlannerLimits:
    num_slots: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    eos_token_ids: frozenset[int] = frozenset()

    def __post_init__(self):
        for name in ("num_slots", "num_kv_blocks", "block_size", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class InflightStep:
    """A step that was sent and has not come back: who is in it, who samples."""

    step_id: int
    requests: list[Request]  # every request with a row in this step, row order
    samplers: list[Request]  # requests whose row is sampled, in row order


@dataclass
class Output:
    """What a reconcile produced for one request: new tokens and maybe a finish."""

    request: Request
    new_tokens: list[int]
    finish_reason: Optional[str] = None


@dataclass
class Planner:
    limits: PlannerLimits
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    inflight: deque[InflightStep] = field(default_factory=deque)

    def __post_init__(self):
        self.blocks = BlockAllocator(self.limits.num_kv_blocks, self.limits.block_size)
        self.slots = Pool(self.limits.num_slots, "slot")
        self.draining: dict[int, Request] = {}  # left the plans, waiting for in-flight steps
        self._step_ids = itertools.count()
        self._releases: list[int] = []  # slots freed since the last plan, for the executor
        self.num_steps_planned = 0

    # ------------------------------------------------------------------ intake

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def abort(self, req: Request) -> Optional[Output]:
        """Finish ``req`` with reason ``abort``; its resources return once safe."""
        if req.status is Status.FINISHED:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        self._finish(req, "abort")
        return Output(req, [], "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_inflight(self) -> int:
        return len(self.inflight)

    # ---------------------------------------------------------------- planning

    def plan(self) -> Optional[StepPlan]:
        """The next step's plan, or None when nothing can be scheduled now."""
        budget = self.limits.max_num_batched_tokens
        rows: list[tuple[Request, int, int, bool, bool]] = []  # req, start, n, prefill, sample
        admits: list[Admit] = []
        appends: list[int] = []
        blocked = False

        # Decodes first, then chunks of requests still prefilling (running order).
        for req in sorted(self.running, key=lambda r: r.is_prefilling):
            if budget == 0:
                break
            if req.status is not Status.RUNNING or not self._wants_row(req):
                continue
            n = min(budget, req.num_prefill - req.num_computed) if req.is_prefilling else 1
            if not self._reserve(req, req.num_computed + n, appends, rows):
                blocked = True
                continue
            rows.append(self._row(req, n))
            budget -= n

        # Admissions, first come first served, only if nobody was short of blocks.
        while self.waiting and budget > 0 and not blocked and self.slots.can_allocate():
            req = self.waiting[0]
            n = min(budget, req.num_known)
            if not self.blocks.can_allocate(self.blocks.blocks_for(n)):
                break
            self.waiting.popleft()
            req.slot = self.slots.allocate(req.rid)[0]
            req.num_prefill = req.num_known
            req.status = Status.RUNNING
            self.running.append(req)
            admits.append(Admit(req.slot, self._slot_sampling(req)))
            self._reserve(req, n, appends, rows)
            rows.append(self._row(req, n))
            budget -= n

        if not rows:
            return None
        return self._emit(rows, admits, appends)

    def _wants_row(self, req: Request) -> bool:
        if req.is_prefilling:
            return True
        # Finishes known ahead: the tokens in flight already reach the limit.
        return req.num_generated < req.max_tokens and req.num_total < self.limits.max_model_len

    def _row(self, req: Request, n: int) -> tuple[Request, int, int, bool, bool]:
        prefill = req.is_prefilling
        sample = (not prefill) or req.num_computed + n == req.num_prefill
        return (req, req.num_computed, n, prefill, sample)

    def _reserve(self, req: Request, num_tokens: int, appends: list[int], rows) -> bool:
        """Make ``req``'s blocks cover ``num_tokens`` tokens, preempting if needed."""
        need = self.blocks.blocks_for(num_tokens) - len(req.blocks)
        while need > 0 and not self.blocks.can_allocate(need):
            if self.blocks.num_free + self._draining_blocks() >= need:
                return False  # blocks are on their way back: wait, do not evict more
            victim = self._pick_victim(req, rows)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            start = len(req.blocks)
            new = self.blocks.allocate(req.rid, need)
            req.blocks.extend(new)
            for i, b in enumerate(new):
                appends += (req.slot, start + i, b)
        return True

    def _draining_blocks(self) -> int:
        return sum(len(r.blocks) for r in self.draining.values())

    def _pick_victim(self, req: Request, rows) -> Optional[Request]:
        """The most recently admitted request not already in this plan (vLLM's policy)."""
        planned = {r[0].rid for r in rows}
        for victim in reversed(self.running):
            if victim is req or victim.rid not in planned:
                return victim
        return None

    def _emit(self, rows, admits, appends) -> StepPlan:
        step_id = next(self._step_ids)
        slots, num_tokens, positions, is_prefill, sample, tokens = [], [], [], [], [], []
        for req, start, n, prefill, samp in rows:
            slots.append(req.slot)
            num_tokens.append(n)
            positions.append(start)
            is_prefill.append(prefill)
            sample.append(samp)
            if prefill:
                tokens += req.known_tokens(start, start + n)
            req.num_computed = start + n
            req.num_pending += samp
            req.num_inflight_steps += 1
        self.inflight.append(
            InflightStep(step_id, [r[0] for r in rows], [r[0] for r in rows if r[4]])
        )
        self.num_steps_planned += 1
        return StepPlan(
            step_id=step_id,
            slots=slots,
            num_tokens=num_tokens,
            positions=positions,
            is_prefill=is_prefill,
            sample=sample,
            prefill_tokens=tokens,
            block_appends=appends,
            admits=admits,
            releases=self._take_releases(),
        )

    def _slot_sampling(self, req: Request) -> SlotSampling:
        s = req.sampling
        return SlotSampling(s.temperature, s.top_k if s.top_k > 0 else 0, s.top_p, s.min_p, req.seed)

    # ----------------------------------------------------------- reconciliation

    def reconcile(self, result: StepResult) -> list[Output]:
        """Apply one returned step: tokens to live requests, finishes, releases."""
        if not self.inflight or self.inflight[0].step_id != result.step_id:
            expected = self.inflight[0].step_id if self.inflight else None
            raise RuntimeError(f"step {result.step_id} returned, expected {expected}")
        step = self.inflight.popleft()
        if len(result.token_ids) != len(step.samplers):
            raise RuntimeError(
                f"step {step.step_id}: {len(result.token_ids)} tokens for {len(step.samplers)} sampled rows"
            )
        outputs: dict[int, Output] = {}
        for req, token in zip(step.samplers, result.token_ids):
            if req.status is Status.FINISHED:
                continue  # the ledger: a request that has left gets nothing more
            req.num_pending -= 1
            req.output.append(token)
            out = outputs.setdefault(req.rid, Output(req, []))
            out.new_tokens.append(token)
            reason = self._finish_reason(req, token)
            if reason:
                self._finish(req, reason)
                out.finish_reason = reason
        for req in step.requests:
            req.num_inflight_steps -= 1
            if req.num_inflight_steps == 0 and req.rid in self.draining:
                self._drained(req)
        return list(outputs.values())

    def _finish_reason(self, req: Request, token: int) -> Optional[str]:
        if token in req.stop_ids or (not req.sampling.ignore_eos and token in self.limits.eos_token_ids):
            return "stop"
        if len(req.output) >= req.max_tokens or req.num_known >= self.limits.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        was = req.status
        req.status = Status.FINISHED
        req.finish_reason = reason
        if was is Status.RUNNING:
            self.running.remove(req)
        if was in (Status.RUNNING, Status.PREEMPTED):
            self._leave(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self._leave(req)

    def _leave(self, req: Request) -> None:
        """Out of future plans; resources return now or when the last in-flight step does."""
        self.draining[req.rid] = req
        if req.num_inflight_steps == 0:
            self._drained(req)

    def _drained(self, req: Request) -> None:
        del self.draining[req.rid]
        self._release_slot(req)
        self.blocks.free(req.rid, req.blocks)
        req.blocks = []
        req.num_computed = 0
        if req.status is Status.PREEMPTED:
            # Recompute from scratch: prompt + received tokens are prefilled again.
            req.status = Status.WAITING
            self.waiting.appendleft(req)

    def _release_slot(self, req: Request) -> None:
        if req.slot is not None:
            self.slots.free(req.rid, [req.slot])
            self._releases.append(req.slot)
            req.slot = None

    def _take_releases(self) -> list[int]:
        out, self._releases = self._releases, []
        return out

    # --------------------------------------------------------------- invariants

    def check_integrity(self) -> None:
        """Assert every accounting invariant; tests call this after every step."""
        self.blocks.check_integrity()
        self.slots.check_integrity()
        inflight_count: dict[int, int] = {}
        pending_count: dict[int, int] = {}
        for step in self.inflight:
            for r in step.requests:
                inflight_count[r.rid] = inflight_count.get(r.rid, 0) + 1
            for r in step.samplers:
                if r.status is not Status.FINISHED:
                    pending_count[r.rid] = pending_count.get(r.rid, 0) + 1
        block_owner = self.blocks.owned_by()
        slot_owner = self.slots.owned_by()
        holders = list(self.running) + list(self.draining.values())
        assert len({r.rid for r in holders}) == len(holders), "a request is both running and draining"
        owned_blocks = 0
        for r in holders:
            assert r.num_inflight_steps == inflight_count.get(r.rid, 0), f"request {r.rid}: in-flight count"
            assert all(block_owner.get(b) == r.rid for b in r.blocks), f"request {r.rid}: block ownership"
            assert r.slot is not None and slot_owner.get(r.slot) == r.rid, f"request {r.rid}: slot ownership"
            assert len(r.blocks) * self.limits.block_size >= r.num_computed, f"request {r.rid}: KV beyond blocks"
            owned_blocks += len(r.blocks)
            if r.status is not Status.FINISHED:
                assert r.num_pending == pending_count.get(r.rid, 0), f"request {r.rid}: pending count"
        assert owned_blocks == len(block_owner), "a block is owned by a request that holds none"
        assert len(slot_owner) == len(holders), "a slot is owned by a request that holds none"
        for r in self.running:
            assert r.status is Status.RUNNING
            assert r.num_pending >= 0 and r.num_computed <= r.num_total
            if not r.is_prefilling:
                assert r.num_computed == r.num_total - 1, f"request {r.rid}: decode invariant"
        for r in self.waiting:
            assert r.status is Status.WAITING and r.slot is None and not r.blocks
            assert r.num_pending == 0 and r.num_inflight_steps == 0
