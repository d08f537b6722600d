"""A lean streaming HTTP/1.1 client for the benchmarks: POST JSON, see SSE events as they arrive.

The benchmarks measure the gateway, not a client library: one plain asyncio
connection per request, driven by a Protocol whose ``data_received`` undoes the
chunked encoding, splits the SSE events, decodes each with msgspec and hands it
to a callback with its arrival time.  No task wakes up per read: one client
process can follow hundreds of streams at tens of thousands of events per second
without becoming the limit it measures.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import msgspec

_decode = msgspec.json.decode


class HTTPError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status


class _SSEProtocol(asyncio.Protocol):
    """One streaming POST: the request goes out on connect; each event goes to ``on_event`` as it comes."""

    def __init__(self, request: bytes, decode: Callable[[bytes], Any],
                 on_event: Callable[[float, Any], None], done: asyncio.Future) -> None:
        self.request = request
        self.decode = decode
        self.on_event = on_event
        self.done = done
        self.transport: Optional[asyncio.Transport] = None
        self.status: Optional[int] = None
        self.chunked = False
        self.raw = b""  # bytes not yet taken apart (head, chunk framing)
        self.body = b""  # body bytes not yet split into events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
        try:
            self._take(t, self.raw + data)
        except Exception as exc:  # a malformed answer or a failing callback ends this request
            self._finish(exc)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self.status is not None and self.status != 200:
            self._finish(HTTPError(self.status, self.raw))
        elif not self.chunked and self.status == 200:
            self._finish(None)  # a body without chunked framing ends with the connection
        else:
            self._finish(exc or ConnectionError("the connection closed before the end of the stream"))

    def _finish(self, exc: Optional[BaseException]) -> None:
        if self.done.done():
            pass
        elif exc is not None:
            self.done.set_exception(exc)
        else:
            self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()

    def _take(self, t: float, raw: bytes) -> None:
        if self.status is None:
            end = raw.find(b"\r\n\r\n")
            if end < 0:
                self.raw = raw
                return
            head, raw = raw[:end], raw[end + 4:]
            self.status = int(head.split(b" ", 2)[1])
            self.chunked = b"transfer-encoding: chunked" in head.lower()
        if self.status != 200 or not self.chunked:
            self.raw = b""
            if self.status != 200:
                self.raw = raw  # the error body, read to the end of the connection
            else:
                self._events(t, raw)
            return
        parts, ended = [], False
        while (eol := raw.find(b"\r\n")) >= 0:
            size = int(raw[:eol].split(b";")[0], 16)
            if size == 0:
                ended = True
                break
            end = eol + 2 + size
            if len(raw) < end + 2:
                break  # the rest of this chunk is still on its way
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


async def sse_post(base_url: str, path: str, body: dict, on_event: Callable[[float, Any], None],
                   api_key: Optional[str] = None, decode: Callable[[bytes], Any] = _decode) -> None:
    """POST ``body`` and call ``on_event(arrival perf_counter, event)`` for each ``data:`` event.

    ``event`` is ``decode(json)`` (a typed msgspec decoder that keeps only the fields a
    benchmark reads is about twice as fast as dicts), None for ``[DONE]``.  Returns at
    the end of the stream; raises HTTPError for a status other than 200, ConnectionError
    when the server closes early.
    """
    url = urlsplit(base_url)
    payload = msgspec.json.encode(body)
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    request = (f"POST {url.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {url.netloc}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{auth}"
               "Connection: close\r\n\r\n").encode() + payload
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _SSEProtocol(request, decode, on_event, done),
                                                url.hostname, url.port or 80)
    try:
        await done
    finally:
        transport.close()
