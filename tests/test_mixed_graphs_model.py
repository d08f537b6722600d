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
async def test_padding_to_buckets_never_changes_outputs(depth, server_factory, chat_prompt_ids):
    prompts = chat_prompt_ids[:8]
    if "want" not in _REFERENCE:
        _REFERENCE["want"] = await _outputs(server_factory("--mixed-graphs", "off", *FLAGS).address, prompts)
    want = _REFERENCE["want"]
    assert all(len(t) == 12 for t in want)
    srv = server_factory("--mixed-graphs", "on", "--pipeline-depth", str(depth), *FLAGS)
    got = await _outputs(srv.address, prompts)
    assert got == want
    assert_no_leak(await wait_idle(srv.address))


async def test_host_kv_swaps_through_the_runner(server_factory, model_server, chat_prompt_ids):
    """The host KV tier's onloads and backups beside padded steps: preempted requests resume by copy, same tokens."""
    from tests.test_host_kv_model import DEVICE_BLOCKS, HOST_BLOCKS, assert_tiers_whole, generate_all

    prompts = [ids + ids for ids in chat_prompt_ids[:8]]
    tier = server_factory("--mixed-graphs", "on", "--max-num-seqs", "8", "--num-kv-blocks", str(DEVICE_BLOCKS),
                          "--num-host-kv-blocks", str(HOST_BLOCKS), "--debug-checks")
    reference = await generate_all(model_server(1).address, prompts)
    got = await generate_all(tier.address, prompts)
    after = await wait_idle(tier.address)
    assert got == reference
    assert after.preemptions > 0 and after.prefix_cache_host_hit_tokens > 0, after
    assert_tiers_whole(after)
