"""Reading a request body under the size limit (--max-request-bytes), and dropping what is past it."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from ipc.gateway.limits import DISCARD_MAX_BYTES
from ipc.gateway.schemas import RequestError
from ipc.gateway.streaming import ClientGone


async def read_body(request: Request, limit: int) -> bytes:
    """The request body; a 413 once it is known to exceed ``limit`` bytes (Content-Length, else while reading).

    Nothing past the limit is kept.  The rest is read and dropped (up to DISCARD_MAX_BYTES) before the 413, so
    that a client still sending its body reads the answer instead of a broken pipe."""
    try:
        header = request.headers.get("content-length", "")
        declared = int(header) if header.isascii() and header.isdigit() and len(header) <= 18 else None
        if declared is not None and declared > limit:
            if declared <= DISCARD_MAX_BYTES:
                await _discard(request, 0)
            raise RequestError(413, f"the request body is {declared} bytes; the limit is {limit} bytes "
                                      "(--max-request-bytes)", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                await _discard(request, size)
                raise RequestError(413, f"the request body exceeds the limit of {limit} bytes "
                                          "(--max-request-bytes)", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)
    except ClientDisconnect:
        raise ClientGone() from None


async def _discard(request: Request, size: int) -> None:
    """Read and drop the rest of a body, ``size`` bytes of it read so far, up to DISCARD_MAX_BYTES in all."""
    async for chunk in request.stream():
        size += len(chunk)
        if size > DISCARD_MAX_BYTES:
            return
