"""SDK outputs against the scripted fake server: stop-string text, logprobs, n completions.

The fake server (tests/test_client_unit.py) plays what the scheduler would
send: deltas with logprobs and a completion ``index``, a Finished naming the
stop string.  The text rule is checked at every chunk: no character past the
cut ever reaches the user.
"""

from __future__ import annotations

import random

import pytest

from ipc.client import AsyncClient, Client
from ipc.client.outputs import StopStringText
from ipc.protocol import Finished, ResetPrefixCache, TokenDelta, TokenDeltas, TokenLogprobs
from tests.test_client_unit import (  # noqa: F401 (fixtures)
    EOS,
    HANG,
    address,
    serve,
    tokenizer,
    tokenizer_dir,
)

# ---------------------------------------------------------------------------
# the text rule, alone
# ---------------------------------------------------------------------------


def cut_text(text: str, stops: list[str], include: bool) -> str:
    """The reference: the text up to the first occurrence of any stop string."""
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text
    pos, s = min(hits)
    return text[:pos + len(s)] if include else text[:pos]


def test_stop_text_holds_back_a_possible_start_and_releases_it_when_it_cannot_be():
    st = StopStringText(["world", "wx"])
    assert st.push("hello w") == "hello "  # "w" could start either stop string
    assert st.push("o") == ""  # "wo" could still be "world"
    assert st.push("nder") == "wonder"  # it cannot any more
    assert st.push(" wor") == " "
    assert st.push("ld and more") == ""  # the stop: nothing past it, ever
    assert st.push("!") == ""
    assert st.finish("world") == ""
    assert st.text == "hello wonder "


def test_stop_text_include_and_earliest_stop_and_finish_only_match():
    st = StopStringText(["b", "xyz"], include_stop_str=True)
    assert st.push("axyzb") == "axyz"  # "xyz" comes first
    assert st.text == "axyz"
    st = StopStringText(["END"])
    assert st.push("abc EN") == "abc "
    assert st.push("D") == ""
    assert st.finish("END") == "" and st.text == "abc "
    st = StopStringText(["END"])  # a stop string the text does not hold: nothing to cut
    assert st.push("abc EN") == "abc "
    assert st.finish("END") == "EN"
    st = StopStringText(["END"])
    assert st.finish(None) == ""
    assert StopStringText(["END"]).push("no stop at all E") == "no stop at all "
    st = StopStringText(["END"])
    st.push("almost EN")
    assert st.finish(None) == "EN"  # a length finish releases the held-back tail


@pytest.mark.parametrize("include", [False, True])
def test_stop_text_random_splits_never_pass_the_cut(include):
    rng = random.Random(7)
    alphabet = "ab世🙂 \n"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        expected = cut_text(text, stops, include)
        st = StopStringText(stops, include)
        out, i = "", 0
        while i < len(text):
            j = min(len(text), i + rng.randint(1, 5))
            out += st.push(text[i:j])
            assert expected.startswith(out), (text, stops, out)
            i = j
        matched = next((s for s in stops if s in text and cut_text(text, [s], False) == cut_text(text, stops, False)),
                       None)
        out += st.finish(matched)
        assert out == expected == st.text, (text, stops)


# ---------------------------------------------------------------------------
# through the client
# ---------------------------------------------------------------------------

def byte_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def lp(token_id: int, k: int = 2) -> TokenLogprobs:
    """A fake logprob entry derived from the token id (so a mix-up shows)."""
    return TokenLogprobs(-token_id / 100, [token_id + i for i in range(k)], [-i / 10 for i in range(k)])


def stop_script(tokenizer, text: str, stop: str):
    """Tokens (one per byte) up to the one that completes ``stop``, as the scheduler sends them."""
    end = text.index(stop) + len(stop)
    ids = byte_ids(tokenizer, text[:end])

    def script(gen):
        msgs = [TokenDelta(gen.request_id, [t], logprobs=[lp(t)]) for t in ids[:-1]]
        msgs.append(Finished(request_id=gen.request_id, reason="stop", prompt_tokens=len(gen.prompt_token_ids),
                             completion_tokens=len(ids), token_ids=ids[-1:], logprobs=[lp(ids[-1])], stop_str=stop))
        return msgs
    return script, ids


