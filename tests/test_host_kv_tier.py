"""The host KV tier against the scripted executor: allocator rules, host hits, swaps, every offset.

The scripted executor models both tiers (``ScriptedRunner.host_kv``) and
asserts that no backup reads a device block not fully written, no onload reads
a host block whose backup is not done, and no device block is written while
it is backed up; backups complete ``backup_lag`` steps after the step that
carries them.  The harness's ledger checks the same from the plans alone, and
each case compares every stream with the script's oracle and checks that both
pools are whole at the end (``assert_drained``).
"""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from scheduler_proc.prefix_tree import PrefixTree
from scheduler_proc.host_tier import HostTier
from scheduler_proc.planner import Planner
from scheduler_proc.prefix_cache import PrefixCache
from scheduler_proc.steps import StepDraft
from tests.planner_harness import (aborted_at_every_half_tick, assert_client_view, assert_drained, assert_logprobs,
                                   distinct_runs, expected, make_request, run)

DEPTHS = [0, 1, 2]
LAGS = [0, 1, 2]
STOP = 3


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def check_case(trace, planner, ex, aborted=()):
    assert_drained(planner)
    assert_client_view(trace, expected(trace, ex, 512), set(aborted))
    assert not ex.backing_up, "a backup never completed"


# ---------------------------------------------------------------- the allocator


def tier(num_device=8, num_host=4, block_size=2):
    device = PrefixTree(num_device, block_size)
    prefix = PrefixCache(device, "m", secret=b"s" * 32)
    return device, prefix, HostTier.attach(prefix, num_host)


def test_backup_holds_the_device_block_until_done_then_the_host_has_the_key():
    device, prefix, host = tier()
    req = make_request(0, prompt_len=5, max_tokens=1)
    req.blocks = device.allocate(3)
    prefix.publish(req, 5)  # two full blocks
    assert host.num_device_busy == 2 and host.has_pending and host.needs_plan(inflight=True)
    pairs = host.send(step_id=7)
    assert pairs[0::2] == req.blocks[:2] and not host.needs_plan(inflight=True) and host.needs_plan(inflight=False)
    device.release(req.blocks)
    assert device.num_free == 6, "blocks being backed up are not room"
    host.backups_done(6)
    assert host.num_device_busy == 2 and host.blocks.match(req.block_keys) == []
    host.backups_done(7)
    assert not host.has_pending and device.num_free == 8
    assert host.blocks.match(req.block_keys) == pairs[1::2] and host.num_backups == 2
    host.check([])


def test_only_blocks_no_request_holds_count_as_returning_from_a_backup():
    """A running request's block under backup comes back to no one: a request short of blocks must not
    wait for it (it would stall while any backup is in flight) but preempt."""
    device, prefix, host = tier()
    req = make_request(0, prompt_len=5, max_tokens=1)
    req.blocks = device.allocate(3)
    prefix.publish(req, 5)
    host.send(step_id=0)
    assert host.num_device_busy == 2 and host.num_device_returning == 0
    device.release(req.blocks)  # the request left: its two backed-up blocks return once the copies are done
    assert host.num_device_returning == 2
    host.backups_done(0)
    assert host.num_device_returning == 0 and device.num_free == 8


def test_no_second_backup_of_a_key_and_skip_when_every_host_block_is_busy():
    device, prefix, host = tier(num_host=1)
    a, b = make_request(0, prompt_len=5, max_tokens=1), make_request(0, prompt_len=5, max_tokens=1)
    a.blocks, b.blocks = device.allocate(3), device.allocate(3)
    prefix.publish(a, 5)
    prefix.publish(b, 5)  # same keys: b's copies stay private, nothing more to back up
    assert host.num_device_busy == 1 and host.num_skipped == 1  # one host block: the second is skipped
    host.backups_done(host.send(0) and 0)
    c = make_request(1, prompt_len=3, max_tokens=1)
    c.blocks = device.allocate(2)
    prefix.publish(c, 3)
    assert host.num_device_busy == 1, "the LRU host block is evicted for a new backup"
    host.check([])


