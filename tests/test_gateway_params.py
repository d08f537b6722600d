"""The gateway's parameter mapping and logprob/echo/n formatting, without a server.

SDK streams are faked (``next_chunk``/``result``/``aclose``), so these tests
check the OpenAI shapes the gateway builds from whatever the engine sends.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from ipc.client import GenerateResult, StreamChunk, Timings
from ipc.gateway import params, responses
from ipc.gateway import schemas as s
from ipc.gateway.logprobs import TokenTexts, chat_logprobs, completion_logprobs, prompt_logprobs
from ipc.protocol import TokenLogprobs
from tests.test_client_unit import tokenizer, tokenizer_dir  # noqa: F401 (fixtures)


def completion_req(**kw) -> s.CompletionRequest:
    return msgspec.json.decode(json.dumps({"prompt": "x", **kw}), type=s.CompletionRequest)


def chat_req(**kw) -> s.ChatCompletionRequest:
    return msgspec.json.decode(json.dumps({"messages": [{"role": "user", "content": "x"}], **kw}),
                               type=s.ChatCompletionRequest)


def test_sampling_kwargs_map_every_parameter():
    req = completion_req(n=3, stop="\n", presence_penalty=0.5, frequency_penalty=-1.0, logit_bias={"13": 5, "7": -100},
                         seed=4, logprobs=2, echo=True, repetition_penalty=1.2, min_tokens=3, prompt_logprobs=1,
                         include_stop_str_in_output=True)
    kw = params.sampling_kwargs(req, 16, vocab_size=100)
    assert kw == {"max_tokens": 16, "seed": 4, "n": 3, "presence_penalty": 0.5, "frequency_penalty": -1.0,
                  "repetition_penalty": 1.2, "min_tokens": 3, "prompt_logprobs": 2, "include_stop_str_in_output": True,
                  "stop": ["\n"], "logit_bias": {13: 5.0, 7: -100.0}, "logprobs": 2}
    assert params.sampling_kwargs(completion_req(stop=["a", "b"]), 4, 100)["stop"] == ["a", "b"]
    chat = params.sampling_kwargs(chat_req(logprobs=True, top_logprobs=3), 4, 100)
    assert chat["logprobs"] == 3 and "prompt_logprobs" not in chat
    assert params.sampling_kwargs(chat_req(logprobs=True), 4, 100)["logprobs"] == 0
    assert "logprobs" not in params.sampling_kwargs(chat_req(logprobs=False), 4, 100)


def test_prompt_forms_and_malformed_prompts():
    assert s.prompts(completion_req(prompt="hi")) == ["hi"]
    assert s.prompts(completion_req(prompt=[5, 6])) == [[5, 6]]
    assert s.prompts(completion_req(prompt=["a", "b"])) == ["a", "b"]
    assert s.prompts(completion_req(prompt=[[5], [6, 7]])) == [[5], [6, 7]]
    assert s.prompts(completion_req(prompt=[5.0, 6])) == [[5, 6]]  # integral floats: ids, as vLLM takes them
    assert s.prompts(completion_req(prompt=[[5.0], [6, 7.0]])) == [[5], [6, 7]]
    for bad in ([], [1, True], [True], [1, "a"], [1.5], [[1], []], [[1], [True]], [[1], "a"], [["a"]]):
        with pytest.raises(s.RequestError) as e:
            s.prompts(completion_req(prompt=bad))
        assert e.value.status == 400 and e.value.param == "prompt", bad
    from ipc.gateway.limits import MAX_PROMPTS

    assert len(s.prompts(completion_req(prompt=["hi"] * MAX_PROMPTS))) == MAX_PROMPTS
    with pytest.raises(s.RequestError) as e:  # more than one request may queue: a 400, not a 429 to retry in vain
        s.prompts(completion_req(prompt=["hi"] * (MAX_PROMPTS + 1)))
    assert e.value.status == 400 and e.value.param == "prompt" and f"at most {MAX_PROMPTS}" in e.value.message
    with pytest.raises(s.RequestError):
        s.prompts(completion_req(prompt=["hi"] * (MAX_PROMPTS // 4 + 1), n=4))


@pytest.mark.parametrize("bias", [{"x": 1}, {"1.5": 1}, {"100": 1}, {"-1": 2}])
def test_bad_logit_bias_key_is_400_naming_logit_bias(bias):
    with pytest.raises(s.RequestError) as e:
        params.sampling_kwargs(completion_req(logit_bias=bias), 4, vocab_size=100)
    assert e.value.status == 400 and e.value.param == "logit_bias"


def test_top_logprobs_out_of_range_is_400_naming_top_logprobs():
    """Chat's top_logprobs is the SDK's logprobs: the 400 names the field the client sent, with the limit."""
    for bad in (21, -1):
        with pytest.raises(s.RequestError) as e:
            params.sampling_kwargs(chat_req(logprobs=True, top_logprobs=bad), 4, 100)
        assert e.value.param == "top_logprobs" and "[0, 20]" in str(e.value.message), e.value.message


def test_top_logprobs_without_logprobs_and_streamed_prompt_logprobs_are_400():
    with pytest.raises(s.RequestError) as e:
        params.sampling_kwargs(chat_req(top_logprobs=2), 4, 100)
    assert e.value.param == "top_logprobs"
    with pytest.raises(s.RequestError) as e:
        params.check_stream_params(completion_req(stream=True, prompt_logprobs=1))
    assert e.value.param == "prompt_logprobs"
    assert s.unsupported_param(completion_req(best_of=2)) == "best_of"
    assert s.unsupported_param(completion_req(n=2, echo=True, logprobs=1, stop=["x"])) is None


def checked(req) -> None:
    """``req`` through the checks every generation route makes first (a worker with no server behind it)."""
    from ipc.gateway.worker import Gateway

    gw = Gateway.__new__(Gateway)
    gw.model_name, gw.failed = "m", False
    gw.check_request(req)


@pytest.mark.parametrize("field,value,param,words", [
    ("n", 10**6, "n", "n must be in [1, 16], got 1000000"), ("n", 0, "n", "[1, 16]"), ("n", -1, "n", "[1, 16]"),
    ("stop", ["x"] * 17, "stop", "at most 16 stop strings"),
    ("stop_token_ids", [1] * 65, "stop_token_ids", "at most 64 stop token ids"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "logit_bias", "at most 300 logit_bias entries"),
])
def test_counts_are_400_naming_them_before_anything_loops_over_them(field, value, param, words):
    """n (n streams per prompt, a detokenizer per completion) and the lists the gateway and the SDK loop over are
    refused first, with the scheduler's limits: an n of a million once held a worker's loop for 11 s."""
    for req in (completion_req(**{field: value}), chat_req(**{field: value}),
                completion_req(prompt=["a"] * 1000, **{field: value})):
        with pytest.raises(s.RequestError) as e:
            checked(req)
        assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message
    checked(completion_req(n=16, stop=["x"] * 16, stop_token_ids=[1] * 64, logit_bias={str(i): 1 for i in range(300)}))


def test_a_refused_prompt_names_the_field_it_came_from():
    """The scheduler names the prompt's tokens; chat has no ``prompt``: there it is ``messages``."""
    from ipc.client import InvalidRequestError

    too_long = InvalidRequestError("invalid_request", "prompt_token_ids", "the prompt has 9000 tokens")
    assert responses.sdk_error(too_long).param == "prompt"
    assert responses.sdk_error(too_long, "messages").param == "messages"
    assert responses.sdk_error(InvalidRequestError("invalid_request", "sampling.n", "n")).param == "n"


