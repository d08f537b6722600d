"""The client's side of the Hello handshake: the first ServerInfo on a new socket."""

from __future__ import annotations

import asyncio
import time

import msgspec
import zmq.asyncio

from ipc.client.errors import ProtocolError, ServerGoneError, error_from_wire
from ipc.protocol import PROTOCOL_VERSION, Error, Hello, ServerInfo, encode, server_reply_decoder


async def handshake(sock: zmq.asyncio.Socket, hello: Hello, address: str, limit: float) -> ServerInfo:
    """Say ``hello`` and return the server's ServerInfo.

    Raises ServerGoneError when nothing answers within ``limit`` s, ProtocolError for another protocol
    version or an undecodable reply, and the wire error's class when the server refuses the Hello
    (a wrong key, say).  Stray replies to an earlier connection's requests are skipped.
    """
    await sock.send(encode(hello))
    deadline = time.monotonic() + limit
    while True:
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise ServerGoneError(f"no server answered at {address} within {limit:g} s") from None
        try:
            msg = server_reply_decoder.decode(frames[-1])
        except msgspec.DecodeError as exc:
            raise ProtocolError("protocol", None, f"undecodable handshake reply: {exc}") from None
        if isinstance(msg, ServerInfo):
            if msg.protocol_version != PROTOCOL_VERSION:
                raise ProtocolError("protocol", "protocol_version",
                                    f"server speaks protocol {msg.protocol_version}, this client {PROTOCOL_VERSION}")
            return msg
        if isinstance(msg, Error) and msg.request_id is None:
            raise error_from_wire(msg)
