"""Drive a Planner against a ScriptedRunner in-process, at a given pipeline depth.

The loop is the server's, one tick at a time::

    arrivals and aborts due at tick t      (before planning: `depth` steps in flight)
    plan until depth + 1 steps are in flight
    aborts due at t + 0.5                  (after planning: `depth` + 1 steps in flight)
    the executor runs the oldest plan; the planner reconciles it (or all of them, burst=True)

Besides the planner's own ``check_integrity()`` after every reconcile, arrival and abort, and after every plan
that admits, preempts, releases or moves blocks between tiers, the harness keeps an independent ledger of what each in-flight step used
(:class:`InflightLedger`) and records what a client would see (:class:`Trace`).

The planner is deterministic: its state is a function of its limits and of the calls it received (requests
added, aborts, plans, results; it reads no clock or random value that its checks look at).  Exhaustive sweeps
reach the same state many times (every abort case repeats the run without it up to the abort, every EOS case
the run without EOS up to it), so ``check_integrity()`` runs once per state and test: the harness keys
each state by a digest of that history (limits, each call's arguments and each plan it returned; a plan()
of an idle planner changes nothing and is left out) and skips the check of a state already checked in the
same test.  (Per test: a test may patch the planner.)
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from hashlib import blake2b
from itertools import chain
from typing import Optional

import msgspec

from executor_proc.testing.scripted import ScriptedRunner, expected_output, fake_logprobs
from ipc.protocol import SamplingParams, StepPlan
from scheduler_proc.limits import Limits
from scheduler_proc.planner import Output, Planner
from scheduler_proc.request import Request, Status

EOS = 2
VOCAB = 1000

_encode = msgspec.msgpack.Encoder().encode
_checked: set[bytes] = set()  # digests of the planner histories whose state was checked, in test _checked_in
_checked_in: Optional[str] = None
_last_run: list = [None, None]  # the planner run() returned last, and the digest of its history


def checked_states() -> set[bytes]:
    """The states already checked in the running test (nothing carries over: a test may patch the planner)."""
    global _checked_in
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if test != _checked_in:
        _checked.clear()
        _checked_in = test
    return _checked


def fake_detokenize(ids: list[int]) -> str:
    """The scripted tokenizer: token t is one letter (so short stop strings span a few tokens)."""
    return "".join("abcdefgh"[t % 8] for t in ids)


@dataclass
class Trace:
    """What the clients saw, per request_id, and what it cost."""

    tokens: dict[str, list[int]] = field(default_factory=dict)  # every streamed token, in order
    finishes: dict[str, list[str]] = field(default_factory=dict)  # finish reasons (exactly one expected)
    counts: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # (prompt, completion) per finish
    dropped: dict[str, int] = field(default_factory=dict)  # sampled rows whose token the ledger dropped
    requests: dict[str, Request] = field(default_factory=dict)
    logprobs: dict[str, list] = field(default_factory=dict)  # every streamed TokenLogprobs, in order
    prompt_logprobs: dict[str, list] = field(default_factory=dict)  # each prompt-logprobs list sent
    stop_strs: dict[str, Optional[str]] = field(default_factory=dict)
    steps: int = 0
    # Coverage: where each abort landed ("waiting",), ("running", steps in flight), ("finished",);
    # and how many steps each preempted request had in flight when it was preempted.
    abort_states: list[tuple] = field(default_factory=list)
    preempted_inflight: set[int] = field(default_factory=set)
    ledger: Optional["InflightLedger"] = None  # the run's ledger (host-tier counts for coverage)
    swapped_in: int = 0  # admissions of a preempted request that onloaded blocks from the host
    # What the pool and the budget bound (see distinct_runs): whether one more block could have changed a plan,
    # and the most tokens in one.
    pool_bound: bool = False
    max_step_tokens: int = 0
    arrived_idle: set[int] = field(default_factory=set)  # requests that arrived with nothing else in the planner

    def client_view(self, request_id: str) -> tuple[list[int], list[str], list[tuple[int, int]]]:
        return self.tokens[request_id], self.finishes[request_id], self.counts[request_id]


class InflightLedger:
    """Proves that no slot or block is handed on while an in-flight step that used it is out.

    It mirrors the executor's slot tables from the plans' diffs alone and
    records, per step, the slots of its rows, every block in their tables and
    the blocks its rows write.  A new plan may not release or admit a slot an
    outstanding step used, nor append a block an outstanding step used, unless
    it shares a block another live table holds (a prefix-cache hit) that no
    outstanding step writes: a block is published only once the step that
    wrote it is back.  No row may write a block that two tables hold.  An
    outstanding step is one sent and not yet reconciled.

    Host KV tier: a backed-up device block is busy from the plan that carries
    the backup until a result reports it done (``backups_done_step_id``): no
    row may write it and no plan may hand it to a new table.  An onload must
    read a host block whose backup is done and not being overwritten, into a
    block this plan gives one new table; a backup may not target a host block
    an outstanding step onloads from.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}
        self.holders: dict[int, int] = {}  # block -> live tables that hold it
        self.outstanding: deque[tuple[int, frozenset[int], frozenset[int], frozenset[int]]] = deque()
        self.num_shared_appends = 0
        self.backing_up: dict[int, int] = {}  # device block -> step that carries its backup
        self.host_pending: dict[int, int] = {}  # host block -> step that carries the backup into it
        self.host_valid: set[int] = set()  # host blocks whose backup is done
        self.onloading: dict[int, set[int]] = {}  # outstanding step -> host blocks it onloads from
        self.num_onloads = self.num_backups = 0
        # Coverage: steps outstanding when a plan with onloads / backups was sent.
        self.onload_offsets: set[int] = set()
        self.backup_offsets: set[int] = set()
        # Speculative rows: a row writes from its slot's exact length, at most the drafts in flight below its
        # planned position (each may be rejected); per outstanding step, its (slot, drafts).
        self.spec_lag: dict[int, int] = {}
        self.spec_rows: dict[int, list[tuple[int, int]]] = {}

    def sent(self, plan: StepPlan) -> None:
        used_slots: set[int] = set()
        used_blocks: set[int] = set()
        writing: set[int] = set()
        for _, slots, blocks, written in self.outstanding:
            used_slots |= slots
            used_blocks |= blocks
            writing |= written
        for slot in plan.releases:
            assert slot not in used_slots, f"step {plan.step_id} releases slot {slot}, still used in flight"
            assert slot in self.tables, f"step {plan.step_id} releases free slot {slot}"
            for b in self.tables.pop(slot):
                self.holders[b] -= 1
        for admit in plan.admits:
            assert admit.slot not in used_slots, f"step {plan.step_id} admits into slot {admit.slot}, used in flight"
            assert admit.slot not in self.tables, f"step {plan.step_id} admits into live slot {admit.slot}"
            self.tables[admit.slot] = []
        a = plan.block_appends
        for i in range(0, len(a), 3):
            slot, block = a[i], a[i + 2]
            # A block being backed up is published (complete): appending it is a prefix hit too.
            shared = self.holders.get(block, 0) > 0 or block in self.backing_up
            assert not shared or block not in writing, (
                f"step {plan.step_id} shares block {block} with slot {slot} while a step in flight writes it")
            assert shared or block not in used_blocks, (
                f"step {plan.step_id} hands block {block} to slot {slot}, used in flight")
            self.num_shared_appends += shared
            self.holders[block] = self.holders.get(block, 0) + 1
            self.tables[slot].append(block)
        self._host_diffs(plan, writing)
        bs, tables, holders, backing_up = self.block_size, self.tables, self.holders, self.backing_up
        written = set()
        spec = self.spec_rows[plan.step_id] = []
        drafts = plan.num_drafts
        for row, (slot, n, start) in enumerate(zip(plan.slots, plan.num_tokens, plan.positions)):
            table = tables[slot]
            low = start
            if drafts and drafts[row] >= 0:
                low -= self.spec_lag.get(slot, 0)
                self.spec_lag[slot] = self.spec_lag.get(slot, 0) + n - 1
                spec.append((slot, n - 1))
            if low >= start + n:
                continue
            # the blocks of positions low .. start + n - 1
            first, last = low // bs, (start + n - 1) // bs
            assert 0 <= first and last < len(table), f"step {plan.step_id}: slot {slot} writes past its blocks"
            for b in table[first:last + 1]:
                assert holders[b] == 1, f"step {plan.step_id}: slot {slot} writes block {b}, which is shared"
                assert b not in backing_up, f"step {plan.step_id}: slot {slot} writes block {b}, backed up"
                written.add(b)
        row_blocks = frozenset(chain.from_iterable(map(tables.__getitem__, plan.slots)))
        self.outstanding.append((plan.step_id, frozenset(plan.slots), row_blocks, frozenset(written)))

    def _host_diffs(self, plan: StepPlan, writing: set[int]) -> None:
        o, b = plan.onloads, plan.backups
        reading = set().union(*self.onloading.values()) if b else ()
        for host, block in zip(o[0::2], o[1::2]):
            assert host in self.host_valid and host not in self.host_pending, (
                f"step {plan.step_id} onloads host block {host}, not backed up")
            assert self.holders.get(block) == 1 and block not in self.backing_up, (
                f"step {plan.step_id} onloads into device block {block}, not a new table's")
        for block, host in zip(b[0::2], b[1::2]):
            assert block not in writing and block not in self.backing_up, (
                f"step {plan.step_id} backs up device block {block}, written or backed up in flight")
            assert host not in self.host_pending and host not in reading, (
                f"step {plan.step_id} backs up into host block {host}, busy")
            self.host_valid.discard(host)
            self.host_pending[host] = self.backing_up[block] = plan.step_id
        self.onloading[plan.step_id] = set(o[0::2])
        if o:
            self.onload_offsets.add(len(self.outstanding))
        if b:
            self.backup_offsets.add(len(self.outstanding))
        self.num_onloads += len(o) // 2
        self.num_backups += len(b) // 2

    def returned(self, step_id: int, backups_done: int = -1) -> None:
        sid = self.outstanding.popleft()[0]
        assert sid == step_id, f"step {step_id} returned, ledger expected {sid}"
        for slot, k in self.spec_rows.pop(step_id):
            self.spec_lag[slot] -= k
        del self.onloading[step_id]
        for block, s in list(self.backing_up.items()):
            if s <= backups_done:
                del self.backing_up[block]
        for host, s in list(self.host_pending.items()):
            if s <= backups_done:
                del self.host_pending[host]
                self.host_valid.add(host)


