"""Soak: a thousand random requests through a small KV pool, at pipeline depths 0, 1 and 2.

Random prompt and output lengths, EOS and stop tokens at random positions,
ignore_eos, staggered arrivals and random aborts, against the in-process
scripted executor.  Every request must finish exactly once; a request that was
not aborted must stream exactly the script's tokens (no token lost, doubled or
sent to another request, across preemptions and recomputes); an aborted one a
prefix of them; and every block and slot must be back at the end.  The
harness checks the planner's integrity and its in-flight ledger after every
step.
"""

from __future__ import annotations

import random

import pytest

from tests.planner_harness import assert_client_view, assert_drained, expected, run

NUM_REQUESTS = 1000
STOP = 3


def workload(seed: int):
    """Specs and events for NUM_REQUESTS requests arriving over time, about a tenth of them aborted."""
    rng = random.Random(seed)
    specs, eos_at, tokens_at, arrivals, aborts = [], {}, {}, {}, {}
    tick = 0
    for i in range(NUM_REQUESTS):
        prompt_len, max_tokens = rng.randint(1, 40), rng.randint(1, 40)
        spec = dict(prompt_len=prompt_len, max_tokens=max_tokens, seed=rng.getrandbits(62))
        kind = rng.random()
        if kind < 0.3:
            eos_at[i] = rng.randrange(max_tokens + 4)  # past max_tokens: no effect
        elif kind < 0.4:
            spec["stop"] = (STOP,)
            tokens_at[i] = {rng.randrange(max_tokens + 4): STOP}
        elif kind < 0.45:
            spec["ignore_eos"] = True
            eos_at[i] = rng.randrange(max_tokens + 4)
        tick += rng.randint(0, 10)  # about the service rate: a queue that grows and drains
        arrivals[i] = tick
        if rng.random() < 0.1:
            aborts[i] = tick + rng.randrange(0, 80) / 2
        specs.append(spec)
    return specs, dict(eos_at=eos_at, tokens_at=tokens_at, arrivals=arrivals, aborts=aborts)


@pytest.mark.parametrize("depth,burst", [(0, False), (1, False), (2, False), (1, True), (2, True)])
def test_soak_no_leak_no_lost_or_doubled_token(depth, burst):
    """``burst``: results are reconciled in batches, as the server does when several are queued."""
    specs, events = workload(seed=1234 + depth)
    max_len = 96
    trace, planner, ex = run(specs, depth=depth, num_slots=16, num_blocks=40, block_size=4, budget=48,
                             max_len=max_len, burst=burst, max_steps=200_000, **events)
    assert_drained(planner)
    aborted = {f"r{i}" for i in events["aborts"]}
    assert_client_view(trace, expected(trace, ex, max_len), aborted)
    reasons = [f[0] for f in trace.finishes.values()]
    # The workload must exercise what it claims to: every finish kind, preemption, aborts in flight.
    assert {"stop", "length", "abort"} <= set(reasons)
    assert planner.num_preemptions > 20, planner.num_preemptions
    assert any(s[0] == "running" and s[1] > 0 for s in trace.abort_states)


def prefix_workload(seed: int):
    """NUM_REQUESTS requests whose prompts start with one of 20 shared prefixes (cut at any length)."""
    rng = random.Random(seed)
    prefixes = [[4 + rng.randrange(500) for _ in range(rng.randint(4, 40))] for _ in range(20)]
    specs, prompts, eos_at, arrivals, aborts = [], {}, {}, {}, {}
    tick = 0
    for i in range(NUM_REQUESTS):
        prefix = rng.choice(prefixes)
        prompts[i] = prefix[: rng.randint(1, len(prefix))] + [4 + rng.randrange(500) for _ in range(rng.randint(0, 8))]
        max_tokens = rng.randint(1, 40)
        specs.append(dict(prompt_len=0, max_tokens=max_tokens, seed=rng.getrandbits(62)))
        if rng.random() < 0.3:
            eos_at[i] = rng.randrange(max_tokens + 4)
        tick += rng.randint(0, 8)
        arrivals[i] = tick
        if rng.random() < 0.1:
            aborts[i] = tick + rng.randrange(0, 60) / 2
    return specs, dict(prompts=prompts, eos_at=eos_at, arrivals=arrivals, aborts=aborts)


@pytest.mark.parametrize("depth,burst", [(0, False), (1, False), (2, True)])
def test_soak_shared_prefixes_no_leak(depth, burst):
    """2,000 requests on 20 prefixes with random aborts and preemptions: exact streams, every block back."""
    specs, events = prefix_workload(seed=99 + depth)
    max_len = 96
    trace, planner, ex = run(specs, depth=depth, num_slots=16, num_blocks=40, block_size=4, budget=48,
                             max_len=max_len, burst=burst, max_steps=200_000, **events)
    assert_drained(planner)
    assert planner.blocks.held() == {}
    assert_client_view(trace, expected(trace, ex, max_len), {f"r{i}" for i in events["aborts"]})
    assert planner.prefix.hit_tokens > planner.prefix.query_tokens // 10, "the workload must hit the cache"
    assert planner.blocks.num_evictions > 100 and planner.num_preemptions > 0
