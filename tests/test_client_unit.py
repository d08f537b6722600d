"""Unit tests of the client SDK and the detokenizer against a scripted fake server.

The fake server is a ZeroMQ ROUTER in a thread: it answers Hello with a
ServerInfo that names a tiny byte-level tokenizer built in a temp folder, and
plays a script of TokenDelta / Finished / Error messages for each Generate,
round-robin across requests so that concurrent replies interleave.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from typing import Callable, Optional

import pytest
import zmq
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

import ipc.client
from ipc.client import (
    AsyncClient,
    BadFrameError,
    Client,
    ExecutorFailedError,
    ForerunError,
    InvalidRequestError,
    ProtocolError,
    ServerGoneError,
)
from ipc.client.detokenizer import IncrementalDetokenizer
from ipc.client.raw import RawConnection
from ipc.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    Finished,
    Generate,
    GetStats,
    GetTokenizer,
    Hello,
    Ping,
    Pong,
    ResetPrefixCache,
    SamplingParams,
    ServerInfo,
    ServerStats,
    TokenDelta,
    TokenizerFiles,
    client_request_decoder,
    encode,
)
from ipc.models import read_tokenizer_files

BOS, EOS = 0, 1
SPECIALS = ["<bos>", "<eos>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "<bos>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Multi-byte characters (2, 3 and 4 bytes) that a byte-level tokenizer splits across tokens.
COMPLETION = "héllo 世界 🙂!"
HANG = object()  # script marker: keep the request open and send nothing more


# ---------------------------------------------------------------------------
# fixtures: tokenizer and fake server
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer (one token per byte) saved as an HF folder."""
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in pre_tokenizers.ByteLevel.alphabet():
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def completion_ids(tokenizer):
    return tokenizer.encode(COMPLETION, add_special_tokens=False)


def finish_script(gen: Generate, ids: list[int], *, in_finished: int = 1, reason: str = "length") -> list:
    """One TokenDelta per token, the last ``in_finished`` tokens carried by Finished."""
    split = len(ids) - in_finished
    msgs: list = [TokenDelta(request_id=gen.request_id, token_ids=[t]) for t in ids[:split]]
    msgs.append(Finished(request_id=gen.request_id, reason=reason, prompt_tokens=len(gen.prompt_token_ids),
                         completion_tokens=len(ids), token_ids=ids[split:]))
    return msgs


class FakeServer:
    """A scripted scheduler on a ROUTER socket, run in a thread."""

    def __init__(self, address: str, tokenizer_path: str, script: Callable[[Generate], list],
                 *, protocol_version: int = PROTOCOL_VERSION, reject_hello: bool = False,
                 step_delay: float = 0.0, server_id: str = "fake-1") -> None:
        self.address = address
        self.tokenizer_path = tokenizer_path
        self.script = script
        self.protocol_version = protocol_version
        self.reject_hello = reject_hello
        self.step_delay = step_delay
        self.server_id = server_id  # "" plays a server from before heartbeats: Pings go unanswered
        self.known: set[bytes] = set()  # clients that said Hello
        self.muted = False  # True: read everything, answer nothing (a hung or unreachable server)
        self.hello_msgs: list[Hello] = []
        self.pings = 0
        self.generates: list[Generate] = []
        self.aborts: list[str] = []
        self.stats_requests: list = []  # GetStats and ResetPrefixCache messages, in order
        self.hellos = 0
        self.peak_active = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 3.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.005)
        return False

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self._ready.set()
        # (identity, request_id) -> (Generate, queue of messages still to send, tokens sent)
        active: dict[tuple[bytes, str], list] = {}
        try:
            while not self._stop.is_set():
                wait_ms = int(self.step_delay * 1000) if active else 10
                if sock.poll(wait_ms):
                    while sock.poll(0):
                        ident, frame = sock.recv_multipart()
                        if not self.muted:
                            self._handle(sock, ident, client_request_decoder.decode(frame), active)
                self.peak_active = max(self.peak_active, len(active))
                if not self.muted:
                    self._play_one_round(sock, active)
        finally:
            sock.close()
            ctx.term()

    def _handle(self, sock, ident: bytes, msg, active: dict) -> None:
        if isinstance(msg, Ping):
            self.pings += 1
            if self.server_id:  # as the real server: a client it has no Hello from is told so
                sock.send_multipart([ident, encode(Pong(server_id=self.server_id, hello=ident in self.known))])
        elif isinstance(msg, Hello):
            self.hellos += 1
            self.known.add(ident)
            self.hello_msgs.append(msg)
            if self.reject_hello:
                reply = Error(code="protocol", message=f"server speaks {PROTOCOL_VERSION}")
            else:
                reply = ServerInfo(protocol_version=self.protocol_version, model_name="fake",
                                   max_model_len=4096, vocab_size=260, has_tokenizer=bool(self.tokenizer_path),
                                   eos_token_ids=[EOS], device="cpu", dtype="float32", pipeline_depth=2,
                                   server_id=self.server_id)
            sock.send_multipart([ident, encode(reply)])
        elif isinstance(msg, GetTokenizer):
            sock.send_multipart([ident, encode(TokenizerFiles(read_tokenizer_files(self.tokenizer_path)))])
        elif isinstance(msg, Generate):
            self.generates.append(msg)
            active[(ident, msg.request_id)] = [msg, deque(self.script(msg)), 0]
        elif isinstance(msg, (GetStats, ResetPrefixCache)):
            self.stats_requests.append(msg)
            stats = ServerStats(num_kv_blocks=8, num_free_kv_blocks=8, num_slots=4, num_free_slots=4, num_running=0,
                                num_waiting=0, num_draining=0, num_inflight_steps=0, steps=0, requests=0)
            sock.send_multipart([ident, encode(stats)])
        elif isinstance(msg, Abort):
            self.aborts.append(msg.request_id)
            entry = active.pop((ident, msg.request_id), None)
            if entry is not None:
                gen, _, sent = entry
                fin = Finished(request_id=gen.request_id, reason="abort",
                               prompt_tokens=len(gen.prompt_token_ids), completion_tokens=sent)
                sock.send_multipart([ident, encode(fin)])

    def _play_one_round(self, sock, active: dict) -> None:
        for key, entry in list(active.items()):
            queue = entry[1]
            if queue and queue[0] is HANG:
                continue
            if not queue:
                del active[key]
                continue
            msg = queue.popleft()
            entry[2] += len(getattr(msg, "token_ids", []))
            sock.send_multipart([key[0], encode(msg)])
            if isinstance(msg, (Finished, Error)) and not queue:  # n > 1: one Finished per completion
                del active[key]


