"""Speculative decoding with a draft model (CPU, float32): output identical token for token.

Three servers start together with ``--speculative-method draft``: two with the default model as its own draft, at
pipeline depths 1 and 2 (2 through the mixed-step runner and the draft's graph buckets, uncaptured), where every
greedy draft is the model's own token, so every one is accepted and each row ends with the bonus token; and one with
a random-weight draft at depth 2, where next to no draft is accepted (the rejection path, with steps planned ahead).
Each server runs a copy prompt and a question greedily and one seeded sampled request; the depth-1 server also runs
each with ``prompt_logprobs=0`` (a row that does not speculate, in the same steps): the reference of every server.
Depth 0 speculates through the same verify and reconcile code with nothing ahead (tests/test_spec_e2e.py runs it).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

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
# Depth 2 runs through the mixed-step runner and the draft's graph buckets (uncaptured on the cpu: the replays' code
# path).
MIXED = ("--mixed-graphs", "on")


async def _run(srv, plain: bool):
    """Every prompt as itself (it speculates), and with ``plain`` also as a row that cannot speculate."""
    async with AsyncClient(srv.address, timeout=300) as c:
        options = [{"max_tokens": 8, "temperature": 0.0, **kw} for _, kw in PROMPTS]
        runs = [c.generate(messages=m, **o) for (m, _), o in zip(PROMPTS, options)]
        if plain:
            runs += [c.generate(messages=m, prompt_logprobs=0, **o) for (m, _), o in zip(PROMPTS, options)]
        return await asyncio.gather(*runs)


@pytest.fixture(scope="module")
def runs(module_servers, default_model_dir, tmp_path_factory) -> dict[str, tuple]:
    """The three servers started together and run at once: name -> (stats before, results, stats once idle)."""
    tiny = write_config(tmp_path_factory.mktemp("draft"), vocab=49152)  # 2 layers, the default model's vocabulary
    servers = {"self_1": ("--pipeline-depth", "1", "--draft-model", default_model_dir),
               "self_2": ("--pipeline-depth", "2", "--draft-model", default_model_dir, *MIXED),
               "random_2": ("--pipeline-depth", "2", "--draft-model", tiny, "--draft-load-format", "dummy", *MIXED)}
    with ThreadPoolExecutor(len(servers)) as pool:
        started = {name: pool.submit(module_servers, *SERVER, *flags) for name, flags in servers.items()}
        srvs = {name: f.result() for name, f in started.items()}
    assert any("(the model's and the draft's KV)" in line for line in srvs["self_1"].log)  # the plan counts it

    async def one(name: str):
        srv = srvs[name]
        before = await server_stats(srv.address)
        results = await _run(srv, plain=name == "self_1")
        return before, results, await wait_idle(srv.address)

    async def everything():
        return dict(zip(srvs, await asyncio.gather(*[one(name) for name in srvs])))

    out = asyncio.run(everything())
    for srv in srvs.values():
        srv.stop()
    return out


def identical_to_the_reference(runs, names) -> dict[str, tuple[int, int]]:
    """Check the ``names`` servers' outputs against the reference, their pools and counters; each one's greedy
    requests' (drafted, accepted)."""
    reference = runs["self_1"][1][len(PROMPTS):]
    assert all(r.timings.draft_tokens == 0 for r in reference)  # rows that cannot speculate
    counts = {}
    for name in names:
        before, results, after = runs[name]
        assert_no_leak(after)
        for spec, ref in zip(results, reference):
            assert (spec.token_ids, spec.finish_reason) == (ref.token_ids, ref.finish_reason), name
        assert all(r.timings.draft_tokens > 0 for r in results[:len(PROMPTS)]), name  # every one speculated
        # the server's counters (its metrics) are the requests' sums: nothing past a finish is counted
        assert after.spec_draft_tokens - before.spec_draft_tokens == sum(r.timings.draft_tokens for r in results)
        assert after.spec_accepted_tokens - before.spec_accepted_tokens == sum(
            r.timings.accepted_tokens for r in results)
        assert all(r.timings.accepted_tokens < len(r.token_ids) for r in results), name
        counts[name] = (sum(r.timings.draft_tokens for r in results[:GREEDY]),
                        sum(r.timings.accepted_tokens for r in results[:GREEDY]))
    return counts


def test_the_model_as_its_own_draft_accepts_every_greedy_draft(runs):
    for name, (drafted, accepted) in identical_to_the_reference(runs, ["self_1", "self_2"]).items():
        assert accepted >= 0.95 * drafted, (name, drafted, accepted)


def test_a_random_draft_changes_no_output(runs):
    for name, (drafted, accepted) in identical_to_the_reference(runs, ["random_2"]).items():
        assert accepted <= 0.1 * drafted, (name, drafted, accepted)
