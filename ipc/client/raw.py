"""A bare connection that speaks the wire protocol message by message.

For tests and benchmarks that need what the SDK hides: malformed frames,
``GetStats``, or many requests read as batched ``TokenDeltas`` with no
per-request bookkeeping in the way.  Applications use :class:`AsyncClient`.

    async with RawConnection(address) as conn:
        info = await conn.hello("bench", batch_deltas=True)
        run = await conn.run_requests([Generate("r0", [1, 2, 3], SamplingParams(max_tokens=8))])
        run.token_ids["r0"], run.finished["r0"].reason
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import msgspec
import zmq
import zmq.asyncio

from ipc.client.errors import error_from_wire
from ipc.protocol import (
    PROTOCOL_VERSION,
    Error,
    Finished,
    Generate,
    GetStats,
    Hello,
    ServerInfo,
    ServerStats,
    TokenDelta,
    TokenDeltas,
    encode,
    server_reply_decoder,
)


@dataclass
class RawRun:
    """What :meth:`RawConnection.run_requests` received, by request id."""

    token_ids: dict[str, list[int]]
    finished: dict[str, Finished] = field(default_factory=dict)
    batches: int = 0  # TokenDeltas messages received


class RawConnection:
    """One DEALER socket to a server; every ``recv`` waits at most ``timeout`` seconds (None: forever)."""

    def __init__(self, address: str, *, timeout: Optional[float] = 30.0) -> None:
        self.timeout = timeout
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)

    async def send(self, msg: msgspec.Struct) -> None:
        """Encode and send one message."""
        await self._sock.send(encode(msg))

    async def send_frames(self, *frames: bytes) -> None:
        """Send bytes as they are (one or more frames), e.g. a malformed message."""
        await self._sock.send_multipart(list(frames))

    async def recv(self) -> Any:
        """The next reply, decoded; TimeoutError when none comes in time."""
        recv = self._sock.recv()
        frame = await (recv if self.timeout is None else asyncio.wait_for(recv, self.timeout))
        return server_reply_decoder.decode(frame)

    async def hello(self, client_name: str = "raw", *, batch_deltas: bool = True) -> ServerInfo:
        """The handshake; raises the server's Error as a ForerunError."""
        await self.send(Hello(PROTOCOL_VERSION, client_name, batch_deltas=batch_deltas))
        reply = await self.recv()
        if isinstance(reply, Error):
            raise error_from_wire(reply)
        if not isinstance(reply, ServerInfo):
            raise RuntimeError(f"expected ServerInfo, got {reply!r}")
        return reply

    async def stats(self) -> ServerStats:
        """The server's pool occupancy and counters (after :meth:`hello`: before it only Ping is answered)."""
        await self.send(GetStats())
        return await self.recv()

    async def run_requests(self, requests: Sequence[Generate]) -> RawRun:
        """Send every Generate, then read until each has finished; check the delta stream on the way.

        Raises RuntimeError when a request appears twice in one TokenDeltas batch,
        gets tokens after its Finished, or finishes with a ``completion_tokens``
        that is not the number of tokens received; an Error reply is raised as a
        ForerunError.
        """
        for gen in requests:
            await self.send(gen)
        run = RawRun(token_ids={gen.request_id: [] for gen in requests})
        while len(run.finished) < len(requests):
            msg = await self.recv()
            if isinstance(msg, TokenDeltas):
                run.batches += 1
                if len(set(msg.request_ids)) != len(msg.request_ids):
                    raise RuntimeError(f"a request twice in one batch: {msg.request_ids}")
                for request_id, token_ids in zip(msg.request_ids, msg.token_ids):
                    self._add(run, request_id, token_ids)
            elif isinstance(msg, TokenDelta):
                self._add(run, msg.request_id, msg.token_ids)
            elif isinstance(msg, Finished):
                self._add(run, msg.request_id, msg.token_ids)
                if msg.completion_tokens != len(run.token_ids[msg.request_id]):
                    raise RuntimeError(f"{msg.request_id}: completion_tokens {msg.completion_tokens}, "
                                       f"received {len(run.token_ids[msg.request_id])}")
                run.finished[msg.request_id] = msg
            elif isinstance(msg, Error):
                raise error_from_wire(msg)
            else:
                raise RuntimeError(f"unexpected reply {msg!r}")
        return run

    @staticmethod
    def _add(run: RawRun, request_id: str, token_ids: list[int]) -> None:
        if request_id not in run.token_ids:
            raise RuntimeError(f"a reply for {request_id!r}, which this run did not send")
        if request_id in run.finished:
            raise RuntimeError(f"{request_id}: tokens after its Finished")
        run.token_ids[request_id].extend(token_ids)

    def close(self) -> None:
        """Close the socket (pending messages are dropped)."""
        self._sock.close()
        self._ctx.term()

    async def __aenter__(self) -> "RawConnection":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