@pytest.fixture
def address():
    run_dir = tempfile.mkdtemp(prefix="fr-", dir="/tmp")
    yield f"ipc://{run_dir}/client.sock"
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def serve(address, tokenizer_dir):
    """Start a FakeServer with a script; stopped at the end of the test."""
    servers = []

    def start(script: Callable[[Generate], list], tokenizer_path: Optional[str] = None, **kwargs) -> FakeServer:
        path = tokenizer_dir if tokenizer_path is None else tokenizer_path
        server = FakeServer(address, path, script, **kwargs).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__()


# ---------------------------------------------------------------------------
# a request's replies, without a server
# ---------------------------------------------------------------------------


async def test_next_chunks_takes_every_ready_reply_and_raises_an_error_behind_them_next():
    from ipc.client.request import PendingRequest

    req = PendingRequest("r")
    req.deliver(0.1, TokenDelta("r", [5]))
    req.deliver(0.2, TokenDelta("r", [6, 7]))
    req.deliver(0.3, Error(request_id="r", code="internal", message="boom"))
    assert [c.token_ids for c in await req.next_chunks()] == [[5], [6, 7]]
    with pytest.raises(ipc.client.ForerunError):
        await req.next_chunks()

    req = PendingRequest("s")
    waiting = asyncio.ensure_future(req.next_chunks())
    await asyncio.sleep(0)
    req.deliver(0.1, TokenDelta("s", [5]))
    req.deliver(0.2, Finished(request_id="s", reason="length", prompt_tokens=2, completion_tokens=2,
                              token_ids=[6]))
    chunks = await waiting
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [([5], None), ([6], "length")]
    assert await req.next_chunks() == [] and req.result.token_ids == [5, 6]


# ---------------------------------------------------------------------------
# detokenizer
# ---------------------------------------------------------------------------


def test_detokenizer_holds_back_split_multibyte_chars(tokenizer, completion_ids):
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in completion_ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == COMPLETION
    # "é" is two byte tokens: the first one emits nothing, the second the whole character.
    assert deltas[1:3] == ["", "é"]
    assert deltas.count("") == len(completion_ids) - len(COMPLETION)


def test_detokenizer_batches_and_skips_special_tokens(tokenizer, completion_ids):
    detok = IncrementalDetokenizer(tokenizer)
    text = detok.add(completion_ids[:7]) + detok.add(completion_ids[7:] + [EOS]) + detok.flush()
    assert text == COMPLETION
    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert keep.add(completion_ids + [EOS]) + keep.flush() == COMPLETION + "<eos>"


def test_detokenizer_flush_emits_incomplete_tail(tokenizer):
    ids = tokenizer.encode("a世", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:2]) == "a"  # only the first byte of the 3-byte character follows
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_detokenizer_uses_prompt_as_context_only(tokenizer, completion_ids):
    prompt = tokenizer.encode("the prompt ")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(detok.add([t]) for t in completion_ids) + detok.flush() == COMPLETION


# ---------------------------------------------------------------------------
# async client
# ---------------------------------------------------------------------------


