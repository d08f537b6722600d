"""The requests one client has on the server, by ``request_id``: where each reply goes.

``pending``: the requests sent and not released; each reply is delivered to its queue
(:class:`~ipc.client.request.PendingRequest`).  ``retiring``: requests let go of before their end (a stream
left early, a timeout), with the completions whose Finished has not come back yet: the server answers their
Abort with a Finished per live completion, and until those are in the id is not reused (they would end the
new request at once while the server ran it).  Both empty out when the connection goes: so do the server's
requests.
"""

from __future__ import annotations

import time
from typing import Any

from ipc.client.errors import DuplicateRequestIdError
from ipc.client.request import PendingRequest, Stop, split_deltas
from ipc.protocol import Error, Finished, TokenDeltas


class InFlight:
    """A client's requests on the server (module docstring)."""

    def __init__(self) -> None:
        self.pending: dict[str, PendingRequest] = {}
        self.retiring: dict[str, set[int]] = {}  # request id -> completions whose Finished is still to come

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, req: PendingRequest) -> None:
        """Register a request about to be sent; DuplicateRequestIdError while its id is in flight or retiring."""
        rid = req.request_id
        if rid in self.pending:
            raise DuplicateRequestIdError("duplicate_id", "request_id",
                                          f"request id {rid!r} is already in flight on this client", rid)
        if rid in self.retiring:
            raise DuplicateRequestIdError("duplicate_id", "request_id", f"request id {rid!r} was let go of and its "
                                          f"abort is not finished on the server yet: use another id, or retry in a "
                                          f"moment", rid)
        self.pending[rid] = req

    def release(self, req: PendingRequest, connected: bool) -> bool:
        """Forget ``req``; whether the caller must abort it on the server: it had not ended and the client is
        ``connected`` (its id then retires until the Finished of each completion still running is back)."""
        if self.pending.get(req.request_id) is req:
            del self.pending[req.request_id]
        if req.done or not connected:
            return False
        req.done = True
        left = req.unfinished()
        if left:
            self.retiring[req.request_id] = left
        return True

    def deliver_deltas(self, t: float, msg: TokenDeltas) -> None:
        """A step's batched tokens, each to its request."""
        pending = self.pending
        for delta in split_deltas(msg, pending):
            pending[delta.request_id].deliver(t, delta)

    def deliver(self, t: float, request_id: str, msg: Any) -> None:
        """A reply naming a request: to its queue, or, for a request let go of, its last Finished (or an Error)
        frees the id."""
        req = self.pending.get(request_id)
        if req is not None:
            req.deliver(t, msg)
            return
        left = self.retiring.get(request_id)
        if left is None:
            return
        if isinstance(msg, Finished):
            left.discard(msg.index)
        if not left or isinstance(msg, Error):
            del self.retiring[request_id]

    def deliver_unaddressed(self, msg: Error) -> None:
        """An Error naming no request: only a request with no reply yet can own the frame the server could not
        read."""
        for req in list(self.pending.values()):
            if not req.answered:
                req.deliver(time.perf_counter(), msg)

    def open_ids(self) -> list[str]:
        """The ids of requests that have not ended (to abort at close)."""
        return [req.request_id for req in self.pending.values() if not req.done]

    def fail_all(self, exc_type: type[BaseException], message: str) -> None:
        """No reply will come on this connection: every request raises ``exc_type(message)``."""
        for req in self.pending.values():
            req.stop(Stop(exc_type, message))
        self.pending.clear()
        self.retiring.clear()
