"""Questions to the server whose answers name no request (stats, tokenizer files).

The server answers each kind in the order it was asked, so the oldest waiter still waiting takes
the next answer.  A waiter that gave up (its timeout) is skipped.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq.asyncio


class OrderedAsks:
    """The waiters of one kind of question (``what`` names it in a timeout's message)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._waiters: list[asyncio.Future] = []

    async def ask(self, sock: zmq.asyncio.Socket, frame: bytes, timeout: float, address: str) -> Any:
        """Send ``frame`` and wait for its answer; TimeoutError if none comes within ``timeout`` s."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await sock.send(frame)
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no {self.what} from {address} within {timeout} s") from None
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def answer(self, msg: Any) -> None:
        """Give ``msg`` to the oldest waiter still waiting."""
        while self._waiters:
            fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_result(msg)
                return

    def fail(self, exc: BaseException) -> None:
        """The connection is gone: no answer will come to anyone waiting."""
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(exc)