def watch_pool(blocks, trace: Trace) -> None:
    """Set ``trace.pool_bound`` when one more block in the pool could change what the planner does with ``blocks``:
    a ``can_allocate`` that says no, a ``take`` or ``allocate`` that finds too few free blocks (it evicts, or finds
    none; a larger pool's extra block, at the bottom of the free list, would be handed out).  The planner reads
    the free count itself before each plan (the harness compares it with the running requests, each of which
    may need a block), after a ``can_allocate`` that said no, and for ``prefill_ahead``."""
    can_allocate, take, allocate = blocks.can_allocate, blocks.take, blocks.allocate

    def watched_can_allocate(n: int = 1) -> bool:
        ok = can_allocate(n)
        trace.pool_bound |= not ok
        return ok

    def watched_take():
        trace.pool_bound |= blocks.num_free == blocks.num_cached
        return take()

    def watched_allocate(n: int) -> list[int]:
        trace.pool_bound |= blocks.num_free - blocks.num_cached < n
        return allocate(n)

    blocks.can_allocate, blocks.take, blocks.allocate = watched_can_allocate, watched_take, watched_allocate


def check_kv_reads(planner: Planner, ex: ScriptedRunner, step_id: int) -> None:
    """The context a step read from shared KV blocks (prefix-cache hits) is the reading request's own."""
    step = next(s for s in planner.inflight if s.step_id == step_id)
    by_slot = {r.slot: r for r in step.requests}
    for slot, start, tokens in ex.reads:
        req = by_slot[slot]
        assert tokens == req.known_tokens(start, start + len(tokens)), f"{req.request_id}: wrong KV read from cache"


