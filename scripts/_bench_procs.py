"""Run a benchmark's client in several processes that start measuring at the same instant.

One client process can become the limit it measures (hundreds of streams, tens of
thousands of events per second, all on one core).  :func:`run_processes` starts one
process per payload (``spawn``: nothing of the parent's sockets or threads is
inherited), lets each get ready (connect, warm up), then gives them all one start
time; each measures from it and returns its figures as bytes.

``fn(payload, gate)`` runs in each process: it prepares, ``await gate.ready()``
(which returns the common start time, a ``time.perf_counter()`` value: that clock
is CLOCK_MONOTONIC on Linux, the same in every process), waits for that instant,
measures, and returns bytes.  Payloads and results are bytes (msgspec in the
callers); only ``fn`` itself is pickled, by reference.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import traceback
from typing import Callable

# Seconds between "every process is ready" and the start: enough for each to read the start time.
START_DELAY_S = 0.05
READY, RESULT, ERROR = b"ready", b"result:", b"error:"


class Gate:
    """A client process's side: say it is ready, learn when to start."""

    def __init__(self, conn) -> None:
        self.conn = conn

    async def ready(self) -> float:
        """Report ready; returns the start time (perf_counter) once every process is ready."""
        self.conn.send_bytes(READY)
        return float(await asyncio.to_thread(self.conn.recv_bytes))


def _child(conn, fn: Callable[[bytes, Gate], bytes], payload: bytes) -> None:
    try:
        conn.send_bytes(RESULT + fn(payload, Gate(conn)))
    except BaseException:
        conn.send_bytes(ERROR + traceback.format_exc().encode())
    finally:
        conn.close()


def _receive(conn, i: int, expect: bytes) -> bytes:
    try:
        msg = conn.recv_bytes()
    except EOFError:
        raise RuntimeError(f"client process {i} exited without an answer") from None
    if msg.startswith(ERROR):
        raise RuntimeError(f"client process {i} failed:\n{msg[len(ERROR):].decode(errors='replace')}")
    if not msg.startswith(expect):
        raise RuntimeError(f"client process {i} sent {msg[:40]!r}, expected {expect!r}")
    return msg[len(expect):]


def run_processes(fn: Callable[[bytes, Gate], bytes], payloads: list[bytes]) -> tuple[float, list[bytes]]:
    """Run ``fn`` on each payload in its own process; returns the common start time and the results, in order."""
    ctx = multiprocessing.get_context("spawn")
    conns, procs = [], []
    try:
        for payload in payloads:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_child, args=(child, fn, payload), daemon=True)
            proc.start()
            child.close()
            conns.append(parent)
            procs.append(proc)
        for i, conn in enumerate(conns):
            _receive(conn, i, READY)
        start = time.perf_counter() + START_DELAY_S
        for conn in conns:
            conn.send_bytes(repr(start).encode())
        return start, [_receive(conn, i, RESULT) for i, conn in enumerate(conns)]
    finally:
        for conn in conns:
            conn.close()  # a process still waiting for the start time gets EOFError and ends
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()
