"""Is the server still there?  The client's side of the heartbeat protocol.

The client's Hello promises a message every ``heartbeat_s`` seconds; the
client keeps that promise with a Ping, which the server answers with a Pong
carrying its ``server_id``.  So a live server is never silent for long: no
message for ``HEARTBEAT_MISSES`` heartbeats means it is gone, and a Pong with
another ``server_id`` than the handshake's means it was restarted (its
requests were lost with the old process).  A server whose ServerInfo has no
``server_id`` predates heartbeats: it is pinged but never taken for dead.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

import zmq
import zmq.asyncio

from ipc.protocol import HEARTBEAT_MISSES, Error, Ping, Pong, ServerInfo, encode

# How often the heartbeat task wakes to check for silence (seconds): detection comes at most
# this late after HEARTBEAT_MISSES x heartbeat_s.
CHECK_INTERVAL_S = 0.25


class Liveness:
    """The server_id seen at the handshake and when the server last said anything."""

    def __init__(self, server_id: str, heartbeat_s: float) -> None:
        self.server_id = server_id
        self.heartbeat_s = heartbeat_s
        self.last_heard = time.perf_counter()

    @property
    def enforced(self) -> bool:
        """Whether silence means death: this client pings and the server answers pings."""
        return self.heartbeat_s > 0 and bool(self.server_id)

    def restarted(self, server_id: str) -> Optional[str]:
        """Why the connection is dead, if ``server_id`` (from a Pong or ServerInfo) is another server's."""
        if server_id and self.server_id and server_id != self.server_id:
            return f"the server was restarted (server_id {self.server_id} became {server_id})"
        return None

    def void(self, msg: Any) -> Optional[str]:
        """Why the connection is void, if ``msg`` says so: another server answers (restarted), or the server no
        longer knows this client (a Pong without its Hello, or a ``hello_first`` Error).  A restarted server does
        not know the client either: the restart is the cause, said first."""
        gone = self.restarted(msg.server_id) if isinstance(msg, (Pong, ServerInfo)) else None
        if gone is None and ((isinstance(msg, Pong) and not msg.hello)
                             or (isinstance(msg, Error) and msg.code == "hello_first")):
            gone = "the server forgot this client (silent past its heartbeat: a stalled event loop?) and aborted its " \
                   "requests"
        return gone

    def silence(self) -> Optional[str]:
        """Why the connection is dead, if the server has been silent for HEARTBEAT_MISSES heartbeats."""
        if not self.enforced:
            return None
        silent = time.perf_counter() - self.last_heard
        if silent <= HEARTBEAT_MISSES * self.heartbeat_s:
            return None
        return (f"no message from the server for {silent:.1f} s "
                f"({HEARTBEAT_MISSES} heartbeats of {self.heartbeat_s:g} s)")


async def keep_alive(sock: zmq.asyncio.Socket, live: Liveness, on_gone: Callable[[str], None]) -> None:
    """Ping every ``heartbeat_s`` and call ``on_gone(reason)`` once the server has been silent too long."""
    ping = encode(Ping())
    next_ping = 0.0
    while True:
        now = time.perf_counter()
        if live.heartbeat_s > 0 and now >= next_ping:
            try:
                await sock.send(ping, zmq.NOBLOCK)
            except zmq.Again:
                pass  # the queue is full: the server is not reading, silence will tell
            next_ping = now + live.heartbeat_s
        reason = live.silence()
        # Replies waiting unread mean this process's loop was busy, not that the server is gone.
        if reason is not None and not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            on_gone(reason)
            return
        await asyncio.sleep(CHECK_INTERVAL_S)