@pytest.mark.parametrize("include", [False, True])
async def test_stream_cuts_at_the_stop_string_and_never_shows_past_it(serve, address, tokenizer, include):
    text, stop = "Hello, 世界 wor and more", "界 wor"
    script, ids = stop_script(tokenizer, text, stop)
    server = serve(script)
    async with AsyncClient(address, timeout=5) as client:
        stream = client.stream("Hi", stop=[stop, "zzz"], include_stop_str_in_output=include, logprobs=2)
        chunks = [c async for c in stream]
    sent = server.generates[0].sampling
    assert sent.stop == [stop, "zzz"] and sent.include_stop_str_in_output is include and sent.logprobs == 2
    expected = "Hello, 世界 wor" if include else "Hello, 世"
    shown = ""
    for c in chunks:
        shown += c.text_delta
        assert expected.startswith(shown)
    assert shown == expected
    r = stream.result
    assert r.text == expected and r.finish_reason == "stop" and r.stop_str == stop
    assert r.token_ids == ids  # the token that completed the stop string is kept
    assert [x.logprob for x in r.logprobs] == [lp(t).logprob for t in ids]
    assert [x for c in chunks for x in c.logprobs] == r.logprobs
    assert chunks[-1].finish_reason == "stop"


async def test_logprobs_and_prompt_logprobs_reach_chunks_and_result(serve, address, tokenizer):
    ids = byte_ids(tokenizer, "abc")

    def script(gen):
        plps = [None] + [lp(t, 1) for t in gen.prompt_token_ids[1:]]
        return [TokenDelta(gen.request_id, ids[:2], logprobs=[lp(t) for t in ids[:2]], prompt_logprobs=plps),
                Finished(request_id=gen.request_id, reason="length", prompt_tokens=len(gen.prompt_token_ids),
                         completion_tokens=3, token_ids=ids[2:], logprobs=[lp(ids[2])])]
    server = serve(script)
    async with AsyncClient(address, timeout=5) as client:
        stream = client.stream("Hi!", logprobs=2, prompt_logprobs=1)
        chunks = [c async for c in stream]
    prompt = server.generates[0].prompt_token_ids
    r = stream.result
    assert r.text == "abc" and r.logprobs == [lp(t) for t in ids]
    assert r.prompt_logprobs == [None] + [lp(t, 1) for t in prompt[1:]]
    assert chunks[0].prompt_logprobs == r.prompt_logprobs and chunks[1].prompt_logprobs is None
    assert chunks[0].logprobs == [lp(t) for t in ids[:2]]


def two_completions(tokenizer, texts: list[str], *, batched: bool):
    """n completions, interleaved token by token, each finishing on its own (index on every message)."""
    per = [byte_ids(tokenizer, t) for t in texts]

    def script(gen):
        msgs = []
        for step in range(max(map(len, per)) - 1):
            live = [i for i, ids in enumerate(per) if step < len(ids) - 1]
            if batched:
                msgs.append(TokenDeltas(request_ids=[gen.request_id] * len(live),
                                        token_ids=[[per[i][step]] for i in live],
                                        logprobs=[[lp(per[i][step])] for i in live], indices=live))
            else:
                msgs += [TokenDelta(gen.request_id, [per[i][step]], logprobs=[lp(per[i][step])], index=i)
                         for i in live]
            msgs += [Finished(request_id=gen.request_id, reason="length", prompt_tokens=len(gen.prompt_token_ids),
                              completion_tokens=len(per[i]), token_ids=per[i][-1:], logprobs=[lp(per[i][-1])],
                              index=i)
                     for i, ids in enumerate(per) if step == len(ids) - 2]
        return msgs
    return script, per


@pytest.mark.parametrize("batched", [False, True])
async def test_n_completions_generate_and_stream(serve, address, tokenizer, batched):
    texts = ["first answer", "2nd", "the third one!"]
    script, per = two_completions(tokenizer, texts, batched=batched)
    server = serve(script)
    async with AsyncClient(address, timeout=5) as client:
        r = await client.generate("Hi", n=3, seed=5, logprobs=2)
        stream = client.stream("Hi", n=3)
        chunks = [c async for c in stream]
    assert server.generates[0].sampling.n == 3
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == texts
    assert [c.token_ids for c in r.choices] == per
    assert [c.logprobs for c in r.choices] == [[lp(t) for t in ids] for ids in per]
    assert r.text == texts[0] and r.index == 0  # the result's own fields: choices[0]
    assert all(c.finish_reason == "length" and c.choices == [] for c in r.choices)
    for i, t in enumerate(texts):
        assert "".join(c.text_delta for c in chunks if c.index == i) == t
        assert [c.finish_reason for c in chunks if c.index == i][-1] == "length"
        assert sum(c.finish_reason is not None for c in chunks if c.index == i) == 1
    assert {c.index for c in chunks} == {0, 1, 2}
    assert [c.text for c in stream.result.choices] == texts


async def test_one_completion_result_lists_itself_as_its_only_choice(serve, address, tokenizer):
    script, _ = two_completions(tokenizer, ["only"], batched=False)
    serve(script)
    async with AsyncClient(address, timeout=5) as client:
        r = await client.generate("Hi")
    assert len(r.choices) == 1 and r.choices[0].text == r.text == "only" and r.choices[0].index == 0