def test_host_hit_onloads_into_new_device_blocks_and_pins_the_host_blocks():
    device, prefix, host = tier()
    a = make_request(0, prompt_len=7, max_tokens=1)
    a.blocks = device.allocate(4)
    prefix.publish(a, 7)
    host.backups_done(host.send(0) and 0)
    device.release(a.blocks)
    device.reset()  # the device forgets: only the host has the prefix
    b = make_request(0, prompt_len=7, max_tokens=1)
    hit, host_hit = prefix.match(b)
    assert hit == [] and len(host_hit) == 3
    b.slot, draft = 5, StepDraft(64)
    host.onload(b, host_hit, draft)
    assert draft.onloads[0::2] == host_hit and draft.onloads[1::2] == b.blocks and b.num_computed == 6
    assert draft.appends == [x for i, blk in enumerate(b.blocks) for x in (5, i, blk)]
    assert host.blocks.num_free == 1, "onloading host blocks are not evictable"
    host.check(draft.onloaded)
    host.step_back(draft.onloaded, -1)
    assert host.blocks.num_free == 4 and host.hit_tokens == 6


# ----------------------------------------------------------- planner scenarios

SHARED = list(range(10, 22))  # 12 tokens: 6 blocks of 2


@pytest.mark.parametrize("lag", [1, 2])
def test_a_request_short_of_blocks_preempts_while_running_blocks_are_backed_up(lag):
    """Two requests outgrow a 10-block pool; backups of their (still held) blocks are in flight most of
    the time. Counting those as blocks on their way back made the short request wait for them, a lag's
    worth of steps per wait (22 steps at lag 2); it must preempt at once and wait only for the victim's
    own blocks: at most ``lag + 2`` steps over the run without the tier."""
    specs = [dict(prompt_len=6, max_tokens=10), dict(prompt_len=6, max_tokens=10)]
    kw = dict(depth=1, num_slots=2, num_blocks=10, block_size=2, budget=16)
    _, plain, _ = run(specs, **kw)
    trace, planner, ex = run(specs, **kw, num_host_blocks=64, backup_lag=lag)
    check_case(trace, planner, ex)
    assert plain.num_preemptions == planner.num_preemptions == 1
    assert planner.num_steps_planned <= plain.num_steps_planned + lag + 2


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("lag", LAGS)
def test_host_prefix_hit_after_device_eviction(depth, lag):
    """r0 computes a prefix, r1 (another prompt) evicts it from the device, r2 reuses it from the host."""
    specs = [dict(prompt_len=0, max_tokens=2), dict(prompt_len=0, max_tokens=2), dict(prompt_len=0, max_tokens=3)]
    prompts = {0: SHARED + [30], 1: list(range(40, 54)), 2: SHARED + [31, 32]}
    trace, planner, ex = run(specs, depth=depth, num_slots=1, num_blocks=8, block_size=2, budget=16,
                             prompts=prompts, arrivals={1: 1, 2: 2}, num_host_blocks=16, backup_lag=lag)
    check_case(trace, planner, ex)
    assert planner.host.hit_tokens == 12 and ex.num_onloads == 6
    assert planner.prefix.hit_tokens == 12, "the total counts both tiers"
    off, _, _ = run(specs, depth=depth, num_slots=1, num_blocks=8, block_size=2, budget=16, prompts=prompts,
                    arrivals={1: 1, 2: 2})
    assert off.tokens == trace.tokens


@pytest.mark.parametrize("depth", DEPTHS)
def test_two_requests_staggered_swap_at_every_offset(depth):
    """Tight device pools force preemption; the victim resumes from the host (or device) copy of its blocks.
    Device pools from the smallest legal size up to one that never runs short, short of room for both; the
    second arrival at every tick up to one that finds the first request gone (the runs left out plan exactly
    what one made: distinct_runs)."""
    bs = 2
    backup_offsets, preempted_inflight, swapped = set(), set(), 0
    for p0, m0, lag, script in itertools.product((3, 5), (4, 6), LAGS, ({}, {"eos_at": {0: 2}})):
        specs = [dict(prompt_len=p0, max_tokens=m0), dict(prompt_len=4, max_tokens=5, stop=(STOP,))]
        need = [blocks_for(p0 + m0, bs), blocks_for(9, bs)]
        for host_blocks in (1, 3, 12):
            for trace, planner, ex in distinct_runs(
                    specs, range(max(need), sum(need)), (3,), 2, [{1: t} for t in range(5)], depth=depth,
                    block_size=bs, num_host_blocks=host_blocks, backup_lag=lag, **script):
                check_case(trace, planner, ex)
                backup_offsets |= trace.ledger.backup_offsets
                preempted_inflight |= trace.preempted_inflight
                swapped += trace.swapped_in
    assert swapped > 0, "no preempted request resumed by onload"
    assert set(range(depth + 1)) <= backup_offsets, f"backups sent with in-flight steps: {backup_offsets}"
    assert set(range(min(depth, 1), depth + 1)) <= preempted_inflight, preempted_inflight


