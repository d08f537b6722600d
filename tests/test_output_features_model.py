"""Stop strings and n > 1 on the default model (float32, real processes), at pipeline depth 2.

Stop strings are taken from the model's own greedy output: a substring that starts in
the last character of one token and ends with a later token (spanning two or three
tokens).  The stream must end exactly at the token that completes it.

The server runs one workload in three rounds, each round's requests at once: the n = 4 request alone
(the prefix cache's counters are its own), then the same four seeds one request each beside the greedy runs the
stop strings are taken from, then the stop strings.

One depth, the deepest (two steps in flight when a stop string completes or the n completions fork): what depends
on the depth, the tokens already in flight past a stop dropped and n completions prefilled once, is checked at
every depth and every in-flight offset by tests/test_output_features.py (stop strings spanning one to three tokens,
n > 1), and on the default model by tests/test_lifecycle_model.py (stop strings, outputs equal at depths 0, 1 and
2) and tests/test_kv_paths.py (stop strings at depths 0, 1 and 2, n = 3 at depth 1).  What this file adds, the real
detokenizer's multi-character tokens, the prefix cache's counters and each completion's seeded sampling on the
default model, does not depend on the depth: the shallower depths' runs of the same workload proved nothing more.
"""

from __future__ import annotations

import asyncio

import pytest

from ipc import protocol as p
from ipc.client.raw import RawConnection
from scheduler_proc.outputs import load_detokenizer
from tests.server_proc import assert_no_leak, reset_prefix_cache, server_stats, wait_idle

pytestmark = pytest.mark.slow
BLOCK_SIZE = 16  # the server's default


async def run(address: str, gens: list[p.Generate], batch_deltas: bool = False):
    """Send every Generate; collect each completion's tokens and Finished, by (request_id, index)."""
    want = sum(g.sampling.n for g in gens)
    tokens: dict[tuple[str, int], list[int]] = {}
    done: dict[tuple[str, int], p.Finished] = {}

    def add(key, token_ids):
        assert key not in done, f"{key}: a message after its Finished"
        tokens.setdefault(key, []).extend(token_ids)

    async with RawConnection(address, timeout=300) as conn:
        await conn.hello(batch_deltas=batch_deltas)
        for g in gens:
            await conn.send(g)
        while len(done) < want:
            msg = await conn.recv()
            assert not isinstance(msg, p.Error), msg
            if isinstance(msg, p.TokenDeltas):
                indices = msg.indices or [0] * len(msg.request_ids)
                assert not msg.logprobs and not msg.prompt_logprobs  # nobody asked: nothing extra on the wire
                for key, token_ids in zip(zip(msg.request_ids, indices), msg.token_ids):
                    add(key, token_ids)
                continue
            add((msg.request_id, msg.index), msg.token_ids)
            if isinstance(msg, p.Finished):
                done[(msg.request_id, msg.index)] = msg
    return {k: (tokens[k], done[k]) for k in done}


def greedy(prompt: list[int], max_tokens: int, **kw) -> p.Generate:
    return p.Generate("g", prompt, p.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))


def spanning_stop(detok, out: list[int], span: int, after: int) -> tuple[str, int]:
    """A stop string from the last char of token k-span+1 to the end of token k (k >= after, first occurrence)."""
    for k in range(after, len(out)):
        first = k - span + 1
        start = len(detok(out[:first + 1])) - 1
        text = detok(out[:k + 1])
        stop = text[start:]
        pieces = [detok(out[:j + 1])[len(detok(out[:j])):] for j in range(first, k + 1)]
        if start >= len(detok(out[:first])) and all(pieces) and stop.isprintable() and stop not in detok(out[:k]):
            if len(stop) >= span:
                return stop, k
    raise AssertionError("no stop string spans the output")


@pytest.fixture(scope="module")
def detok(default_model_dir):
    return load_detokenizer(default_model_dir)


MAX_TOKENS = 12  # the stop strings' runs; the n = 4 request's completions have 8 tokens
N_SAMPLING = dict(max_tokens=8, temperature=0.8, ignore_eos=True)
DEPTHS = [2]  # see the module docstring
_WORKLOADS: dict[int, dict] = {}  # depth -> its workload's results, run by the first test at that depth


