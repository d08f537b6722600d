"""Prefix caching: the block allocator's counts, LRU and keys; the planner sharing blocks at depths 0, 1, 2.

Planner cases run through :func:`tests.planner_harness.run`, which checks after
every operation the planner's integrity (reference counts equal the requests'
block tables, keyed blocks complete in every holder's view, the LRU), and with
its ledger that a block is never shared while a step in flight writes it and
that no row writes a shared block.  The scripted executor checks that no
shared block is written and no unwritten KV is read, and the harness that the
context a request reads from shared blocks is its own.  Outputs are checked
against the script's oracle, which is also what the run without prefix
caching streams.
"""

from __future__ import annotations

import itertools
import random

import pytest

from scheduler_proc.block_allocator import BlockAllocator
from scheduler_proc.prefix_cache import PrefixCache
from tests.planner_harness import (aborted_at_every_half_tick, assert_client_view, assert_drained, expected,
                                   distinct_runs, make_request, run)

DEPTHS = [0, 1, 2]


# ------------------------------------------------------------------ allocator


def test_refcounts_share_and_release():
    a = BlockAllocator(4, 2)
    b0, b1 = a.allocate(2)
    assert a.held() == {b0: 1, b1: 1} and a.num_free == 2
    assert a.publish(b0, b"k0") and a.publish(b1, b"k1")
    assert a.match([b"k0", b"k1", b"k2"]) == [b0, b1]
    a.share([b0])
    assert a.held() == {b0: 2, b1: 1}
    a.release([b0, b1])
    assert a.held() == {b0: 1} and a.num_cached == 1 and a.num_free == 3
    a.release([b0])
    assert a.held() == {} and a.num_cached == 2 and a.num_free == 4
    a.check_integrity()
    with pytest.raises(RuntimeError):
        a.release([b0])


def test_cached_block_is_shared_out_of_the_lru_and_not_evicted():
    a = BlockAllocator(2, 1)
    b0, b1 = a.allocate(2)
    a.publish(b0, b"k0")
    a.release([b0, b1])  # b0 cached, b1 free
    assert a.num_evictable([b0, b1]) == 2
    a.share(a.match([b"k0"]))
    assert a.num_cached == 0 and a.num_free == 1
    assert a.take() == b1 and a.take() is None  # b0 is held: never evicted
    a.check_integrity()


def test_lru_evicts_least_recently_released_and_tail_blocks_first():
    a = BlockAllocator(6, 1)
    first = a.allocate(3)
    second = a.allocate(3)
    for i, b in enumerate(first + second):
        a.publish(b, bytes([i]))
    a.release(first)  # released first: older in the LRU, its tail before its head
    a.release(second)
    assert a.num_free == 6 and a.num_cached == 6
    order = [a.take() for _ in range(6)]
    assert order == first[::-1] + second[::-1]
    assert a.num_evictions == 6 and a.match([bytes([0])]) == []
    a.check_integrity()


def test_free_blocks_are_taken_before_cached_ones():
    a = BlockAllocator(3, 1)
    b0, b1, b2 = a.allocate(3)
    a.publish(b0, b"k")
    a.release([b0, b1, b2])
    assert a.take() in (b1, b2) and a.take() in (b1, b2)
    assert a.match([b"k"]) == [b0]
    assert a.take() == b0 and a.match([b"k"]) == []


def test_publish_conflicts_and_reset():
    a = BlockAllocator(3, 1)
    b0, b1, b2 = a.allocate(3)
    assert a.publish(b0, b"k")
    assert not a.publish(b1, b"k")  # the same block computed twice: the first one wins
    assert not a.publish(b0, b"other")  # a block keeps its one key
    a.publish(b2, b"k2")
    a.release([b0, b1])
    assert a.num_cached == 1  # b1 had no key: free, not cached
    assert a.reset() == 1
    assert a.match([b"k"]) == [] and a.num_cached == 0 and a.num_free == 2
    assert a.key_of(b2) == b"k2"  # a held block keeps its key
    a.check_integrity()
    with pytest.raises(RuntimeError):
        a.publish(b0, b"again")  # nobody holds it


def test_keys_chain_over_parents_model_and_secret():
    a = BlockAllocator(8, 2)
    cache = PrefixCache(a, "model-a", secret=b"s" * 32)
    r1 = make_request(0, 0, 1)
    r1.prompt = [1, 2, 3, 4, 5]
    r2 = make_request(1, 0, 1)
    r2.prompt = [9, 9, 3, 4, 5]
    k1, k2 = list(cache.keys(r1, 2)), list(cache.keys(r2, 2))
    assert len(k1) == 2 and len(set(k1)) == 2
    assert k1[1] != k2[1], "equal tokens after different parents must get different keys"
    r3 = make_request(2, 0, 1)
    r3.prompt = [1, 2, 3, 4, 7, 7]
    assert cache.keys(r3, 2) == k1, "keys depend on the blocks' tokens only"
    for other in (PrefixCache(a, "model-b", secret=b"s" * 32), PrefixCache(a, "model-a", secret=b"t" * 32)):
        r = make_request(3, 0, 1)
        r.prompt = r1.prompt
        assert set(other.keys(r, 2)).isdisjoint(k1)
    r1.output = [6, 7, 8]  # generated tokens key blocks too, once received
    assert cache.keys(r1, 4)[:2] == k1 and len(r1.block_keys) == 4


