"""Running SDK requests for HTTP clients: whole answers, SSE streams, and client disconnects.

A client that goes away must not leave its request running in the scheduler:
each request runs in a task raced against the ASGI ``http.disconnect``
message, and the task is cancelled when it arrives.  Cancelling an SDK
``generate`` or ``stream`` sends ``Abort`` (their ``finally`` releases the
request), so the KV blocks come back within a step.  Plain asyncio
cancellation is used (delivered once), so the ``Abort`` send in that
``finally`` is never cancelled itself.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar

T = TypeVar("T")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first (then it is cancelled: ClientGone)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watch.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def gather_or_cancel(aws: list[Awaitable[T]]) -> list[T]:
    """Like asyncio.gather, but the first exception cancels the rest (their requests are aborted)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge(streams: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """``(index, chunk)`` from several SDK streams as chunks arrive; ``(index, None)`` at each end."""
    if len(streams) == 1:  # the common case, without a queue hop
        while (chunk := await streams[0].next_chunk()) is not None:
            yield 0, chunk
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: Any) -> None:
        try:
            while (chunk := await stream.next_chunk()) is not None:
                queue.put_nowait((i, chunk))
            queue.put_nowait((i, None))
        except Exception as exc:  # handed to the consumer, raised there
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            left -= item is None
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEResponse:
    """An ASGI response that sends ``events`` (bytes) as they come and stops them on disconnect.

    ``on_close`` runs after the events end or are cancelled (it aborts what is left).
    """

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 headers: Optional[list[tuple[bytes, bytes]]] = None) -> None:
        self.events = events
        self.on_close = on_close
        self.headers = SSE_HEADERS + (headers or [])

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        try:
            await until_disconnect(receive, self._pump(send))
        except (ClientGone, OSError):
            pass
        finally:
            await self.on_close()

    async def _pump(self, send: Callable) -> None:
        try:
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        finally:
            await self.events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
