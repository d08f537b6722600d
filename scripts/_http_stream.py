"""A lean streaming HTTP/1.1 client for the benchmarks: POST JSON, read SSE events as they arrive.

The benchmarks measure the gateway, not a client library: one plain asyncio
connection per request, chunked transfer decoding and SSE splitting by hand
(one await per read, however many chunks it brought), msgspec to decode each
event, and the arrival time of every event.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable, Optional
from urllib.parse import urlsplit

import msgspec

_decode = msgspec.json.decode
READ_SIZE = 65536  # bytes per read: everything the server has written since the last read


class HTTPError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status


async def sse_post(base_url: str, path: str, body: dict, api_key: Optional[str] = None,
                   decode: Callable[[bytes], Any] = _decode) -> AsyncIterator[tuple[float, Any]]:
    """``(arrival perf_counter, decoded event)`` for each ``data:`` event of a streaming POST.

    ``decode`` turns an event's JSON into what is yielded (a typed msgspec decoder
    that keeps only the fields a benchmark reads is about twice as fast as dicts).
    """
    url = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
    try:
        payload = msgspec.json.encode(body)
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        writer.write((f"POST {url.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {url.netloc}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{auth}"
                      "Connection: close\r\n\r\n").encode() + payload)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        chunked = b"transfer-encoding: chunked" in head.lower()
        if status != 200:
            raise HTTPError(status, await reader.read())
        buf = b""
        async for data in _body(reader, chunked):
            t = time.perf_counter()
            buf += data
            while (end := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:end], buf[end + 2:]
                if event.startswith(b"data: "):
                    data = event[6:]
                    yield t, None if data == b"[DONE]" else decode(data)
    finally:
        writer.close()


async def _body(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The body as it arrives: one item per read, every whole chunk in it (chunked encoding undone)."""
    if not chunked:
        while data := await reader.read(READ_SIZE):
            yield data
        return
    buf = b""
    while data := await reader.read(READ_SIZE):
        buf += data
        parts = []
        while (eol := buf.find(b"\r\n")) >= 0:
            size = int(buf[:eol].split(b";")[0], 16)
            if size == 0:
                yield b"".join(parts)
                return
            end = eol + 2 + size
            if len(buf) < end + 2:
                break  # the rest of this chunk is still on its way
            parts.append(buf[eol + 2:end])
            buf = buf[end + 2:]
        if parts:
            yield b"".join(parts)