def make_request(rid: int, prompt_len: int, max_tokens: int, *, seed=None, stop=(), ignore_eos=False,
                 stop_strings=(), min_tokens=0, logprobs=None, prompt_logprobs=None) -> Request:
    """A greedy request with a deterministic prompt; its seed keys the script (default: rid)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=list(stop), ignore_eos=ignore_eos,
                        stop=list(stop_strings), min_tokens=min_tokens, logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs)
    return Request(
        rid=rid, client=b"c", request_id=f"r{rid}", prompt=[5 + (rid * 7 + i) % 90 for i in range(prompt_len)],
        sampling=sp, seed=rid if seed is None else seed, max_tokens=max_tokens, stop_ids=frozenset(stop),
    )


def expected(trace: Trace, ex: ScriptedRunner, max_len: int) -> dict[str, tuple[list[int], str]]:
    """What each request of ``trace`` must stream if it is not aborted (the script's oracle)."""
    return {
        rid: expected_output(
            ex.token_at, seed=r.seed, prompt_len=len(r.prompt), max_tokens=r.max_tokens, max_model_len=max_len,
            eos_token_ids=(EOS,), stop_token_ids=r.stop_ids, ignore_eos=r.sampling.ignore_eos,
            min_tokens=r.sampling.min_tokens, vocab=VOCAB, stop_strings=r.sampling.stop, detokenize=fake_detokenize)
        for rid, r in trace.requests.items()
    }


def steps_in_flight(planner: Planner, req: Request) -> int:
    """How many of the planner's steps in flight have a row of ``req``."""
    return sum(req in step.requests for step in planner.inflight)


def check_counters(reqs) -> None:
    """No counter of any request, live or gone, may go negative."""
    for r in reqs:
        assert r.num_computed >= 0, r.request_id
        assert r.num_sent <= len(r.output), r.request_id


def run(
    specs, *, depth: int, num_slots=4, num_blocks=64, block_size=4, max_len=512, budget=64,
    eos_at=None, tokens_at=None, arrivals=None, aborts=None, burst=False, check=True, max_steps=10_000,
    prefix_caching=True, prompts=None, leaders=None, num_host_blocks=0, backup_lag=0, prefill_ahead=False,
    num_speculative_tokens=0, accept=None, lookup_ngram=0,
) -> tuple[Trace, Planner, ScriptedRunner]:
    """Run requests to completion.

    ``specs``: list of dicts for make_request.  ``arrivals[i]``: tick at which
    request i arrives (default 0).  ``aborts[i]``: tick at which request i is
    aborted: an int aborts before that tick's planning, ``t + 0.5`` after it.
    ``eos_at[i] = k``: request i's k-th generated token is EOS;
    ``tokens_at[i] = {k: token}``: its k-th generated token is ``token``.
    ``burst``: reconcile every in-flight step at once, as the server does
    when several results are queued.  ``prompts[i]``: request i's prompt
    (default: made from its id, so distinct requests share no block).
    ``leaders[i] = j``: request i is a later completion of request j's prompt (n > 1).
    ``num_host_blocks``: the host KV tier's pool (0: none); ``backup_lag``: steps a backup takes.
    ``prefill_ahead``: as the server's option, a plan with a prefill chunk may go one step further ahead.
    ``num_speculative_tokens``: drafts per speculative row (0: off); ``accept(seed, position, k)``: how many
    of a row's k drafts the script accepts (ScriptedRunner.accept); ``lookup_ngram``: n-gram drafts' shortest
    match (Limits.spec_lookup_ngram; 0: drafts in every row).
    """
    limits = Limits(num_slots, num_blocks, block_size, max_len, budget, frozenset({EOS}),
                    num_host_blocks=num_host_blocks, num_speculative_tokens=num_speculative_tokens,
                    spec_lookup_ngram=lookup_ngram)
    planner = Planner(limits, prefix_cache_id="scripted" if prefix_caching else None, detokenize=fake_detokenize)
    # What the planner was told, in order.  Request i is make_request(i, **specs[i]) with prompts[i], if given,
    # for its prompt: its spec and prompt stand for it.
    history = blake2b(repr((limits, prefix_caching)).encode(), digest_size=16)
    checked = checked_states()
    reqs = [make_request(i, **s) for i, s in enumerate(specs)]
    for i, prompt in (prompts or {}).items():
        reqs[i].prompt = list(prompt)
    eos_pos = {reqs[i].seed: len(reqs[i].prompt) + k for i, k in (eos_at or {}).items()}
    placed = {reqs[i].seed: {len(reqs[i].prompt) + k: t for k, t in at.items()} for i, at in (tokens_at or {}).items()}
    ex = ScriptedRunner(num_slots, num_blocks, block_size, vocab_size=VOCAB, eos_token_id=EOS, eos_at=eos_pos,
                        tokens_at=placed, num_host_blocks=num_host_blocks, backup_lag=backup_lag,
                        num_speculative_tokens=num_speculative_tokens, accept=accept)
    arrivals = arrivals or {}
    aborts = aborts or {}
    ids = [r.request_id for r in reqs]
    trace = Trace({i: [] for i in ids}, {i: [] for i in ids}, {i: [] for i in ids}, {i: 0 for i in ids},
                  dict(zip(ids, reqs)), {i: [] for i in ids}, {i: [] for i in ids}, {i: None for i in ids})
    ledger = InflightLedger(block_size)
    sent: deque[StepPlan] = deque()  # plans sent and not yet executed (the executor's queue)
    done: deque = deque()  # results back and not yet reconciled
    tick = 0
    preemptions = [0] * len(reqs)  # per request, as of the last plan that preempted anyone

    def emit(outputs: list[Output]) -> None:
        for out in outputs:
            rid = out.request.request_id
            assert not trace.finishes[rid], f"{rid}: output after its finish"
            trace.tokens[rid] += out.new_tokens
            out.request.num_sent = len(out.request.output)
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_tokens), f"{rid}: logprobs not parallel to tokens"
                trace.logprobs[rid] += out.logprobs
            if out.prompt_logprobs is not None:
                trace.prompt_logprobs[rid].append(out.prompt_logprobs)
            if out.stop_str is not None:
                trace.stop_strs[rid] = out.stop_str
            if out.finish_reason:
                trace.finishes[rid].append(out.finish_reason)
                trace.counts[rid].append((len(out.request.prompt), len(out.request.output)))
                assert len(out.request.output) == len(trace.tokens[rid]), f"{rid}: completion count"

    due: dict[float, list[tuple[bool, int]]] = {}  # half tick -> (is_abort, request index), in order
    for i in range(len(reqs)):
        due.setdefault(arrivals.get(i, 0), []).append((False, i))
    for i, at in sorted(aborts.items()):
        due.setdefault(max(at, arrivals.get(i, 0)), []).append((True, i))
    last_event = max(due)

    def events(at: float) -> None:
        happening = due.pop(at, ())
        for is_abort, i in happening:
            r = reqs[i]
            if not is_abort:
                leader = (leaders or {}).get(i)
                if not (planner.has_work or planner.draining or planner.inflight):
                    trace.arrived_idle.add(i)
                history.update(b"add %r %r" % ((i, specs[i], (prompts or {}).get(i)), leader))
                planner.add(r, None if leader is None else reqs[leader])
                continue
            live = r.status is Status.RUNNING or r.status is Status.PREEMPTED
            trace.abort_states.append(("running", steps_in_flight(planner, r)) if live else (r.status.value,))
            history.update(b"abort %d" % i)
            out = planner.abort(r)
            if out:
                emit([out])
        if check and happening:  # nothing changed at a tick without arrivals or aborts
            check_integrity()

    def check_integrity() -> None:
        """The planner's own checks, unless its history led to this state before (then they passed)."""
        key = history.digest()
        if key not in checked:
            planner.check_integrity()
            checked.add(key)

    def record_preemptions() -> None:
        """Note how many steps each request preempted by the last plan still had in flight."""
        for i, r in enumerate(reqs):
            if r.num_preemptions > preemptions[i]:
                trace.preempted_inflight.add(steps_in_flight(planner, r))
                preemptions[i] = r.num_preemptions

    def execute(plan: StepPlan):
        result = ex.execute(plan)
        if check:
            check_kv_reads(planner, ex, plan.step_id)
        return result

    def reconcile_one() -> None:
        result = done.popleft()
        step = planner.inflight[0]
        for r in step.samplers:
            trace.dropped[r.request_id] += r.status is Status.FINISHED
        history.update(b"result " + _encode(msgspec.structs.replace(result, t_start=0.0, t_end=0.0)))
        emit(planner.reconcile(result))
        ledger.returned(result.step_id, result.backups_done_step_id)
        if check:
            check_integrity()
            check_counters(step.requests)
        trace.steps += 1

    watch_pool(planner.blocks, trace)
    while True:
        events(tick)
        while planner.room_ahead(depth, prefill_ahead):
            if planner.blocks.num_free < len(planner._running):  # its decode rows might not all get a block at once
                trace.pool_bound = True
            before = planner.num_preemptions
            idle = not (planner.has_work or planner.draining or planner.inflight)
            plan = planner.plan()
            if idle:  # nothing running, waiting, draining or in flight: plan() reads empty sets, changes nothing
                assert plan is None, "a plan from an idle planner"
            else:
                history.update(b"plan " + (b"-" if plan is None else _encode(plan)))
            if planner.num_preemptions != before:
                record_preemptions()
            if plan is None:
                break
            if plan.onloads:
                by_slot, targets, a = {r.slot: r for r in planner.running}, set(plan.onloads[1::2]), plan.block_appends
                onloaded = {a[i] for i in range(0, len(a), 3) if a[i + 2] in targets}
                trace.swapped_in += sum(by_slot[slot].num_preemptions > 0 for slot in onloaded)
            ledger.sent(plan)
            sent.append(plan)
            trace.max_step_tokens = max(trace.max_step_tokens, sum(plan.num_tokens))
            # after a plan that admitted, preempted, released or moved blocks between tiers; every plan's state is
            # checked again after the next reconcile (a plan of decode rows alone only appends blocks: half the
            # plans, and the checks are most of this harness's time)
            if check and (plan.admits or plan.releases or plan.onloads or plan.backups
                          or planner.num_preemptions != before):
                check_integrity()
        events(tick + 0.5)
        if not sent:
            if not planner.has_work and not planner.draining and tick >= last_event:
                break
        else:
            done.append(execute(sent.popleft()))
            while burst and sent:
                done.append(execute(sent.popleft()))
            while done:
                reconcile_one()
        tick += 1
        assert tick < max_steps, "no progress"
    trace.ledger = ledger
    _last_run[:] = planner, history.digest()
    return trace, planner, ex