async def test_generate_returns_text_tokens_and_timings(serve, address, tokenizer, completion_ids):
    server = serve(lambda g: finish_script(g, completion_ids), step_delay=0.002)
    async with AsyncClient(address, timeout=5) as client:
        assert client.server_info.model_name == "fake"
        result = await client.generate("Hi there", max_tokens=64, temperature=0.5, top_k=5,
                                       seed=7, stop_token_ids=[EOS])
    assert result.text == COMPLETION
    assert result.token_ids == completion_ids
    assert result.finish_reason == "length"
    assert result.completion_tokens == len(completion_ids)
    gen = server.generates[0]
    assert gen.prompt_token_ids == tokenizer.encode("Hi there") and gen.prompt_token_ids[0] == BOS
    assert result.prompt_tokens == len(gen.prompt_token_ids)
    assert result.request_id == gen.request_id
    s = gen.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.seed, s.stop_token_ids) == (64, 0.5, 5, 7, [EOS])
    t = result.timings
    assert 0 < t.ttft <= t.e2e
    assert len(t.token_times) == len(completion_ids)
    assert t.token_times == sorted(t.token_times)
    # One message per token (the last one is the Finished): one gap fewer than tokens.
    assert len(t.itl) == len(completion_ids) - 1 and all(x >= 0 for x in t.itl)
    assert t.tpot is not None and t.tpot > 0


async def test_messages_go_through_the_chat_template(serve, address, tokenizer, completion_ids):
    server = serve(lambda g: finish_script(g, completion_ids))
    messages = [{"role": "user", "content": "hi"}]
    async with AsyncClient(address, timeout=5) as client:
        await client.generate(messages=messages)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    assert server.generates[0].prompt_token_ids == expected
    assert expected.count(BOS) == 1


async def test_content_parts_are_joined_as_the_gateway_joins_them(serve, address, tokenizer, completion_ids):
    """OpenAI's list of content parts reads as its texts a line each, as vLLM joins them (the template renders
    strings); a part that is not text is refused naming it."""
    serve(lambda g: finish_script(g, completion_ids))
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]
    async with AsyncClient(address, timeout=5) as client:
        assert await client.encode(messages=parts) == await client.encode(
            messages=[{"role": "user", "content": "h\ni"}, {"role": "assistant", "content": "no"}])
        for bad, field in (([{"type": "image_url", "image_url": {"url": "x"}}], r"messages\[0\]\.content\[0\]\.type"),
                           (["hi"], r"content\[0\]\.type"), ([{"type": "text", "text": 5}], r"content\[0\]\.text"),
                           ([{"type": "refusal", "refusal": "no"}], r"content\[0\]\.type")):
            with pytest.raises(InvalidRequestError, match=field):
                await client.encode(messages=[{"role": "user", "content": bad}])
        # a text within the characters' bound that tokenizes past the context: named as the caller's field
        with pytest.raises(InvalidRequestError, match="prompt has 4097 tokens.*at most 4095") as raised:
            await client.generate("a" * 4096)
        assert raised.value.field == "prompt"


async def test_clients_of_one_model_share_one_tokenizer(serve, address, tokenizer_dir, completion_ids):
    """The tokenizer a server sends is built once a process: a second client gets the first one's; other files
    (another model's) build another."""
    from ipc.client.prompt import load_tokenizer_files
    from ipc.models import read_tokenizer_files

    serve(lambda g: finish_script(g, completion_ids))
    async with AsyncClient(address, timeout=5) as a, AsyncClient(address, timeout=5) as b:
        first, second = await a.get_tokenizer(), await b.get_tokenizer()
    assert first is second
    files = read_tokenizer_files(tokenizer_dir)
    config = json.loads(files["tokenizer_config.json"])
    other = dict(files, **{"tokenizer_config.json": json.dumps(dict(config, model_max_length=77)).encode()})
    assert load_tokenizer_files(other) is not first and load_tokenizer_files(other).model_max_length == 77


async def test_token_ids_without_tokenizer(serve, address, completion_ids):
    server = serve(lambda g: finish_script(g, completion_ids), tokenizer_path="")
    async with AsyncClient(address, timeout=5) as client:
        result = await client.generate(prompt_token_ids=[5, 6, 7], detokenize=False, ignore_eos=True)
    assert server.generates[0].prompt_token_ids == [5, 6, 7]
    assert server.generates[0].sampling.ignore_eos is True
    assert result.text == "" and result.token_ids == completion_ids


async def test_stream_yields_chunks_and_exposes_request_id(serve, address, completion_ids):
    server = serve(lambda g: finish_script(g, completion_ids, in_finished=3))
    async with AsyncClient(address, timeout=5) as client:
        stream = client.stream("Hi", request_id="req-1")
        assert stream.request_id == "req-1"
        chunks = [chunk async for chunk in stream]
    assert server.generates[0].request_id == "req-1"
    assert "".join(c.text_delta for c in chunks) == COMPLETION
    assert [t for c in chunks for t in c.token_ids] == completion_ids
    assert chunks[-1].token_ids == completion_ids[-3:]
    assert stream.result.text == COMPLETION and stream.result.finish_reason == "length"