async def workload(depth: int, srv, chat_prompt_ids, detok) -> dict:
    """The module docstring's three rounds on ``srv``, once per depth."""
    if depth in _WORKLOADS:
        return _WORKLOADS[depth]
    a, b, prompt = chat_prompt_ids[0], chat_prompt_ids[2], chat_prompt_ids[5]
    out = dict(prompt=prompt)
    await reset_prefix_cache(srv.address)
    out["before"] = await server_stats(srv.address)
    out["many"] = await run(srv.address, [p.Generate("n", prompt, p.SamplingParams(n=4, seed=77, **N_SAMPLING))],
                            batch_deltas=True)
    out["after"] = await server_stats(srv.address)
    base, *alone = await asyncio.gather(
        run(srv.address, [greedy(a, MAX_TOKENS, ignore_eos=True), p.Generate("h", b, greedy(b, MAX_TOKENS).sampling)]),
        *[run(srv.address, [p.Generate(f"s{i}", prompt, p.SamplingParams(seed=77 + i, **N_SAMPLING))])
          for i in range(4)])
    out_a, out_b = base[("g", 0)][0], base[("h", 0)][0]
    stop2, k2 = spanning_stop(detok, out_a, 2, 3)
    stop3, k3 = spanning_stop(detok, out_b, 3, 5)
    out.update(alone=alone, out_a=out_a, out_b=out_b, stop2=stop2, k2=k2, stop3=stop3, k3=k3)
    prompt_word = next(w for w in detok(a).split() if w.isalpha() and w not in detok(out_a))
    gens = [p.Generate("two", a, greedy(a, MAX_TOKENS, stop=[stop2], ignore_eos=True).sampling),
            p.Generate("three", b, greedy(b, MAX_TOKENS, stop=["\u2603never", stop3]).sampling),
            p.Generate("prompt-only", a, greedy(a, MAX_TOKENS, stop=[prompt_word], ignore_eos=True).sampling)]
    out["got"] = await run(srv.address, gens)  # one batch: different stop strings side by side
    out["idle"] = await wait_idle(srv.address)
    _WORKLOADS[depth] = out
    return out


@pytest.mark.parametrize("depth", DEPTHS)
async def test_stop_strings_end_the_stream_exactly(depth, model_server, chat_prompt_ids, detok):
    w = await workload(depth, model_server(depth), chat_prompt_ids, detok)
    out_a, out_b, got = w["out_a"], w["out_b"], w["got"]
    stop2, k2, stop3, k3 = w["stop2"], w["k2"], w["stop3"], w["k3"]
    tokens, fin = got[("two", 0)]
    assert tokens == out_a[:k2 + 1] and (fin.reason, fin.stop_str) == ("stop", stop2)
    assert detok(tokens).endswith(stop2)
    tokens, fin = got[("three", 0)]
    assert tokens == out_b[:k3 + 1] and (fin.reason, fin.stop_str) == ("stop", stop3)
    tokens, fin = got[("prompt-only", 0)]
    assert tokens == out_a and fin.reason == "length" and fin.stop_str is None
    assert_no_leak(w["idle"])


@pytest.mark.parametrize("depth", DEPTHS)
async def test_n_completions_each_equal_to_its_own_seed(depth, model_server, chat_prompt_ids, detok):
    w = await workload(depth, model_server(depth), chat_prompt_ids, detok)
    prompt, many, alone, before, after = w["prompt"], w["many"], w["alone"], w["before"], w["after"]
    cached = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # full blocks, the last token always computed
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 3 * cached  # prefilled once
    completions = [many[("n", i)][0] for i in range(4)]
    assert len({tuple(c) for c in completions}) == 4
    for i in range(4):
        assert completions[i] == alone[i][(f"s{i}", 0)][0], f"completion {i} differs from seed {77 + i} alone"
        assert many[("n", i)][1].prompt_tokens == len(prompt)
    assert_no_leak(w["idle"])


def test_a_stop_string_inside_min_tokens_neither_stops_nor_cuts_the_text(model_server):
    """min_tokens past the token that completes a stop string's first occurrence: the request goes on and the text
    keeps that occurrence, ending before the next one (vLLM's rule), streamed or not."""
    from ipc.client import AsyncClient

    messages = [{"role": "user", "content": "Write a short greeting for a new colleague."}]

    async def go():
        async with AsyncClient(model_server(1).address) as c:
            free = await c.generate(messages=messages, max_tokens=40, temperature=0)
            stop = next(ch for ch in free.text if not ch.isspace() and free.text.count(ch) >= 2)  # occurs twice
            first = await c.generate(messages=messages, max_tokens=40, temperature=0, stop=[stop])
            assert first.finish_reason == "stop" and free.text.startswith(first.text + stop)
            k = first.completion_tokens  # the token that completes the first occurrence
            later = await c.generate(messages=messages, max_tokens=40, temperature=0, stop=[stop], min_tokens=k + 1)
            second = free.text.index(stop, len(first.text) + 1)
            assert (later.text, later.finish_reason) == (free.text[:second], "stop"), (stop, later.text, free.text)
            streamed = "".join([ch.text_delta async for ch in c.stream(messages=messages, max_tokens=40,
                                                                        temperature=0, stop=[stop], min_tokens=k + 1)])
            assert streamed == later.text
    asyncio.run(go())
