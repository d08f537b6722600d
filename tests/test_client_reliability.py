"""The SDK when things go wrong: a server that dies, restarts or never was, and the local traps.

Against the scripted fake server of ``test_client_unit`` (a real ZeroMQ ROUTER in a thread that
answers Ping with Pong): liveness (ServerGoneError within 5 s, reconnecting afterwards), refusal
codes, values that cannot be sent, frames over the size limit, text too long to tokenize, chat
messages the template would mangle, a process exiting with a live stream, and several clients
loading the tokenizer at once.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from ipc.client import (
    AsyncClient,
    Client,
    ForerunError,
    InvalidRequestError,
    OverloadedError,
    ServerGoneError,
    ServerShuttingDownError,
    SlowReaderError,
)
from ipc.client.prompt import (MIN_CHARS_PER_TOKEN, NORMALIZER_FOLD, UNKNOWN_CHARS_PER_TOKEN, chars_per_token,
                               encode_prompt, load_tokenizer)
from ipc.protocol import HEARTBEAT_MISSES, Error, Generate, TokenDelta
from tests.server_proc import ROOT, python_path
from tests.test_client_unit import (  # noqa: F401  (fixtures)
    HANG,
    FakeServer,
    address,
    finish_script,
    serve,
    tokenizer,
    tokenizer_dir,
)


def one_token_then_hang(gen: Generate) -> list:
    return [TokenDelta(request_id=gen.request_id, token_ids=[5]), HANG]


# ---------------------------------------------------------------------------
# liveness
# ---------------------------------------------------------------------------


async def test_hello_promises_a_heartbeat_and_idle_client_pings(serve, address):
    server = serve(lambda g: [])
    async with AsyncClient(address, timeout=5, heartbeat_s=0.1) as client:
        await asyncio.sleep(0.6)
        assert client.server_info.server_id == "fake-1"
    assert server.hello_msgs[0].heartbeat_s == 0.1
    assert server.pings >= 3


async def test_silent_server_fails_waiting_requests_within_5s_then_reconnects(serve, address):
    server = serve(one_token_then_hang)
    async with AsyncClient(address, timeout=60) as client:  # the default heartbeat: 1 s
        stream = client.stream(prompt_token_ids=[1], detokenize=False)
        assert (await stream.next_chunk()).token_ids == [5]
        server.muted = True
        t0 = time.monotonic()
        with pytest.raises(ServerGoneError, match="no message from the server") as info:
            await stream.next_chunk()
        # HEARTBEAT_MISSES x 1 s of silence (about 4 s): the bound only tells it from the 60 s timeout, with room
        # for a loaded machine that runs the client's check late.
        assert time.monotonic() - t0 < 20
        assert info.value.code == "server_gone" and address in str(info.value)
        assert client.in_flight == 0
        server.muted = False
        # The next call connects again (a new socket, a new Hello).
        server.script = lambda g: finish_script(g, [7, 8])
        result = await client.generate(prompt_token_ids=[1], detokenize=False)
        assert result.token_ids == [7, 8] and server.hellos == 2
    assert HEARTBEAT_MISSES == 4


async def test_restarted_server_is_noticed_by_its_server_id(serve, address):
    first = serve(one_token_then_hang)
    async with AsyncClient(address, timeout=60, heartbeat_s=0.2) as client:
        stream = client.stream(prompt_token_ids=[1], detokenize=False)
        assert (await stream.next_chunk()).token_ids == [5]
        first.__exit__()
        # Another process at the same address: it answers Pings, with another id.
        second = serve(lambda g: finish_script(g, [9]), server_id="fake-2")
        with pytest.raises(ServerGoneError, match="restarted"):
            await asyncio.wait_for(stream.next_chunk(), 5)
        assert (await client.generate(prompt_token_ids=[1], detokenize=False)).token_ids == [9]
        assert client.server_info.server_id == "fake-2" and second.hellos == 1


async def test_server_without_heartbeats_is_never_taken_for_dead(serve, address):
    server = serve(lambda g: finish_script(g, [4]), server_id="")  # answers no Ping
    async with AsyncClient(address, timeout=10, heartbeat_s=0.05) as client:
        await asyncio.sleep(0.5)  # 10 heartbeats of silence
        assert (await client.generate(prompt_token_ids=[1], detokenize=False)).token_ids == [4]
    assert server.pings > 0 and server.hellos == 1


def test_blocking_client_sees_server_gone_and_nothing_at_address(serve, address):
    with pytest.raises(ServerGoneError, match=f"no server answered at {address}"):
        Client(address, timeout=60, connect_timeout=0.5).connect()
    server = serve(one_token_then_hang)
    with Client(address, timeout=60, heartbeat_s=0.2) as client:
        it = iter(client.stream(prompt_token_ids=[1], detokenize=False))
        assert next(it).token_ids == [5]
        server.muted = True
        with pytest.raises(ServerGoneError):
            next(it)


@pytest.mark.parametrize("code, cls", [("overloaded", OverloadedError), ("shutting_down", ServerShuttingDownError),
                                       ("slow_reader", SlowReaderError)])
async def test_refusal_codes_have_their_own_errors(serve, address, code, cls):
    serve(lambda g: [Error(code=code, message="no", request_id=g.request_id)])
    async with AsyncClient(address, timeout=5) as client:
        with pytest.raises(cls) as info:
            await client.generate(prompt_token_ids=[1], detokenize=False)
    assert info.value.code == code and isinstance(info.value, ForerunError)


# ---------------------------------------------------------------------------
# local failures leave nothing behind
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt_token_ids=[1, 2**64]), "prompt_token_ids"),
    (dict(prompt_token_ids=[-(2**63) - 1]), "prompt_token_ids"),
    (dict(prompt_token_ids=[1], top_k=2**70), "sampling.top_k"),
    (dict(prompt_token_ids=[1], seed=-(2**80)), "sampling.seed"),
    (dict(prompt_token_ids=[1], max_tokens=2**64), "sampling.max_tokens"),
    (dict(prompt_token_ids=[1], stop_token_ids=[2**65]), "sampling.stop_token_ids"),
])
async def test_unencodable_values_raise_and_leave_no_phantom(serve, address, kwargs, field):
    server = serve(lambda g: finish_script(g, [3]))
    client = AsyncClient(address, timeout=5)
    with pytest.raises(InvalidRequestError) as info:
        await client.generate(request_id="same", detokenize=False, **kwargs)
    assert info.value.field == field
    assert client.in_flight == 0 and server.generates == []
    # The id is free again, and close() works.
    assert (await client.generate(prompt_token_ids=[1], request_id="same", detokenize=False)).token_ids == [3]
    await client.close()


async def test_lone_surrogate_request_id_and_abort_raise_forerun_error(serve, address):
    serve(lambda g: finish_script(g, [3]))
    async with AsyncClient(address, timeout=5) as client:
        with pytest.raises(InvalidRequestError) as info:
            await client.generate(prompt_token_ids=[1], request_id="bad\ud800id", detokenize=False)
        assert info.value.field == "request_id" and client.in_flight == 0
        with pytest.raises(InvalidRequestError):
            await client.abort("\udfff")
        with pytest.raises(InvalidRequestError) as info:
            await client.generate("text with a lone \ud800 surrogate")
        assert info.value.field == "prompt"


def test_blocking_unencodable_value_then_same_id_and_close(serve, address):
    serve(lambda g: finish_script(g, [3]))
    client = Client(address, timeout=5)
    with pytest.raises(InvalidRequestError):
        client.generate(prompt_token_ids=[2**64], request_id="x", detokenize=False)
    assert client.generate(prompt_token_ids=[1], request_id="x", detokenize=False).token_ids == [3]
    client.close()
    assert client.closed


async def test_frame_over_the_size_limit_fails_at_once(serve, address):
    server = serve(lambda g: finish_script(g, [3]))
    async with AsyncClient(address, timeout=60) as client:
        with pytest.raises(InvalidRequestError, match="bytes per message") as info:
            await client.generate(prompt_token_ids=[100_000] * 6_000_000, detokenize=False)  # ~30 MB
        assert info.value.field == "prompt_token_ids" and client.in_flight == 0
    assert server.generates == []


async def test_huge_text_is_refused_before_tokenizing(serve, address):
    server = serve(lambda g: finish_script(g, [3]))
    async with AsyncClient(address, timeout=60) as client:
        limit = client.server_info.max_model_len * chars_per_token(await client.get_tokenizer())
        t0 = time.monotonic()
        with pytest.raises(InvalidRequestError, match="characters") as info:
            await client.generate("x" * 10_000_000)
        # The fake tokenizer takes one token per byte: tokenizing 10 MB would take minutes.
        assert time.monotonic() - t0 < 10.0
        assert info.value.field == "prompt"
        with pytest.raises(InvalidRequestError) as info:
            await client.generate(messages=[{"role": "user", "content": "y" * (limit + 1)}])
        assert info.value.field == "messages"
    assert server.generates == []


def test_the_text_cap_is_the_tokenizers_longest_token(default_model_dir):
    """SmolLM2's vocabulary holds tokens of up to 81 characters (80 '#', a newline and 80 spaces): a text of more
    than 32 characters a token can still fit, and the cap's message ("no text over N characters fits") holds."""
    tokenizer = load_tokenizer(default_model_dir)
    per_token = chars_per_token(tokenizer)
    assert per_token == max(map(len, tokenizer.get_vocab())) >= 80
    context = 8192
    for text in (" " * (32 * context + 1000), "#" * (32 * context + 1000)):
        assert len(encode_prompt(tokenizer, text, max_model_len=context)) < context
    with pytest.raises(InvalidRequestError, match=f"no text over {context * per_token} characters") as info:
        encode_prompt(tokenizer, "#" * (context * per_token + 1), max_model_len=context)
    assert info.value.field == "prompt"