async def test_concurrent_generates_are_demultiplexed(serve, address):
    # Each request's completion is derived from its prompt, so a mix-up shows.
    server = serve(lambda g: finish_script(g, [t + 10 for t in g.prompt_token_ids]), step_delay=0.001)
    prompts = [[i, i + 1, i + 2, i + 3] for i in range(0, 96, 3)]
    async with AsyncClient(address, timeout=10) as client:
        results = await asyncio.gather(*(
            client.generate(prompt_token_ids=p, detokenize=False) for p in prompts))
        assert client.in_flight == 0
    assert [r.token_ids for r in results] == [[t + 10 for t in p] for p in prompts]
    assert len({r.request_id for r in results}) == len(prompts)
    assert server.peak_active > 1  # replies really were interleaved


async def test_abort_mid_stream_ends_with_reason_abort(serve, address, completion_ids):
    server = serve(lambda g: finish_script(g, completion_ids)[:2] + [HANG])
    async with AsyncClient(address, timeout=5) as client:
        stream = client.stream("Hi")
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 2:
                await client.abort(stream.request_id)
        assert client.in_flight == 0
    assert server.aborts == [stream.request_id]
    assert stream.result.finish_reason == "abort"
    assert stream.result.token_ids == completion_ids[:2]


async def test_an_abort_before_the_request_is_sent_follows_it(serve, address):
    """abort() of a stream not iterated yet, or of a request whose prompt is still being tokenized (the first call
    fetches the tokenizer), reaches the server right after its Generate: the request ends with reason "abort"."""
    server = serve(lambda g: [HANG])
    async with AsyncClient(address, timeout=5) as client:
        stream = client.stream("Hi")
        await client.abort(stream.request_id)
        assert [chunk async for chunk in stream] == [] and stream.result.finish_reason == "abort"
        task = asyncio.create_task(client.generate("Hi", request_id="tokenizing"))
        await asyncio.sleep(0)  # the call is under way, its Generate not sent
        await client.abort("tokenizing")
        assert (await task).finish_reason == "abort"
        await client.abort("unknown")  # an id no call has: sent as it is (the server ignores it)
        assert client.in_flight == 0
    assert [g.request_id for g in server.generates] == [stream.request_id, "tokenizing"]
    assert server.wait_for(lambda: server.aborts == [stream.request_id, "tokenizing", "unknown"])


def test_dropped_async_client_does_not_hang_the_process(serve, address):
    """An AsyncClient used in ``asyncio.run`` and never closed: the garbage collector (or the exit) closes its
    socket before its context, so the process neither hangs in pyzmq's context finalizer nor at exit."""
    serve(lambda g: [Finished(request_id=g.request_id, reason="length", prompt_tokens=1, completion_tokens=1,
                              token_ids=[5])])
    code = f"""
import asyncio, gc
from ipc.client import AsyncClient
async def ask():
    client = AsyncClient({address!r}, timeout=10)
    return (await client.generate(prompt_token_ids=[3], detokenize=False)).token_ids
for _ in range(3):
    assert asyncio.run(ask()) == [5]
    gc.collect()
print("ok")
"""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


async def test_leaving_a_stream_early_aborts_it(serve, address, completion_ids):
    server = serve(lambda g: finish_script(g, completion_ids)[:1] + [HANG])
    async with AsyncClient(address, timeout=5) as client:
        async with client.stream("Hi") as stream:
            async for _ in stream:
                break
        assert server.wait_for(lambda: server.aborts == [stream.request_id])
        assert client.in_flight == 0


async def test_an_id_let_go_of_waits_for_its_abort_before_it_is_used_again(serve, address, completion_ids):
    """A stream left early is aborted; its id cannot be reused until the server's Finished(abort) for it is back
    (that late Finished would otherwise end the new request at once, which the server would still run): the
    reuse is refused in one DuplicateRequestIdError, and once the Finished is in, it runs as any request."""
    from ipc.client import DuplicateRequestIdError

    calls = []

    def script(gen: Generate) -> list:
        calls.append(gen.request_id)
        return finish_script(gen, completion_ids)[:1] + [HANG] if len(calls) == 1 else finish_script(gen, completion_ids)

    server = serve(script)
    kw = dict(prompt_token_ids=[5, 6], detokenize=False)
    async with AsyncClient(address, timeout=5) as client:
        async with client.stream(**kw, request_id="B") as stream:
            async for _ in stream:
                break
        with pytest.raises(DuplicateRequestIdError, match="its abort is not finished on the server yet"):
            await client.generate(**kw, request_id="B")  # no await since the release: the Finished is not in
        assert server.wait_for(lambda: server.aborts == ["B"])
        for _ in range(300):
            if "B" not in client._inflight.retiring:
                break
            await asyncio.sleep(0.01)
        result = await client.generate(**kw, request_id="B")
        assert result.finish_reason == "length" and result.token_ids == completion_ids
        assert calls == ["B", "B"] and client.in_flight == 0


