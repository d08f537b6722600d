"""A streaming request on the async client: ``async for chunk in client.stream(...)``."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from ipc.client.request import Call, PendingRequest, RequestOwner
from ipc.client.results import GenerateResult, StreamChunk


class AsyncStream:
    """A streaming request: ``async for chunk in stream`` yields StreamChunk items.

    The Generate is sent when iteration (or ``async with``) starts.  Leaving
    early (``break``, an exception, ``aclose()``) aborts the request on the
    server: at once inside ``async with stream:``; after a ``break`` out of a
    bare ``async for``, when Python finalizes that loop's async generator (a
    loop iteration or more later: until then the id is still in flight).
    ``abort()`` asks the server to stop it, after which the stream ends
    normally with ``result.finish_reason == "abort"``.
    """

    def __init__(self, client: RequestOwner, call: Call) -> None:
        self.request_id = call.request_id
        self._client = client
        self._call = call
        self._req: Optional[PendingRequest] = None
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

    async def next_chunks(self) -> list[StreamChunk]:
        """Every chunk that has arrived, waiting for the first; [] at the end (see PendingRequest.next_chunks)."""
        if self._req is None or self._closed:
            await self.start()
        return await self._req.next_chunks()

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
