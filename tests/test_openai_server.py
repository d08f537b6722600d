"""The OpenAI-compatible HTTP gateway, driven by the official ``openai`` client.

One real-model server (``forerun serve --port P --api-key K``) is shared by the
module; scripted-executor servers cover what needs many streams or a dying
executor.  Greedy answers must equal the SDK's, counts must match the
requests, a client that leaves must abort its request.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipc.client import AsyncClient, Client
from ipc.gateway.process import start_gateways
from tests.server_proc import run_dir, server_stats, wait_idle

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_line(srv, text: str, timeout: float = 180.0) -> str:
    """Read the server's output until a line holds ``text`` (the gateways announce themselves)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = srv.proc.stdout.readline()
        if not line:
            raise RuntimeError("server exited:\n" + "".join(srv.log))
        srv.log.append(line)
        if text in line:
            return line
    raise TimeoutError("".join(srv.log))


@pytest.fixture(scope="module")
def http_server(module_servers, default_model_dir):
    port = free_port()
    srv = module_servers("--port", str(port), "--host", "127.0.0.1", "--api-key", API_KEY,
                         "--max-num-seqs", "8", "--num-kv-blocks", "256")
    wait_for_line(srv, "OpenAI-compatible API at")
    srv.url = f"http://127.0.0.1:{port}"
    return srv


@pytest.fixture(scope="module")
def oai(http_server):
    return openai.OpenAI(base_url=f"{http_server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def sdk(http_server):
    with Client(http_server.address) as client:
        yield client


def http(method: str, url: str, body=None, key: str = None, raw: bytes = None) -> tuple[int, bytes]:
    """(status, body) of one plain HTTP request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def at_once(*calls):
    """Each call's result, the calls made at the same time from threads: their requests share the server's steps
    (the checks compare outputs, never how requests were batched)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def metric_values(url: str) -> dict[tuple, float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    text = http("GET", f"{url}/metrics")[1].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# ---------------------------------------------------------------------------
# answers: the same as the SDK's
# ---------------------------------------------------------------------------


def test_chat_greedy_equals_sdk(oai, sdk):
    r, ref = at_once(lambda: oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0),
                     lambda: sdk.generate(messages=MESSAGES, max_tokens=12, temperature=0))
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.usage.prompt_tokens == len(sdk.encode(messages=MESSAGES)) == ref.prompt_tokens
    assert r.usage.completion_tokens == ref.completion_tokens
    assert r.usage.total_tokens == ref.prompt_tokens + ref.completion_tokens


def test_completions_prompt_forms(oai, sdk):
    ids = sdk.encode("The capital of France is")

    def complete(prompt):
        return lambda: oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)

    ref, other, text, by_ids, two, two_ids = at_once(
        lambda: sdk.generate("The capital of France is", max_tokens=8, temperature=0),
        lambda: sdk.generate("Once upon a time", max_tokens=8, temperature=0),
        complete("The capital of France is"), complete(ids), complete(["The capital of France is", "Once upon a time"]),
        complete([ids, ids]))
    assert text.choices[0].text == ref.text and text.usage.completion_tokens == ref.completion_tokens
    assert by_ids.choices[0].text == ref.text and by_ids.usage.prompt_tokens == len(ids)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [ref.text, other.text]
    assert two.usage.completion_tokens == ref.completion_tokens + other.completion_tokens
    assert [c.text for c in two_ids.choices] == [ref.text, ref.text]


def test_completions_default_max_tokens_is_16(oai):
    r = oai.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_chat_default_max_tokens_is_what_the_kv_cache_leaves(oai, sdk):
    """This server's cache (256 blocks of 16 tokens) holds less than the model's 8,192-token context: the context
    it serves and advertises is the cache's, and a chat without max_tokens (the rest of that context) runs."""
    assert sdk.server_info.max_model_len == 256 * 16
    assert oai.models.list().data[0].max_model_len == 256 * 16
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, stop=[".", "\n"])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens > 0