async def test_a_request_id_or_timeout_the_server_cannot_take_fails_that_call_only(serve, address, completion_ids):
    """Checked before anything is sent: an Error the server could not route to the request (its id is not a
    string) would reach every request of the client that has no reply yet."""
    server = serve(lambda g: [HANG] if g.request_id == "slow" else finish_script(g, completion_ids))
    kw = dict(prompt_token_ids=[5, 6], detokenize=False)
    async with AsyncClient(address, timeout=5) as client:
        slow = asyncio.ensure_future(client.generate(**kw, request_id="slow"))
        for _ in range(300):  # sent and read by the server (its wait_for would block this loop)
            if server.generates:
                break
            await asyncio.sleep(0.01)
        for bad, field in ((dict(request_id=5), "request_id"), (dict(timeout=float("nan")), "timeout"),
                           (dict(timeout=-1.0), "timeout")):
            with pytest.raises(InvalidRequestError) as refused:
                await client.generate(**kw, **bad)
            assert refused.value.field == field, refused.value
        assert len(server.generates) == 1 and not slow.done()
        assert (await client.generate(**kw)).token_ids == completion_ids
        await client.abort("slow")
        assert (await slow).finish_reason == "abort"


async def test_server_error_raises_with_code_and_field(serve, address):
    def script(gen: Generate) -> list:
        if math.isnan(gen.sampling.temperature):
            return [Error(code="invalid_request", field="sampling.temperature",
                          message="temperature must be finite", request_id=gen.request_id)]
        return [Error(code="executor_failed", message="executor died", request_id=gen.request_id)]

    serve(script)
    async with AsyncClient(address, timeout=5) as client:
        with pytest.raises(InvalidRequestError) as info:
            await client.generate(prompt_token_ids=[1, 2], temperature=float("nan"))
        assert (info.value.code, info.value.field) == ("invalid_request", "sampling.temperature")
        assert isinstance(info.value, ForerunError)
        with pytest.raises(ExecutorFailedError):
            async for _ in client.stream(prompt_token_ids=[1, 2]):
                pass
        assert client.in_flight == 0


async def test_error_without_request_id_fails_unanswered_requests(serve, address):
    serve(lambda g: [Error(code="bad_frame", message="cannot decode")])
    async with AsyncClient(address, timeout=5) as client:
        with pytest.raises(BadFrameError):
            await client.generate(prompt_token_ids=[1])
        assert client.last_connection_error.code == "bad_frame"


async def test_timeout_raises_and_aborts_on_server(serve, address, completion_ids):
    server = serve(lambda g: [HANG] if g.request_id == "slow" else finish_script(g, completion_ids))
    async with AsyncClient(address, timeout=5) as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.generate(prompt_token_ids=[1], request_id="slow", timeout=0.2)
        assert 0.2 <= time.monotonic() - start < 4.5  # its own timeout, not the client's 5 s
        assert server.wait_for(lambda: server.aborts == ["slow"])
        # The connection is still good, and the late Finished(abort) is dropped.
        result = await client.generate(prompt_token_ids=[1], detokenize=False)
        assert result.token_ids == completion_ids


async def test_duplicate_request_id_in_flight_is_refused(serve, address):
    serve(lambda g: [HANG])
    async with AsyncClient(address, timeout=5) as client:
        first = client.stream(prompt_token_ids=[1], request_id="same", detokenize=False)
        await first.start()
        from ipc.client import DuplicateRequestIdError  # the server's own code for a reused id, said before sending

        with pytest.raises(DuplicateRequestIdError, match="already in flight on this client"):
            await client.generate(prompt_token_ids=[1], request_id="same")
        await first.aclose()


async def test_a_stream_read_by_two_tasks_refuses_the_second(serve, address):
    """The second reader would take the first one's wake-up and one of them would hang: it is refused instead."""
    serve(lambda g: [HANG])
    async with AsyncClient(address, timeout=5) as client:
        stream = client.stream(prompt_token_ids=[1], detokenize=False)
        await stream.start()
        first = asyncio.ensure_future(stream.next_chunk())
        await asyncio.sleep(0.05)  # the first reader waits
        with pytest.raises(RuntimeError, match="already being read by another task or thread"):
            await stream.next_chunk()
        first.cancel()
        await stream.aclose()


