"""The asyncio client: one DEALER socket, any number of concurrent requests on it.

A reader task (:mod:`ipc.client.reader`) decodes every reply and hands it to its request's queue by
``request_id`` (see :class:`~ipc.client.inflight.InFlight`); a heartbeat
task pings the server and fails every waiting request with ServerGoneError
once the server falls silent or turns out to be another process (see
:mod:`ipc.client.liveness`).  After that the next call connects again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import weakref
from typing import Any, Optional, Sequence

import zmq
import zmq.asyncio

from ipc.client.errors import ForerunError, InvalidRequestError, ServerGoneError
from ipc.client.asks import OrderedAsks
from ipc.client.handshake import handshake
from ipc.client.inflight import InFlight
from ipc.client.liveness import Liveness, keep_alive
from ipc.client.prompt import encode_prompt, load_tokenizer, load_tokenizer_files
from ipc.client.reader import read_replies
from ipc.client.request import Call, PendingRequest, Stop, sampling_params
from ipc.client.results import GenerateResult
from ipc.client.stream import AsyncStream
from ipc.client.wire import encode_abort, encode_generate
from ipc.protocol import (
    PROTOCOL_VERSION,
    Error,
    Generate,
    GetStats,
    GetTokenizer,
    Hello,
    ResetPrefixCache,
    SamplingParams,
    ServerInfo,
    ServerStats,
    TokenizerFiles,
    encode,
)
from ipc.sockets import check_address, make_socket

logger = logging.getLogger("forerun.client")

# Seconds allowed for each request unless a call says otherwise.
DEFAULT_TIMEOUT = 300.0
# Seconds the handshake may take: a server answers Hello at once, so silence means nobody is there.
DEFAULT_CONNECT_TIMEOUT = 5.0
# The heartbeat this client promises in its Hello (seconds); a dead server is noticed after
# HEARTBEAT_MISSES of them (4 s).
DEFAULT_HEARTBEAT_S = 1.0
# Milliseconds that close() lets queued Abort messages drain before dropping them.
CLOSE_LINGER_MS = 100
# The server's shared secret when the api_key argument is not given (servers on a tcp:// address with a key).
API_KEY_ENV = "FORERUN_API_KEY"


class _Zmq:
    """The context and socket a client holds, where its finalizer reaches them (a finalizer must not hold the
    client itself)."""

    __slots__ = ("ctx", "sock")

    def __init__(self) -> None:
        self.ctx: Optional[zmq.asyncio.Context] = None
        self.sock: Optional[zmq.asyncio.Socket] = None


def _drop_zmq(held: _Zmq) -> None:
    """A client dropped without close() (or open at exit): close its socket at once, then its context.  Left to
    pyzmq's own finalizers, the context's could run first and wait forever in term() for the open socket."""
    if held.sock is not None:
        held.sock.close(linger=0)
    if held.ctx is not None:
        held.ctx.term()
    held.sock = held.ctx = None


class AsyncClient:
    """An asyncio client; any number of generate/stream calls may run concurrently.

    ``timeout`` (seconds, None for no limit) is the default total time of each
    request.  ``connect_timeout`` bounds the handshake (also by ``timeout``):
    no answer raises ServerGoneError.  ``heartbeat_s`` is the ping interval
    (0: no heartbeat, a dead server is then noticed only by timeouts).
    ``tokenizer`` overrides the server's tokenizer: a local folder, or an
    already loaded tokenizer object (else its files come from the server).
    ``api_key`` (default: $FORERUN_API_KEY) is the server's shared secret,
    sent in the Hello.  A server that forgot this client (its loop stalled
    past the heartbeat, say) fails the requests in flight with
    ServerGoneError; the next call says Hello again.
    """

    def __init__(self, address: str, *, timeout: Optional[float] = DEFAULT_TIMEOUT,
                 tokenizer: Any = None, client_name: str = "forerun-python",
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, api_key: Optional[str] = None) -> None:
        self.address = check_address(address)
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.heartbeat_s = heartbeat_s
        self.client_name = client_name
        self._tokenizer_path = tokenizer if isinstance(tokenizer, str) else None
        self._tokenizer = None if isinstance(tokenizer, str) else tokenizer
        self._ctx: Optional[zmq.asyncio.Context] = None
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._zmq = _Zmq()  # the same two, for the finalizer of a client dropped without close()
        self._finalizer = weakref.finalize(self, _drop_zmq, self._zmq)
        self._reader: Optional[asyncio.Task] = None
        self._heartbeat: Optional[asyncio.Task] = None
        self._server_info: Optional[ServerInfo] = None
        self._inflight = InFlight()
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the loop the socket was made in (connect)
        self._connect_lock: Optional[asyncio.Lock] = None
        self._tokenizer_lock: Optional[asyncio.Lock] = None
        # Calls made and not yet sent (a stream not iterated yet, a prompt being tokenized), and those of them
        # aborted meanwhile: their Abort follows their Generate (the server ignores one for an id it never saw)
        self._unsent: "weakref.WeakValueDictionary[str, Call]" = weakref.WeakValueDictionary()
        self._abort_on_send: set[str] = set()
        self._stats_asks = OrderedAsks("stats")  # get_stats / reset_prefix_cache calls
        self._tokenizer_asks = OrderedAsks("tokenizer files")
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
        return len(self._inflight)

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
            self._check_open()
            if self._ctx is None:
                self._ctx = self._zmq.ctx = zmq.asyncio.Context()
            # No high-water mark: a ROUTER drops replies to a full peer silently, and a
            # lost Finished would hang its request; the client chose to ask for them all.
            sock = make_socket(self._ctx, zmq.DEALER, self.address, bind=False, hwm=0)
            try:
                hello = Hello(protocol_version=PROTOCOL_VERSION, client_name=self.client_name,
                              batch_deltas=True,  # one message per step, not per request
                              heartbeat_s=self.heartbeat_s, api_key=self.api_key)
                limit = self.connect_timeout if self.timeout is None else min(self.timeout, self.connect_timeout)
                info = await handshake(sock, hello, self.address, limit)
            except BaseException:
                sock.close(linger=0)
                raise
            self._sock, self._server_info, self._loop = sock, info, asyncio.get_running_loop()
            self._zmq.sock = sock
            live = Liveness(info.server_id, self.heartbeat_s)
            loop = asyncio.get_running_loop()
            self._reader = loop.create_task(read_replies(
                sock, self.address, live, self._inflight,
                {ServerStats: self._stats_asks, TokenizerFiles: self._tokenizer_asks},
                lambda why: self._server_gone(sock, why), self._on_connection_error))
            if self.heartbeat_s > 0:
                self._heartbeat = loop.create_task(keep_alive(sock, live, lambda why: self._server_gone(sock, why)))
        return info

    async def get_stats(self, timeout: float = 10.0) -> ServerStats:
        """The server's pool occupancy and counters; TimeoutError if no answer within ``timeout`` s."""
        return await self._ask_stats(GetStats(), timeout)

    async def reset_prefix_cache(self, timeout: float = 10.0) -> ServerStats:
        """Make the server forget every cached KV block no running request holds (benchmarks); its stats after."""
        return await self._ask_stats(ResetPrefixCache(), timeout)

    async def _ask_stats(self, msg: Any, timeout: float) -> ServerStats:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:  # NaN fails > too
            raise InvalidRequestError("invalid_request", "timeout", f"timeout must be a number of seconds > 0, "
                                      f"got {timeout!r}")
        await self.connect()
        self._check_open()
        return await self._stats_asks.ask(self._sock, encode(msg), timeout, self.address)

    def _on_connection_error(self, msg: Any) -> None:
        if not isinstance(msg, Error):
            return
        logger.warning("server error without a request id: [%s] %s", msg.code, msg.message)
        self.last_connection_error = msg
        self._inflight.deliver_unaddressed(msg)

    def _server_gone(self, sock: zmq.asyncio.Socket, reason: str) -> None:
        """Fail every waiting request with ServerGoneError and drop the connection (the next call reconnects)."""
        if self._sock is not sock:
            return  # this connection was already dropped
        logger.warning("server at %s is gone: %s", self.address, reason)
        self._inflight.fail_all(ServerGoneError, f"{reason} at {self.address}; the request is lost")
        for asks in (self._stats_asks, self._tokenizer_asks):  # their answers will not come on this connection
            asks.fail(ServerGoneError(f"{reason} at {self.address}"))
        tasks = [t for t in (self._reader, self._heartbeat) if t is not None and t is not asyncio.current_task()]
        self._sock, self._server_info, self._reader, self._heartbeat, self._loop = None, None, None, None, None
        self._zmq.sock = None
        for task in tasks:
            task.cancel()
        # Queued frames are dropped: they must not reach a restarted server at the same address.
        sock.close(linger=0)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            raise RuntimeError("this AsyncClient connected in another event loop (its sockets live there): make one "
                               "AsyncClient per loop, e.g. per asyncio.run")

    async def close(self) -> None:
        """Abort every in-flight request, then close the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        sock = self._sock
        here = self._loop is None or self._loop is asyncio.get_running_loop()  # else its tasks died with their loop
        if sock is not None and here:
            for request_id in self._inflight.open_ids():
                await sock.send(encode_abort(request_id))
        self._inflight.fail_all(ConnectionError, "the client was closed")
        tasks = [t for t in (self._reader, self._heartbeat) if t is not None and here]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._finalizer.detach()
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
        """The tokenizer (loaded once: from the path given, else from the files the server sends, which build one
        tokenizer a process however many clients ask)."""
        if self._tokenizer is not None:
            return self._tokenizer
        if self._tokenizer_lock is None:
            self._tokenizer_lock = asyncio.Lock()
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                if self._tokenizer_path:
                    self._tokenizer = await asyncio.to_thread(load_tokenizer, self._tokenizer_path)
                    return self._tokenizer
                if not (await self.connect()).has_tokenizer:
                    raise ForerunError("no_tokenizer", "tokenizer", "the server has no tokenizer (its model has "
                                       "none): send prompt_token_ids with detokenize=False, or pass tokenizer=")
                answer = await self._tokenizer_asks.ask(self._sock, encode(GetTokenizer()), 60.0, self.address)
                self._tokenizer = await asyncio.to_thread(load_tokenizer_files, answer.files)
        return self._tokenizer

    async def encode(self, prompt: Optional[str] = None, *,
                     messages: Optional[list[dict[str, Any]]] = None) -> list[int]:
        """Token ids that generate() would send for this prompt or these messages.

        Raises InvalidRequestError (naming the field) for malformed messages, a
        chat-template or tokenizer failure, or a text too long for the server's
        context (checked before tokenizing; see ``prompt.chars_per_token``).
        """
        tokenizer = await self.get_tokenizer()
        max_model_len = self._server_info.max_model_len if self._server_info is not None else None
        return encode_prompt(tokenizer, prompt, messages=messages, max_model_len=max_model_len)

    # -- requests -----------------------------------------------------------

    async def generate(
        self,
        prompt: Optional[str] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        prompt_token_ids: Optional[Sequence[int]] = None,
        sampling: Optional[SamplingParams] = None,
        timeout: Optional[float] = None,
        request_id: Optional[str] = None,
        detokenize: bool = True,
        **overrides: Any,
    ) -> GenerateResult:
        """Run one request to its end and return the result.

        Give exactly one of ``prompt`` (text), ``messages`` (chat, through the
        chat template) or ``prompt_token_ids``.  Sampling is ``sampling`` (a
        :class:`~ipc.protocol.SamplingParams`, default ``SamplingParams()``)
        with any of its fields overridden by keyword: ``max_tokens=16,
        temperature=0``; an unknown keyword raises TypeError.  ``timeout`` is
        the total time allowed (None: the client's default; ``math.inf``: no
        limit); when it passes the request is aborted on the server and
        TimeoutError raised.  ``detokenize=False`` skips text (and the
        tokenizer, for token-id prompts).  Raises ForerunError (a subclass per
        code) when the server rejects the request.  ``stop``, ``logprobs``, ``n``: see GenerateResult.
        """
        call = self._make_call(prompt, messages, prompt_token_ids, sampling, timeout, request_id, detokenize,
                               overrides)
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
        sampling: Optional[SamplingParams] = None,
        timeout: Optional[float] = None,
        request_id: Optional[str] = None,
        detokenize: bool = True,
        **overrides: Any,
    ) -> "AsyncStream":
        """A streaming request (same arguments as generate): ``async for chunk in ...``.

        The returned AsyncStream knows its ``request_id`` before anything is
        sent, so another task can ``abort`` it; its ``result`` is filled in at
        the end.  Leaving the loop early aborts the request on the server.
        """
        call = self._make_call(prompt, messages, prompt_token_ids, sampling, timeout, request_id, detokenize,
                               overrides)
        return AsyncStream(self, call)

    async def abort(self, request_id: str) -> None:
        """Ask the server to stop a request; its generate/stream ends with reason "abort" (a request not sent yet,
        a stream not iterated or a prompt still being tokenized, is aborted as soon as it is sent)."""
        self._check_open()
        frame = encode_abort(request_id)
        if request_id not in self._inflight.pending and request_id in self._unsent:
            self._abort_on_send.add(request_id)
            return
        if self._sock is not None:
            await self._sock.send(frame)

    def _make_call(self, prompt: Optional[str], messages: Optional[list[dict[str, Any]]],
                   prompt_token_ids: Optional[Sequence[int]], sampling: Optional[SamplingParams],
                   timeout: Optional[float], request_id: Optional[str], detokenize: bool,
                   overrides: dict[str, Any]) -> Call:
        call = Call.make(prompt, messages, prompt_token_ids, request_id=request_id,
                         timeout=self.timeout if timeout is None else timeout, detokenize=detokenize,
                         sampling=sampling_params(sampling, **overrides))
        self._unsent[call.request_id] = call
        self._abort_on_send.discard(call.request_id)  # an abort of an earlier call of this id is not this one's
        return call

    async def _start(self, call: Call) -> PendingRequest:
        """Tokenize, register and send one Generate."""
        if self._server_info is None:
            await self.connect()
        prompt_ids = call.prompt_token_ids
        if prompt_ids is None:
            prompt_ids = await self.encode(call.prompt, messages=call.messages)
        # Encoded (and so checked) before the request is registered: a failure leaves nothing behind.
        frame = encode_generate(Generate(request_id=call.request_id, prompt_token_ids=prompt_ids,
                                         sampling=call.sampling))
        tokenizer = await self.get_tokenizer() if call.detokenize else None
        if self._server_info is None:
            await self.connect()  # again: the server may have gone (and this client reconnects) meanwhile
        self._check_open()
        # No await between this check and the send: ids stay unique among pending requests.
        req = PendingRequest(call.request_id, tokenizer, call.sampling, prompt_ids)
        self._inflight.add(req)
        if call.timeout is not None and not math.isinf(call.timeout):
            req.timer = asyncio.get_running_loop().call_later(
                call.timeout, req.stop,
                Stop(TimeoutError, f"request {call.request_id} timed out after {call.timeout} s"))
        req.t_send = time.perf_counter()
        try:
            await self._sock.send(frame)
        except BaseException:
            await self._release(req)
            raise
        finally:
            if self._unsent.get(call.request_id) is call:
                del self._unsent[call.request_id]
        if call.request_id in self._abort_on_send:  # aborted before it went out
            self._abort_on_send.discard(call.request_id)
            await self._sock.send(encode_abort(call.request_id))
        return req

    async def _release(self, req: PendingRequest) -> None:
        """Forget a request; abort it on the server if it has not ended."""
        if req.timer is not None:
            req.timer.cancel()
        if self._inflight.release(req, connected=not self._closed and self._sock is not None):
            await self._sock.send(encode_abort(req.request_id))