def distinct_runs(specs, pools, budgets, num_slots: int, arrivals=({},), **kw):
    """``run(specs, num_blocks=n, budget=b, num_slots=num_slots, arrivals=a, **kw)`` over the pools ``n``, budgets
    ``b`` and arrivals ``a`` of a sweep, leaving out the runs that plan exactly what one made already; yields each
    run's (trace, planner, executor).

    - A pool's size enters the planner only through its free count: a run in which one more block could not
      have changed a decision (``trace.pool_bound`` false, see watch_pool) plans the same in every larger pool,
      with the same blocks (the extra ones stay at the bottom of the free list).  The pools (ascending) stop
      there.
    - The budget only caps a plan's tokens: where the largest budget's run at that pool planned fewer than ``b``
      tokens in every step and there are at most ``b`` slots, budget ``b`` never binds.
    - ``arrivals``: dicts request -> tick, each the one before with every tick one later.  When the first of
      those requests found the planner idle (nothing running, waiting, draining or in flight), every later
      shift is the same run later on: an idle planner's ``plan()`` changes nothing.
    """
    assert not kw.get("prefill_ahead") and not kw.get("num_speculative_tokens"), "they read the pool and budget too"
    assert "aborts" not in kw, "an abort at a fixed tick does not shift with the arrivals"
    budgets = sorted(budgets, reverse=True)
    made: dict[tuple, Trace] = {}  # (arrivals index, budget, pool) -> the run made there, or the one it repeats
    idle: dict[tuple, Trace] = {}  # (budget, pool) -> a run whose shifted arrivals found the planner idle
    for i, late in enumerate(arrivals):
        first = min(late, key=late.get) if late else None
        for b in budgets:
            for n in pools:
                trace = idle.get((b, n))
                largest = made.get((i, budgets[0], n))
                if trace is None and largest is not None and largest.max_step_tokens < b and num_slots <= b:
                    trace = largest
                if trace is None:
                    trace, planner, ex = run(specs, num_blocks=n, budget=b, num_slots=num_slots, arrivals=late, **kw)
                    yield trace, planner, ex
                made[i, b, n] = trace
                if first in trace.arrived_idle:
                    idle.setdefault((b, n), trace)
                if not trace.pool_bound:
                    break