def test_an_async_client_belongs_to_the_loop_it_connected_in(serve, address, completion_ids):
    """Its sockets live in that loop: a second asyncio.run is told so at once, not left to time out."""
    serve(lambda g: finish_script(g, completion_ids))
    client = AsyncClient(address, timeout=5)

    async def one():
        return await client.generate(prompt_token_ids=[1], detokenize=False)

    assert asyncio.run(one()).token_ids == completion_ids
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="connected in another event loop"):
        asyncio.run(one())
    assert time.monotonic() - start < 1
    asyncio.run(client.close())


async def test_close_fails_waiting_requests_and_aborts_them(serve, address):
    server = serve(lambda g: [HANG])
    client = AsyncClient(address, timeout=5)
    task = asyncio.create_task(client.generate(prompt_token_ids=[1], request_id="r"))
    assert await asyncio.to_thread(server.wait_for, lambda: len(server.generates) == 1)
    await client.close()
    with pytest.raises(ConnectionError):
        await task
    assert server.wait_for(lambda: server.aborts == ["r"])
    with pytest.raises(RuntimeError):
        await client.generate(prompt_token_ids=[1])


async def test_protocol_error_reply_to_hello(serve, address):
    serve(lambda g: [], reject_hello=True)
    client = AsyncClient(address, timeout=5)
    with pytest.raises(ProtocolError) as info:
        await client.connect()
    assert info.value.code == "protocol"
    await client.close()


async def test_server_info_with_another_protocol_version(serve, address):
    serve(lambda g: [], protocol_version=PROTOCOL_VERSION + 1)
    client = AsyncClient(address, timeout=5)
    with pytest.raises(ProtocolError):
        await client.connect()
    await client.close()


async def test_connect_times_out_without_server(address):
    client = AsyncClient(address, timeout=0.2)
    with pytest.raises(ServerGoneError, match="no server answered at"):
        await client.connect()
    await client.close()


async def test_sampling_struct_and_keyword_overrides_merge(serve, address):
    server = serve(lambda g: finish_script(g, [5]))
    base = SamplingParams(max_tokens=3, temperature=0.7, top_k=5, seed=9)
    async with AsyncClient(address, timeout=5) as client:
        await client.generate(prompt_token_ids=[1], sampling=base, temperature=0, detokenize=False)
        await client.generate(prompt_token_ids=[1], sampling=base, detokenize=False)
        async for _ in client.stream(prompt_token_ids=[1], stop_token_ids=(7, 8), detokenize=False):
            pass
    merged, plain, streamed = (g.sampling for g in server.generates)
    # The keyword wins, the struct's other fields stay, and the struct's type applies (0 -> 0.0).
    assert merged == SamplingParams(max_tokens=3, temperature=0.0, top_k=5, seed=9)
    assert type(merged.temperature) is float
    assert plain == base and base.temperature == 0.7  # the caller's struct is not changed
    assert streamed == SamplingParams(stop_token_ids=[7, 8])


async def test_unknown_or_mistyped_sampling_keyword_is_refused_before_sending(serve, address):
    server = serve(lambda g: finish_script(g, [5]))
    async with AsyncClient(address, timeout=5) as client:
        with pytest.raises(TypeError, match="'temprature'"):
            await client.generate(prompt_token_ids=[1], temprature=0)
        with pytest.raises(TypeError, match="'bogus'"):
            client.stream(prompt_token_ids=[1], bogus=1)
        with pytest.raises(InvalidRequestError) as info:
            await client.generate(prompt_token_ids=[1], max_tokens="8")
        assert info.value.field == "sampling.max_tokens"
        assert client.in_flight == 0
    with Client(address, timeout=5) as blocking:
        with pytest.raises(TypeError, match="'temprature'"):
            blocking.generate(prompt_token_ids=[1], temprature=0)
        with pytest.raises(TypeError, match="'temprature'"):
            blocking.stream(prompt_token_ids=[1], temprature=0)
    assert server.generates == []


@pytest.mark.parametrize("kwargs,field,limit", [
    ({"n": 10**6}, "sampling.n", "n must be in [1, 16], got 1000000"),
    ({"n": 0}, "sampling.n", "[1, 16]"),
    ({"sampling": SamplingParams(n=10**6)}, "sampling.n", "[1, 16]"),  # a struct is checked as keywords are
    ({"stop": ["x"] * 17}, "sampling.stop", "at most 16"),
    ({"stop_token_ids": [1] * 65}, "sampling.stop_token_ids", "at most 64"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "sampling.logit_bias", "at most 300"),
])
async def test_counts_past_their_limits_are_refused_before_anything_is_built(serve, address, kwargs, field, limit):
    """n (each completion gets a detokenizer and a stop-string matcher) and the lists are bounded before the request
    is set up or sent: an n of a million once held the caller's loop for 11 s.  Field and words are the server's."""
    server = serve(lambda g: finish_script(g, [5]))
    async with AsyncClient(address, timeout=5) as client:
        t0 = time.monotonic()
        with pytest.raises(InvalidRequestError) as info:
            await client.generate("Hi", **kwargs)
        assert time.monotonic() - t0 < 1.0
        assert info.value.field == field and limit in info.value.message, info.value
        with pytest.raises(InvalidRequestError):
            client.stream("Hi", **kwargs)  # at the call, before iteration
        assert client.in_flight == 0
    with Client(address, timeout=5) as blocking:
        with pytest.raises(InvalidRequestError):
            blocking.generate("Hi", **kwargs)
    assert server.generates == []


