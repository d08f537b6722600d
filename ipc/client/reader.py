"""The client's reader task: every reply from the server, decoded and handed on.

A step's tokens and each reply naming a request go to :class:`~ipc.client.inflight.InFlight`; stats and
tokenizer files to the calls that asked (:class:`~ipc.client.asks.OrderedAsks`); a reply that voids the
connection (:meth:`~ipc.client.liveness.Liveness.void`) to ``on_gone``, which ends the task; an Error naming no
request to ``on_unaddressed``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from ipc.client.asks import OrderedAsks
from ipc.client.inflight import InFlight
from ipc.client.liveness import Liveness
from ipc.protocol import TokenDeltas, server_reply_decoder

logger = logging.getLogger("forerun.client")

# Replies read per wake-up of the reader task before it yields to other tasks.
DRAIN_BATCH = 256


async def read_replies(sock: zmq.asyncio.Socket, address: str, live: Liveness, inflight: InFlight,
                       asks: dict[type, OrderedAsks], on_gone: Callable[[str], None],
                       on_unaddressed: Callable[[Any], None]) -> None:
    """Read ``sock`` until it is void or cancelled (module docstring); ``asks``: the calls waiting for each type
    of answer.  A failure of the reader itself fails every request in flight."""
    # Drain through a plain shadow socket: an awaited recv per message costs ~50 us
    # of future bookkeeping, which caps a busy client far below the server's rate.
    raw = zmq.Socket.shadow(sock.underlying)
    try:
        while True:
            await sock.poll(flags=zmq.POLLIN)
            live.last_heard = time.perf_counter()
            for _ in range(DRAIN_BATCH):
                try:
                    frames = raw.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                t = time.perf_counter()
                try:
                    msg = server_reply_decoder.decode(frames[-1])
                except msgspec.DecodeError as exc:
                    logger.warning("dropping an undecodable reply from %s: %s", address, exc)
                    continue
                if isinstance(msg, TokenDeltas):
                    inflight.deliver_deltas(t, msg)
                    continue
                waiting = asks.get(type(msg))
                if waiting is not None:
                    waiting.answer(msg)
                    continue
                gone = live.void(msg)
                if gone is not None:
                    on_gone(gone)
                    return
                request_id = getattr(msg, "request_id", None)
                if request_id is None:
                    on_unaddressed(msg)
                    continue
                inflight.deliver(t, request_id, msg)
            else:
                # A full batch: let the consumers (and new requests) run before reading on.
                await asyncio.sleep(0)
    except (asyncio.CancelledError, zmq.ContextTerminated):
        raise
    except Exception:
        logger.exception("client reader for %s failed", address)
        inflight.fail_all(ConnectionError, "the connection to the server failed")
