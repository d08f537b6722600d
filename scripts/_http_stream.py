"""A lean streaming HTTP/1.1 client for the benchmarks: POST JSON, see SSE events as they arrive.

The benchmarks measure the gateway, not a client library: plain asyncio
connections driven by a Protocol whose ``data_received`` undoes the chunked
encoding, splits the SSE events, decodes each with msgspec and hands it to a
callback with its arrival time.  No task wakes up per read: one client process
can follow hundreds of streams at tens of thousands of events per second.

``sse_post`` opens one connection per request (``Connection: close``), as a
client without a pool does; :class:`Connections` keeps connections open and
sends one request after another on each (keep-alive), as a pooling client or a
proxy in front of the gateway does, and can open them before a measurement.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import msgspec

_decode = msgspec.json.decode
_END = b"0\r\n\r\n"  # the last chunk of a chunked body (the gateway sends no trailers)
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)")


class HTTPError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status


class _SSEProtocol(asyncio.Protocol):
    """One connection; ``send`` starts a streaming POST, whose events go to ``on_event`` as they come.

    ``done`` (a future per request) ends with the response; the connection then
    takes the next request when ``reusable`` (the server kept it open).
    """

    def __init__(self) -> None:
        self.transport: Optional[asyncio.Transport] = None
        self.lost = False
        self.done: Optional[asyncio.Future] = None  # the request in flight, if any
        self.reusable = False

    def send(self, request: bytes, decode: Callable[[bytes], Any], on_event: Callable[[float, Any], None],
             done: asyncio.Future) -> None:
        """Write one request; the connection must be idle."""
        self.decode, self.on_event, self.done = decode, on_event, done
        self.status: Optional[int] = None
        self.chunked = False
        self.keep_alive = False
        self.raw = b""  # bytes not yet taken apart (head, chunk framing)
        self.body = b""  # body bytes not yet split into events
        self.transport.write(request)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.done is None or self.done.done():
            self.transport.close()  # nothing was asked: the connection is out of step
            return
        t = time.perf_counter()
        try:
            self._take(t, self.raw + data)
        except Exception as exc:  # a malformed answer or a failing callback ends this request
            self._finish(exc)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.lost = True
        if self.done is None or self.done.done():
            return
        if self.status is not None and self.status != 200:
            self._finish(HTTPError(self.status, self.raw))
        elif not self.chunked and self.status == 200:
            self._finish(None)  # a body without chunked framing ends with the connection
        else:
            self._finish(exc or ConnectionError("the connection closed before the end of the stream"))

    def _finish(self, exc: Optional[BaseException]) -> None:
        self.reusable = exc is None and self.keep_alive and not self.lost and not self.raw
        if not self.done.done():
            if exc is not None:
                self.done.set_exception(exc)
            else:
                self.done.set_result(None)
        if not self.reusable and self.transport is not None:
            self.transport.close()

    def _take(self, t: float, raw: bytes) -> None:
        if self.status is None:
            end = raw.find(b"\r\n\r\n")
            if end < 0:
                self.raw = raw
                return
            head, raw = raw[:end].lower(), raw[end + 4:]
            self.status = int(head.split(b" ", 2)[1])
            self.chunked = b"transfer-encoding: chunked" in head
            self.keep_alive = b"connection: close" not in head and head.startswith(b"http/1.1")
            length = _CONTENT_LENGTH.search(head)
            self.left = int(length.group(1)) if length and not self.chunked else None
        if not self.chunked:  # a body of Content-Length bytes (an error answer), else up to the close
            if self.status == 200:
                self.raw = b""
                self._events(t, raw)
                if self.left is not None:
                    self.left -= len(raw)
                    if self.left <= 0:
                        self._finish(None)
            else:
                self.raw = raw  # the error body so far
                if self.left is not None and len(raw) >= self.left:
                    self._finish(HTTPError(self.status, raw))
            return
        parts, ended = [], False
        while (eol := raw.find(b"\r\n")) >= 0:
            if raw.startswith(_END):
                ended, raw = True, raw[len(_END):]
                break
            size = int(raw[:eol].split(b";")[0], 16)
            end = eol + 2 + size
            if size == 0 or len(raw) < end + 2:
                break  # the rest of this chunk (or of the last one) is still on its way
            parts.append(raw[eol + 2:end])
            raw = raw[end + 2:]
        self.raw = raw
        self._events(t, b"".join(parts))
        if ended:
            self._finish(None)

    def _events(self, t: float, data: bytes) -> None:
        buf = self.body + data
        while (end := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:end], buf[end + 2:]
            if event.startswith(b"data: "):
                payload = event[6:]
                self.on_event(t, None if payload == b"[DONE]" else self.decode(payload))
        self.body = buf


def _request(base_url: str, path: str, body: dict, api_key: Optional[str], keep_alive: bool) -> bytes:
    url = urlsplit(base_url)
    payload = msgspec.json.encode(body)
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    connection = "keep-alive" if keep_alive else "close"
    return (f"POST {url.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{auth}"
            f"Connection: {connection}\r\n\r\n").encode() + payload


async def _connect(base_url: str) -> _SSEProtocol:
    url = urlsplit(base_url)
    _, protocol = await asyncio.get_running_loop().create_connection(_SSEProtocol, url.hostname, url.port or 80)
    return protocol


async def _post(protocol: _SSEProtocol, request: bytes, on_event: Callable[[float, Any], None],
                decode: Callable[[bytes], Any]) -> None:
    done = asyncio.get_running_loop().create_future()
    protocol.send(request, decode, on_event, done)
    try:
        await done
    except BaseException:
        protocol.reusable = False
        protocol.transport.close()
        raise


async def sse_post(base_url: str, path: str, body: dict, on_event: Callable[[float, Any], None],
                   api_key: Optional[str] = None, decode: Callable[[bytes], Any] = _decode) -> None:
    """POST ``body`` on a new connection and call ``on_event(arrival perf_counter, event)`` for each event.

    ``event`` is ``decode(json)`` (a typed msgspec decoder that keeps only the fields a
    benchmark reads is about twice as fast as dicts), None for ``[DONE]``.  Returns at
    the end of the stream; raises HTTPError for a status other than 200, ConnectionError
    when the server closes early.
    """
    protocol = await _connect(base_url)
    try:
        await _post(protocol, _request(base_url, path, body, api_key, keep_alive=False), on_event, decode)
    finally:
        protocol.transport.close()


class Connections:
    """Keep-alive connections to one server: each carries one request at a time, then the next."""

    def __init__(self, base_url: str, api_key: Optional[str] = None) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.idle: list[_SSEProtocol] = []

    async def open(self, n: int) -> None:
        """Open connections until ``n`` are idle (before a measurement: no connection set-up inside it)."""
        missing = n - len(self.idle)
        if missing > 0:
            self.idle += await asyncio.gather(*[_connect(self.base_url) for _ in range(missing)])

    async def post(self, path: str, body: dict, on_event: Callable[[float, Any], None],
                   decode: Callable[[bytes], Any] = _decode) -> None:
        """As :func:`sse_post`, on an idle connection (a new one when none is idle)."""
        while self.idle:
            protocol = self.idle.pop()
            if not protocol.lost:
                break
        else:
            protocol = await _connect(self.base_url)
        await _post(protocol, _request(self.base_url, path, body, self.api_key, keep_alive=True), on_event, decode)
        if protocol.reusable:
            self.idle.append(protocol)

    def close(self) -> None:
        """Close every idle connection."""
        for protocol in self.idle:
            protocol.transport.close()
        self.idle.clear()