def test_counts_at_their_limits_pass():
    from ipc.protocol import count_problem

    at_limits = SamplingParams(n=16, stop=["x"] * 16, stop_token_ids=[1] * 64, logit_bias={i: 1.0 for i in range(300)})
    assert count_problem(at_limits) is None
    assert count_problem(SamplingParams()) is None


def test_forerun_package_reexports_the_sdk():
    import forerun
    from forerun import AsyncClient as A, Client as C, ForerunError as E, SamplingParams as S

    assert (A, C, E, S) == (AsyncClient, Client, ForerunError, SamplingParams)
    assert forerun.__all__ == ipc.client.__all__
    assert all(getattr(forerun, name) is getattr(ipc.client, name) for name in ipc.client.__all__)


async def test_raw_connection_runs_requests_and_checks_counts(serve, address):
    def script(gen: Generate) -> list:
        if gen.request_id == "bad":  # Finished claims more tokens than were sent
            return [Finished(request_id="bad", reason="length", prompt_tokens=1, completion_tokens=3,
                             token_ids=[4])]
        return finish_script(gen, [t + 1 for t in gen.prompt_token_ids], in_finished=2)

    serve(script)
    async with RawConnection(address, timeout=5) as conn:
        info = await conn.hello("test")
        assert info.model_name == "fake"
        run = await conn.run_requests([Generate("a", [1, 2, 3]), Generate("b", [7, 8])])
        assert run.token_ids == {"a": [2, 3, 4], "b": [8, 9]}
        assert {rid: fin.reason for rid, fin in run.finished.items()} == {"a": "length", "b": "length"}
        with pytest.raises(RuntimeError, match="completion_tokens 3, received 1"):
            await conn.run_requests([Generate("bad", [1])])


# ---------------------------------------------------------------------------
# blocking client
# ---------------------------------------------------------------------------


