"""Bucket padding never changes outputs: the default model (float32, CPU), greedy, chunked prompts.

Servers run with ``--mixed-graphs on``: every step with a prefill chunk (and, on the torch
backend, every decode step too) is padded to a token and row bucket and run through the
mixed-step runner, called eagerly (padded tokens write no KV, padded rows sample for the
pad slot).  A small token budget chunks the prompts, so steps carry decode rows and chunks
of several requests.  At depths 0, 1 and 2 (three servers run at once) the outputs must equal
the shared real-model server's (the runner off, prompts not chunked); with the host KV tier (a
tiny device pool: swaps and host hits) they must equal an untouched run's.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from tests.server_proc import assert_no_leak, wait_idle
from tests.test_output_features_model import greedy, run

pytestmark = pytest.mark.slow
FLAGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--max-num-batched-tokens", "40", "--debug-checks")
DEPTHS = [0, 1, 2]


async def _outputs(address: str, prompts: list[list[int]]) -> list[list[int]]:
    gens = [msgspec.structs.replace(greedy(x, 12, ignore_eos=True), request_id=f"r{i}") for i, x in enumerate(prompts)]
    out = await run(address, gens)
    return [out[(f"r{i}", 0)][0] for i in range(len(gens))]


@pytest.fixture(scope="module")
def padded(module_servers, model_server, chat_prompt_ids):
    """The servers with the runner on, one per depth, started together beside the shared reference server (the
    runner off, prompts not chunked); all of them run the prompts at the same time (each executor serves on one
    thread): the reference's outputs, and each depth's with its server's stats once idle."""
    prompts = chat_prompt_ids[:8]
    with ThreadPoolExecutor(len(DEPTHS)) as pool:
        started = [pool.submit(module_servers, "--mixed-graphs", "on", "--pipeline-depth", str(depth), *FLAGS)
                   for depth in DEPTHS]
        reference = model_server(1)
        srvs = dict(zip(DEPTHS, [f.result() for f in started]))

    async def on(depth: int):
        return await _outputs(srvs[depth].address, prompts), await wait_idle(srvs[depth].address)

    async def everything():
        return await asyncio.gather(_outputs(reference.address, prompts), *[on(depth) for depth in DEPTHS])

    want, *got = asyncio.run(everything())
    for srv in srvs.values():
        srv.stop()
    return want, dict(zip(DEPTHS, got))


@pytest.mark.parametrize("depth", DEPTHS)
def test_padding_to_buckets_never_changes_outputs(depth, padded):
    want, got = padded
    assert all(len(t) == 12 for t in want)
    outputs, stats = got[depth]
    assert outputs == want
    assert_no_leak(stats)


async def test_host_kv_swaps_and_hits_through_the_runner(servers, model_server, chat_prompt_ids):
    """The host KV tier's onloads and backups beside padded steps: swapped and host-hit requests, same tokens."""
    from tests.test_host_kv_model import (DEVICE_BLOCKS, HOST_BLOCKS, assert_tiers_whole, generate_all, push_out,
                                          reference_of, swap_and_hit_prompts)

    tier = servers("--mixed-graphs", "on", "--max-num-seqs", "8", "--num-kv-blocks", str(DEVICE_BLOCKS),
                   "--num-host-kv-blocks", str(HOST_BLOCKS), "--debug-checks")
    prompts, long, others = swap_and_hit_prompts(chat_prompt_ids)  # the tiny device pool forces preemption
    reference, got = await asyncio.gather(reference_of(model_server(1).address, prompts, long),
                                          generate_all(tier.address, prompts))
    assert got == reference[:len(prompts)]
    swapped = await wait_idle(tier.address)
    assert swapped.preemptions > 0 and swapped.resumes > 0, swapped
    first = await generate_all(tier.address, [long])  # pushed out of the device pool by the others, then sent
    await push_out(tier.address, others)                # again: a host hit
    again = await generate_all(tier.address, [long])
    after = await wait_idle(tier.address)
    assert first == again == reference[-1:]
    assert after.prefix_cache_host_hit_tokens > swapped.prefix_cache_host_hit_tokens, after
    assert_tiers_whole(after)