async def test_prompt_ids_out_of_the_vocabulary_are_named_in_the_schedulers_words_past_64_bits_too():
    """Checked by the gateway as sent: an id past 64 bits cannot even be sent to the scheduler (msgpack's words
    named neither).  Of several prompts, the message says which one; a prompt the scheduler refuses too."""
    from ipc.client import InvalidRequestError
    from ipc.gateway import app, handling
    from ipc.gateway.worker import Gateway

    gw = Gateway.__new__(Gateway)
    gw.vocab_size, gw.tokenizer, gw.max_model_len, gw.chars_per_token = 49152, None, 8192, 81

    async def refused(prompt) -> tuple[str, str]:
        with pytest.raises(s.RequestError) as e:
            await app._prompts(gw, completion_req(prompt=prompt))
        assert e.value.status == 400
        return e.value.message, e.value.param

    for bad in (1180591620717411303424, 49152, -1, -(2**64)):
        assert await refused([5, bad]) == (f"token id {bad} is out of range [0, 49152)", "prompt")
    assert await refused([[5], [6, 2**70]]) == (f"prompt[1]: token id {2**70} is out of range [0, 49152)", "prompt")
    message, _ = await refused([10**4000])  # cut, so that the 400's message keeps its range
    assert message.endswith("... (4001 characters) is out of range [0, 49152)") and len(message) < 200, message
    assert await refused(["hi", "there"]) == ("prompt[0]: the server has no tokenizer: send token ids", "prompt")
    assert [p.ids for p in await app._prompts(gw, completion_req(prompt=[[0], [49151]]))] == [[0], [49151]]
    too_long = InvalidRequestError("invalid_request", "prompt_token_ids", "the prompt has 9000 tokens", "cmpl-a-1")
    for count, message in ((2, "prompt[1]: the prompt has 9000 tokens"), (1, "the prompt has 9000 tokens")):
        response = handling.error_for(FakeGateway(None), too_long, prompt_names=app._prompt_names("cmpl-a", count))
        assert json.loads(response.body)["error"] | {"type": None, "code": None} == {
            "message": message, "param": "prompt", "type": None, "code": None}