def test_the_text_cap_of_small_odd_or_normalizing_vocabularies(tokenizer):
    """At least the floor (the fake byte-level vocabulary's longest token is 13 characters); a generous constant
    for a tokenizer whose vocabulary cannot be read; a tokenizer that normalizes text first (NFC folds a letter and
    its accents into one character) gets room for the folding."""
    from tokenizers import Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast

    assert chars_per_token(tokenizer) == MIN_CHARS_PER_TOKEN
    assert chars_per_token(None) == chars_per_token(object()) == UNKNOWN_CHARS_PER_TOKEN
    word = "x" * 40
    tok = Tokenizer(models.WordLevel({word: 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.normalizer = normalizers.NFC()
    assert chars_per_token(PreTrainedTokenizerFast(tokenizer_object=tok)) == 40 * NORMALIZER_FOLD


@pytest.mark.parametrize("messages, field", [
    ([{"role": "banana", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi"}, {"content": "no role"}], "messages[1].role"),
    (["just a string"], "messages[0]"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([], "messages"),
    ("not a list", "messages"),
])
async def test_malformed_chat_messages_are_refused_naming_the_field(serve, address, messages, field):
    server = serve(lambda g: finish_script(g, [3]))
    async with AsyncClient(address, timeout=5) as client:
        with pytest.raises(InvalidRequestError) as info:
            await client.generate(messages=messages)
        assert info.value.field == field, info.value
        # Every role the templates know is accepted.
        roles = ["system", "user", "assistant", "tool", "user"]
        await client.generate(messages=[{"role": r, "content": "ok"} for r in roles])
    assert len(server.generates) == 1


def test_template_and_tokenizer_exceptions_become_forerun_error():
    class Broken:
        def apply_chat_template(self, *args, **kwargs):
            import jinja2

            raise jinja2.TemplateError("boom")

        def encode(self, *args, **kwargs):
            raise RuntimeError("tokenizer exploded")

    with pytest.raises(InvalidRequestError, match="TemplateError") as info:
        encode_prompt(Broken(), messages=[{"role": "user", "content": "hi"}])
    assert info.value.field == "messages"
    with pytest.raises(InvalidRequestError, match="exploded") as info:
        encode_prompt(Broken(), "hi")
    assert info.value.field == "prompt"


# ---------------------------------------------------------------------------
# process-level traps
# ---------------------------------------------------------------------------


def _run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=python_path())
    return subprocess.run(["timeout", str(timeout), sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True)


def test_process_exits_with_a_live_stream_iterator(serve, address):
    serve(one_token_then_hang)
    code = f"""
from ipc.client import Client
client = Client({address!r}, timeout=60)
it = iter(client.stream(prompt_token_ids=[1], detokenize=False))
print(next(it).token_ids, flush=True)
"""  # ends with the client open and the iterator alive: it used to hang here forever
    t0 = time.monotonic()
    done = _run_python(code, timeout=30)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "[5]" and time.monotonic() - t0 < 25


def test_several_clients_load_the_tokenizer_at_once(serve, address):
    serve(lambda g: finish_script(g, [3]))
    # A fresh process, so that transformers is imported for the first time by the threads.
    code = f"""
import threading
from ipc.client import Client
clients = [Client({address!r}, timeout=60) for _ in range(6)]
errors = []
start = threading.Barrier(len(clients))
def load(client):
    start.wait()
    try:
        client.encode("hello")
    except BaseException as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=load, args=(c,)) for c in clients]
for t in threads: t.start()
for t in threads: t.join()
for c in clients: c.close()
print("errors:", errors, flush=True)
"""
    done = _run_python(code, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "errors: []" in done.stdout, done.stdout + done.stderr[-2000:]
