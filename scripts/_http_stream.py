"""A lean streaming HTTP/1.1 client for the benchmarks: POST JSON, read SSE events as they arrive.

The benchmarks measure the gateway, not a client library: one plain asyncio
connection per request, chunked transfer decoding and SSE splitting by hand,
msgspec to decode each event, and the arrival time of every event.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Optional
from urllib.parse import urlsplit

import msgspec

_decode = msgspec.json.decode


class HTTPError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status


async def sse_post(base_url: str, path: str, body: dict, api_key: Optional[str] = None
                   ) -> AsyncIterator[tuple[float, Any]]:
    """``(arrival perf_counter, decoded event)`` for each ``data:`` event of a streaming POST."""
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
                    yield t, None if data == b"[DONE]" else _decode(data)
    finally:
        writer.close()


async def _body(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]