# ---------------------------------------------------------------------------
# logprob shapes
# ---------------------------------------------------------------------------


def ids_of(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_token_bytes_join_back_a_character_split_over_tokens(tokenizer):
    """A token holding part of a UTF-8 character decodes to U+FFFD; its ``bytes`` are its own, so the tokens'
    bytes join back to the text (as OpenAI means them to), in the chat logprobs too."""
    texts = TokenTexts(tokenizer)
    for text in ("わらい", "Grüße 🙂", "plain words"):
        ids = ids_of(tokenizer, text)
        assert b"".join(bytes(texts.bytes_of(t)) for t in ids) == text.encode(), (text, ids)
    ids = ids_of(tokenizer, "わらい")
    assert any("\ufffd" in texts(t) for t in ids)  # the case: some token is part of a character
    lps = [TokenLogprobs(-0.5, [t], [-0.5]) for t in ids]
    content = chat_logprobs(texts, ids, lps, 1).content
    assert b"".join(bytes(c.bytes) for c in content) == "わらい".encode()
    assert [c.top_logprobs[0].bytes for c in content] == [c.bytes for c in content]


def test_chat_and_legacy_logprob_shapes(tokenizer):
    texts = TokenTexts(tokenizer)
    a, b, c = ids_of(tokenizer, "abc")
    lps = [TokenLogprobs(-0.5, [a, c], [-0.5, -1.5]), TokenLogprobs(-2.0, [c, a], [-0.1, -0.2], 7)]
    chat = msgspec.to_builtins(chat_logprobs(texts, [a, b], lps, 1))
    assert chat == {"content": [
        {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]},
        {"token": "b", "logprob": -2.0, "bytes": [98], "top_logprobs": [{"token": "c", "logprob": -0.1, "bytes": [99]}]},
    ]}
    legacy = msgspec.to_builtins(completion_logprobs(texts, [a, b], lps, 2, offset=3))
    assert legacy == {"text_offset": [3, 4], "token_logprobs": [-0.5, -2.0], "tokens": ["a", "b"],
                      "top_logprobs": [{"a": -0.5, "c": -1.5}, {"c": -0.1, "a": -0.2, "b": -2.0}]}
    plps = json.loads(msgspec.json.encode(prompt_logprobs(texts, [a, b], [None, lps[1]], 2)))  # JSON keys: strings
    assert plps[0] is None
    assert plps[1] == {str(b): {"logprob": -2.0, "rank": 7, "decoded_token": "b"},
                       str(c): {"logprob": -0.1, "rank": 1, "decoded_token": "c"},
                       str(a): {"logprob": -0.2, "rank": 2, "decoded_token": "a"}}
    # the server sent more alternatives than prompt_logprobs asked (echo with a larger logprobs): cut to the ask
    plps = json.loads(msgspec.json.encode(prompt_logprobs(texts, [a, b], [None, lps[1]], 1)))
    assert plps[1] == {str(b): {"logprob": -2.0, "rank": 7, "decoded_token": "b"},
                       str(c): {"logprob": -0.1, "rank": 1, "decoded_token": "c"}}
    unranked = TokenLogprobs(-2.0, [c], [-0.1])  # a rank not known (0): null
    assert json.loads(msgspec.json.encode(prompt_logprobs(texts, [a, b], [None, unranked], 1)))[1][str(b)]["rank"] \
        is None