def aborted_at_every_half_tick(specs, victim: int, **kw):
    """``run(specs, aborts={victim: t}, **kw)`` for t = 0, 0.5, 1, ... up to the first abort that finds the victim
    finished, yielding each run's (trace, planner, executor).  Every later abort finds it finished too: a no-op
    (``Planner.abort`` returns at once), so each of those runs is the run without the abort."""
    half = 0
    while True:
        trace, planner, ex = run(specs, aborts={victim: half / 2}, **kw)
        yield trace, planner, ex
        if trace.abort_states == [("finished",)]:
            return
        half += 1


def assert_drained(planner: Planner) -> None:
    """Every block and slot is back in its pool and nothing is left anywhere.

    The planner's own checks run unless ``planner`` is the one run() returned last and its final state was
    checked there (the end of a run plans nothing: its last state is the one after the last result or event)."""
    if not (planner is _last_run[0] and _last_run[1] in checked_states()):
        planner.check_integrity()
    assert planner.blocks.num_free == planner.limits.num_kv_blocks
    assert planner.slots.num_free == planner.limits.num_slots
    if planner.host is not None:
        assert not planner.host.has_pending and not planner.host.blocks.held(), "host blocks still busy"
    assert not planner.running and not planner.waiting and not planner.draining and not planner.inflight