@pytest.mark.parametrize("depth", DEPTHS)
def test_shared_prefix_aborted_at_every_half_tick(depth):
    """Three requests on one prefix in a pool that evicts it; any one aborted at every half tick."""
    specs = [dict(prompt_len=0, max_tokens=3), dict(prompt_len=0, max_tokens=4), dict(prompt_len=0, max_tokens=3)]
    prompts = {0: SHARED[:7], 1: list(range(40, 47)), 2: SHARED[:9]}
    for victim, lag, arrivals in itertools.product(range(3), (0, 2), ({1: 1, 2: 3}, {1: 0, 2: 1})):
        common = dict(depth=depth, num_slots=2, num_blocks=7, block_size=2, budget=4, prompts=prompts,
                      arrivals=arrivals, num_host_blocks=6, backup_lag=lag)
        for trace, planner, ex in aborted_at_every_half_tick(specs, victim, **common):
            check_case(trace, planner, ex, aborted={f"r{victim}"})


@pytest.mark.parametrize("depth", DEPTHS)
def test_random_small_cases_with_a_host_tier(depth):
    """1 to 5 requests on two prefixes, random finishes, aborts, lags, tight device pools, host pools tiny to ample."""
    rng = random.Random(100 + depth)
    onloads, onload_offsets = 0, set()
    for _ in range(300):
        n = rng.randint(1, 5)
        bs = rng.choice((1, 2, 4))
        bases = [[4 + rng.randrange(90) for _ in range(12)] for _ in range(2)]  # they evict each other
        specs, prompts, eos_at, aborts = [], {}, {}, {}
        for i in range(n):
            m = rng.randint(1, 6)
            prompts[i] = bases[i % 2][: rng.randint(1, 12)] + [4 + rng.randrange(90) for _ in range(rng.randint(0, 3))]
            spec = dict(prompt_len=0, max_tokens=m, stop=(STOP,), ignore_eos=rng.random() < 0.2)
            if rng.random() < 0.2:  # output features; a request owed prompt logprobs takes no hit on either tier
                spec.update(stop_strings=("".join(rng.choices("abcdefgh", k=rng.randint(1, 3))),),
                            min_tokens=rng.randint(0, m), logprobs=rng.choice((None, 0, 2)),
                            prompt_logprobs=rng.choice((None, 1)))
            specs.append(spec)
            if rng.random() < 0.4:
                eos_at[i] = rng.randrange(m + 1)
            if rng.random() < 0.2:
                aborts[i] = rng.randrange(0, 40) / 2
        need = [blocks_for(len(prompts[i]) + s["max_tokens"], bs) for i, s in enumerate(specs)]
        trace, planner, ex = run(
            specs, depth=depth, num_slots=rng.randint(1, 3), num_blocks=rng.randint(max(need), max(need) + 1),
            block_size=bs, budget=rng.choice((1, 2, 3, 5, 64)), eos_at=eos_at, prompts=prompts, aborts=aborts,
            arrivals={i: i * rng.randrange(6) for i in range(n)}, burst=depth > 0 and rng.random() < 0.5,
            num_host_blocks=rng.choice((1, 2, 4, 32)), backup_lag=rng.choice(LAGS))
        check_case(trace, planner, ex, aborted={f"r{i}" for i in aborts})
        assert_logprobs(trace)
        onloads += ex.num_onloads
        onload_offsets |= trace.ledger.onload_offsets
    assert onloads > 50, onloads
    assert set(range(depth + 1)) <= onload_offsets, f"onloads sent with in-flight steps: {onload_offsets}"