def test_keys_are_the_documented_keyed_blake2b_chain():
    from array import array
    from hashlib import blake2b

    secret = b"s" * 32
    cache = PrefixCache(BlockAllocator(8, 2), "model-a", secret=secret)
    r = make_request(0, 0, 1)
    r.prompt = [1, 2, 70000, 4, 5]
    r.output = [6, 7]
    parent = blake2b(b"model-a", key=secret, digest_size=16).digest()
    want = []
    for i in range(3):
        block = array("I", (r.prompt + r.output)[2 * i : 2 * i + 2]).tobytes()
        parent = blake2b(parent + block, key=secret, digest_size=16).digest()
        want.append(parent)
    assert cache.keys(r, 1) == want[:1] and cache.keys(r, 3) == want  # memoized, then extended


# ------------------------------------------------------------------ planner


def check(trace, planner, ex, aborted=()):
    assert_drained(planner)
    assert planner.blocks.held() == {}, "every block is free or cached with count 0"
    assert_client_view(trace, expected(trace, ex, 512), set(aborted))


def shared_prompts(prefix_len: int, suffix_lens: tuple[int, ...]) -> dict[int, list[int]]:
    """Prompts with a common prefix of ``prefix_len`` tokens and distinct suffixes."""
    prefix = [10 + i % 50 for i in range(prefix_len)]
    return {i: prefix + [100 + 10 * i + j for j in range(n)] for i, n in enumerate(suffix_lens)}


def bursts(depth: int) -> tuple[bool, ...]:
    return (False, True) if depth else (False,)


@pytest.mark.parametrize("depth", DEPTHS)
def test_shared_prefix_of_every_length_arriving_at_every_tick(depth):
    """Two requests share a prefix of every length around 1-3 blocks; the second arrives at every tick.

    Arriving while the first one's prefix is in flight, it computes the blocks
    itself (the ledger proves none was shared while being written); arriving
    later, it shares them.  A third request is the first one's next turn (its
    prompt and output), so generated blocks are shared too.
    """
    hits = {}
    for bs, burst in itertools.product((1, 2, 3, 4), bursts(depth)):
        for prefix_len, s0, s1 in itertools.product(range(3 * bs + 2), (0, 1), (0, 2)):
            if prefix_len + min(s0, s1) == 0:
                continue
            prompts = shared_prompts(prefix_len, (s0, s1))
            specs = [dict(prompt_len=0, max_tokens=3), dict(prompt_len=0, max_tokens=2)]
            # Budgets 3 and 64; arrivals at ticks 0 to 6, up to one that finds the first request gone (the runs
            # left out plan exactly what one made: distinct_runs).
            for trace, planner, ex in distinct_runs(specs, (64,), (3, 64), 4, [{1: t} for t in range(7)],
                                                    depth=depth, block_size=bs, burst=burst, prompts=prompts):
                check(trace, planner, ex)
                full = min(prefix_len, len(prompts[1]) - 1) // bs
                hit = planner.prefix.hit_tokens // bs
                assert hit <= full
                hits.setdefault(full > 0, set()).add(hit == full)
    assert hits[True] == {True, False}, "both shared and computed-again prefixes"


@pytest.mark.parametrize("depth", DEPTHS)
def test_next_turn_shares_prompt_and_generated_blocks(depth):
    """A request whose prompt is an earlier request's prompt + output shares every block that one wrote."""
    for bs, prompt_len, max_tokens in itertools.product((1, 2, 3, 4), range(1, 8), range(1, 7)):
        first = [20 + i for i in range(prompt_len)]
        trace, _, _ = run([dict(prompt_len=0, max_tokens=max_tokens)], depth=depth, block_size=bs,
                          prompts={0: first})
        turn = first + trace.tokens["r0"] + [7, 8]
        specs = [dict(prompt_len=0, max_tokens=max_tokens), dict(prompt_len=0, max_tokens=2)]
        trace, planner, ex = run(specs, depth=depth, block_size=bs, prompts={0: first, 1: turn},
                                 arrivals={1: 40})
        check(trace, planner, ex)
        written = prompt_len + max_tokens - 1  # the last token is sampled, never fed back
        assert planner.prefix.hit_tokens == min(written, len(turn) - 1) // bs * bs, (bs, prompt_len, max_tokens)


