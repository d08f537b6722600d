"""Every small request lifecycle, at pipeline depths 0, 1 and 2, against the scripted executor.

Each case runs through :func:`tests.planner_harness.run`, which checks the
planner's integrity after every operation and, with its own ledger, that no
slot or block is handed on while an in-flight step that used it is out.  Each
case then checks what a client sees against the script's oracle (so every depth
sees the same thing): tokens, finish reason, counts, exactly one finish; and
that the pools are full at the end.

Aborts cannot give the same stream at every depth (an abort lands at another
point of a request's life when more steps are in flight): an aborted request
sees a strict prefix of its stream with reason ``abort``, or the whole stream
with its own reason when the abort came after its last token; the other
requests see exactly their streams.

Each sweep also asserts its own coverage: that the offsets it claims (EOS
with 0..depth steps in flight, aborts with 0..depth+1, preemption of a request
with steps in flight) actually happened.  ``burst`` cases reconcile every
in-flight step at once, as the server does when several results are queued
(it only differs from one at a time at depth >= 1).
"""

from __future__ import annotations

import itertools
import random

import pytest

from tests.planner_harness import (EOS, aborted_at_every_half_tick, assert_client_view, assert_drained, assert_logprobs,
                                   distinct_runs, expected, run)

DEPTHS = [0, 1, 2]
STOP = 3  # a token the script places and the request lists in stop_token_ids


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def bursts(depth: int) -> tuple[bool, ...]:
    return (False, True) if depth else (False,)


def finish_kinds(max_tokens: int):
    """(name, run kwargs, spec extras) for every finish of request 0 at every generated index."""
    yield "length", {}, {}
    for k in range(max_tokens):
        yield f"eos@{k}", {"eos_at": {0: k}}, {}
        yield f"stop@{k}", {"tokens_at": {0: {k: STOP}}}, {"stop": (STOP,)}
        yield f"ignored-eos@{k}", {"eos_at": {0: k}}, {"ignore_eos": True}


def check_case(trace, planner, ex, max_len=512, aborted=()):
    assert_drained(planner)
    assert_client_view(trace, expected(trace, ex, max_len), set(aborted))
    assert_logprobs(trace)