@pytest.mark.parametrize("depth", [0, 2])
def test_soak_small_device_pool_larger_host_pool(depth):
    """1,000 requests on 20 prefixes, 40 device blocks and 160 host blocks: exact streams, both pools whole."""
    from tests.test_soak import prefix_workload

    specs, events = prefix_workload(seed=7 + depth)
    specs, events = specs[:1000], {k: {i: v for i, v in d.items() if i < 1000} for k, d in events.items()}
    trace, planner, ex = run(specs, depth=depth, num_slots=16, num_blocks=40, block_size=4, budget=48, max_len=96,
                             burst=depth > 0, max_steps=200_000, num_host_blocks=160, backup_lag=1, **events)
    check_case(trace, planner, ex, aborted={f"r{i}" for i in events["aborts"]})
    host = planner.host
    assert host.hit_tokens > 0 and host.num_backups > 100 and planner.num_preemptions > 0
    assert host.blocks.num_evictions > 0 or host.blocks.num_free < 160
    assert planner.blocks.held() == {} and host.blocks.held() == {}


@pytest.mark.parametrize("depth", DEPTHS)
def test_backups_taken_for_done_a_step_early_are_caught(monkeypatch, depth):
    """A planner that frees backed-up device blocks one step early is caught by the ledger and the executor,
    with the planner's own integrity check off (it would see nothing wrong: it is the planner that errs)."""
    done = HostTier.backups_done
    monkeypatch.setattr(HostTier, "backups_done", lambda self, step_id: done(self, step_id + 1))
    monkeypatch.setattr(Planner, "check_integrity", lambda self: None)
    with pytest.raises(AssertionError, match="backed up|backup never completed"):
        test_random_small_cases_with_a_host_tier(depth)


def test_decode_blocks_are_backed_up_while_the_request_runs():
    """A block filled by decode rows is published at its step's reconcile and backed up at once (swap-ready)."""
    from executor_proc.testing.scripted import ScriptedRunner
    from scheduler_proc.limits import Limits
    from scheduler_proc.request import Status

    planner = Planner(Limits(1, 16, 2, 512, 64, frozenset({2}), num_host_blocks=16), prefix_cache_id="m")
    ex = ScriptedRunner(1, 16, 2, num_host_blocks=16)
    req = make_request(0, prompt_len=3, max_tokens=9, ignore_eos=True)
    planner.add(req)
    backed_up_while_running = 0
    while planner.has_work:
        plan = planner.plan()
        if req.status is Status.RUNNING:
            backed_up_while_running += len(plan.backups) // 2
        planner.reconcile(ex.execute(plan))
        planner.check_integrity()
    full = (3 + 9 - 1) // 2  # KV of 11 tokens: the prompt and 8 decode rows
    assert backed_up_while_running == full and planner.host.num_backups == full


async def test_scripted_server_with_a_host_tier(tmp_path):
    """The real processes and protocol (StepPlan onloads/backups, StepResult completion, ServerStats): requests on
    three prefixes through a small device pool, one by one, then all at once; exact streams, both pools whole."""
    from executor_proc.testing.scripted import ScriptedRunner, expected_output
    from ipc.client import AsyncClient
    from tests.server_proc import ServerProcess, assert_no_leak, wait_idle

    srv = ServerProcess("--load-format", "scripted", "--pipeline-depth", "1", "--max-num-seqs", "4",
                        "--num-kv-blocks", "12", "--block-size", "4", "--max-model-len", "64",
                        "--num-host-kv-blocks", "64", "--debug-checks", tmpdir=str(tmp_path), timeout=120)
    script = ScriptedRunner(1, 1, 1, vocab_size=1000, eos_token_id=2)
    bases = (SHARED, list(range(70, 82)), list(range(100, 112)))  # they evict each other from 12 blocks
    prompts = {seed: bases[seed % 3][: 8 + seed % 5] + [60 + seed] * (seed % 3) for seed in range(12)}
    try:
        async with AsyncClient(srv.address, timeout=60) as client:
            async def one(seed):
                r = await client.generate(prompt_token_ids=prompts[seed], max_tokens=6 + seed % 7, temperature=0.0,
                                          seed=seed, ignore_eos=True, detokenize=False)
                want, _ = expected_output(script.token_at, seed=seed, prompt_len=len(prompts[seed]),
                                          max_tokens=6 + seed % 7, max_model_len=64, eos_token_ids=(), vocab=1000)
                assert r.token_ids == want, seed
            for seed in range(8):
                await one(seed)
            await asyncio.gather(*[one(seed) for seed in range(12)])
        s = await wait_idle(srv.address)
    finally:
        srv.stop()
    assert s.num_host_kv_blocks == 64 and s.num_free_host_kv_blocks == 64 and s.prefix_cache_host_hit_tokens > 0
    assert_no_leak(s)