def test_chat_continues_the_final_assistant_message(oai, sdk):
    """vLLM's continue_final_message: the prompt ends inside the assistant's last message, the answer goes on."""
    turns = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    r = oai.chat.completions.create(model=MODEL, messages=turns, max_tokens=6, temperature=0,
                                    extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = sdk.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True)
    assert text.endswith("The answer is")
    ref = sdk.generate(prompt_token_ids=sdk.tokenizer.encode(text, add_special_tokens=False), max_tokens=6,
                       temperature=0)
    assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == ref.prompt_tokens


def test_continuous_usage_stats_count_every_chunk(oai):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries its prompt's tokens and its choice's so far,
    ending at the usage chunk's figures; without it, chunks carry none."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for make in (lambda **kw: oai.chat.completions.create(messages=MESSAGES, **kw),
                 lambda **kw: oai.completions.create(prompt="Count: 1, 2, 3,", **kw)):
        chunks = list(make(model=MODEL, max_tokens=8, temperature=0, stream=True, stream_options=options,
                           extra_body={"ignore_eos": True}))
        *body, last = chunks
        assert not last.choices and last.usage.completion_tokens == 8
        counts = [c.usage.completion_tokens for c in body]
        assert all(c.usage.prompt_tokens == last.usage.prompt_tokens for c in body)
        assert counts == sorted(counts) and counts[-1] == 8, counts
        plain = list(make(model=MODEL, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
                          extra_body={"ignore_eos": True}))
        assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 8


async def test_chat_stream_async_with_usage(http_server, sdk):
    client = openai.AsyncOpenAI(base_url=f"{http_server.url}/v1", api_key=API_KEY, max_retries=0)

    async def streamed():
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                                      stream=True, stream_options={"include_usage": True})
        return [c async for c in stream]

    chunks, ref = await asyncio.gather(streamed(), asyncio.to_thread(sdk.generate, messages=MESSAGES, max_tokens=24,
                                                                     temperature=0))
    await client.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.completion_tokens
    assert chunks[-1].usage.prompt_tokens == ref.prompt_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_completions_stream_sync(oai, sdk):
    ref, chunks = at_once(lambda: sdk.generate("Once upon a time", max_tokens=8, temperature=0),
                          lambda: list(oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                                              temperature=0, stream=True)))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


async def test_async_non_streaming_and_seed(http_server, sdk):
    client = openai.AsyncOpenAI(base_url=f"{http_server.url}/v1", api_key=API_KEY, max_retries=0)
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=1234)
    a, b, ref = await asyncio.gather(client.chat.completions.create(**kw), client.chat.completions.create(**kw),
                                     asyncio.to_thread(sdk.generate, messages=MESSAGES, max_tokens=8, temperature=1.0,
                                                       seed=1234))
    await client.close()
    assert a.choices[0].message.content == b.choices[0].message.content == ref.text


def test_extra_body_sampling(oai, sdk):
    extra = {"top_k": 5, "min_p": 0.05, "stop_token_ids": [13], "ignore_eos": True}
    r, ref = at_once(lambda: oai.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0.7,
                                                    top_p=0.9, seed=3, extra_body=extra),
                     lambda: sdk.generate("Hello", max_tokens=10, temperature=0.7, top_p=0.9, seed=3, top_k=5,
                                          min_p=0.05, stop_token_ids=[13], ignore_eos=True))
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("param,kwargs,instead", [("best_of", {"best_of": 2}, "only 1 is"),
                                                  ("best_of", {"best_of": 0}, "only 1 is"),
                                                  ("suffix", {"suffix": "end"}, "")])
def test_unsupported_completion_params_are_400(oai, param, kwargs, instead):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, **kwargs)
    assert e.value.param == param and "not supported" in e.value.message and instead in e.value.message


@pytest.mark.parametrize("kwargs,param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
])
def test_bad_new_params_are_400_naming_them(oai, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kwargs)
    assert e.value.param == param


