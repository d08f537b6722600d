"""Speculative decoding with the default model as its own draft (CPU, float32): output identical token for token.

Three servers start together, at pipeline depths 0, 1 and 2 (2 through the mixed-step runner and the draft's graph
buckets, uncaptured), with ``--speculative-method draft --draft-model`` the default model itself: every greedy draft
is the model's own token, so every one is accepted and each row ends with the bonus token.  Each server runs a copy
prompt and a question greedily and one seeded sampled request; the depth-1 server also runs each with
``prompt_logprobs=0`` (a row that does not speculate, in the same steps): the reference of every depth.
A random-weight draft (next to no draft accepted: the rejection path) runs the same checks on one server, at depth 2.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from ipc.client import AsyncClient
from tests.server_proc import assert_no_leak, server_stats, wait_idle
from tests.test_gpu_fastpath import write_config

PASSAGE = ("The committee met on Tuesday to review the budget. It approved funding for the new library and asked "
           "the city to repair the bridge before winter.")
PROMPTS = [
    ([{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"}], {}),
    ([{"role": "user", "content": "Tell me a short joke about cats."}], {}),
    ([{"role": "user", "content": f"Repeat this text: {PASSAGE}"}], {"temperature": 0.8, "top_p": 0.95, "seed": 7}),
]
GREEDY = 2  # the first prompts are greedy
SERVER = ("--speculative-method", "draft", "--max-num-seqs", "8", "--num-kv-blocks", "128", "--max-model-len", "512",
          "--debug-checks")
DEPTHS = (1, 0, 2)  # the first runs the reference beside its speculating rows
# depth 2 through the mixed-step runner and the draft's graph buckets (uncaptured on the cpu: the replays' code path)
MIXED = {2: ("--mixed-graphs", "on")}


async def _run(srv, plain: bool):
    """Every prompt as itself (it speculates), and with ``plain`` also as a row that cannot speculate."""
    async with AsyncClient(srv.address, timeout=300) as c:
        options = [{"max_tokens": 12, "temperature": 0.0, **kw} for _, kw in PROMPTS]
        runs = [c.generate(messages=m, **o) for (m, _), o in zip(PROMPTS, options)]
        if plain:
            runs += [c.generate(messages=m, prompt_logprobs=0, **o) for (m, _), o in zip(PROMPTS, options)]
        return await asyncio.gather(*runs)


async def identical_at_every_depth(module_servers, *draft: str, depths=DEPTHS) -> dict[int, tuple[int, int]]:
    """Serve with the ``draft`` flags at ``depths`` at once (the first also runs the reference); check every output
    against the reference, the pools and the counters; the greedy requests' (drafted, accepted) per depth."""
    with ThreadPoolExecutor(len(depths)) as pool:
        started = [pool.submit(module_servers, "--pipeline-depth", str(depth), *SERVER, *draft, *MIXED.get(depth, ()))
                   for depth in depths]
        srvs = dict(zip(depths, [f.result() for f in started]))
    assert any("(the model's and the draft's KV)" in line for line in srvs[depths[0]].log)  # the plan counts it

    async def one(depth: int):
        srv = srvs[depth]
        before = await server_stats(srv.address)
        results = await _run(srv, plain=depth == depths[0])
        return before, results, await wait_idle(srv.address)

    runs = dict(zip(depths, await asyncio.gather(*[one(depth) for depth in depths])))
    for srv in srvs.values():
        srv.stop()
    reference = runs[depths[0]][1][len(PROMPTS):]
    assert all(r.timings.draft_tokens == 0 for r in reference)  # rows that cannot speculate
    counts = {}
    for depth, (before, results, after) in runs.items():
        assert_no_leak(after)
        for spec, ref in zip(results, reference):
            assert (spec.token_ids, spec.finish_reason) == (ref.token_ids, ref.finish_reason), depth
        assert all(r.timings.draft_tokens > 0 for r in results[:len(PROMPTS)]), depth  # every one speculated
        # the server's counters (its metrics) count every row, also those past a finish
        assert after.spec_draft_tokens - before.spec_draft_tokens >= sum(r.timings.draft_tokens for r in results)
        assert after.spec_accepted_tokens - before.spec_accepted_tokens >= sum(
            r.timings.accepted_tokens for r in results)
        counts[depth] = (sum(r.timings.draft_tokens for r in results[:GREEDY]),
                         sum(r.timings.accepted_tokens for r in results[:GREEDY]))
    return counts


async def test_the_model_as_its_own_draft_accepts_every_greedy_draft(module_servers, default_model_dir):
    counts = await identical_at_every_depth(module_servers, "--draft-model", default_model_dir)
    for depth, (drafted, accepted) in counts.items():
        assert accepted >= 0.95 * drafted, (depth, drafted, accepted)


async def test_a_random_draft_changes_no_output(module_servers, tmp_path_factory):
    tiny = write_config(tmp_path_factory.mktemp("draft"), vocab=49152)  # 2 layers, the default model's vocabulary
    counts = await identical_at_every_depth(module_servers, "--draft-model", tiny, "--draft-load-format", "dummy",
                                            depths=(2,))
    for depth, (drafted, accepted) in counts.items():
        assert accepted <= 0.1 * drafted, (depth, drafted, accepted)