@pytest.mark.parametrize("depth", DEPTHS)
def test_one_request_every_finish_at_every_offset(depth):
    """Prompt ends at every block offset, in one chunk or many; every finish kind at every generated index.

    Budgets: 64 (one chunk) and each smaller one that splits the prompt; a budget that holds the whole prompt
    plans exactly what 64 does (the budget only caps a step's tokens, and one request's decode row takes 1).
    """
    stop_drops = set()
    for block_size, prompt_len, max_tokens, budget, burst in itertools.product(
            (1, 2, 3, 4), range(1, 7), range(1, 6), (1, 2, 64), bursts(depth)):
        if prompt_len <= budget < 64:
            continue
        for name, kw, extra in finish_kinds(max_tokens):
            spec = dict(prompt_len=prompt_len, max_tokens=max_tokens, **extra)
            trace, planner, ex = run([spec], depth=depth, block_size=block_size, budget=budget, burst=burst,
                                     num_blocks=blocks_for(prompt_len + max_tokens, block_size), **kw)
            check_case(trace, planner, ex)
            reason = trace.finishes["r0"][0]
            # Length finishes are known ahead; a data-dependent one wastes at most one row per step ahead.
            assert trace.dropped["r0"] <= (depth if reason == "stop" else 0), (name, trace.dropped)
            if reason == "stop":
                stop_drops.add(trace.dropped["r0"])
    assert stop_drops == set(range(depth + 1)), "EOS/stop did not land at every in-flight offset"


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("finish", ["length", "eos", "stop"])
def test_abort_at_every_point_of_a_life(depth, finish):
    """One request aborted at every half tick (before and after planning), from arrival to its finish and the
    first half tick after it (later aborts find it finished too: no-ops, see aborted_at_every_half_tick).

    A second request arrives at once with one slot between them, so it is
    aborted while waiting too; it must be untouched by the first one's abort.
    """
    seen = set()
    for prompt_len, max_tokens, budget, block_size, burst in itertools.product(
            (1, 3, 4), (1, 3, 5), (2, 64), (1, 2), bursts(depth)):
        kw = {"eos": {"eos_at": {0: max_tokens // 2}},
              "stop": {"tokens_at": {0: {max_tokens // 2: STOP}}}}.get(finish, {})
        specs = [dict(prompt_len=prompt_len, max_tokens=max_tokens, stop=(STOP,)), dict(prompt_len=2, max_tokens=3)]
        common = dict(depth=depth, budget=budget, num_slots=1, block_size=block_size, burst=burst, **kw)
        for victim in (0, 1):
            for trace, planner, ex in aborted_at_every_half_tick(specs, victim, **common):
                check_case(trace, planner, ex, aborted={f"r{victim}"})
                seen.update(trace.abort_states)
    assert {("waiting",), ("finished",)} <= seen, seen
    # At depth >= 1 a running request is always in a step in flight (unless short of blocks).
    assert {("running", n) for n in range(min(depth, 1), depth + 2)} <= seen, f"in-flight aborts covered: {seen}"


TWO_REQUEST_SCRIPTS = [
    {},
    {"eos_at": {0: 1}},
    {"tokens_at": {1: {0: STOP}}},
    {"eos_at": {0: 0, 1: 2}},
]


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("num_slots", [1, 2])
def test_two_requests_staggered_with_tight_pools(depth, num_slots):
    """Second arrival at every tick; pools from the smallest legal size up to one that never runs short (room
    for both at most); budgets 3 and 64; mixed finishes.  Larger pools, budget 3 where it never binds, and later
    arrivals once one finds the first request gone plan exactly what a run made already (distinct_runs)."""
    preempted_inflight = set()
    bs = 2
    for p0, p1, m0, script in itertools.product((1, 3, 4), (2, 3), (2, 4), TWO_REQUEST_SCRIPTS):
        specs = [dict(prompt_len=p0, max_tokens=m0), dict(prompt_len=p1, max_tokens=3, stop=(STOP,))]
        need = [blocks_for(p0 + m0, bs), blocks_for(p1 + 3, bs)]
        for burst in bursts(depth):
            for trace, planner, ex in distinct_runs(
                    specs, range(max(need), sum(need) + 1), (3, 64), num_slots, [{1: t} for t in range(6)],
                    depth=depth, block_size=bs, burst=burst, **script):
                check_case(trace, planner, ex)
                preempted_inflight |= trace.preempted_inflight
    if num_slots == 2:
        assert set(range(min(depth, 1), depth + 1)) <= preempted_inflight, f"preemptions covered: {preempted_inflight}"


@pytest.mark.parametrize("depth", DEPTHS)
def test_three_requests_staggered_preemption_and_finishes(depth):
    """Three requests, arrivals at every offset, pools from tight to one that never runs short (larger ones plan
    the same: distinct_runs), mixed finishes, bursts."""
    preempted_inflight = set()
    bs = 2
    specs = [dict(prompt_len=3, max_tokens=4, stop=(STOP,)), dict(prompt_len=2, max_tokens=3),
             dict(prompt_len=1, max_tokens=4)]
    need = [blocks_for(s["prompt_len"] + s["max_tokens"], bs) for s in specs]
    scripts = [{}, {"eos_at": {1: 1}}, {"tokens_at": {0: {2: STOP}}, "eos_at": {2: 0}}]
    for a1, a2, num_slots, burst, script in itertools.product(range(4), range(4), (2, 3), bursts(depth), scripts):
        for trace, planner, ex in distinct_runs(
                specs, range(max(need), sum(need) + 1), (4,), num_slots, [{1: a1, 2: a2}], depth=depth,
                block_size=bs, burst=burst, **script):
            check_case(trace, planner, ex)
            preempted_inflight |= trace.preempted_inflight
    assert set(range(min(depth, 1), depth + 1)) <= preempted_inflight, f"preemptions covered: {preempted_inflight}"


@pytest.mark.parametrize("depth", DEPTHS)
def test_three_requests_aborted_at_every_half_tick_in_tight_pools(depth):
    """Any of three requests aborted at every half tick, while running, preempted, waiting or done."""
    bs = 2
    specs = [dict(prompt_len=3, max_tokens=4), dict(prompt_len=2, max_tokens=4), dict(prompt_len=4, max_tokens=3)]
    need = [blocks_for(s["prompt_len"] + s["max_tokens"], bs) for s in specs]
    for victim, num_blocks, arrivals, burst in itertools.product(
            range(3), (max(need), max(need) + 2), ({1: 1, 2: 2}, {}), bursts(depth)):
        common = dict(depth=depth, num_slots=3, num_blocks=num_blocks, block_size=bs, budget=4, arrivals=arrivals,
                      burst=burst)
        for trace, planner, ex in aborted_at_every_half_tick(specs, victim, **common):
            check_case(trace, planner, ex, aborted={f"r{victim}"})


@pytest.mark.parametrize("depth,prefill_ahead", [(d, False) for d in DEPTHS] + [(1, True), (2, True)])
def test_random_small_cases_with_everything(depth, prefill_ahead):
    """1 to 3 requests, random finishes, stops, ignore_eos, arrivals, aborts, pools and bursts (and the
    server's default: plans with a prefill chunk one step further ahead)."""
    rng = random.Random(depth + 10 * prefill_ahead)
    for _ in range(1500):
        n = rng.randint(1, 3)
        bs = rng.choice((1, 2, 3, 4))
        specs, eos_at, tokens_at, aborts = [], {}, {}, {}
        for i in range(n):
            m = rng.randint(1, 6)
            spec = dict(prompt_len=rng.randint(1, 7), max_tokens=m, stop=(STOP,), ignore_eos=rng.random() < 0.2)
            if rng.random() < 0.3:  # output features: stop strings, min_tokens, logprobs
                spec.update(stop_strings=("".join(rng.choices("abcdefgh", k=rng.randint(1, 3))),),
                            min_tokens=rng.randint(0, m), logprobs=rng.choice((None, 0, 2)),
                            prompt_logprobs=rng.choice((None, 1)))
            specs.append(spec)
            if rng.random() < 0.4:
                eos_at[i] = rng.randrange(m + 1)
            if rng.random() < 0.2:
                tokens_at[i] = {rng.randrange(m + 1): STOP}
            if rng.random() < 0.3:
                aborts[i] = rng.randrange(0, 40) / 2
        need = [blocks_for(s["prompt_len"] + s["max_tokens"], bs) for s in specs]
        trace, planner, ex = run(
            specs, depth=depth, num_slots=rng.randint(1, 3), num_blocks=rng.randint(max(need), sum(need) + 2),
            block_size=bs, budget=rng.choice((1, 2, 3, 5, 64)), eos_at=eos_at, tokens_at=tokens_at,
            arrivals={i: rng.randrange(6) for i in range(n)}, aborts=aborts, burst=depth > 0 and rng.random() < 0.5,
            prefill_ahead=prefill_ahead)
        check_case(trace, planner, ex, aborted={f"r{i}" for i in aborts})


def test_eos_token_is_streamed_and_ends_the_request():
    trace, planner, _ = run([dict(prompt_len=4, max_tokens=9)], depth=1, eos_at={0: 2})
    assert trace.tokens["r0"][-1] == EOS and len(trace.tokens["r0"]) == 3
    assert trace.finishes["r0"] == ["stop"] and trace.dropped["r0"] == 1
    assert_drained(planner)


def test_short_of_blocks_waits_for_blocks_on_their_way_back():
    """r0 stops (EOS) with two steps in flight; r1 needs a block its blocks will free: it waits, nobody is evicted."""
    specs = [dict(prompt_len=2, max_tokens=6), dict(prompt_len=2, max_tokens=4)]
    trace, planner, ex = run(specs, depth=2, num_slots=2, num_blocks=6, block_size=2, eos_at={0: 3}, arrivals={1: 1})
    check_case(trace, planner, ex)
    assert planner.num_preemptions == 0
