"""The client SDK: send prompts to a forerun scheduler and read back tokens and text.

    with Client("ipc:///tmp/forerun/client.sock") as client:
        print(client.generate("The capital of France is", max_tokens=16).text)

    async with AsyncClient(address) as client:
        async for chunk in client.stream(messages=[{"role": "user", "content": "hi"}]):
            print(chunk.text_delta, end="")

One ZeroMQ DEALER socket per client.  :class:`AsyncClient` multiplexes any
number of concurrent requests on it: a reader task decodes every reply and
hands it to its request's queue by ``request_id``.  :class:`Client` is a
blocking facade that runs an :class:`AsyncClient` on a private event-loop
thread, so one ``Client`` may be used from several threads at once.

Parameters are sent as given (NaN included): the server validates them and
answers an ``Error`` that this module raises as :class:`ForerunError`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Optional, Sequence

import msgspec
import zmq
import zmq.asyncio

from ipc.detokenizer import IncrementalDetokenizer
from ipc.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    Finished,
    Generate,
    GetStats,
    Hello,
    SamplingParams,
    ServerInfo,
    ServerStats,
    TokenDelta,
    TokenDeltas,
    encode,
    server_reply_decoder,
)
from ipc.sockets import check_address, make_socket

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "BadFrameError",
    "Client",
    "DuplicateRequestIdError",
    "ExecutorFailedError",
    "ForerunError",
    "GenerateResult",
    "InvalidRequestError",
    "ProtocolError",
    "Stream",
    "StreamChunk",
    "Timings",
    "encode_prompt",
    "error_from_wire",
]

logger = logging.getLogger("forerun.client")

# Seconds allowed for the handshake and for each request unless a call says otherwise.
DEFAULT_TIMEOUT = 300.0
# Milliseconds that close() lets queued Abort messages drain before dropping them.
CLOSE_LINGER_MS = 100
# Replies read per wake-up of the reader task before it yields to other tasks.
DRAIN_BATCH = 256
_DEFAULTS = SamplingParams()


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


class ForerunError(Exception):
    """The server rejected a request or a frame (an ``Error`` message on the wire)."""

    def __init__(self, code: str, field: Optional[str], message: str,
                 request_id: Optional[str] = None) -> None:
        where = f" (field {field!r})" if field else ""
        super().__init__(f"[{code}]{where} {message}")
        self.code = code
        self.field = field
        self.message = message
        self.request_id = request_id


class InvalidRequestError(ForerunError):
    """A parameter is out of range or malformed; ``field`` names it."""


class ProtocolError(ForerunError):
    """Client and server speak different protocol versions (or no Hello was sent)."""


class BadFrameError(ForerunError):
    """The server could not decode a frame."""


class DuplicateRequestIdError(ForerunError):
    """A request id was reused while the first request with it was still running."""


class ExecutorFailedError(ForerunError):
    """The server's executor (the GPU process) died; the request cannot finish."""


_ERROR_TYPES: dict[str, type[ForerunError]] = {
    "invalid_request": InvalidRequestError,
    "protocol": ProtocolError,
    "bad_frame": BadFrameError,
    "duplicate_id": DuplicateRequestIdError,
    "executor_failed": ExecutorFailedError,
}


def error_from_wire(err: Error) -> ForerunError:
    """The exception for an ``Error`` message (a subclass of ForerunError by code)."""
    cls = _ERROR_TYPES.get(err.code, ForerunError)
    return cls(err.code, err.field, err.message, err.request_id)


# ---------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------


@dataclass
class Timings:
    """Client-side latencies of one request, in seconds since its Generate was sent."""

    ttft: Optional[float]  # first token's arrival; None when no token came
    e2e: float  # arrival of the Finished message
    token_times: list[float] = field(default_factory=list)  # arrival of each completion token
    itl: list[float] = field(default_factory=list)  # gaps between consecutive token-bearing messages

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.ttft is None or len(self.token_times) < 2:
            return None
        return (self.e2e - self.ttft) / (len(self.token_times) - 1)