def test_a_huge_n_is_400_at_once_and_the_worker_serves_on(http_server, oai):
    """n is bounded before anything is set up per completion: n = 10**6 once held the worker's loop for 11 s, past
    its heartbeat, and the scheduler dropped the worker with every request in flight."""
    t0 = time.monotonic()
    for create in (lambda: oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=10**6),
                   lambda: oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=10**6)):
        with pytest.raises(openai.BadRequestError) as e:
            create()
        assert e.value.param == "n" and "[1, 16]" in e.value.message
    assert time.monotonic() - t0 < 5
    assert len(oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2).choices) == 2


def test_a_long_text_the_context_holds_is_not_refused_by_its_length(http_server, oai):
    """A run of spaces is 64 characters a token of SmolLM2: the cap before tokenizing is the tokenizer's longest
    token (81 characters), not 32, so a text of 33 characters a token of the context is served."""
    context = json.loads(http("GET", f"{http_server.url}/v1/models", key=API_KEY)[1])["data"][0]["max_model_len"]
    text = " " * (33 * context)
    status, body = http("POST", f"{http_server.url}/tokenize", {"prompt": text}, API_KEY)
    assert status == 200 and json.loads(body)["count"] < context, body[:300]
    r = oai.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert r.usage.prompt_tokens == json.loads(body)["count"]


def test_a_chat_prompt_too_long_names_messages(oai):
    """Chat has no prompt field: a rendered prompt over the context, or a text over the length cap, is the
    messages' fault, streamed or not."""
    long_turn = [{"role": "user", "content": "hello " * 9000}]  # about 9000 tokens: over the context
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=long_turn, max_tokens=2, stream=stream)
        assert e.value.param == "messages" and "context" in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "#" * 900_000}], max_tokens=2)
    assert e.value.param == "messages" and "characters" in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # completions keep naming their prompt
        oai.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=2)
    assert e.value.param == "prompt", e.value.message


def test_prompt_ids_out_of_the_vocabulary_are_named_and_so_is_one_prompt_of_several(http_server):
    """An id past 64 bits gets the words of any id out of the vocabulary (as /detokenize's), not msgpack's; of
    several prompts, the message names the one refused, by the gateway or the scheduler, streamed or not."""
    def error(body):
        status, answer = http("POST", f"{http_server.url}/v1/completions", {"model": MODEL, "max_tokens": 1, **body},
                              API_KEY)
        assert status == 400, answer
        return json.loads(answer)["error"]["message"], json.loads(answer)["error"]["param"]

    huge = 1180591620717411303424
    assert error({"prompt": [huge]}) == (f"token id {huge} is out of range [0, 49152)", "prompt")
    assert error({"prompt": [5, 49152]}) == ("token id 49152 is out of range [0, 49152)", "prompt")
    assert error({"prompt": [[5], [6], [huge]]}) == (f"prompt[2]: token id {huge} is out of range [0, 49152)",
                                                      "prompt")
    status, answer = http("POST", f"{http_server.url}/detokenize", {"tokens": [huge]}, API_KEY)
    assert json.loads(answer)["error"]["message"] == f"token id {huge} is out of range [0, 49152)"
    for stream in (False, True):  # the scheduler refuses the second prompt: over the context
        message, param = error({"prompt": ["Hi", "hello " * 9000], "stream": stream})
        assert param == "prompt" and message.startswith("prompt[1]: the prompt has "), message