def assert_client_view(trace: Trace, oracle: dict[str, tuple[list[int], str]],
                       aborted: Optional[set[str]] = None) -> None:
    """Exactly one finish per request; tokens and counts as the oracle says.

    An aborted request's stream is either the whole expected stream with its
    natural finish (the abort came after its last token) or a strict prefix of
    it with reason ``abort``.
    """
    aborted = aborted or set()
    for rid, (want, reason) in oracle.items():
        got, finishes, counts = trace.client_view(rid)
        assert len(finishes) == 1, f"{rid}: finishes {finishes}"
        prompt_len = len(trace.requests[rid].prompt)
        assert counts == [(prompt_len, len(got))], f"{rid}: counts {counts}, {len(got)} tokens"
        if rid in aborted and finishes[0] == "abort":
            assert len(got) < len(want) and got == want[: len(got)], f"{rid}: {got} is not a prefix of {want}"
        else:
            assert (got, finishes[0]) == (want, reason), f"{rid}: got {got} {finishes}, want {want} {reason}"


def assert_logprobs(trace: Trace) -> None:
    """Every token of a request that asked has its own logprobs, and the prompt's came exactly once, whole."""
    for rid, req in trace.requests.items():
        s, p = req.sampling, len(req.prompt)
        if s.logprobs is None:
            assert not trace.logprobs[rid], f"{rid}: logprobs it did not ask for"
        else:
            want = [fake_logprobs(t, p + k, s.logprobs, VOCAB) for k, t in enumerate(trace.tokens[rid])]
            assert trace.logprobs[rid] == want, f"{rid}: logprobs lost, duplicated or misplaced"
        if s.prompt_logprobs is None or trace.finishes[rid] == ["abort"]:
            assert len(trace.prompt_logprobs[rid]) <= (s.prompt_logprobs is not None), rid
            continue
        want = [None] + [fake_logprobs(req.prompt[q], q, s.prompt_logprobs, VOCAB) for q in range(1, p)]
        assert trace.prompt_logprobs[rid] == [want], f"{rid}: prompt logprobs {trace.prompt_logprobs[rid]}"
