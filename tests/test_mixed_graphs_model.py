"""Bucket padding never changes outputs: the default model (float32, CPU), greedy, chunked prompts.

Servers run with ``--mixed-graphs on``: every step with a prefill chunk (and, on the torch
backend, every decode step too) is padded to a token and row bucket and run through the
mixed-step runner, called eagerly (padded tokens write no KV, padded rows sample for the
pad slot).  A small token budget chunks the prompts, so steps carry decode rows and chunks
of several requests.  At depths 0, 1 and 2 (three servers run at once) the outputs must equal
the shared real-model server's (the runner off, prompts not chunked).  The depth-1 server is
also the host KV tier's (a tiny device pool): its requests are swapped and a long prompt hits
the host tier, beside padded steps (tests/test_host_kv_model.py's workload).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from tests.server_proc import assert_no_leak, wait_idle
from tests.test_host_kv_model import (BLOCK, DEVICE_BLOCKS, HOST_BLOCKS, assert_tiers_whole, generate_all,
                                      push_out, swap_and_hit_prompts)
from tests.test_output_features_model import greedy, run

pytestmark = pytest.mark.slow
FLAGS = ("--max-num-seqs", "8", "--max-num-batched-tokens", "40", "--debug-checks")
POOLS = {0: ("--num-kv-blocks", "256"), 2: ("--num-kv-blocks", "256"),  # depth 1: the host tier's tiny device pool
         1: ("--num-kv-blocks", str(DEVICE_BLOCKS), "--num-host-kv-blocks", str(HOST_BLOCKS))}


async def _outputs(address: str, prompts: list[list[int]]) -> list[list[int]]:
    gens = [msgspec.structs.replace(greedy(x, 12, ignore_eos=True), request_id=f"r{i}") for i, x in enumerate(prompts)]
    out = await run(address, gens)
    return [out[(f"r{i}", 0)][0] for i in range(len(gens))]


async def _tiered(address: str, prompts: list[list[int]], long: list[int], others: list[list[int]]) -> dict:
    """The prompts at once (the device pool preempts them), then ``long`` alone, pushed out of the device pool by
    the others, and sent again: a host hit."""
    got = await generate_all(address, prompts)
    swapped = await wait_idle(address)
    first = await generate_all(address, [long])
    await push_out(address, others)
    pushed = await wait_idle(address)
    again = await generate_all(address, [long])
    return dict(got=got, swapped=swapped, first=first, pushed=pushed, again=again, after=await wait_idle(address))


@pytest.fixture(scope="module")
def padded(module_servers, model_server, chat_prompt_ids):
    """The servers with the runner on, one per depth, started together beside the shared reference server (the
    runner off, prompts not chunked); all of them run at the same time (each executor serves on one thread):
    depths 0 and 2 the chat prompts, depth 1 the host tier's workload, the reference both.  The reference's
    outputs, each depth's with its server's stats once idle."""
    prompts = chat_prompt_ids[:8]
    tier_prompts, long, others = swap_and_hit_prompts(chat_prompt_ids)
    with ThreadPoolExecutor(len(POOLS)) as pool:
        started = {depth: pool.submit(module_servers, "--mixed-graphs", "on", "--pipeline-depth", str(depth),
                                      *flags, *FLAGS) for depth, flags in POOLS.items()}
        reference = model_server(1)
        srvs = {depth: f.result() for depth, f in started.items()}

    async def on(depth: int):
        return await _outputs(srvs[depth].address, prompts), await wait_idle(srvs[depth].address)

    async def everything():
        return await asyncio.gather(_outputs(reference.address, prompts),
                                    generate_all(reference.address, tier_prompts + [long]), on(0), on(2),
                                    _tiered(srvs[1].address, tier_prompts, long, others))

    want, tier_want, *got, tiered = asyncio.run(everything())
    for srv in srvs.values():
        srv.stop()
    return dict(want=want, got=dict(zip((0, 2), got)), tier_want=tier_want, tiered=tiered)


@pytest.mark.parametrize("depth", [0, 2])
def test_padding_to_buckets_never_changes_outputs(depth, padded):
    """Depth 1: the next test."""
    want = padded["want"]
    assert all(len(t) == 12 for t in want)
    outputs, stats = padded["got"][depth]
    assert outputs == want
    assert_no_leak(stats)


def test_host_kv_swaps_and_hits_through_the_runner(padded):
    """Depth 1, the host KV tier's onloads and backups beside padded steps: swapped and host-hit requests, the
    reference's tokens."""
    reference, run = padded["tier_want"], padded["tiered"]
    assert run["got"] == reference[:-1]
    swapped = run["swapped"]
    assert swapped.preemptions > 0 and swapped.resumes > 0, swapped
    assert run["first"] == run["again"] == reference[-1:]
    host_hits = run["after"].prefix_cache_host_hit_tokens - run["pushed"].prefix_cache_host_hit_tokens
    assert host_hits >= BLOCK * 3, f"expected the long prompt's blocks from the host, got {host_hits} tokens"
    assert_tiers_whole(run["after"])
