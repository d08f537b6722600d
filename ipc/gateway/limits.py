"""What one HTTP request may cost a gateway worker (docs/reliability.md, "Hostile clients").

Shared by the app, the worker processes and the ``forerun serve`` flags that set them.
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from ipc.gateway.schemas import RequestError
from ipc.gateway.streaming import ClientGone

# --max-request-bytes: a full 8k-token context of text is about 40 KB, so 4 MiB leaves room for
# token-id lists and many prompts; a larger body is a 413 before it is read in full.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# --api-tokenizer-threads: the pool that templates and tokenizes long prompts off the event loop.
DEFAULT_TOKENIZER_THREADS = 2
# Prompts up to this many characters are templated and tokenized on the event loop (tens of
# microseconds: a thread hop would cost more); longer ones in the pool.
INLINE_CHARS = 4096
# A refused body up to this size is read and dropped before the 413, so that a client still sending
# it reads the answer instead of a broken pipe; beyond it the connection is left to close.
DISCARD_MAX_BYTES = 64 * 2**20
# An error message never echoes more of the input than this.
MAX_ERROR_MESSAGE_CHARS = 1024


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