@pytest.mark.parametrize("restart_at", range(1, 14))
def test_executor_restart_empties_the_host_tier_too(restart_at):
    """An executor restart with backups and onloads in flight: the planner's host tier starts empty, the new
    (empty) executor gets no onload from the old pool, and every stream is still exact."""
    from executor_proc.testing.scripted import ScriptedRunner, expected_output
    from scheduler_proc.limits import Limits

    limits = Limits(2, 10, 2, 512, 8, frozenset({2}), num_host_blocks=16)
    planner = Planner(limits, prefix_cache_id="m")
    reqs = [make_request(i, prompt_len=0, max_tokens=4, ignore_eos=True) for i in range(4)]
    for i, r in enumerate(reqs):
        r.prompt = (SHARED if i % 2 else list(range(40, 52)))[: 7 + i]
        planner.add(r)
    ex = ScriptedRunner(2, 10, 2, num_host_blocks=16, backup_lag=1)
    inflight, step = [], 0
    while planner.has_work or inflight:
        while len(inflight) < 2 and (plan := planner.plan()) is not None:
            inflight.append(plan)
        if step == restart_at:
            planner.restart()
            planner.check_integrity()
            assert not planner.host.has_pending and planner.host.blocks.num_free == 16
            ex, inflight = ScriptedRunner(2, 10, 2, num_host_blocks=16, backup_lag=1), []
        elif inflight:
            planner.reconcile(ex.execute(inflight.pop(0)))
            planner.check_integrity()
        step += 1
    for r in reqs:
        want, _ = expected_output(ex.token_at, seed=r.seed, prompt_len=len(r.prompt), max_tokens=4,
                                  max_model_len=512, eos_token_ids=())
        assert r.output == want and r.status.value == "finished"
    assert planner.blocks.num_free == 10 and not planner.host.blocks.held()


def test_a_host_pool_past_the_hosts_memory_is_refused_in_one_line():
    """--host-kv-gib / --num-host-kv-blocks beyond HOST_POOL_SHARE of the available host memory: a start-up
    refusal naming the flag and a size that fits (not the allocator's traceback)."""
    import torch

    from executor_proc.memory_plan import StartupRefused
    from executor_proc.step.host_kv import GIB, HOST_POOL_SHARE, num_host_blocks
    from ipc.config import ExecutorConfig

    cpu, block = torch.device("cpu"), 1 << 20
    assert num_host_blocks(ExecutorConfig(device="cpu", host_kv_gib=8.0), cpu, block, available=16 * GIB) == 8192
    assert num_host_blocks(ExecutorConfig(device="cpu", num_host_kv_blocks=100), cpu, block, available=GIB) == 100
    assert num_host_blocks(ExecutorConfig(device="cpu"), cpu, block, available=GIB) == 0  # off on the cpu
    for cfg, flag in ((ExecutorConfig(device="cpu", host_kv_gib=40.0), "--host-kv-gib 40"),
                      (ExecutorConfig(device="cpu", num_host_kv_blocks=10_000_000), "--num-host-kv-blocks 10,000,000")):
        with pytest.raises(StartupRefused) as e:
            num_host_blocks(cfg, cpu, block, available=16 * GIB)
        message = str(e.value)
        assert message.startswith(flag) and f"--host-kv-gib {HOST_POOL_SHARE * 16:.1f}" in message, message
        assert "\n" not in message
