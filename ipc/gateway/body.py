"""Reading a request body under the size limit (--max-request-bytes) and the idle limit, and dropping what is past
them."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.requests import ClientDisconnect, Request

from ipc.gateway.limits import DEFAULT_BODY_TIMEOUT_S, DISCARD_MAX_BYTES
from ipc.gateway.schemas import RequestError
from ipc.gateway.streaming import ClientGone


async def read_body(request: Request, limit: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> bytes:
    """The request body; a 413 once it is known to exceed ``limit`` bytes (Content-Length, else while reading), a
    408 when no byte of it came for ``timeout_s`` seconds.

    Nothing past the limit is kept.  The rest is read and dropped (up to DISCARD_MAX_BYTES) before the 413, so
    that a client still sending its body reads the answer instead of a broken pipe.  A client that stalls is
    answered 408 and its connection closed (``handling.error_response``): what it had sent is dropped, so a
    crowd of stalled uploads holds no memory."""
    idle = _IdleLimit(timeout_s)
    try:
        header = request.headers.get("content-length", "")
        declared = int(header) if header.isascii() and header.isdigit() and len(header) <= 18 else None
        if declared is not None and declared > limit:
            if declared <= DISCARD_MAX_BYTES:
                await _discard(_progressing(request.stream(), idle), 0)
            raise RequestError(413, f"the request body is {declared} bytes; the limit is {limit} bytes "
                                      "(--max-request-bytes)", code="request_too_large")
        chunks, size = [], 0
        async for chunk in _progressing(request.stream(), idle):
            size += len(chunk)
            if size > limit:
                await _discard(_progressing(request.stream(), idle), size)
                raise RequestError(413, f"the request body exceeds the limit of {limit} bytes "
                                          "(--max-request-bytes)", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)
    except ClientDisconnect:
        raise ClientGone() from None
    except asyncio.CancelledError:
        if not idle.expired:
            raise
        idle.uncancel()
        raise RequestError(408, f"no byte of the request body came for {timeout_s:g} s; what came was dropped",
                           code="request_timeout") from None
    finally:
        idle.close()


class _IdleLimit:
    """Cancels the task once ``timeout_s`` seconds pass without a call of :meth:`progress` (``expired`` says it
    was this).  One timer for the whole body, moved on at each chunk: no task per chunk (asyncio.wait_for's), and
    on Python 3.10 too (no asyncio.timeout).  The cancel can only land inside read_body: the timer runs while the
    task waits there, and is stopped before read_body returns."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.expired = False
        self.handle = self.loop.call_later(timeout_s, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self.task.cancel()

    def progress(self) -> None:
        self.handle.cancel()
        self.handle = self.loop.call_later(self.timeout_s, self._expire)

    def uncancel(self) -> None:
        """This cancel is handled: the task goes on (Python 3.11+ counts cancels)."""
        if hasattr(self.task, "uncancel"):
            self.task.uncancel()

    def close(self) -> None:
        self.handle.cancel()


async def _progressing(chunks: AsyncIterator[bytes], idle: _IdleLimit) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        idle.progress()
        yield chunk


async def _discard(chunks: AsyncIterator[bytes], size: int) -> None:
    """Read and drop the rest of a body, ``size`` bytes of it read so far, up to DISCARD_MAX_BYTES in all."""
    async for chunk in chunks:
        size += len(chunk)
        if size > DISCARD_MAX_BYTES:
            return
