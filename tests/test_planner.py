"""Planner + reconciliation against the scripted executor, at depths 0, 1 and 2."""

import random

import pytest

from tests.planner_harness import EOS, assert_drained, run


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_single_request_length_finish(depth):
    trace, planner, _ = run([dict(prompt_len=5, max_tokens=7)], depth=depth)
    assert len(trace.tokens["r0"]) == 7
    assert trace.finishes["r0"] == ["length"]
    assert_drained(planner)


def test_eos_late_costs_one_row_and_same_output():
    base = None
    for depth in (0, 1, 2):
        trace, planner, _ = run([dict(prompt_len=6, max_tokens=20)], depth=depth, eos_at={0: 3})
        assert trace.tokens["r0"][-1] == EOS and len(trace.tokens["r0"]) == 4
        assert trace.finishes["r0"] == ["stop"]
        assert_drained(planner)
        base = base or trace.tokens
        assert trace.tokens == base


def test_random_workloads_identical_across_depths():
    """Random workloads at depths 0, 1 and 2, and (the first 100) at depths 1 and 2 with the server's default
    prefill_ahead: a plan with a prefill chunk may leave with depth + 1 steps in flight.  Same tokens in every
    run of a workload."""
    rng = random.Random(0)
    for case in range(200):
        n = rng.randint(1, 8)
        specs = [dict(prompt_len=rng.randint(1, 40), max_tokens=rng.randint(1, 30)) for _ in range(n)]
        eos_at = {i: rng.randint(0, 30) for i in range(n) if rng.random() < 0.5}
        arrivals = {i: rng.randint(0, 10) for i in range(n)}
        bs = rng.choice([1, 2, 4, 16])
        # The server rejects requests that could never fit the pool; so does this workload.
        need = max(-(-(s["prompt_len"] + s["max_tokens"]) // bs) for s in specs)
        kw = dict(num_slots=rng.randint(1, 4), num_blocks=need + rng.randint(0, 20), block_size=bs,
                  budget=rng.randint(8, 64), eos_at=eos_at, arrivals=arrivals)
        runs = [(0, False), (1, False), (2, False)] + [(1, True), (2, True)] * (case < 100)
        outs = []
        for depth, prefill_ahead in runs:
            trace, planner, _ = run(specs, depth=depth, prefill_ahead=prefill_ahead, **kw)
            assert_drained(planner)
            assert all(len(f) == 1 for f in trace.finishes.values()), trace.finishes
            outs.append(trace.tokens)
        assert all(out == outs[0] for out in outs), f"case {case}"


def test_prefill_ahead_plans_prefills_a_step_further():
    """With prefill_ahead (random workloads: test_random_workloads_identical_across_depths), a request arriving
    while another decodes at depth 1 gets its prefill planned with two steps already in flight."""
    from scheduler_proc.limits import Limits
    from scheduler_proc.planner import Planner
    from tests.planner_harness import make_request

    planner = Planner(Limits(4, 64, 4, 512, 64, frozenset({EOS})), prefix_cache_id="p")
    planner.add(make_request(0, prompt_len=5, max_tokens=20))
    assert planner.prefill_ready
    planner.plan(), planner.plan()  # r0's prefill, then a decode step: depth 1 is full
    assert not planner.prefill_ready and planner.num_inflight == 2
    assert not planner.room_ahead(1, True) and planner.room_ahead(2, False)
    planner.add(make_request(1, prompt_len=9, max_tokens=4))
    assert planner.prefill_ready  # the server sends one more plan now, not after the next result
    assert planner.room_ahead(1, True) and not planner.room_ahead(1, False) and not planner.room_ahead(0, True)
    plan = planner.plan()
    assert planner.num_inflight == 3 and any(plan.is_prefill) and not planner.prefill_ready
    assert not planner.room_ahead(1, True) and planner.room_ahead(2, True) == planner.room_ahead(2, False)


def test_preemption_under_tiny_pool_gives_same_tokens():
    specs = [dict(prompt_len=10, max_tokens=30) for _ in range(4)]
    ref, planner, _ = run(specs, depth=0, num_blocks=200, block_size=4)
    for depth in (0, 1, 2):
        trace, planner, _ = run(specs, depth=depth, num_blocks=12, block_size=4)
        assert trace.tokens == ref.tokens
        assert_drained(planner)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_abort_at_every_tick(depth):
    for t in range(0, 20):
        trace, planner, _ = run([dict(prompt_len=5, max_tokens=12), dict(prompt_len=3, max_tokens=12)],
                                depth=depth, aborts={0: t})
        assert len(trace.finishes["r0"]) == 1 and len(trace.finishes["r1"]) == 1
        assert trace.finishes["r1"] == ["length"] and len(trace.tokens["r1"]) == 12
        assert_drained(planner)