@dataclass
class GenerateResult:
    """A finished request: its tokens, text, finish reason and timings."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "abort" or "error"
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    message: str = ""  # the server's note on the finish, if any


@dataclass
class StreamChunk:
    """New tokens of a streaming request and the text they completed (may be empty)."""

    text_delta: str
    token_ids: list[int]


# ---------------------------------------------------------------------------
# one request on the async client
# ---------------------------------------------------------------------------


class _Stop:
    """Queue sentinel: no reply will ever come (deadline passed, client closed)."""

    def __init__(self, exc_type: type[BaseException], message: str) -> None:
        self.exc_type = exc_type
        self.message = message


@dataclass(frozen=True)
class _Call:
    """What a generate/stream call asked for, before it is sent."""

    request_id: str
    prompt: Optional[str]
    messages: Optional[list[dict[str, Any]]]
    prompt_token_ids: Optional[list[int]]
    sampling: SamplingParams
    timeout: Optional[float]
    detokenize: bool


class _Request:
    """One in-flight Generate: its reply queue, received tokens, text and timings."""

    def __init__(self, request_id: str, detokenizer: Optional[IncrementalDetokenizer]) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.detokenizer = detokenizer
        self.answered = False  # any reply at all (see AsyncClient._on_connection_error)
        self.done = False  # Finished or Error received, or nothing more can come
        self.t_send = 0.0
        self.timer: Optional[asyncio.TimerHandle] = None
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.chunk_times: list[float] = []
        self.text_parts: list[str] = []
        self.result: Optional[GenerateResult] = None

    def deliver(self, t: float, msg: Any) -> None:
        """Called by the reader task with a reply and its arrival time."""
        self.answered = True
        self.queue.put_nowait((t, msg))

    async def next_chunk(self) -> Optional[StreamChunk]:
        """The next tokens and text; None once Finished; raises on Error or timeout."""
        while not self.done:
            item = await self.queue.get()
            if isinstance(item, _Stop):
                self.done = item.exc_type is not TimeoutError  # a timed-out request still needs an Abort
                raise item.exc_type(item.message)
            t, msg = item
            if isinstance(msg, TokenDelta):
                if msg.token_ids:
                    return self._take(t, msg.token_ids, final=False)
            elif isinstance(msg, Finished):
                self.done = True
                chunk = self._take(t, msg.token_ids, final=True)
                self.result = self._result(t, msg)
                return chunk
            elif isinstance(msg, Error):
                self.done = True
                raise error_from_wire(msg)
        return None

    def _take(self, t: float, token_ids: list[int], *, final: bool) -> Optional[StreamChunk]:
        since_send = t - self.t_send
        if token_ids:
            self.token_ids.extend(token_ids)
            self.token_times.extend([since_send] * len(token_ids))
            self.chunk_times.append(since_send)
        text = ""
        if self.detokenizer is not None:
            text = self.detokenizer.add(token_ids)
            if final:
                text += self.detokenizer.flush()
        self.text_parts.append(text)
        if not token_ids and not text:
            return None
        return StreamChunk(text, list(token_ids))

    def _result(self, t: float, fin: Finished) -> GenerateResult:
        times = self.chunk_times
        timings = Timings(
            ttft=times[0] if times else None,
            e2e=t - self.t_send,
            token_times=self.token_times,
            itl=[b - a for a, b in zip(times, times[1:])],
        )
        return GenerateResult(
            request_id=self.request_id,
            text="".join(self.text_parts),
            token_ids=self.token_ids,
            finish_reason=fin.reason,
            prompt_tokens=fin.prompt_tokens,
            completion_tokens=fin.completion_tokens,
            timings=timings,
            message=fin.message,
        )


# ---------------------------------------------------------------------------
# async client
# ---------------------------------------------------------------------------


def _new_request_id() -> str:
    return uuid.uuid4().hex


def _load_tokenizer(path: str) -> Any:
    # Imported here: transformers takes seconds to import and token-id clients never need it.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def encode_prompt(tokenizer: Any, prompt: Optional[str] = None, *,
                  messages: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """Token ids of a text prompt, or of chat messages through the chat template.

    Plain text gets the tokenizer's default special tokens (as ``tokenizer(prompt)``
    before HF ``generate``); a rendered chat template already holds them, so it is
    tokenized without adding more (as ``apply_chat_template(tokenize=True)`` does).
    """
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if messages is not None:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(prompt))


def _sampling(max_tokens: int, temperature: float, top_k: int, top_p: float, min_p: float,
              seed: Optional[int], stop_token_ids: Sequence[int], ignore_eos: bool) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          min_p=min_p, seed=seed, stop_token_ids=list(stop_token_ids),
                          ignore_eos=ignore_eos)


class AsyncClient:
    """An asyncio client; any number of generate/stream calls may run concurrently.

    ``timeout`` (seconds, None for no limit) bounds the handshake and is the
    default total time of each request.  ``tokenizer`` overrides the server's
    tokenizer: a local folder, or an already loaded tokenizer object.
    """

    def __init__(self, address: str, *, timeout: Optional[float] = DEFAULT_TIMEOUT,
                 tokenizer: Any = None, client_name: str = "forerun-python") -> None:
        self.address = check_address(address)
        self.timeout = timeout
        self.client_name = client_name
        self._tokenizer_path = tokenizer if isinstance(tokenizer, str) else None
        self._tokenizer = None if isinstance(tokenizer, str) else tokenizer
        self._ctx: Optional[zmq.asyncio.Context] = None
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._reader: Optional[asyncio.Task] = None
        self._server_info: Optional[ServerInfo] = None
        self._pending: dict[str, _Request] = {}
        self._connect_lock: Optional[asyncio.Lock] = None
        self._tokenizer_lock: Optional[asyncio.Lock] = None
        self._stats_waiters: list[asyncio.Future] = []  # get_stats calls, answered in order
        self._closed = False
        # The last Error that named no request (a bad frame, a connection problem).
        self.last_connection_error: Optional[Error] = None

    # -- connection ---------------------------------------------------------

    @property
    def server_info(self) -> ServerInfo:
        """What the server said in its handshake; needs ``await connect()`` first."""
        if self._server_info is None:
            raise RuntimeError("not connected: await client.connect() first")
        return self._server_info

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet finished."""
        return len(self._pending)

    async def connect(self) -> ServerInfo:
        """Open the socket and do the Hello handshake (once; later calls return at once)."""
        if self._server_info is not None:
            return self._server_info
        self._check_open()
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self._server_info is not None:
                return self._server_info
            ctx = zmq.asyncio.Context()
            # No high-water mark: a ROUTER drops replies to a full peer silently, and a
            # lost Finished would hang its request; the client chose to ask for them all.
            sock = make_socket(ctx, zmq.DEALER, self.address, bind=False, hwm=0)
            try:
                info = await self._handshake(sock)
            except BaseException:
                sock.close(linger=0)
                ctx.term()
                raise
            self._ctx, self._sock, self._server_info = ctx, sock, info
            self._reader = asyncio.get_running_loop().create_task(self._read_loop(sock))
        return info

    async def _handshake(self, sock: zmq.asyncio.Socket) -> ServerInfo:
        await sock.send(encode(Hello(protocol_version=PROTOCOL_VERSION, client_name=self.client_name,
                                     batch_deltas=True)))  # one message per step, not per request
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), remaining)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no answer to Hello from {self.address} within {self.timeout} s") from None
            try:
                msg = server_reply_decoder.decode(frames[-1])
            except msgspec.DecodeError as exc:
                raise ProtocolError("protocol", None, f"undecodable handshake reply: {exc}") from None
            if isinstance(msg, ServerInfo):
                if msg.protocol_version != PROTOCOL_VERSION:
                    raise ProtocolError("protocol", "protocol_version",
                                        f"server speaks protocol {msg.protocol_version}, "
                                        f"this client {PROTOCOL_VERSION}")
                return msg
            if isinstance(msg, Error) and msg.request_id is None:
                raise error_from_wire(msg)
            # Anything else is a stray reply to an earlier connection's request.

    async def _read_loop(self, sock: zmq.asyncio.Socket) -> None:
        pending = self._pending
        # Drain through a plain shadow socket: an awaited recv per message costs ~50 us
        # of future bookkeeping, which caps a busy client far below the server's rate.
        raw = zmq.Socket.shadow(sock.underlying)
        try:
            while True:
                await sock.poll(flags=zmq.POLLIN)
                for _ in range(DRAIN_BATCH):
                    try:
                        frames = raw.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    t = time.perf_counter()
                    try:
                        msg = server_reply_decoder.decode(frames[-1])
                    except msgspec.DecodeError as exc:
                        logger.warning("dropping an undecodable reply from %s: %s", self.address, exc)
                        continue
                    if isinstance(msg, TokenDeltas):
                        for request_id, token_ids in zip(msg.request_ids, msg.token_ids):
                            req = pending.get(request_id)
                            if req is not None:
                                req.deliver(t, TokenDelta(request_id, token_ids))
                        continue
                    if isinstance(msg, ServerStats):
                        self._on_stats(msg)
                        continue
                    request_id = getattr(msg, "request_id", None)
                    if request_id is None:
                        self._on_connection_error(msg)
                        continue
                    req = pending.get(request_id)
                    if req is not None:
                        req.deliver(t, msg)
                else:
                    # A full batch: let the consumers (and new requests) run before reading on.
                    await asyncio.sleep(0)
        except (asyncio.CancelledError, zmq.ContextTerminated):
            raise
        except Exception:
            logger.exception("client reader for %s failed", self.address)
            self._fail_pending("the connection to the server failed")

    def _on_stats(self, msg: ServerStats) -> None:
        while self._stats_waiters:
            fut = self._stats_waiters.pop(0)
            if not fut.done():
                fut.set_result(msg)
                return

    async def get_stats(self, timeout: float = 10.0) -> ServerStats:
        """The server's pool occupancy and counters; TimeoutError if no answer within ``timeout`` s."""
        await self.connect()
        self._check_open()
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        try:
            await self._sock.send(encode(GetStats()))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no stats from {self.address} within {timeout} s") from None
        finally:
            if fut in self._stats_waiters:
                self._stats_waiters.remove(fut)

    def _on_connection_error(self, msg: Any) -> None:
        if not isinstance(msg, Error):
            return
        logger.warning("server error without a request id: [%s] %s", msg.code, msg.message)
        self.last_connection_error = msg
        # Only a request with no reply yet can own the frame the server could not read.
        for req in list(self._pending.values()):
            if not req.answered:
                req.deliver(time.perf_counter(), msg)

    def _fail_pending(self, message: str) -> None:
        for req in self._pending.values():
            req.queue.put_nowait(_Stop(ConnectionError, message))
        self._pending.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the client is closed")

    async def close(self) -> None:
        """Abort every in-flight request, then close the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        sock = self._sock
        if sock is not None:
            for req in self._pending.values():
                if not req.done:
                    await sock.send(encode(Abort(request_id=req.request_id)))
        self._fail_pending("the client was closed")
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if sock is not None:
            sock.close(linger=CLOSE_LINGER_MS)
        if self._ctx is not None:
            self._ctx.term()

    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- tokenizer ----------------------------------------------------------

    async def get_tokenizer(self) -> Any:
        """The tokenizer (loaded once, from ServerInfo.tokenizer_path unless overridden)."""
        if self._tokenizer is not None:
            return self._tokenizer
        if self._tokenizer_lock is None:
            self._tokenizer_lock = asyncio.Lock()
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                path = self._tokenizer_path or (await self.connect()).tokenizer_path
                if not path:
                    raise RuntimeError("the server names no tokenizer; pass tokenizer= to the client")
                self._tokenizer = await asyncio.to_thread(_load_tokenizer, path)
        return self._tokenizer

    async def encode(self, prompt: Optional[str] = None, *,
                     messages: Optional[list[dict[str, Any]]] = None) -> list[int]:
        """Token ids that generate() would send for this prompt or these messages."""
        return encode_prompt(await self.get_tokenizer(), prompt, messages=messages)

    # -- requests -----------------------------------------------------------

    async def generate(
        self,
        prompt: Optional[str] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        prompt_token_ids: Optional[Sequence[int]] = None,
        max_tokens: int = _DEFAULTS.max_tokens,
        temperature: float = _DEFAULTS.temperature,
        top_k: int = _DEFAULTS.top_k,
        top_p: float = _DEFAULTS.top_p,
        min_p: float = _DEFAULTS.min_p,
        seed: Optional[int] = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        timeout: Optional[float] = None,
        request_id: Optional[str] = None,
        detokenize: bool = True,
    ) -> GenerateResult:
        """Run one request to its end and return the result.

        Give exactly one of ``prompt`` (text), ``messages`` (chat, through the
        chat template) or ``prompt_token_ids``.  ``timeout`` is the total time
        allowed (None: the client's default; ``math.inf``: no limit); when it
        passes the request is aborted on the server and TimeoutError raised.
        ``detokenize=False`` skips text (and the tokenizer, for token-id prompts).
        Raises ForerunError (a subclass per code) when the server rejects it.
        """
        call = self._make_call(prompt, messages, prompt_token_ids, request_id, timeout, detokenize,
                          _sampling(max_tokens, temperature, top_k, top_p, min_p, seed,
                                    stop_token_ids, ignore_eos))
        req = await self._start(call)
        try:
            while await req.next_chunk() is not None:
                pass
        finally:
            await self._release(req)
        return req.result

    def stream(
        self,
        prompt: Optional[str] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        prompt_token_ids: Optional[Sequence[int]] = None,
        max_tokens: int = _DEFAULTS.max_tokens,
        temperature: float = _DEFAULTS.temperature,
        top_k: int = _DEFAULTS.top_k,
        top_p: float = _DEFAULTS.top_p,
        min_p: float = _DEFAULTS.min_p,
        seed: Optional[int] = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        timeout: Optional[float] = None,
        request_id: Optional[str] = None,
        detokenize: bool = True,
    ) -> "AsyncStream":
        """A streaming request (same arguments as generate): ``async for chunk in ...``.

        The returned AsyncStream knows its ``request_id`` before anything is
        sent, so another task can ``abort`` it; its ``result`` is filled in at
        the end.  Leaving the loop early aborts the request on the server.
        """
        call = self._make_call(prompt, messages, prompt_token_ids, request_id, timeout, detokenize,
                          _sampling(max_tokens, temperature, top_k, top_p, min_p, seed,
                                    stop_token_ids, ignore_eos))
        return AsyncStream(self, call)

    async def abort(self, request_id: str) -> None:
        """Ask the server to stop a request; its generate/stream ends with reason "abort"."""
        self._check_open()
        if self._sock is not None:
            await self._sock.send(encode(Abort(request_id=request_id)))

    def _make_call(self, prompt: Optional[str], messages: Optional[list[dict[str, Any]]],
                   prompt_token_ids: Optional[Sequence[int]], request_id: Optional[str],
                   timeout: Optional[float], detokenize: bool, sampling: SamplingParams) -> _Call:
        given = sum(x is not None for x in (prompt, messages, prompt_token_ids))
        if given != 1:
            raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
        return _Call(
            request_id=request_id if request_id is not None else _new_request_id(),
            prompt=prompt,
            messages=messages,
            prompt_token_ids=list(prompt_token_ids) if prompt_token_ids is not None else None,
            sampling=sampling,
            timeout=self.timeout if timeout is None else timeout,
            detokenize=detokenize,
        )

    async def _start(self, call: _Call) -> _Request:
        """Tokenize, register and send one Generate."""
        await self.connect()
        prompt_ids = call.prompt_token_ids
        if prompt_ids is None:
            prompt_ids = await self.encode(call.prompt, messages=call.messages)
        detok = IncrementalDetokenizer(await self.get_tokenizer(), prompt_ids) if call.detokenize else None
        self._check_open()
        # No await between this check and the insert: ids stay unique among pending requests.
        if call.request_id in self._pending:
            raise ValueError(f"request id {call.request_id!r} is already in flight on this client")
        req = _Request(call.request_id, detok)
        self._pending[call.request_id] = req
        frame = encode(Generate(request_id=call.request_id, prompt_token_ids=prompt_ids,
                                sampling=call.sampling))
        if call.timeout is not None and not math.isinf(call.timeout):
            req.timer = asyncio.get_running_loop().call_later(
                call.timeout, req.queue.put_nowait,
                _Stop(TimeoutError, f"request {call.request_id} timed out after {call.timeout} s"))
        req.t_send = time.perf_counter()
        try:
            await self._sock.send(frame)
        except BaseException:
            await self._release(req)
            raise
        return req

    async def _release(self, req: _Request) -> None:
        """Forget a request; abort it on the server if it has not ended."""
        if req.timer is not None:
            req.timer.cancel()
        if self._pending.get(req.request_id) is req:
            del self._pending[req.request_id]
        if not req.done and not self._closed:
            req.done = True
            await self._sock.send(encode(Abort(request_id=req.request_id)))


class AsyncStream:
    """A streaming request: ``async for chunk in stream`` yields StreamChunk items.

    The Generate is sent when iteration (or ``async with``) starts.  Leaving
    early (``break``, an exception, ``aclose()``) aborts the request on the
    server; ``abort()`` asks the server to stop it, after which the stream ends
    normally with ``result.finish_reason == "abort"``.
    """

    def __init__(self, client: AsyncClient, call: _Call) -> None:
        self.request_id = call.request_id
        self._client = client
        self._call = call
        self._req: Optional[_Request] = None
        self._closed = False

    @property
    def result(self) -> Optional[GenerateResult]:
        """The finished request (None until the Finished message has been read)."""
        return self._req.result if self._req is not None else None

    async def start(self) -> None:
        """Send the request now (iteration does it on its own)."""
        if self._closed:
            raise RuntimeError(f"stream {self.request_id} is closed")
        if self._req is None:
            self._req = await self._client._start(self._call)

    async def next_chunk(self) -> Optional[StreamChunk]:
        """The next chunk, or None at the end."""
        await self.start()
        return await self._req.next_chunk()

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamChunk]:
        try:
            while (chunk := await self.next_chunk()) is not None:
                yield chunk
        finally:
            await self.aclose()

    async def abort(self) -> None:
        """Ask the server to stop this request."""
        await self._client.abort(self.request_id)

    async def aclose(self) -> None:
        """Stop reading; aborts the request on the server if it has not ended."""
        if self._closed:
            return
        self._closed = True
        if self._req is not None:
            await self._client._release(self._req)

    async def __aenter__(self) -> "AsyncStream":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


# ---------------------------------------------------------------------------
# blocking client
# ---------------------------------------------------------------------------


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=1.0)


class Client:
    """A blocking client with the same API as AsyncClient.

    It runs an AsyncClient on a private event-loop thread, so calls from
    several threads may be in flight at once on one connection.
    """

    def __init__(self, address: str, *, timeout: Optional[float] = DEFAULT_TIMEOUT,
                 tokenizer: Any = None, client_name: str = "forerun-python") -> None:
        self._async = AsyncClient(address, timeout=timeout, tokenizer=tokenizer, client_name=client_name)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="forerun-client", daemon=True)
        self._thread.start()
        self._closed = False
        # A client dropped without close() still stops its loop thread.
        self._finalizer = weakref.finalize(self, _stop_loop, self._loop, self._thread)

    def _run(self, coro: Any) -> Any:
        if self._closed:
            coro.close()
            raise RuntimeError("the client is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            # KeyboardInterrupt while waiting: cancel the coroutine so it aborts its request.
            fut.cancel()
            raise

    @property
    def address(self) -> str:
        return self._async.address

    @property
    def timeout(self) -> Optional[float]:
        return self._async.timeout

    @property
    def server_info(self) -> ServerInfo:
        """What the server said in its handshake (connects on first use)."""
        return self._run(self._async.connect())

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (loaded once, on first use)."""
        return self._run(self._async.get_tokenizer())

    def connect(self) -> ServerInfo:
        """Open the socket and do the Hello handshake (once)."""
        return self._run(self._async.connect())

    def encode(self, prompt: Optional[str] = None, *,
               messages: Optional[list[dict[str, Any]]] = None) -> list[int]:
        """Token ids that generate() would send for this prompt or these messages."""
        return self._run(self._async.encode(prompt, messages=messages))

    def generate(
        self,
        prompt: Optional[str] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        prompt_token_ids: Optional[Sequence[int]] = None,
        max_tokens: int = _DEFAULTS.max_tokens,
        temperature: float = _DEFAULTS.temperature,
        top_k: int = _DEFAULTS.top_k,
        top_p: float = _DEFAULTS.top_p,
        min_p: float = _DEFAULTS.min_p,
        seed: Optional[int] = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        timeout: Optional[float] = None,
        request_id: Optional[str] = None,
        detokenize: bool = True,
    ) -> GenerateResult:
        """Run one request to its end; see AsyncClient.generate."""
        return self._run(self._async.generate(
            prompt, messages=messages, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, timeout=timeout,
            request_id=request_id, detokenize=detokenize))

    def stream(
        self,
        prompt: Optional[str] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        prompt_token_ids: Optional[Sequence[int]] = None,
        max_tokens: int = _DEFAULTS.max_tokens,
        temperature: float = _DEFAULTS.temperature,
        top_k: int = _DEFAULTS.top_k,
        top_p: float = _DEFAULTS.top_p,
        min_p: float = _DEFAULTS.min_p,
        seed: Optional[int] = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        timeout: Optional[float] = None,
        request_id: Optional[str] = None,
        detokenize: bool = True,
    ) -> "Stream":
        """A streaming request: ``for chunk in client.stream(...)``; see AsyncClient.stream."""
        self._check_open()
        return Stream(self, self._async.stream(
            prompt, messages=messages, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, timeout=timeout,
            request_id=request_id, detokenize=detokenize))

    def abort(self, request_id: str) -> None:
        """Ask the server to stop a request (safe to call from any thread)."""
        self._run(self._async.abort(request_id))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the client is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Abort in-flight requests, close the socket and stop the loop thread (idempotent)."""
        if self._closed:
            return
        try:
            self._run(self._async.close())
        finally:
            self._closed = True
            self._finalizer()
            self._loop.close()

    def __enter__(self) -> "Client":
        self.connect()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Stream:
    """A blocking streaming request: ``for chunk in stream`` yields StreamChunk items.

    Leaving the loop early aborts the request on the server; ``abort()`` (from
    any thread) makes the stream end with ``result.finish_reason == "abort"``.
    """

    def __init__(self, client: Client, inner: AsyncStream) -> None:
        self.request_id = inner.request_id
        self._client = client
        self._inner = inner

    @property
    def result(self) -> Optional[GenerateResult]:
        """The finished request (None until the stream has ended)."""
        return self._inner.result

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            while (chunk := self._client._run(self._inner.next_chunk())) is not None:
                yield chunk
        finally:
            self.close()

    def abort(self) -> None:
        """Ask the server to stop this request."""
        self._client.abort(self.request_id)

    def close(self) -> None:
        """Stop reading; aborts the request on the server if it has not ended."""
        if not self._client.closed:
            self._client._run(self._inner.aclose())

    def __enter__(self) -> "Stream":
        self._client._run(self._inner.start())
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
