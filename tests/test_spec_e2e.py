"""Speculative decoding (n-gram) on the default model on the CPU: output identical token for token, greedy and seeded.

One server per pipeline depth with ``--speculative-method ngram``, all three at once.  At depth 1 each prompt runs
twice at once: as itself (it speculates) and with ``prompt_logprobs=0`` (a row that does not speculate, in the same steps),
the reference of every depth.  The prompts ask to copy or edit
a given text (drafts found in the prompt get accepted) or for something new (little is), one stop string falls
inside an accepted run, one asks for logprobs (each token's own, accepted runs included), one has penalties,
logit_bias and min_tokens, and one is sampled with a
seed (a sampled row accepts a draft when the sampler's keyed draw at that position is the draft: the plain sampler's
output).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import msgspec

from ipc import protocol as p
from ipc.client import AsyncClient
from ipc.gateway.metrics import render
from executor_proc.testing.scripted import ScriptedRunner, expected_output
from tests.server_proc import assert_no_leak, server_stats, wait_idle

PASSAGE = ("The committee met on Tuesday to review the budget. It approved funding for the new library and asked "
           "the city to repair the bridge before winter.")
PROMPTS = [
    ([{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"}],
     {"logprobs": 2}),  # each token's own logprobs, accepted runs included
    ([{"role": "user", "content": "Correct the spelling in this text and write it out again: The commitee met on "
                                  "Tuesday to reveiw the budget. It aproved funding for the new library."}],
     {"stop": ["budget"]}),
    ([{"role": "user", "content": "Tell me a short joke about cats."}], {}),
    ([{"role": "user", "content": f"Repeat this text: {PASSAGE}"}], {"temperature": 0.8, "top_p": 0.95, "seed": 7}),
    ([{"role": "user", "content": f"Copy this text: {PASSAGE}"}],  # penalties see the drafts before each position
     {"repetition_penalty": 1.2, "frequency_penalty": 0.3, "presence_penalty": 0.1, "min_tokens": 8,
      "logit_bias": {13: -2.0}}),
]

SERVER = ("--speculative-method", "ngram", "--max-num-seqs", "8", "--num-kv-blocks", "128", "--max-model-len", "512",
          "--debug-checks")


async def _run(srv, plain: bool):
    """Every prompt as itself (it speculates), and with ``plain`` also as a row that cannot speculate."""
    async with AsyncClient(srv.address, timeout=300) as c:
        options = [{"max_tokens": 12, "temperature": 0.0, **kw} for _, kw in PROMPTS]
        runs = [c.generate(messages=m, **o) for (m, _), o in zip(PROMPTS, options)]
        if plain:  # prompt logprobs: a row that cannot speculate
            runs += [c.generate(messages=m, prompt_logprobs=0, **o) for (m, _), o in zip(PROMPTS, options)]
        return await asyncio.gather(*runs)


async def test_greedy_identical_with_and_without_speculation_at_every_depth(module_servers):
    """Depth 1 runs the reference beside the speculating rows; depths 0 and 2 must give the same tokens.  The three
    servers start together and run at the same time (each executor serves on one thread)."""
    depths = (1, 0, 2)
    # depth 2 through the mixed-step runner (uncaptured on the cpu: the code path of the graphs' replays)
    mixed = {2: ("--mixed-graphs", "on", "--max-num-seqs", "64")}
    with ThreadPoolExecutor(len(depths)) as pool:
        started = [pool.submit(module_servers, "--pipeline-depth", str(depth), *SERVER, *mixed.get(depth, ()))
                   for depth in depths]
        srvs = dict(zip(depths, [f.result() for f in started]))
    # the start-up line says that it speculates, and how
    assert any("speculation: 4 tokens a step from n-grams of 1-4 tokens" in line for line in srvs[1].log), srvs[1].log

    async def one(depth: int):
        srv = srvs[depth]
        before = await server_stats(srv.address)
        results = await _run(srv, plain=depth == 1)
        return before, results, await server_stats(srv.address)

    runs = dict(zip(depths, await asyncio.gather(*[one(depth) for depth in depths])))
    for srv in srvs.values():
        srv.stop()
    reference = runs[1][1][len(PROMPTS):]
    for depth in depths:
        before, results, after = runs[depth]
        for spec, ref in zip(results, reference):
            assert (spec.token_ids, spec.finish_reason) == (ref.token_ids, ref.finish_reason), depth
            if ref.logprobs:
                assert len(spec.logprobs) == len(ref.logprobs)
                for a, b in zip(spec.logprobs, ref.logprobs):
                    assert abs(a.logprob - b.logprob) < 1e-3 and a.top_ids[:1] == b.top_ids[:1], depth
        assert results[1].finish_reason == "stop"  # its stop string, inside an accepted run
        drafted = after.spec_draft_tokens - before.spec_draft_tokens
        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        assert accepted >= 10 and drafted > accepted, (depth, drafted, accepted)  # the copy is accepted, the joke not
        # per request, in timings: the server's counts are their sums (nothing past a finish is counted)
        assert sum(r.timings.accepted_tokens for r in results) == accepted > 0, depth
        assert sum(r.timings.draft_tokens for r in results) == drafted, depth
        assert all(r.timings.accepted_tokens < len(r.token_ids) for r in results)  # each run follows a sampled token
        assert results[0].timings.accepted_tokens >= 8  # the copy
        assert all(r.timings.draft_tokens > 0 for r in results[:len(PROMPTS)])  # every one of them speculated
        assert all(r.timings.draft_tokens == 0 for r in results[len(PROMPTS):])  # rows that cannot speculate


async def test_scripted_executor_through_the_processes(module_servers):
    """The scheduler and the scripted executor as processes, depth 2, a pool small enough to preempt: every stream
    (logprobs included) is the script's, the script's accepted counts add up, nothing leaks."""
    srv = module_servers("--load-format", "scripted", "--scripted-step-ms", "0.2", "--pipeline-depth", "2",
                         "--speculative-method", "ngram", "--num-speculative-tokens", "3", "--max-num-seqs", "6",
                         "--num-kv-blocks", "20", "--block-size", "4", "--max-model-len", "256",
                         "--max-num-batched-tokens", "16", "--debug-checks")
    prompt = lambda seed: [10 + (seed + i) % 50 for i in range(5)]  # noqa: E731
    async with AsyncClient(srv.address, timeout=60) as c:
        results = await asyncio.gather(*[
            c.generate(prompt_token_ids=prompt(seed), max_tokens=10 + seed % 20, seed=seed, ignore_eos=True,
                       logprobs=1 if seed % 3 == 0 else None, detokenize=False) for seed in range(16)])
    script = ScriptedRunner(1, 1, 1)
    for seed, r in enumerate(results):
        want, reason = expected_output(script.token_at, seed=seed, prompt_len=5, max_tokens=10 + seed % 20,
                                       max_model_len=256, eos_token_ids=(2,), ignore_eos=True)
        assert (r.token_ids, r.finish_reason) == (want, reason), seed
        assert len(r.logprobs) == (len(want) if seed % 3 == 0 else 0), seed
    stats = await wait_idle(srv.address)
    assert_no_leak(stats)
    assert stats.spec_accepted_tokens > 0 and stats.preemptions > 0, stats


def test_metrics_carry_the_draft_counts():
    """The gateway's speculative-decoding series, from the scheduler's counters."""
    fields = {f.name: 0 for f in msgspec.structs.fields(p.ServerStats) if f.default is msgspec.NODEFAULT}
    stats = msgspec.structs.replace(p.ServerStats(**fields), spec_rows=10, spec_draft_tokens=40, spec_accepted_tokens=25)
    text = render(stats, "m").decode()
    for line in ('forerun:spec_decode_num_drafts_total{model_name="m"} 10.0',
                 'forerun:spec_decode_num_draft_tokens_total{model_name="m"} 40.0',
                 'forerun:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0',
                 'forerun:spec_decode_mean_accepted_length{model_name="m"} 3.5'):
        assert line in text


async def test_rows_at_the_context_limit_stay_within_the_slot(module_servers):
    """A request that ends at the model's length: its last rows' drafts are cut to the room left, and a step of
    greedy speculative rows run as decode rows pads each to K + 1 positions, past the length; the CPU's attention
    keeps to the rows' block tables (it once gathered 128 keys and masked 144: the executor failed until the server
    gave up).  Alone on the server, with K = 8, at every depth the tokens are the plain row's."""
    ids = [1000, 1001, 1002, 1003] * 14  # 56 tokens, a pattern the lookup drafts from
    depths = ("0", "1")
    # the two servers start together and run at the same time (each executor serves on one thread)
    with ThreadPoolExecutor(len(depths)) as pool:
        started = [pool.submit(module_servers, "--speculative-method", "ngram", "--num-speculative-tokens", "8",
                               "--max-model-len", "64", "--max-num-seqs", "4", "--num-kv-blocks", "32",
                               "--pipeline-depth", depth, "--debug-checks", "--max-restarts", "0") for depth in depths]
        srvs = dict(zip(depths, [f.result() for f in started]))

    async def one(depth: str):
        srv = srvs[depth]
        async with AsyncClient(srv.address, timeout=120) as c:
            run = lambda **kw: c.generate(prompt_token_ids=ids, max_tokens=8, temperature=0.0, ignore_eos=True,  # noqa
                                          detokenize=False, **kw)
            spec = await run()
            plain = await run(prompt_logprobs=0)  # a row that cannot speculate
        return spec, plain, await wait_idle(srv.address)

    for depth, (spec, plain, stats) in zip(depths, await asyncio.gather(*[one(depth) for depth in depths])):
        assert (spec.token_ids, spec.finish_reason) == (plain.token_ids, "length"), depth
        assert stats.executor_restarts == 0 and stats.spec_draft_tokens > 0, depth
        assert_no_leak(stats)
        srvs[depth].stop()
