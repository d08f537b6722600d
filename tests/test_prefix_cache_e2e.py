"""Prefix caching end to end: the default model (fp32, CPU) gives the same greedy tokens with and without it.

Four prompts with one long system prompt go to a server started with
``--no-prefix-caching`` (the reference; its stats prove nothing was looked
up) and to the shared real-model server (depth 1, prefix caching on by
default), the two at the same time: first all together on an empty cache,
then all together again (every prompt hits the blocks the first pass cached).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from ipc.client import AsyncClient
from tests.server_proc import assert_no_leak, reset_prefix_cache, wait_idle

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful assistant for a small museum of clocks and watches. Answer in one short sentence, "
          "plainly, without lists. Visitors ask about opening hours, tickets, the collection, pendulums, "
          "escapements, sundials, water clocks, marine chronometers, wristwatches and how to wind a clock. "
          "If you do not know, say so. Never invent prices. ") * 3
# Four requests arriving together on an empty cache and then hitting it together: more questions would repeat the
# same pattern.
QUESTIONS = ["When do you open?", "What is an escapement?", "Who invented the pendulum clock?", "What is GMT?"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                            add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


async def test_greedy_outputs_identical_with_and_without_prefix_caching(servers, model_server, prompts):
    assert min(len(x) for x in prompts) > 200
    kw = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:  # both servers start at once
        started = pool.submit(servers, "--pipeline-depth", "1", "--max-num-seqs", "32", "--num-kv-blocks", "512",
                              "--no-prefix-caching")
        srv = model_server(1)
        plain = started.result()

    async def reference():
        async with AsyncClient(plain.address, timeout=300) as c:
            out = [r.token_ids for r in await asyncio.gather(*[c.generate(prompt_token_ids=ids, **kw)
                                                                for ids in prompts])]
        return out, await wait_idle(plain.address)

    async def cached():
        async with AsyncClient(srv.address, timeout=300) as c:
            await reset_prefix_cache(srv.address)
            concurrent = await asyncio.gather(*[c.generate(prompt_token_ids=ids, **kw) for ids in prompts])
            cold = await wait_idle(srv.address)
            again = await asyncio.gather(*[c.generate(prompt_token_ids=ids, **kw) for ids in prompts])
            warm = await wait_idle(srv.address)
        return concurrent, cold, again, warm

    (want, off), (concurrent, cold, again, warm) = await asyncio.gather(reference(), cached())
    plain.stop()
    assert off.prefix_cache_query_tokens == 0 and off.prefix_cache_hit_tokens == 0
    assert [r.token_ids for r in concurrent] == want
    assert [r.token_ids for r in again] == want
    # Sent again after the first pass, every prompt shares at least the system prompt's blocks.
    assert warm.prefix_cache_hit_tokens - cold.prefix_cache_hit_tokens >= len(prompts) * (len(SYSTEM) // 8)
    assert_no_leak(warm)


async def test_request_sent_twice_hits_the_cache_the_second_time(model_server, prompts):
    srv = model_server(1)
    ids = prompts[3] + [42] * 40  # a prompt nobody sent before
    async with AsyncClient(srv.address, timeout=300) as c:
        first = await c.generate(prompt_token_ids=ids, max_tokens=4, temperature=0.0)
        s1 = await wait_idle(srv.address)
        second = await c.generate(prompt_token_ids=ids, max_tokens=4, temperature=0.0)
        s2 = await wait_idle(srv.address)
    assert second.token_ids == first.token_ids
    assert s2.prefix_cache_query_tokens - s1.prefix_cache_query_tokens == len(ids)
    block_size = 16
    assert s2.prefix_cache_hit_tokens - s1.prefix_cache_hit_tokens == (len(ids) - 1) // block_size * block_size
    reset = await reset_prefix_cache(srv.address)
    assert reset.num_free_kv_blocks == reset.num_kv_blocks
