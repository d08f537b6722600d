"""Plan steps ahead of the executor and reconcile their results late (that half: planner_reconcile).

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

Per-step cost is one short loop over the rows (a decode row costs a few
attribute updates) plus work proportional to what changed.  Running requests
are kept in three insertion-ordered sets, updated only when a request changes
phase, so a plan never sorts or filters everything that is running::

    _running     every RUNNING request, in admission order (preemption picks from its end)
    _prefilling  prompt (or recompute) chunks left to plan, in admission order
    _decoding    decode rows left to plan, in the order requests reached decode;
                 a request leaves it when its last length-bounded row is planned

A running request in neither of the last two is waiting for its last tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from ipc.protocol import Admit, StepPlan
from scheduler_proc.block_allocator import Pool
from scheduler_proc.host_tier import HostTier
from scheduler_proc.limits import Limits
from scheduler_proc.outputs import Detokenize, request_extras, slot_sampling
from scheduler_proc.planner_checks import check_planner
from scheduler_proc.planner_reconcile import Reconciler
from scheduler_proc.planner_restart import new_device_blocks, restart_planner
from scheduler_proc.prefix_cache import PrefixCache
from scheduler_proc.request import Request, Status
from scheduler_proc.speculation import RATE_START, DraftCounts, Speculation
from scheduler_proc.steps import InflightStep, Output, ResumeClock, StepDraft

_RUNNING = Status.RUNNING
_FINISHED = Status.FINISHED


@dataclass
class Planner(Reconciler, Speculation):
    """Intake and planning; applying returned steps and releasing requests are :class:`Reconciler`'s."""

    limits: Limits
    waiting: deque[Request] = field(default_factory=deque)
    inflight: deque[InflightStep] = field(default_factory=deque)
    # The model/revision the cached KV belongs to (part of the host tier's block keys); None: no prefix caching.
    prefix_cache_id: Optional[str] = None
    detokenize: Optional[Detokenize] = None  # ids -> text, for stop strings (None: no tokenizer)

    def __post_init__(self):
        self.blocks = new_device_blocks(self.limits, self.prefix_cache_id is not None)
        self.prefix = None if self.prefix_cache_id is None else PrefixCache(self.blocks, self.prefix_cache_id)
        self.host = HostTier.attach(self.prefix, self.limits.num_host_blocks)  # None: no host KV tier
        self.slots = Pool(self.limits.num_slots, "slot")
        self.draining: dict[int, Request] = {}  # left the plans, waiting for in-flight steps
        self._running: dict[int, Request] = {}
        self._prefilling: dict[int, Request] = {}
        self._decoding: dict[int, Request] = {}
        self._speculating: dict[int, Request] = {}  # past their prompt, speculative rows (scheduler_proc/speculation)
        self._paused: dict[int, Request] = {}  # speculating requests that kept rejecting: plain rows for a while
        self.spec_drafts = DraftCounts()
        # Blocks held by draining requests: they will come back (a shared one may not; then the wait
        # ends when its holder has drained, and the next plan preempts).
        self._draining_blocks = 0
        self._stop_refs: dict[int, int] = {}  # stop token id -> live requests that list it
        # A sampled token outside this set can only end a request by length (the fast path).
        self._stop_tokens: set[int] = set(self.limits.eos_token_ids)
        self._next_step = 0  # the id of the plan being drafted
        self._returned = -1  # every step up to this id has come back (or was voided by a restart)
        self._releases: list[int] = []  # slots freed since the last plan, for the executor
        self.num_steps_planned = 0
        self.num_preemptions = 0
        self.resumes = ResumeClock()  # preempted requests' time from readmission to their next token
        self.num_with_extras = 0  # live requests with req.extras: reconcile's slow path while > 0
        self.followers: dict[int, list[Request]] = {}  # n > 1: leader rid -> completions held until it samples

    # ------------------------------------------------------------------ intake

    @property
    def running(self) -> list[Request]:
        """Running requests in admission order (a copy)."""
        return list(self._running.values())

    def add(self, req: Request, leader: Optional[Request] = None) -> None:
        """Queue a validated request (first come, first served); raises ValueError if it cannot be served.

        With ``leader`` (another completion of the same prompt), ``req`` is held until the
        leader has sampled its first token: the prompt's blocks are published then, so
        ``req`` finds them in the prefix cache instead of computing its own copy.
        """
        req.extras = request_extras(req.sampling, len(req.prompt), self.detokenize, req.output)
        self.num_with_extras += req.extras is not None
        req.status = Status.WAITING
        req.max_output = min(req.max_tokens, self.limits.max_model_len - len(req.prompt))
        req.max_total = len(req.prompt) + req.max_output
        for t in req.stop_ids:
            self._stop_refs[t] = self._stop_refs.get(t, 0) + 1
            self._stop_tokens.add(t)
        if leader is not None and leader.status is not _FINISHED and not leader.output:
            req.held_by = leader.rid
            self.followers.setdefault(leader.rid, []).append(req)
        else:
            self.waiting.append(req)

    def release_followers(self, leader: Request) -> None:
        """The leader sampled (or left): its held completions queue now, at the front."""
        for req in reversed(self.followers.pop(leader.rid, ())):
            req.held_by = None
            self.waiting.appendleft(req)

    def abort(self, req: Request) -> Optional[Output]:
        """Finish ``req`` with reason ``abort``; its resources return once safe."""
        if req.status is _FINISHED:
            return None
        if req.held_by is not None:
            self.followers[req.held_by].remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self._finish(req, "abort")
        return Output(req, [], "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self._running) or (self.host is not None and self.host.has_pending)

    @property
    def num_inflight(self) -> int:
        return len(self.inflight)

    @property
    def prefill_ready(self) -> bool:
        """Whether the next plan would carry a prefill chunk: a running request still prefilling, or a waiting
        one with a slot and a block free (an estimate: its prefix match and block count are the plan's)."""
        return bool(self._prefilling) or (bool(self.waiting) and self.slots.can_allocate()
                                           and self.blocks.num_free > 0)

    def room_ahead(self, depth: int, prefill_ahead: bool) -> bool:
        """Whether another plan may leave now: while at most ``depth`` steps are in flight, or ``depth + 1``
        when the next plan would carry a prefill chunk and ``prefill_ahead`` is on (depth >= 1 only)."""
        return self.num_inflight <= depth + (prefill_ahead and depth > 0 and self.prefill_ready)

    # ---------------------------------------------------------------- planning

    def plan(self) -> Optional[StepPlan]:
        """The next step's plan, or None when nothing can be scheduled now.

        Decode rows first, then prefill chunks of running requests, then
        admissions, within the step's token budget.
        """
        draft = StepDraft(self.limits.max_num_batched_tokens, self._next_step)
        if self._paused:
            self._move_paused(draft.step_id)
        self._plan_decodes(draft)
        if self._speculating:
            self._plan_speculative(draft)
        self._plan_chunks(draft)
        if not draft.blocked:
            self._plan_admissions(draft)
        if not draft.rows and (self.host is None or not self.host.needs_plan(bool(self.inflight))):
            return None
        return self._emit(draft)

    def _plan_decodes(self, draft: StepDraft) -> None:
        """One row per decoding request; a block is reserved only when a row crosses into a new one."""
        decoders = list(self._decoding.values())
        if len(decoders) > draft.budget:
            decoders = decoders[: draft.budget]
        block_size, step_id = self.limits.block_size, draft.step_id
        rows, ended, crossing = draft.rows, [], []
        bulk = self.blocks.num_free >= len(decoders)  # room for a block per row: crossing rows get theirs at once
        if bulk:
            rows += decoders
        else:
            self._decode_blocks(decoders, draft)  # one at a time, waiting or preempting: the rows that can go
        draft.slots += [r.slot for r in rows]
        draft.positions += [r.num_computed for r in rows]
        fills = draft.written if self.host is not None else None  # the host tier backs up decode blocks too
        for req in rows:
            pos = req.num_computed
            if not pos % block_size:  # its blocks end here (a new one at each multiple of the block size)
                crossing.append(req)
            pos += 1
            req.num_computed = pos
            req.last_step = step_id
            if fills is not None and not pos % block_size:
                fills.append((req, pos))  # it fills a block: published (and backed up) when the step is back
            if pos + 1 >= req.max_total:
                ended.append(req)  # its last token is now in flight: a length finish, known ahead
        if bulk and crossing:
            for req, block in zip(crossing, self.blocks.allocate(len(crossing))):
                draft.appends += (req.slot, len(req.blocks), block)
                req.blocks.append(block)
        for req in ended:
            del self._decoding[req.rid]
        draft.num_decode = len(rows)
        draft.budget -= len(rows)

    def _decode_blocks(self, decoders: list[Request], draft: StepDraft) -> None:
        """Add to ``draft.rows`` the decoders that can have a row when blocks are short: each one crossing into
        a new block takes one, or waits (blocking admissions), or preempts the most recently admitted request."""
        preemptions = self.num_preemptions
        for req in decoders:
            if self.num_preemptions != preemptions and req.status is not _RUNNING:
                continue  # preempted by an earlier row of this plan
            pos = req.num_computed
            if not pos % self.limits.block_size:
                block = self.blocks.take()
                if block is not None:
                    draft.appends += (req.slot, len(req.blocks), block)
                    req.blocks.append(block)
                elif not self._reserve(req, pos + 1, draft):  # none free: wait or preempt
                    draft.blocked = True
                    continue
            draft.rows.append(req)

    def _plan_chunks(self, draft: StepDraft) -> None:
        """Prefill chunks of running requests, in admission order."""
        for req in list(self._prefilling.values()):
            if draft.budget == 0:
                break
            if req.status is not _RUNNING:
                continue  # preempted by an earlier row of this plan
            n = min(draft.budget, req.num_prefill - req.num_computed)
            if not self._reserve(req, req.num_computed + n, draft):
                draft.blocked = True
                continue
            self._chunk(req, n, draft)

    def _plan_admissions(self, draft: StepDraft) -> None:
        """Admit waiting requests, first come first served, while a slot and blocks for their first chunk are free."""
        blocks = self.blocks
        while self.waiting and draft.budget > 0 and self.slots.can_allocate():
            req = self.waiting[0]
            hit, host_hit = self._match(req) if self.prefix is not None else ([], [])
            start = (len(hit) + len(host_hit)) * self.limits.block_size
            n = min(draft.budget, req.num_known - start)
            need = blocks.blocks_for(start + n)
            if hit:
                need += blocks.num_evictable(hit) - len(hit)
            if not blocks.can_allocate(need):
                break
            self.waiting.popleft()
            req.slot = self.slots.allocate(req.rid)[0]
            req.num_prefill = req.num_known
            req.status = _RUNNING
            req.t_readmit = time.perf_counter() if req.num_preemptions else 0.0
            self._running[req.rid] = req
            self._prefilling[req.rid] = req
            sampling = slot_sampling(req, self.limits.eos_token_ids, self.limits.vocab_size)
            req.spec_k, req.spec_rate, req.spec_pauses = self.spec_drafts_for(sampling), RATE_START, 0
            req.spec_grams, req.spec_indexed = ({}, 0) if req.spec_k and self.limits.spec_lookup_ngram else (None, 0)
            # The slot's penalty state (and a speculating slot's token table) is built from every token the request
            # has, not from the chunks this admission computes: a prefix hit, an onload or a swap resume computes fewer.
            tokens = req.known_tokens(0, req.num_known) if sampling.reads_tokens or req.spec_k else []
            draft.admits.append(Admit(req.slot, sampling, tokens))
            if self.prefix is not None:
                self.prefix.admit(req, hit)  # shares the hit blocks; num_computed starts after them
                if hit:
                    draft.add_blocks(req.slot, 0, hit)
                if host_hit:
                    self.host.onload(req, host_hit, draft)  # new device blocks, copied from the host first
            self._reserve(req, start + n, draft)
            self._chunk(req, n, draft)

    def _match(self, req: Request) -> tuple[list[int], list[int]]:
        """The device and host blocks ``req`` can share (none while it is owed prompt logprobs: a
        cached block has none)."""
        extras = req.extras
        if extras is not None and extras.prompt is not None and not extras.prompt.complete:
            return [], []
        return self.prefix.match(req)

    def _chunk(self, req: Request, n: int, draft: StepDraft) -> None:
        """Add a prefill row of ``n`` tokens for ``req``; the chunk reaching its end samples."""
        start = req.num_computed
        end = start + n
        sample = end == req.num_prefill
        draft.rows.append(req)
        draft.slots.append(req.slot)
        draft.positions.append(start)
        draft.chunk_lens.append(n)
        draft.chunk_sample.append(sample)
        draft.chunk_tokens += req.known_tokens(start, end)
        draft.budget -= n
        req.num_computed = end
        req.last_step = draft.step_id
        if self.prefix is not None:
            draft.written.append((req, end))
        if sample:
            if req.t_readmit:
                draft.resumed.append(req)
            del self._prefilling[req.rid]
            if end + 1 < req.max_total:
                (self._speculating if req.spec_k else self._decoding)[req.rid] = req

    def _emit(self, draft: StepDraft) -> StepPlan:
        """Record the step as in flight and build its plan: decode rows, then prefill rows."""
        rows, chunk_lens, spec = draft.rows, draft.chunk_lens, draft.spec
        nd = draft.num_decode + len(spec)  # decode rows, then speculative rows: every one samples
        if chunk_lens:
            samplers = rows[:nd] + [r for r, s in zip(rows[nd:], draft.chunk_sample) if s]
        else:
            samplers = rows
        step_id = draft.step_id
        self._next_step = step_id + 1
        releases, self._releases = self._releases, []
        backups = self.host.send(step_id) if self.host is not None else []
        self.inflight.append(InflightStep(step_id, rows, samplers, draft.written, draft.onloaded, draft.resumed,
                                          sum(chunk_lens), len(backups) // 2, spec))
        self.num_steps_planned += 1
        return StepPlan(
            step_id=step_id,
            slots=draft.slots,
            num_tokens=[1] * draft.num_decode + [k + 1 for _, k in spec] + chunk_lens,
            positions=draft.positions,
            is_prefill=[False] * nd + [True] * len(chunk_lens),
            sample=[True] * nd + draft.chunk_sample,
            prefill_tokens=draft.chunk_tokens,
            block_appends=draft.appends,
            admits=draft.admits,
            releases=releases,
            onloads=draft.onloads,
            backups=backups,
            num_drafts=[-1] * draft.num_decode + [k for _, k in spec] + [-1] * len(chunk_lens) if spec else [],
        )

    def _reserve(self, req: Request, num_tokens: int, draft: StepDraft) -> bool:
        """Make ``req``'s blocks cover ``num_tokens`` tokens, preempting if needed."""
        need = self.blocks.blocks_for(num_tokens) - len(req.blocks)
        while need > 0 and not self.blocks.can_allocate(need):
            backups = self.host.num_device_returning if self.host is not None else 0  # free once backed up
            if self.blocks.num_free + self._draining_blocks + backups >= need:
                return False  # blocks are on their way back: wait, do not evict more
            victim = self._pick_victim(req, draft.rows)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            new = self.blocks.allocate(need)
            draft.add_blocks(req.slot, len(req.blocks), new)
            req.blocks += new
        return True

    def _pick_victim(self, req: Request, rows: list[Request]) -> Optional[Request]:
        """The most recently admitted request not already in this plan (vLLM's policy)."""
        planned = {r.rid for r in rows}
        for victim in reversed(self._running.values()):
            if victim is req or victim.rid not in planned:
                return victim
        return None

    # ------------------------------------------------------ restart, invariants

    def restart(self) -> None:
        """The executor was replaced: every running request is recomputed (see planner_restart)."""
        restart_planner(self)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody holds, on both tiers (they become free); returns how many."""
        return self.blocks.reset() + (self.host.blocks.reset() if self.host is not None else 0)

    def check_integrity(self) -> None:
        """Assert every accounting invariant; tests call this after every step."""
        check_planner(self)
