"""Running SDK requests for HTTP clients: whole answers, SSE streams, and client disconnects.

A client that goes away must not leave its request running in the scheduler:
each request is raced against the ASGI ``http.disconnect`` message, and its
task is cancelled when that arrives.  Cancelling an SDK
``generate`` or ``stream`` sends ``Abort`` (their ``finally`` releases the
request), so the KV blocks come back within a step.  Plain asyncio
cancellation is used (delivered once), so the ``Abort`` send in that
``finally`` is never cancelled itself.

A streaming answer is one task (uvicorn's) and one disconnect watcher for its whole life
(first tokens, then events), and it writes whatever chunks are ready at each
wake-up in one send: a worker that falls behind the steps writes fewer, larger
chunks instead of falling further behind.
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
    """Await ``work`` in this task unless the client disconnects first (then it is cancelled: ClientGone).

    The watcher cancels this task itself: no task for the work and no asyncio.wait
    bookkeeping per request.  The cancel can only land inside ``work``: once it has
    returned, ``running`` is cleared before this task can yield to the watcher.
    """
    me = asyncio.current_task()
    running, gone = True, False

    def on_disconnect(watch: asyncio.Future) -> None:
        nonlocal gone
        if running and not watch.cancelled():
            gone = True
            me.cancel()

    watch = asyncio.ensure_future(_wait_disconnect(receive))
    watch.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if gone:
            if hasattr(me, "uncancel"):  # Python 3.11+: this cancel is handled, the task goes on
                me.uncancel()
            raise ClientGone() from None
        raise
    finally:
        running = False
        watch.cancel()


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


async def first_chunks(streams: list[Any]) -> list[Any]:
    """The first chunk of every stream (None for one that ended without any)."""
    if len(streams) == 1:  # the common case, without a task per stream
        return [await streams[0].next_chunk()]
    return await gather_or_cancel([st.next_chunk() for st in streams])


async def merge(streams: list[Any]) -> AsyncIterator[list[tuple[int, Any]]]:
    """Batches of ``(index, chunk)`` from several SDK streams, as much as is ready; ``(index, None)`` at each end."""
    if len(streams) == 1:  # the common case, without a queue hop
        stream = streams[0]
        while chunks := await stream.next_chunks():
            if stream.result is not None:  # the end came with these chunks: no wake-up just to learn it
                yield [(0, chunk) for chunk in chunks] + [(0, None)]
                return
            yield [(0, chunk) for chunk in chunks]
        yield [(0, None)]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: Any) -> None:
        try:
            while chunks := await stream.next_chunks():
                queue.put_nowait([(i, chunk) for chunk in chunks])
            queue.put_nowait([(i, None)])
        except Exception as exc:  # handed to the consumer, raised there
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            batch = []
            for item in items:
                if isinstance(item, Exception):
                    raise item
                left -= sum(chunk is None for _, chunk in item)
                batch += item
            yield batch
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEResponse:
    """An ASGI response for SDK streams: their first chunks, then the 200 and SSE events.

    ``make_events(firsts)`` gives the events (bytes, possibly several per item).
    Until the first chunks are there an exception is still answered with its own
    status: ``on_error(exc)`` returns that response (None: re-raise).
    ``on_close(cut)`` runs at the end in every case (it aborts what is left); ``cut``: the answer had started
    (the 200 went out) or the client left before it did, so a stream that did not finish was cut short.
    """

    def __init__(self, streams: list[Any], make_events: Callable[[list[Any]], AsyncIterator[bytes]],
                 on_error: Callable[[BaseException], Any], on_close: Callable[[bool], Awaitable[None]],
                 headers: Optional[list[tuple[bytes, bytes]]] = None) -> None:
        self.streams = streams
        self.make_events = make_events
        self.on_error = on_error
        self.on_close = on_close
        self.headers = SSE_HEADERS + (headers or [])
        self.started = False  # the 200 went out

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        gone = False
        try:
            await until_disconnect(receive, self._respond(scope, receive, send))
        except (ClientGone, OSError):
            gone = True  # nobody reads the answer: the streams are aborted below
        finally:
            await self.on_close(self.started or gone)

    async def _respond(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            firsts = await first_chunks(self.streams)
        except Exception as exc:
            response = self.on_error(exc)
            if response is None:
                raise
            await response(scope, receive, send)
            return
        self.started = True
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        events = self.make_events(firsts)
        more = True
        try:
            async for data in events:
                more = not data.endswith(DONE)  # [DONE] is every answer's last event: the body ends with it
                await send({"type": "http.response.body", "body": data, "more_body": more})
        finally:
            await events.aclose()
        if more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
