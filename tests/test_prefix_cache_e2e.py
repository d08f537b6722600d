"""Prefix caching end to end on the shared real-model server (the default model, fp32, CPU, blocks of 16).

A prompt with one long system prompt, never sent before, is sent twice: the second time every full block of it
comes from the cache (the counters say exactly how many tokens), with the same greedy tokens; resetting the cache
frees every block.  That caching never changes an output, for prompts that arrive together on an empty cache and
hit it again, shared openings and whole prompts, beside a server started with ``--no-prefix-caching`` that never
looks a prompt up, is tests/test_kv_paths.py's.
"""

from __future__ import annotations

import pytest

from ipc.client import AsyncClient
from tests.server_proc import reset_prefix_cache, wait_idle

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful assistant for a small museum of clocks and watches. Answer in one short sentence, "
          "plainly, without lists. Visitors ask about opening hours, tickets, the collection, pendulums, "
          "escapements, sundials, water clocks, marine chronometers, wristwatches and how to wind a clock. "
          "If you do not know, say so. Never invent prices. ") * 3


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is GMT?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def test_request_sent_twice_hits_the_cache_the_second_time(model_server, prompt):
    srv = model_server(1)
    assert len(prompt) > 200
    ids = prompt + [42] * 40  # a prompt nobody sent before
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
