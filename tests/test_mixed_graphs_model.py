"""Bucket padding never changes outputs: the default model (float32, CPU), greedy, chunked prompts.

Servers run with ``--mixed-graphs on``: every step with a prefill chunk (and, on the torch
backend, every decode step too) is padded to a token and row bucket and run through the
mixed-step runner, called eagerly (padded tokens write no KV, padded rows sample for the
pad slot).  A small token budget chunks the prompts, so steps carry decode rows and chunks
of several requests.  At depths 0, 1 and 2 the outputs must equal a server's with the
runner off.
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
