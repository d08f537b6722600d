"""Prefix caching end to end: the default model (fp32, CPU) gives the same greedy tokens with and without it.

12 prompts with one long system prompt go to a server started with
``--no-prefix-caching`` (the reference; its stats prove nothing was looked
up) and to the shared real-model server (depth 1, prefix caching on by
default), concurrently and one by one, sharing the system prompt's blocks.
"""

from __future__ import annotations

import asyncio

import pytest

from ipc.client import AsyncClient
from tests.server_proc import assert_no_leak, reset_prefix_cache, wait_idle

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful assistant for a small museum of clocks and watches. Answer in one short sentence, "
          "plainly, without lists. Visitors ask about opening hours, tickets, the collection, pendulums, "
          "escapements, sundials, water clocks, marine chronometers, wristwatches and how to wind a clock. "
          "If you do not know, say so. Never invent prices. ") * 3
# Twelve requests already arrive together, share blocks still being computed and then hit them one by one:
# more questions would repeat the same sharing pattern.
QUESTIONS = [
    "When do you open?", "How much is a ticket?", "What is an escapement?", "Do you have sundials?",
    "Who invented the pendulum clock?", "What is a chronometer?", "Can I wind a clock myself?", "Is there a cafe?",
    "What is a water clock?", "Are children welcome?", "How old is the oldest clock?", "What is GMT?",
]
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
    plain = servers("--pipeline-depth", "1", "--max-num-seqs", "32", "--num-kv-blocks", "512",
                           "--no-prefix-caching")
    async with AsyncClient(plain.address, timeout=300) as c:
        reference = [r.token_ids for r in await asyncio.gather(*[c.generate(prompt_token_ids=ids, **kw)
                                                                  for ids in prompts])]
    off = await wait_idle(plain.address)
    assert off.prefix_cache_query_tokens == 0 and off.prefix_cache_hit_tokens == 0
    plain.stop()

    srv = model_server(1)
    async with AsyncClient(srv.address, timeout=300) as c:
        await reset_prefix_cache(srv.address)
        concurrent = await asyncio.gather(*[c.generate(prompt_token_ids=ids, **kw) for ids in prompts])
        cold = await wait_idle(srv.address)
        one_by_one = [await c.generate(prompt_token_ids=ids, **kw) for ids in prompts]
        warm = await wait_idle(srv.address)
    assert [r.token_ids for r in concurrent] == reference
    assert [r.token_ids for r in one_by_one] == reference
    # Sent one by one after the concurrent pass, every prompt shares at least the system prompt's blocks.
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