def test_content_parts_other_than_text_are_refused_for_their_type_and_a_refusal_part_is_text(http_server, oai):
    for part in ({"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                 {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [part]}], max_tokens=1)
        assert e.value.body["message"] == f"content part of type {part['type']!r} is not supported; only text parts " \
                                          "are" and e.value.param == "messages[0].content[0].type", e.value.body
    said, why = "I can't help with that.", {"role": "user", "content": "Why?"}
    sent = MESSAGES + [{"role": "assistant", "content": [{"type": "refusal", "refusal": said}]}, why]
    plain = MESSAGES + [{"role": "assistant", "content": said}, why]
    counts = [oai.chat.completions.create(model=MODEL, messages=m, max_tokens=1).usage.prompt_tokens
              for m in (sent, plain)]
    assert counts[0] == counts[1]  # the refusal's text, rendered as a text part's


# ---------------------------------------------------------------------------
# sampling and output features: these need the scheduler and executor
# sides of n, stop strings, logprobs and penalties; run them after merging those.
# ---------------------------------------------------------------------------


def test_needs_engine_n_with_seed_and_usage(oai, sdk):
    def streamed():
        texts, finishes = {0: "", 1: ""}, {}
        for chunk in oai.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.0, seed=3, n=2,
                                            stream=True):
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason
        return texts, finishes

    r, ref, alone, two, (texts, finishes), whole = at_once(
        lambda: oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=77,
                                            n=3),
        lambda: sdk.generate(messages=MESSAGES, max_tokens=8, temperature=1.0, seed=77, n=3),
        lambda: sdk.generate(messages=MESSAGES, max_tokens=8, temperature=1.0, seed=78),
        lambda: oai.completions.create(model=MODEL, prompt=["Hello", "Once upon"], max_tokens=5, temperature=1.0,
                                       seed=3, n=2),
        streamed,
        lambda: oai.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.0, seed=3, n=2))
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [c.text for c in ref.choices]
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.prompt_tokens == ref.prompt_tokens  # once, not n times
    assert r.usage.completion_tokens == sum(c.completion_tokens for c in ref.choices)
    # Completion i uses seed + i: the second choice is what a lone request with seed 78 gives.
    assert r.choices[1].message.content == alone.text
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [texts[0], texts[1]] == [c.text for c in whole.choices] and set(finishes) == {0, 1}


def test_needs_engine_stop_strings(oai, sdk):
    full = sdk.generate("The capital of France is", max_tokens=8, temperature=0)  # " Paris.\n\nThe answer is:"
    words = full.text.split()
    assert len(words) >= 3
    stop = words[2]
    cut = full.text[:full.text.index(stop)]

    def complete(**kw):
        return lambda: oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=24,
                                              temperature=0, **kw)

    r, included, stream, ref = at_once(
        complete(stop=stop), complete(stop=["zzzz", stop], extra_body={"include_stop_str_in_output": True}),
        lambda: list(complete(stop=[stop], stream=True)()),
        lambda: sdk.generate("The capital of France is", max_tokens=24, temperature=0, stop=[stop]))
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert included.choices[0].text == cut + stop
    assert "".join(c.choices[0].text for c in stream if c.choices) == cut
    assert ref.text == cut and ref.stop_str == stop and ref.finish_reason == "stop"
    # vLLM's stop_reason names the stop string, whole and on the streamed finish
    assert r.choices[0].stop_reason == included.choices[0].stop_reason == stop
    assert [c.choices[0].stop_reason for c in stream if c.choices and c.choices[0].finish_reason] == [stop]


def test_a_stop_token_s_text_is_left_out_unless_included(oai, sdk):
    """vLLM's rule for stop_token_ids: the text of the token that ended the answer is not shown unless
    include_stop_str_in_output; the token still counts in the usage and keeps its logprobs entry."""
    prompt = "The capital of France is"
    first = sdk.generate(prompt, max_tokens=1, temperature=0)  # " Paris"
    stop = {"stop_token_ids": first.token_ids}
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=0, extra_body=stop)
    c = r.choices[0]
    assert (c.text, c.finish_reason, r.usage.completion_tokens) == ("", "stop", 1)
    assert c.stop_reason == first.token_ids[0]  # vLLM's stop_reason: the stop token
    assert c.logprobs.tokens == [first.text]
    streamed = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                      extra_body=stop)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == ""
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                               extra_body={**stop, "include_stop_str_in_output": True})
    assert r.choices[0].text == first.text and r.choices[0].finish_reason == "stop"
    # chat: stop on a token of the greedy answer after its first, where that token first comes
    ids = sdk.generate(messages=MESSAGES, max_tokens=6, temperature=0).token_ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    before = sdk.generate(messages=MESSAGES, max_tokens=k, temperature=0).text
    upto = sdk.generate(messages=MESSAGES, max_tokens=k + 1, temperature=0).text
    assert before != upto
    chat = {"stop_token_ids": [ids[k]]}
    for include, expected in ((False, before), (True, upto)):
        extra = {**chat, "include_stop_str_in_output": include}
        r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, extra_body=extra)
        assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
        streamed = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                               stream=True, extra_body=extra)
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == expected