# ---------------------------------------------------------------------------
# whole answers and streams from fake SDK streams
# ---------------------------------------------------------------------------


class FakeGateway:
    model_name = "fake"

    def __init__(self, tokenizer):
        self.token_texts = TokenTexts(tokenizer)
        self.observed = []

    def observe(self, result):
        self.observed.append(result)

    def note_error(self, exc):
        pass


class FakeStream:
    """An SDK stream that hands out given chunks, then has ``result``."""

    def __init__(self, chunks: list[StreamChunk], result: GenerateResult) -> None:
        self.chunks = list(chunks)
        self.final = result
        self.result = None

    async def next_chunk(self):
        if self.chunks:
            return self.chunks.pop(0)
        self.result = self.final
        return None

    async def next_chunks(self):
        chunk = await self.next_chunk()
        return [] if chunk is None else [chunk]

    async def aclose(self):
        pass


def sse_events(blobs: list[bytes]) -> list[bytes]:
    """Each SSE event of the gateway's writes (one write may carry several)."""
    return [e + b"\n\n" for blob in blobs for e in blob.split(b"\n\n") if e]


def choice(index, text, ids, lps, prompt_tokens=3, reason="length", plps=None) -> GenerateResult:
    return GenerateResult(request_id="r", text=text, token_ids=ids, finish_reason=reason, prompt_tokens=prompt_tokens,
                          completion_tokens=len(ids), timings=Timings(ttft=0.1, e2e=0.2), index=index,
                          logprobs=lps, prompt_logprobs=plps)


def request_result(choices) -> GenerateResult:
    import dataclasses
    return dataclasses.replace(choices[0], choices=choices)