async def test_aborting_n_completions_ends_them_all(serve, address, tokenizer):
    ids = byte_ids(tokenizer, "ab")
    server = serve(lambda g: [TokenDelta(g.request_id, ids[:1], index=1), HANG])
    async with AsyncClient(address, timeout=5) as client:
        stream = client.stream("Hi", n=4)
        first = await stream.next_chunk()
        assert first.index == 1
        await stream.abort()
        rest = [c async for c in stream]
    assert server.aborts == [stream.request_id]
    assert [c.finish_reason for c in stream.result.choices] == ["abort"] * 4
    assert stream.result.choices[1].token_ids == ids[:1]
    assert {c.index for c in rest if c.finish_reason == "abort"} == {0, 1, 2, 3}


def test_reset_prefix_cache_and_stats_blocking(serve, address):
    server = serve(lambda g: [])
    with Client(address, timeout=5) as client:
        stats = client.reset_prefix_cache()
        assert stats.num_kv_blocks == 8
        assert client.get_stats().num_free_kv_blocks == 8
    assert isinstance(server.stats_requests[0], ResetPrefixCache)
    assert len(server.stats_requests) == 2


def test_stop_text_under_min_tokens_counts_only_stops_that_end_after_arming():
    """min_tokens: an occurrence ending in the first tokens' text stays (the scheduler did not stop there); the
    first one ending after :meth:`arm` cuts, also one that straddles the arming point."""
    st = StopStringText(["!"], armed=False)
    assert st.push("Hello! How") == "Hello! How"
    st.arm()
    assert st.push(" are you! Fine") == " are you"
    assert st.finish("!") == "" and st.text == "Hello! How are you"
    st = StopStringText(["!"], armed=False)  # the scheduler's stop_str at finish: found past the arming point
    st.push("a!b")
    st.arm()
    st.push("c!d")
    assert st.finish("!") == "" and st.text == "a!bc"
    st = StopStringText(["END"], armed=False)  # straddling: starts in the first tokens' text, ends after
    assert st.push("x EN") == "x "
    st.arm()
    assert st.push("D y") == ""
    assert st.finish("END") == "" and st.text == "x "


# ---------------------------------------------------------------------------
# a finish on a stop token (EOS, or one of stop_token_ids)
# ---------------------------------------------------------------------------


def stop_token_script(tokenizer, text: str, stop_token: int, min_tokens: int = 0):
    """The tokens of ``text``, then ``stop_token``: carried by the Finished (reason "stop", no stop string), as the
    scheduler sends a finish on a stop token."""
    ids = byte_ids(tokenizer, text)

    def script(gen):
        msgs = [TokenDelta(gen.request_id, [t], logprobs=[lp(t)]) for t in ids]
        msgs.append(Finished(request_id=gen.request_id, reason="stop", prompt_tokens=len(gen.prompt_token_ids),
                             completion_tokens=len(ids) + 1, token_ids=[stop_token], logprobs=[lp(stop_token)]))
        return msgs
    return script, ids + [stop_token]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("min_tokens", [0, 3])
async def test_a_stop_token_s_text_is_left_out_unless_included(serve, address, tokenizer, include, min_tokens):
    """vLLM's rule: the text of the stop token that ended the request is not shown unless
    include_stop_str_in_output; the token itself stays in token_ids, logprobs and the count."""
    stop_token = byte_ids(tokenizer, "!")[0]
    script, ids = stop_token_script(tokenizer, "Paris 世界", stop_token)
    serve(script)
    async with AsyncClient(address, timeout=5) as client:
        kw = dict(stop_token_ids=[stop_token], include_stop_str_in_output=include, logprobs=1, min_tokens=min_tokens)
        r = await client.generate("Hi", **kw)
        stream = client.stream("Hi", **kw)
        chunks = [c async for c in stream]
    expected = "Paris 世界!" if include else "Paris 世界"
    assert r.text == expected and r.finish_reason == "stop" and r.stop_str is None
    assert r.token_ids == ids and r.completion_tokens == len(ids)
    assert r.logprobs == [lp(t) for t in ids]  # the stop token's entry is kept (vLLM keeps it)
    assert "".join(c.text_delta for c in chunks) == expected == stream.result.text
    assert chunks[-1].token_ids == [stop_token] and chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("include", [False, True])
async def test_an_eos_finish_shows_the_same_text_either_way(serve, address, tokenizer, include):
    """EOS is a special token, never rendered: include_stop_str_in_output changes nothing for it."""
    script, ids = stop_token_script(tokenizer, "done.", EOS)
    serve(script)
    async with AsyncClient(address, timeout=5) as client:
        r = await client.generate("Hi", include_stop_str_in_output=include)
    assert r.text == "done." and r.token_ids == ids and r.finish_reason == "stop"