def test_needs_engine_chat_logprobs(oai, sdk):
    r, ref, stream = at_once(
        lambda: oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=3),
        lambda: sdk.generate(messages=MESSAGES, max_tokens=8, temperature=0, logprobs=3),
        lambda: list(oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 logprobs=True, stream=True)))
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == r.usage.completion_tokens
    for item, lp in zip(content, ref.logprobs):
        assert item.logprob == pytest.approx(lp.logprob, abs=1e-4) and item.logprob <= 0
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= item.top_logprobs[2].logprob
        assert item.top_logprobs[0].token == item.token  # greedy: the chosen token is the most likely
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    streamed = [x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.token for x in streamed] == [x.token for x in content]


def test_needs_engine_completion_logprobs_and_echo(oai, sdk):
    prompt = "The capital of France is"

    def complete(**kw):
        return lambda: oai.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)

    r, e, plain, v, scored = at_once(complete(max_tokens=6, logprobs=2), complete(max_tokens=6, logprobs=2, echo=True),
                                     complete(max_tokens=4, echo=True),
                                     complete(max_tokens=2, extra_body={"prompt_logprobs": 1}),
                                     complete(max_tokens=0, logprobs=1, echo=True))  # scoring the prompt
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(d) >= 2 for d in lp.top_logprobs) and lp.text_offset[0] == 0
    assert e.choices[0].text == prompt + r.choices[0].text
    n_prompt = len(sdk.encode(prompt))
    elp = e.choices[0].logprobs
    assert len(elp.tokens) == n_prompt + 6
    assert elp.token_logprobs[0] is None and all(x is not None for x in elp.token_logprobs[1:])
    assert elp.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-4)
    # max_tokens 0 with echo (lm-eval-harness's loglikelihood): the prompt and its logprobs, nothing generated
    slp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0 and len(slp.tokens) == n_prompt
    assert slp.token_logprobs == pytest.approx(elp.token_logprobs[:n_prompt], abs=1e-4)
    for bad in (dict(echo=True, stream=True), dict()):  # streamed, or without echo: a 400 naming max_tokens
        with pytest.raises(openai.BadRequestError) as refused:
            oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, **bad)
        assert refused.value.body["param"] == "max_tokens"
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    plps = v.choices[0].model_extra["prompt_logprobs"]
    assert plps[0] is None and len(plps) == n_prompt and all(len(d) >= 1 for d in plps[1:])
    # every entry has its rank, the prompt token's too where it is outside the top 1 (vLLM's shape)
    ranks = [(e["rank"], e["logprob"]) for d in plps[1:] for e in d.values()]
    assert all(isinstance(k, int) and k >= 1 for k, _ in ranks), ranks
    assert any(k > 1 for k, _ in ranks)  # a prompt has tokens the model did not expect most