async def test_whole_completion_echo_logprobs_n_and_usage(tokenizer):
    gw = FakeGateway(tokenizer)
    p_ids = ids_of(tokenizer, "Hi")
    out = [ids_of(tokenizer, t) for t in ("ab", "c")]
    lp = lambda t: TokenLogprobs(-t / 100, [t], [-t / 100])  # noqa: E731
    plps = [None, lp(p_ids[1])]
    results = [request_result([choice(i, t, ids, [lp(x) for x in ids], plps=plps)
                               for i, (t, ids) in enumerate(zip(("ab", "c"), out))]) for _ in range(2)]
    streams = [FakeStream([], r) for r in results]
    prompts = [responses.Prompt(p_ids, "Hi"), responses.Prompt(p_ids, "Hi")]
    req = completion_req(n=2, echo=True, logprobs=0, prompt_logprobs=0)
    resp = msgspec.to_builtins(await responses.whole_completion(gw, req, "cmpl-1", prompts, streams))
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in resp["choices"]] == ["Hiab", "Hic", "Hiab", "Hic"]
    first = resp["choices"][0]["logprobs"]
    assert first["tokens"] == ["H", "i", "a", "b"]
    assert first["token_logprobs"][0] is None and first["top_logprobs"][0] is None
    assert first["token_logprobs"][1:] == [lp(t).logprob for t in [p_ids[1]] + out[0]]
    assert first["text_offset"] == [0, 1, 2, 3]
    assert resp["choices"][0]["prompt_logprobs"][0] is None
    assert resp["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}


async def test_chat_stream_n_with_logprobs_and_finishes(tokenizer):
    gw = FakeGateway(tokenizer)
    a, b = ids_of(tokenizer, "ab")
    lp = TokenLogprobs(-1.0, [a], [-1.0])
    chunks = [StreamChunk("a", [a], [lp], index=1), StreamChunk("b", [b], [lp], index=0, finish_reason="stop"),
              StreamChunk("", [], [], index=1, finish_reason="length")]
    result = request_result([choice(0, "b", [b], [lp], reason="stop"), choice(1, "a", [a], [lp])])
    stream = FakeStream(chunks[1:], result)
    req = chat_req(n=2, stream=True, logprobs=True, top_logprobs=1, stream_options={"include_usage": True})
    events = sse_events([e async for e in responses.chat_stream(gw, req, "chatcmpl-1", [stream], [chunks[0]])])
    bodies = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert events[-1] == b"data: [DONE]\n\n"
    roles = [c["choices"][0]["index"] for c in bodies if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    content = [(c["choices"][0]["index"], c["choices"][0]["delta"].get("content"), c["choices"][0]["finish_reason"])
               for c in bodies[2:] if c["choices"]]
    assert content == [(1, "a", None), (0, "b", "stop"), (1, None, "length")]
    assert bodies[2]["choices"][0]["logprobs"]["content"][0]["token"] == "a"
    assert bodies[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert gw.observed == [result]


async def test_completion_stream_echo_leads_each_choice_and_offsets_advance(tokenizer):
    gw = FakeGateway(tokenizer)
    p_ids, (a, b) = ids_of(tokenizer, "P"), ids_of(tokenizer, "ab")
    lp = TokenLogprobs(-1.0, [], [])
    chunks = [StreamChunk("a", [a], [lp], prompt_logprobs=[None]), StreamChunk("b", [b], [lp], finish_reason="length")]
    stream = FakeStream(chunks[1:], request_result([choice(0, "ab", [a, b], [lp, lp])]))
    req = completion_req(stream=True, echo=True, logprobs=0)
    events = sse_events([e async for e in responses.completion_stream(gw, req, "c", [responses.Prompt(p_ids, "P")],
                                                                      [stream], [chunks[0]])])
    bodies = [json.loads(e[len(b"data: "):])["choices"][0] for e in events[:-1]]
    assert [c["text"] for c in bodies] == ["Pa", "b"]
    assert bodies[0]["logprobs"]["tokens"] == ["P", "a"] and bodies[0]["logprobs"]["text_offset"] == [0, 1]
    assert bodies[1]["logprobs"]["text_offset"] == [2] and bodies[1]["finish_reason"] == "length"


async def test_echoed_offsets_run_on_past_a_prompt_of_split_characters(tokenizer):
    """An echoed prompt whose characters split over tokens (each part's text a U+FFFD) counts its token texts; the
    output's offsets continue from there, whole or streamed (they restarted at the prompt's length in characters:
    the offsets went back)."""
    gw = FakeGateway(tokenizer)
    prompt = "日本の首都は"
    p_ids, out = ids_of(tokenizer, prompt), ids_of(tokenizer, "ab")
    assert sum(len(gw.token_texts(t)) for t in p_ids) > len(prompt)  # split characters: the case at hand
    lp = TokenLogprobs(-1.0, [], [])
    chunks = [StreamChunk("a", out[:1], [lp], prompt_logprobs=[None] * len(p_ids)),
              StreamChunk("b", out[1:], [lp], finish_reason="length")]
    result = request_result([choice(0, "ab", out, [lp, lp])])
    req = completion_req(echo=True, logprobs=0)
    whole = msgspec.to_builtins(await responses.whole_completion(gw, req, "c", [responses.Prompt(p_ids, prompt)],
                                                                 [FakeStream([], result)]))
    offsets = whole["choices"][0]["logprobs"]["text_offset"]
    tokens = whole["choices"][0]["logprobs"]["tokens"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))], offsets
    events = sse_events([e async for e in responses.completion_stream(
        gw, completion_req(stream=True, echo=True, logprobs=0), "c", [responses.Prompt(p_ids, prompt)],
        [FakeStream(chunks[1:], result)], [chunks[0]])])
    assert offsets == [o for e in events[:-1] for o in json.loads(e[len(b"data: "):])["choices"][0]["logprobs"][
        "text_offset"]]


async def test_stop_reason_names_the_stop_string_or_stop_token_as_vllm(tokenizer):
    """vLLM's ``stop_reason`` on each choice: the stop string that ended it, or the token of ``stop_token_ids``;
    null for EOS and ``length``; whole and streamed (where the finish chunk may bring no token), chat and
    completions."""
    import dataclasses

    gw = FakeGateway(tokenizer)
    (a,), (b,) = ids_of(tokenizer, "a"), ids_of(tokenizer, "b")
    eos = tokenizer.eos_token_id
    cases = [(dict(stop_str="x"), [a], "x"), (dict(), [a, b], b), (dict(), [a, eos], None),
             (dict(finish_reason="length"), [a, b], None)]
    for fields, ids, expect in cases:
        c = dataclasses.replace(choice(0, "a", ids, [], reason="stop"), **fields)
        result = request_result([c])
        comp = msgspec.to_builtins(await responses.whole_completion(
            gw, completion_req(stop_token_ids=[b]), "c", [responses.Prompt([1], "P")], [FakeStream([], result)]))
        chat = msgspec.to_builtins(await responses.whole_chat(
            gw, chat_req(stop_token_ids=[b]), "c", responses.Prompt([1], "P"), FakeStream([], result)))
        assert comp["choices"][0]["stop_reason"] == chat["choices"][0]["stop_reason"] == expect, (fields, ids)
        # streamed: the tokens, then a finish chunk without any
        chunks = [StreamChunk("a", ids, []), StreamChunk("", [], finish_reason=c.finish_reason, stop_str=c.stop_str)]
        for stream_fn, req in ((responses.completion_stream, completion_req(stream=True, stop_token_ids=[b])),
                               (responses.chat_stream, chat_req(stream=True, stop_token_ids=[b]))):
            args = ([responses.Prompt([1], "P")],) if stream_fn is responses.completion_stream else ()
            events = sse_events([e async for e in stream_fn(gw, req, "c", *args, [FakeStream(chunks[1:], result)],
                                                            [chunks[0]])])
            finals = [json.loads(e[len(b"data: "):])["choices"][0] for e in events[:-1]]
            finals = [f for f in finals if f["finish_reason"] is not None]
            assert [f["stop_reason"] for f in finals] == [expect], (stream_fn.__name__, fields, ids)


async def test_completion_stream_offsets_count_token_texts_past_held_back_text(tokenizer):
    """A chunk whose text was held back (the start of a possible stop string: its tokens came, their text did not)
    does not shift the next chunk's offsets: they continue from the token texts, as the answer without streaming
    counts them."""
    gw = FakeGateway(tokenizer)
    (a,), (b,), (c,) = ids_of(tokenizer, "a"), ids_of(tokenizer, "b"), ids_of(tokenizer, "c")
    lp = TokenLogprobs(-1.0, [], [])
    chunks = [StreamChunk("a", [a], [lp]), StreamChunk("", [b], [lp]),
              StreamChunk("bc", [c], [lp], finish_reason="length")]
    stream = FakeStream(chunks[1:], request_result([choice(0, "abc", [a, b, c], [lp] * 3)]))
    req = completion_req(stream=True, logprobs=0)
    events = sse_events([e async for e in responses.completion_stream(gw, req, "c", [responses.Prompt([1], "P")],
                                                                      [stream], [chunks[0]])])
    offsets = [o for e in events[:-1] for o in json.loads(e[len(b"data: "):])["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2]


def test_observe_many_matches_one_observe_per_value():
    from prometheus_client import CollectorRegistry, Histogram

    from ipc.gateway.metrics import TOKEN_LATENCY_BUCKETS, observe_many

    registry = CollectorRegistry()
    one = Histogram("one", "by observe", ["m"], buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
    many = Histogram("many", "by observe_many", ["m"], buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
    values = [0.0, 0.01, 0.0100001, 0.3, 0.31, 5.0, 79.0, 80.0, 1e6, 0.002]
    for v in values:
        one.labels("x").observe(v)
    observe_many(many.labels("x"), values)
    observe_many(many.labels("x"), [])
    samples = {m.name: {(s.name.split("_", 1)[1], tuple(sorted(s.labels.items()))): s.value for s in m.samples
                        if not s.name.endswith("_created")} for m in registry.collect()}
    assert samples["one"] == samples["many"]