@pytest.mark.parametrize("depth", DEPTHS)
def test_abort_and_finish_at_every_offset_while_sharing(depth):
    """Three requests on one prefix, one aborted at every half tick, or stopped by EOS at every index."""
    bs = 2
    seen_hits = set()
    for prefix_len, budget, burst, victim in itertools.product((3, 4, 5), (3, 64), bursts(depth), (0, 1)):
        prompts = shared_prompts(prefix_len, (1, 2, 0))
        specs = [dict(prompt_len=0, max_tokens=4), dict(prompt_len=0, max_tokens=3), dict(prompt_len=0, max_tokens=2)]
        common = dict(depth=depth, block_size=bs, budget=budget, burst=burst, prompts=prompts,
                      arrivals={1: 1, 2: 3}, num_slots=3)
        for trace, planner, ex in aborted_at_every_half_tick(specs, victim, **common):
            check(trace, planner, ex, aborted={f"r{victim}"})
            seen_hits.add(planner.prefix.hit_tokens)
        for k in range(specs[victim]["max_tokens"]):
            trace, planner, ex = run(specs, eos_at={victim: k}, **common)
            check(trace, planner, ex)
    assert len(seen_hits) > 2, f"aborts at different points change what is shared: {seen_hits}"


@pytest.mark.parametrize("depth", DEPTHS)
def test_preemption_in_tight_pools_resumes_from_the_cache(depth):
    """Requests on one prefix in pools from the smallest legal size up (to one that never runs short: larger ones
    plan the same, see distinct_runs): preempted ones resume mostly by hits."""
    bs = 2
    resumed_hits = 0
    for prefix_len, burst, script in itertools.product((2, 4, 5), bursts(depth), ({}, {"eos_at": {1: 1}})):
        prompts = shared_prompts(prefix_len, (2, 1, 3))
        specs = [dict(prompt_len=0, max_tokens=5), dict(prompt_len=0, max_tokens=4), dict(prompt_len=0, max_tokens=3)]
        need = [-(-(len(prompts[i]) + s["max_tokens"]) // bs) for i, s in enumerate(specs)]
        for trace, planner, ex in distinct_runs(
                specs, range(max(need), sum(need) + 1), (4,), 3, [{1: t, 2: t + 1} for t in range(4)], depth=depth,
                block_size=bs, prompts=prompts, burst=burst, **script):
            check(trace, planner, ex)
            if planner.num_preemptions:
                resumed_hits += planner.prefix.hit_tokens > 0
    assert resumed_hits > 0


@pytest.mark.parametrize("depth", DEPTHS)
def test_random_shared_prefixes_with_everything(depth):
    """1 to 4 requests on 2 prefixes: random lengths, finishes, arrivals, aborts, pools, bursts; same as no cache."""
    rng = random.Random(100 + depth)
    for _ in range(600):
        n = rng.randint(1, 4)
        bs = rng.choice((1, 2, 3, 4))
        bases = [[10 + k * 40 + i for i in range(rng.randint(0, 9))] for k in range(2)]
        prompts, specs, eos_at, aborts = {}, [], {}, {}
        for i in range(n):
            prompts[i] = rng.choice(bases)[: rng.randint(0, 9)] + [200 + i] * rng.randint(1, 3)
            m = rng.randint(1, 5)
            specs.append(dict(prompt_len=0, max_tokens=m))
            if rng.random() < 0.3:
                eos_at[i] = rng.randrange(m + 1)
            if rng.random() < 0.3:
                aborts[i] = rng.randrange(0, 30) / 2
        need = [-(-(len(prompts[i]) + s["max_tokens"]) // bs) for i, s in enumerate(specs)]
        kw = dict(depth=depth, num_slots=rng.randint(1, 4), num_blocks=rng.randint(max(need), sum(need) + 2),
                  block_size=bs, budget=rng.choice((1, 2, 3, 64)), eos_at=eos_at, prompts=prompts,
                  arrivals={i: rng.randrange(8) for i in range(n)}, burst=depth > 0 and rng.random() < 0.5)
        trace, planner, ex = run(specs, aborts=aborts, **kw)
        check(trace, planner, ex, aborted={f"r{i}" for i in aborts})
        if not aborts:
            plain, _, _ = run(specs, prefix_caching=False, **kw)
            assert plain.tokens == trace.tokens and plain.finishes == trace.finishes


def test_reset_forgets_cached_blocks_only():
    prompts = shared_prompts(8, (1,))
    trace, planner, _ = run([dict(prompt_len=0, max_tokens=2)], depth=1, block_size=2, prompts=prompts)
    assert planner.blocks.num_cached == 5  # 9 prompt tokens + the first generated one written: 5 full blocks
    assert planner.reset_prefix_cache() == 5
    assert planner.blocks.num_cached == 0 and planner.blocks.num_free == planner.limits.num_kv_blocks
    planner.check_integrity()