def test_needs_engine_penalties_and_bias_accepted(oai, sdk):
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0)
    r, ref, plain = at_once(
        lambda: oai.chat.completions.create(**kw, max_tokens=8, presence_penalty=0.5, frequency_penalty=0.5,
                                            extra_body={"repetition_penalty": 1.3, "min_tokens": 4}),
        lambda: sdk.generate(messages=MESSAGES, max_tokens=8, temperature=0, presence_penalty=0.5,
                             frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=4),
        lambda: sdk.generate(messages=MESSAGES, max_tokens=1, temperature=0))  # the first greedy token
    assert r.choices[0].message.content == ref.text and r.usage.completion_tokens >= 4
    banned = plain.token_ids[0]
    r = oai.chat.completions.create(**kw, max_tokens=1, logit_bias={str(banned): -100}, logprobs=True)
    assert r.choices[0].logprobs.content[0].token != sdk.tokenizer.decode([banned])


def test_neutral_values_are_accepted(oai):
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=1, stop=None, logprobs=False,
                                    presence_penalty=0, frequency_penalty=0.0, logit_bias={}, user="someone",
                                    extra_body={"repetition_penalty": 1.0, "min_tokens": 0})
    assert r.usage.completion_tokens <= 2
    r = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, echo=False, logprobs=None, stop=[], n=1)
    assert len(r.choices) == 1


def test_error_codes(http_server, oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    bad = openai.OpenAI(base_url=f"{http_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:  # a wrong type, named by msgspec
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens="many")
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # out of range, named by the scheduler
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:  # streaming too: the status comes before the stream
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, top_p=0, stream=True)
    assert e.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="Hi", extra_body={"best_effort": 1})
    assert e.value.param == "best_effort"
    status, body = http("POST", f"{http_server.url}/v1/completions", raw=b"{not json", key=API_KEY)
    assert status == 400 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_models_tokenize_detokenize_health_version(http_server, oai, sdk):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    url = http_server.url
    _, body = http("POST", f"{url}/tokenize", {"model": MODEL, "messages": MESSAGES}, API_KEY)
    assert json.loads(body)["tokens"] == sdk.encode(messages=MESSAGES)
    _, body = http("POST", f"{url}/tokenize", {"prompt": "Hello world"}, API_KEY)
    ids = json.loads(body)["tokens"]
    assert ids == sdk.encode("Hello world") and json.loads(body)["count"] == len(ids)
    _, body = http("POST", f"{url}/detokenize", {"tokens": ids}, API_KEY)
    assert json.loads(body)["prompt"] == "Hello world"
    assert http("POST", f"{url}/detokenize", {"tokens": [10**9]}, API_KEY)[0] == 400
    assert http("POST", f"{url}/tokenize", {"prompt": "x"})[0] == 401
    assert http("GET", f"{url}/health")[0] == 200  # open: no key needed
    assert json.loads(http("GET", f"{url}/version")[1])["version"]
    # what it does not serve: OpenAI error bodies that say what it does
    status, body = http("POST", f"{url}/v1/embeddings", {"model": MODEL, "input": "x"}, API_KEY)
    error = json.loads(body)["error"]
    assert status == 404 and error["code"] == "not_found" and "POST /v1/chat/completions" in error["message"], body
    status, body = http("GET", f"{url}/v1/chat/completions", None, API_KEY)
    assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed", body
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model=MODEL, input="x")


# ---------------------------------------------------------------------------
# metrics and disconnects
# ---------------------------------------------------------------------------