def test_blocking_generate_and_stream(serve, address, completion_ids):
    server = serve(lambda g: finish_script(g, completion_ids))
    with Client(address, timeout=5) as client:
        assert client.server_info.vocab_size == 260
        assert client.generate("Hi").text == COMPLETION
        stream = client.stream(messages=[{"role": "user", "content": "hi"}])
        assert "".join(c.text_delta for c in stream) == COMPLETION
        assert stream.result.completion_tokens == len(completion_ids)
        assert server.generates[1].prompt_token_ids == client.encode(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(RuntimeError):
        client.generate("Hi")


def test_blocking_calls_from_threads_and_abort_from_another_thread(serve, address, completion_ids):
    def script(gen: Generate) -> list:
        return [HANG] if gen.request_id == "hang" else finish_script(gen, completion_ids)

    server = serve(script, step_delay=0.001)
    with Client(address, timeout=5) as client:
        results = []
        threads = [threading.Thread(target=lambda: results.append(client.generate("Hi")))
                   for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        assert [r.text for r in results] == [COMPLETION] * 4

        stream = client.stream("Hi", request_id="hang")
        aborter = threading.Timer(0.1, client.abort, args=("hang",))
        aborter.start()
        assert list(stream) == []
        aborter.join()
        assert stream.result.finish_reason == "abort"
        assert server.aborts == ["hang"]


def test_blocking_stream_aborted_before_it_is_read(serve, address):
    server = serve(lambda g: [HANG])
    with Client(address, timeout=5) as client:
        stream = client.stream("Hi", request_id="early")
        stream.abort()
        assert list(stream) == [] and stream.result.finish_reason == "abort"
    assert server.aborts == ["early"]


def test_blocking_timeout_aborts(serve, address):
    def script(gen: Generate) -> list:
        return [HANG] if gen.request_id == "t" else [TokenDelta(request_id=gen.request_id, token_ids=[5]), HANG]

    server = serve(script)
    with Client(address, timeout=0.2) as client:
        with pytest.raises(TimeoutError):
            client.generate(prompt_token_ids=[1], request_id="t")
        assert server.wait_for(lambda: server.aborts == ["t"])
        for _ in client.stream(prompt_token_ids=[1], request_id="s", timeout=math.inf):
            break
        assert server.wait_for(lambda: server.aborts == ["t", "s"])


# ---------------------------------------------------------------------------
# benchmark script
# ---------------------------------------------------------------------------


@pytest.fixture
def bench_serve(monkeypatch):
    """scripts/bench_serve.py imported as Python runs it: its own folder first on sys.path, for its siblings."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_serve

    return bench_serve


def test_bench_serve_runs_against_a_server(serve, address, tmp_path, bench_serve):
    import json

    def script(gen: Generate) -> list:
        return finish_script(gen, [7] * gen.sampling.max_tokens, in_finished=2)

    server = serve(script)
    out = tmp_path / "bench.json"
    figures = bench_serve.main(["--address", address, "--num-requests", "6", "--warmup", "1",
                                "--input-len", "5", "--output-len", "4", "--concurrency", "3",
                                "--request-rate", "500", "--no-progress", "--json", str(out)])
    assert figures["completed"] == 6 and figures["failed"] == 0
    assert figures["total_output_tokens"] == 24 and figures["total_input_tokens"] == 30
    assert len(server.generates) == 7
    assert all(g.sampling.ignore_eos and len(g.prompt_token_ids) == 5 for g in server.generates)
    assert all(EOS not in g.prompt_token_ids for g in server.generates)
    saved = json.loads(out.read_text())
    assert saved["ttft_ms"]["p50"] > 0 and saved["itl_ms"]["p99"] is not None


def test_bench_serve_spreads_requests_over_client_processes(serve, address, bench_serve):
    def script(gen: Generate) -> list:
        return finish_script(gen, [7] * gen.sampling.max_tokens, in_finished=2)

    server = serve(script)
    figures = bench_serve.main(["--address", address, "--num-requests", "7", "--warmup", "2", "--input-len", "5",
                                "--output-len", "4", "--concurrency", "4", "--client-procs", "2", "--no-progress"])
    assert figures["completed"] == 7 and figures["failed"] == 0 and figures["client_procs"] == 2
    assert figures["total_output_tokens"] == 28 and figures["total_input_tokens"] == 35
    assert figures["ttft_ms"]["p50"] > 0 and figures["itl_ms"]["p99"] is not None and figures["duration_s"] > 0
    # This process and each client process said Hello; every request (warm-up included) came once.
    assert server.hellos == 3
    assert len({g.request_id for g in server.generates}) == len(server.generates) == 9
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--address", address, "--num-requests", "2", "--client-procs", "3"])


def test_the_sdk_loads_the_class_autotokenizer_picks_without_importing_it(default_model_dir, tmp_path):
    """The SDK (and the API workers) load the tokenizer class named in tokenizer_config.json directly: the same
    class, chat template and token ids as AutoTokenizer's, without its import of torch and every model family."""
    import transformers

    from ipc.client.prompt import load_tokenizer, tokenizer_class

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    ours = load_tokenizer(default_model_dir)
    assert type(ours) is type(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, wörld! 1 + 1?"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for special in (True, False):
        text = "Héllo wörld, 12345\n\t<|im_start|> tabs"
        assert ours.encode(text, add_special_tokens=special) == tokenizer.encode(text, add_special_tokens=special)
    assert (ours.eos_token_id, ours.bos_token, ours.pad_token) == (tokenizer.eos_token_id, tokenizer.bos_token,
                                                                   tokenizer.pad_token)
    config = tmp_path / "tokenizer_config.json"
    for written, want in (('{"tokenizer_class": "NoSuchTokenizer"}', transformers.AutoTokenizer),
                          ("{}", transformers.AutoTokenizer), ("[1]", transformers.AutoTokenizer),
                          ('{"tokenizer_class": "GPT2Tokenizer"}', transformers.GPT2TokenizerFast)):  # fast first
        config.write_text(written)
        assert tokenizer_class(str(tmp_path)) is want, written


def test_an_address_that_is_not_a_string_is_refused_naming_it():
    for bad in (None, 5):
        with pytest.raises(TypeError, match="address must be a string"):
            Client(bad)
        with pytest.raises(TypeError, match="address must be a string"):
            AsyncClient(bad)
    with pytest.raises(ValueError, match="must start with ipc:// or tcp://"):
        AsyncClient("http://localhost:8000")


def test_a_client_used_after_a_fork_says_so(serve, address):
    """A Client inherited through fork has no loop thread in the child: its calls raise at once, saying why."""
    serve(lambda g: [HANG])
    client = Client(address, timeout=5)
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what the call raised, then leave without running the parent's cleanup
            try:
                client.get_stats(timeout=1)
                os.write(write, b"no error")
            except RuntimeError as e:
                os.write(write, str(e).encode()[:200])
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert b"made in another process" in os.read(read, 400)
    finally:
        client.close()


async def test_stats_timeout_must_be_positive(serve, address):
    serve(lambda g: [HANG])
    async with AsyncClient(address, timeout=5) as client:
        for bad in (-1, 0, float("nan"), "1", True):
            with pytest.raises(InvalidRequestError, match="timeout"):
                await client.get_stats(timeout=bad)
        assert (await client.get_stats(timeout=5)).num_slots == 4
