"""Bucket padding never changes outputs: the default model (float32, CPU), greedy, chunked prompts.

Servers run with ``--mixed-graphs on``: every step with a prefill chunk (and, on the torch
backend, every decode step too) is padded to a token and row bucket and run through the
mixed-step runner, called eagerly (padded tokens write no KV, padded rows sample for the
pad slot).  A small token budget chunks the prompts, so steps carry decode rows and chunks
of several requests.  At depths 0, 1 and 2 the outputs must equal a server's with the
runner off; with the host KV tier (a tiny device pool: swaps and host hits) they must equal
an untouched run's.
"""

from __future__ import annotations

import msgspec
import pytest

from tests.server_proc import assert_no_leak, wait_idle
from tests.test_output_features_model import greedy, run

pytestmark = pytest.mark.slow
FLAGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--max-num-batched-tokens", "40", "--debug-checks")
_REFERENCE: dict[str, list[list[int]]] = {}


async def _outputs(address: str, prompts: list[list[int]]) -> list[list[int]]:
    gens = [msgspec.structs.replace(greedy(x, 12, ignore_eos=True), request_id=f"r{i}") for i, x in enumerate(prompts)]
    out = await run(address, gens)
    return [out[(f"r{i}", 0)][0] for i in range(len(gens))]


@pytest.mark.parametrize("depth", [0, 1, 2])
async def test_padding_to_buckets_never_changes_outputs(depth, servers, chat_prompt_ids):
    prompts = chat_prompt_ids[:8]
    if "want" not in _REFERENCE:
        _REFERENCE["want"] = await _outputs(servers("--mixed-graphs", "off", *FLAGS).address, prompts)
    want = _REFERENCE["want"]
    assert all(len(t) == 12 for t in want)
    srv = servers("--mixed-graphs", "on", "--pipeline-depth", str(depth), *FLAGS)
    got = await _outputs(srv.address, prompts)
    assert got == want
    assert_no_leak(await wait_idle(srv.address))


async def test_host_kv_swaps_and_hits_through_the_runner(servers, model_server, chat_prompt_ids):
    """The host KV tier's onloads and backups beside padded steps: swapped and host-hit requests, same tokens."""
    from tests.test_host_kv_model import DEVICE_BLOCKS, HOST_BLOCKS, assert_tiers_whole, generate_all

    tier = servers("--mixed-graphs", "on", "--max-num-seqs", "8", "--num-kv-blocks", str(DEVICE_BLOCKS),
                          "--num-host-kv-blocks", str(HOST_BLOCKS), "--debug-checks")
    reference = model_server(1).address
    prompts = [ids + ids for ids in chat_prompt_ids[:8]]  # the tiny device pool forces preemption
    assert await generate_all(tier.address, prompts) == await generate_all(reference, prompts)
    swapped = await wait_idle(tier.address)
    assert swapped.preemptions > 0 and swapped.resumes > 0, swapped
    long = chat_prompt_ids[8] * 4  # pushed out of the device pool by the others, then sent again: a host hit
    first = await generate_all(tier.address, [long])
    for ids in chat_prompt_ids[9:12]:
        await generate_all(tier.address, [ids * 4])
    again = await generate_all(tier.address, [long])
    after = await wait_idle(tier.address)
    assert first == again == await generate_all(reference, [long])
    assert after.prefix_cache_host_hit_tokens > swapped.prefix_cache_host_hit_tokens, after
    assert_tiers_whole(after)