def test_metrics_count_the_requests(http_server, oai):
    model = (("model_name", MODEL),)
    before = metric_values(http_server.url)
    usages = []
    for max_tokens in (3, 5):
        usages.append(oai.completions.create(model=MODEL, prompt="One two", max_tokens=max_tokens, temperature=0,
                                             extra_body={"ignore_eos": True}).usage)
    stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usages.append(list(stream)[-1].usage)
    after = metric_values(http_server.url)

    def delta(name, labels=model):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    length = tuple(sorted(model + (("finished_reason", "length"),)))
    assert delta("forerun:request_success_total", length) == 3
    assert delta("forerun:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("forerun:generation_tokens_total") == 3 + 5 + 4
    assert delta("forerun:e2e_request_latency_seconds_count") == 3
    assert delta("forerun:time_to_first_token_seconds_count") == 3
    assert delta("forerun:inter_token_latency_seconds_count") == 2 + 4 + 3
    assert after[("forerun:num_requests_running", model)] == 0
    assert after[("forerun:num_kv_blocks_free", model)] == 256 and after[("forerun:kv_cache_usage_perc", model)] == 0
    assert delta("forerun:steps_total") >= 12 and delta("forerun:step_time_seconds_total") > 0
    # Every admission looks its prompt up in the prefix cache (no preemption here: each once).
    assert delta("forerun:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert 0 <= delta("forerun:prefix_cache_hits_total") <= delta("forerun:prefix_cache_queries_total")
    assert 0.0 <= after[("forerun:gpu_idle_fraction", model)] < 1.0


async def test_client_disconnect_aborts(http_server):
    before = metric_values(http_server.url)
    client = openai.AsyncOpenAI(base_url=f"{http_server.url}/v1", api_key=API_KEY, max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt="Tell me a long story.", max_tokens=2000,
                                             stream=True, extra_body={"ignore_eos": True})
    n = 0
    async for _ in stream:
        n += 1
        if n == 3:
            break
    assert (await server_stats(http_server.address)).num_running == 1
    await stream.close()  # closes the connection mid-stream
    await client.close()
    s = await wait_idle(http_server.address)
    assert s.num_running == 0 and s.num_free_kv_blocks == s.num_kv_blocks and s.num_free_slots == s.num_slots
    abort = (("finished_reason", "abort"), ("model_name", MODEL))
    after = metric_values(http_server.url)
    assert after[("forerun:request_success_total", abort)] - before.get(("forerun:request_success_total", abort), 0) == 1


# ---------------------------------------------------------------------------
# the benchmark client: kept-alive connections, several client processes
# ---------------------------------------------------------------------------


@pytest.fixture
def scripts_path(monkeypatch):
    """scripts/ first on sys.path, as when Python runs a script there."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))


async def test_keep_alive_connections_carry_one_stream_after_another(http_server, scripts_path):
    from benchlib import Connections, HTTPError

    conns = Connections(http_server.url, API_KEY)
    await conns.open(2)
    opened = list(conns.idle)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    try:
        for _ in range(3):
            events = []
            await conns.post("/v1/completions", body, lambda t, e: events.append(e))
            assert events[-1] is None and events[-2]["usage"]["completion_tokens"] == 3  # [DONE] after the usage
            assert sum(len(e["choices"]) for e in events[:-1]) == 3
        assert sorted(map(id, conns.idle)) == sorted(map(id, opened))  # no new connection was opened
        with pytest.raises(HTTPError) as e:  # an error answer is not chunked: its connection is not reused
            await conns.post("/v1/completions", dict(body, max_tokens=-1), lambda t, e: None)
        assert e.value.status == 400 and len(conns.idle) == 1
    finally:
        conns.close()


def test_bench_serve_over_http_in_two_processes_with_keep_alive(http_server, scripts_path):
    import bench_serve

    figures = bench_serve.main(["--backend", "openai", "--base-url", http_server.url, "--address",
                                http_server.address, "--api-key", API_KEY, "--num-requests", "6", "--warmup", "2",
                                "--input-len", "5", "--output-len", "4", "--concurrency", "4", "--client-procs", "2",
                                "--http-keep-alive", "--no-progress"])
    assert figures["completed"] == 6 and figures["failed"] == 0 and figures["client_procs"] == 2
    assert figures["total_output_tokens"] == 24 and figures["total_input_tokens"] == 30
    assert figures["ttft_ms"]["p50"] > 0 and figures["tpot_ms"]["p50"] > 0


# ---------------------------------------------------------------------------
# scripted executor: many streams over two workers; health once the executor is gone
# ---------------------------------------------------------------------------


async def test_two_workers_64_streams_no_mixup(servers, default_model_dir):
    port = free_port()
    srv = servers("--load-format", "scripted", "--scripted-step-ms", "2", "--tokenizer", default_model_dir,
                         "--max-num-seqs", "64", "--port", str(port), "--api-workers", "2")
    wait_for_line(srv, "OpenAI-compatible API at")
    prompt = [5, 6, 7, 8, 9]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

    async def one(seed: int) -> tuple[set, str]:
        stream = await client.completions.create(model="scripted", prompt=prompt, max_tokens=24, seed=seed,
                                                 stream=True, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return {c.id for c in chunks}, "".join(c.choices[0].text for c in chunks)

    got = await asyncio.gather(*(one(seed) for seed in range(64)))
    await client.close()
    async with AsyncClient(srv.address) as sdk:
        want = await asyncio.gather(*(sdk.generate(prompt_token_ids=prompt, max_tokens=24, seed=seed,
                                                   ignore_eos=True) for seed in range(64)))
    assert all(len(ids) == 1 for ids, _ in got)
    assert len({next(iter(ids)) for ids, _ in got}) == 64
    assert [text for _, text in got] == [w.text for w in want]
    assert len({w.text for w in want}) == 64
    # Both workers served: each writes its own metric files, named by pid.
    run_dir = os.path.dirname(srv.address[len("ipc://"):])
    files = glob.glob(os.path.join(run_dir, "forerun-*", "prometheus", "histogram_*.db"))
    assert len(files) == 2, files
    assert_no_leak_after = await wait_idle(srv.address)
    assert assert_no_leak_after.num_free_kv_blocks == assert_no_leak_after.num_kv_blocks


async def test_a_request_given_up_leaves_the_gateway_serving_once_the_server_serves():
    """A request failed after two executor failures in a row (the server restarts its executor and serves the
    others): the gateway answers 503 only until the server says it takes requests; a server that failed for
    good (draining, or not answering) keeps it at 503."""
    from ipc.client import ExecutorFailedError
    from ipc.client_protocol import ServerStats
    from ipc.gateway.worker import Gateway

    class Server:
        def __init__(self, answer):
            self.answer = answer

        async def get_stats(self, timeout=None):
            if isinstance(self.answer, BaseException):
                raise self.answer
            required = ServerStats.__struct_fields__[:-len(ServerStats.__struct_defaults__)]
            return ServerStats(**dict.fromkeys(required, 0), draining=self.answer)

        async def close(self):
            pass

    for answer, serves in ((False, True), (True, False), (TimeoutError("no answer"), False)):
        gw = Gateway("ipc:///nowhere")
        gw.client = Server(answer)
        gw.note_error(ExecutorFailedError("executor_failed", None, "two failures in a row; not retried"))
        assert gw.failed
        await gw._recheck
        assert gw.failed is not serves, answer
        await gw.stop()


async def test_health_503_once_the_executor_is_gone(servers):
    # No restarts allowed: the executor's death is the server's (fail-stop), as after too many restarts.
    srv = servers("--load-format", "scripted", "--scripted-step-ms", "5", "--max-restarts", "0")
    port = free_port()
    gateways = start_gateways(srv.address, host="127.0.0.1", port=port, workers=1, run_dir=run_dir("gw"))
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(gateways.wait_ready, 120)
        assert http("GET", f"{url}/health")[0] == 200
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = await client.completions.create(model="scripted", prompt=[5, 6], max_tokens=3000, stream=True,
                                                 extra_body={"ignore_eos": True})
        await anext(stream)
        os.kill(srv.executor_pid(), signal.SIGKILL)
        with pytest.raises(openai.APIError) as e:  # the error event ends the stream
            async for _ in stream:
                pass
        assert "executor" in str(e.value)
        await client.close()
        assert http("GET", f"{url}/health")[0] == 503
        status, body = http("POST", f"{url}/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
        assert status == 503 and json.loads(body)["error"]["code"] == "executor_failed"
    finally:
        gateways.stop()
