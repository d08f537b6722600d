"""Helpers shared by the benchmark scripts: percentiles, summaries, tables, JSON, a server process, a
benchmark client spread over several processes, and a lean streaming HTTP client.

Scripts import it as a package beside them (``from benchlib import ...``): Python puts the
script's own folder first on ``sys.path``.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import math
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import Any, Callable, Iterable, Optional, Sequence
from urllib.parse import urlsplit

import msgspec

DEFAULT_PERCENTILES = (50, 90, 99)

CHAT_PROMPTS = [
    "Explain how a hash table works, with an example in Python.",
    "Write a short poem about the sea at night.",
    "What are the main causes of the French Revolution?",
    "Give me three ideas for a weekend trip near the mountains.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "How do vaccines train the immune system?",
    "Translate 'Where is the train station?' into French, Spanish and German.",
    "What is the difference between TCP and UDP?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a ten-year-old.",
    "List five tips for writing clear technical documentation.",
    "Why is the sky blue?",
    "Describe the water cycle step by step.",
    "Write a function that checks whether a string is a palindrome.",
    "What should I consider when adopting a dog?",
    "Compare electric cars and petrol cars in a short table.",
]


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Iterable[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              scale: float = 1.0) -> dict[str, Optional[float]]:
    """Mean and percentiles of ``values`` times ``scale`` (e.g. 1000 for seconds -> ms)."""
    scaled = [v * scale for v in values]
    summary: dict[str, Optional[float]] = {"mean": sum(scaled) / len(scaled) if scaled else None}
    for q in percentiles:
        summary[f"p{q:g}"] = percentile(scaled, q)
    return summary


def fmt(value: Optional[float], digits: int = 2) -> str:
    """A number for a table cell; "-" for a missing one."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_table(rows: Sequence[tuple[str, Any]], title: Optional[str] = None) -> str:
    """Two aligned columns (label, value) with an optional centred title."""
    cells = [(label, value if isinstance(value, str) else fmt(value)) for label, value in rows]
    left = max((len(label) for label, _ in cells), default=0)
    right = max((len(value) for _, value in cells), default=0)
    width = max(left + right + 2, len(title) + 4 if title else 0)
    lines = []
    if title:
        lines += [f" {title} ".center(width, "="), ""]
    lines += [f"{label:<{width - right}}{value:>{right}}" for label, value in cells]
    lines.append("=" * width)
    return "\n".join(lines)


def latency_rows(name: str, summary: dict[str, Optional[float]], unit: str = "ms") -> list[tuple[str, Any]]:
    """Table rows for one summarize() result: "Mean TTFT (ms)", "P50 TTFT (ms)", ..."""
    return [(f"{key.capitalize() if key == 'mean' else key.upper()} {name} ({unit})", value)
            for key, value in summary.items()]


def shapes_of(name: str) -> dict[str, tuple[int, int]]:
    """The decode-time linears of ``scripts/configs/<name>`` as ``{weight: (N, K)}``."""
    scripts = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(scripts, "configs", name, "config.json")) as f:
        c = json.load(f)
    h, heads, kvh = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // heads
    return {"qkv": ((heads + 2 * kvh) * d, h), "o": (h, heads * d), "gate_up": (2 * c["intermediate_size"], h),
            "down": (h, c["intermediate_size"]), "lm_head": (c["vocab_size"], h)}


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write benchmark figures as indented JSON, creating the folder if needed."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")


def run_dir(prefix: str = "fr") -> str:
    """A new folder for a server's sockets, short (ipc paths are limited to 107 bytes: under /tmp), removed when
    this process exits."""
    folder = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def ipc_address(folder: str) -> str:
    """A fresh ``ipc://`` address in ``folder`` (keep it short: ipc paths are limited to 107 bytes)."""
    return f"ipc://{folder}/c-{uuid.uuid4().hex[:8]}.sock"


def start_server(address: str, *flags: str, run_dir: Optional[str] = None, echo: bool = True,
                 timeout: Optional[float] = None) -> subprocess.Popen:
    """``forerun serve --address ADDRESS --quiet FLAGS``, returned once it prints that it is ready.

    The server's output after that stays unread in ``proc.stdout`` for the caller.  ``timeout``:
    seconds to wait for the "ready at" line before the server is killed (None: no limit).
    """
    cmd = [sys.executable, "-m", "scheduler_proc.launch", "serve", "--address", address, "--quiet", *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"FORERUN_RUN_DIR": run_dir} if run_dir else {}))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    watchdog = None if timeout is None else threading.Timer(timeout, proc.kill)
    if watchdog is not None:
        watchdog.start()
    log = []
    try:
        for line in iter(proc.stdout.readline, ""):
            log.append(line)
            if echo:
                print("  server:", line.rstrip(), flush=True)
            if "ready at" in line:
                return proc
    finally:
        if watchdog is not None:
            watchdog.cancel()
    proc.wait()
    if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"server not ready within {timeout} s:\n" + "".join(log))
    raise RuntimeError("server exited during start-up:\n" + "".join(log))


def executor_pid(server: subprocess.Popen) -> int:
    """The pid of the server's executor process (its only child)."""
    out = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
    return int(out[0])


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server and wait for it (SIGKILL after 30 s)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()



async def lockstep_decode(address: str, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    """Seconds for ``batch`` greedy requests of random ``prompt_len``-token prompts decoding ``new_tokens`` tokens
    each, sent together through the SDK (EOS ignored): they decode in lockstep."""
    import random

    from ipc.client import AsyncClient

    rng = random.Random(0)
    async with AsyncClient(address, timeout=600) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*[
            c.generate(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(prompt_len)], max_tokens=new_tokens,
                       temperature=0.0, ignore_eos=True, detokenize=False) for _ in range(batch)])
        return time.perf_counter() - t0


def gpu_idle_of(rows: list[dict], batch: int) -> dict:
    """The GPU's idle fraction over --step-log rows with ``batch`` decoding rows (first and last tenth trimmed):
    sum(gap) / (sum(gap) + sum(busy)) from the executor's CUDA events (None without them)."""
    steady = [r for r in rows if r["num_rows"] == batch and r["num_tokens"] == batch]
    trim = len(steady) // 10
    steady = steady[trim:len(steady) - trim] if trim else steady
    busy = sum(r["gpu_busy_s"] for r in steady)
    gaps = [r["gpu_gap_s"] for r in steady]
    return {
        "steps": len(steady),
        "gpu_idle_fraction": sum(gaps) / (sum(gaps) + busy) if sum(gaps) + busy > 0 else None,
        "gpu_gap_us_p50": percentile(gaps, 50) * 1e6 if gaps else None,
        "gpu_gap_us_p99": percentile(gaps, 99) * 1e6 if gaps else None,
        "gpu_step_us_p50": percentile([r["gpu_busy_s"] for r in steady], 50) * 1e6 if steady else None,
    }

# ----------------------------------------------------------------------------------------------------
# Several client processes that start measuring at one instant
#
# Run a benchmark's client in several processes that start measuring at the same instant.
#
# One client process can become the limit it measures (hundreds of streams, tens of
# thousands of events per second, all on one core).  :func:`run_processes` starts one
# process per payload (``spawn``: nothing of the parent's sockets or threads is
# inherited), lets each get ready (connect, warm up), then gives them all one start
# time; each measures from it and returns its figures as bytes.
#
# ``fn(payload, gate)`` runs in each process: it prepares, ``await gate.ready()``
# (which returns the common start time, a ``time.perf_counter()`` value: that clock
# is CLOCK_MONOTONIC on Linux, the same in every process), waits for that instant,
# measures, and returns bytes.  Payloads and results are bytes (msgspec in the
# callers); only ``fn`` itself is pickled, by reference.
# ----------------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------------
# A lean streaming HTTP/1.1 client (POST JSON, SSE events as they arrive)
#
# A lean streaming HTTP/1.1 client for the benchmarks: POST JSON, see SSE events as they arrive.
#
# The benchmarks measure the gateway, not a client library: plain asyncio
# connections driven by a Protocol whose ``data_received`` undoes the chunked
# encoding, splits the SSE events, decodes each with msgspec and hands it to a
# callback with its arrival time.  No task wakes up per read: one client process
# can follow hundreds of streams at tens of thousands of events per second.
#
# ``sse_post`` opens one connection per request (``Connection: close``), as a
# client without a pool does; :class:`Connections` keeps connections open and
# sends one request after another on each (keep-alive), as a pooling client or a
# proxy in front of the gateway does, and can open them before a measurement.
# ----------------------------------------------------------------------------------------------------

_decode = msgspec.json.decode
_END = b"0\r\n\r\n"  # the last chunk of a chunked body (the gateway sends no trailers)
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)")


class HTTPError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status


class _SSEProtocol(asyncio.Protocol):
    """One connection; ``send`` starts a streaming POST, whose events go to ``on_event`` as they come.

    ``done`` (a future per request) ends with the response; the connection then
    takes the next request when ``reusable`` (the server kept it open).
    """

    def __init__(self) -> None:
        self.transport: Optional[asyncio.Transport] = None
        self.lost = False
        self.done: Optional[asyncio.Future] = None  # the request in flight, if any
        self.reusable = False

    def send(self, request: bytes, decode: Callable[[bytes], Any], on_event: Callable[[float, Any], None],
             done: asyncio.Future) -> None:
        """Write one request; the connection must be idle."""
        self.decode, self.on_event, self.done = decode, on_event, done
        self.status: Optional[int] = None
        self.chunked = False
        self.keep_alive = False
        self.raw = b""  # bytes not yet taken apart (head, chunk framing)
        self.body = b""  # body bytes not yet split into events
        self.transport.write(request)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.done is None or self.done.done():
            self.transport.close()  # nothing was asked: the connection is out of step
            return
        t = time.perf_counter()
        try:
            self._take(t, self.raw + data)
        except Exception as exc:  # a malformed answer or a failing callback ends this request
            self._finish(exc)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.lost = True
        if self.done is None or self.done.done():
            return
        if self.status is not None and self.status != 200:
            self._finish(HTTPError(self.status, self.raw))
        elif not self.chunked and self.status == 200:
            self._finish(None)  # a body without chunked framing ends with the connection
        else:
            self._finish(exc or ConnectionError("the connection closed before the end of the stream"))

    def _finish(self, exc: Optional[BaseException]) -> None:
        self.reusable = exc is None and self.keep_alive and not self.lost and not self.raw
        if not self.done.done():
            if exc is not None:
                self.done.set_exception(exc)
            else:
                self.done.set_result(None)
        if not self.reusable and self.transport is not None:
            self.transport.close()

    def _take(self, t: float, raw: bytes) -> None:
        if self.status is None:
            end = raw.find(b"\r\n\r\n")
            if end < 0:
                self.raw = raw
                return
            head, raw = raw[:end].lower(), raw[end + 4:]
            self.status = int(head.split(b" ", 2)[1])
            self.chunked = b"transfer-encoding: chunked" in head
            self.keep_alive = b"connection: close" not in head and head.startswith(b"http/1.1")
            length = _CONTENT_LENGTH.search(head)
            self.left = int(length.group(1)) if length and not self.chunked else None
        if not self.chunked:  # a body of Content-Length bytes (an error answer), else up to the close
            if self.status == 200:
                self.raw = b""
                self._events(t, raw)
                if self.left is not None:
                    self.left -= len(raw)
                    if self.left <= 0:
                        self._finish(None)
            else:
                self.raw = raw  # the error body so far
                if self.left is not None and len(raw) >= self.left:
                    self._finish(HTTPError(self.status, raw))
            return
        parts, ended = [], False
        while (eol := raw.find(b"\r\n")) >= 0:
            if raw.startswith(_END):
                ended, raw = True, raw[len(_END):]
                break
            size = int(raw[:eol].split(b";")[0], 16)
            end = eol + 2 + size
            if size == 0 or len(raw) < end + 2:
                break  # the rest of this chunk (or of the last one) is still on its way
            parts.append(raw[eol + 2:end])
            raw = raw[end + 2:]
        self.raw = raw
        self._events(t, b"".join(parts))
        if ended:
            self._finish(None)

    def _events(self, t: float, data: bytes) -> None:
        buf = self.body + data
        while (end := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:end], buf[end + 2:]
            if event.startswith(b"data: "):
                payload = event[6:]
                self.on_event(t, None if payload == b"[DONE]" else self.decode(payload))
        self.body = buf


def _request(base_url: str, path: str, body: dict, api_key: Optional[str], keep_alive: bool) -> bytes:
    url = urlsplit(base_url)
    payload = msgspec.json.encode(body)
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    connection = "keep-alive" if keep_alive else "close"
    return (f"POST {url.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{auth}"
            f"Connection: {connection}\r\n\r\n").encode() + payload


async def _connect(base_url: str) -> _SSEProtocol:
    url = urlsplit(base_url)
    _, protocol = await asyncio.get_running_loop().create_connection(_SSEProtocol, url.hostname, url.port or 80)
    return protocol


async def _post(protocol: _SSEProtocol, request: bytes, on_event: Callable[[float, Any], None],
                decode: Callable[[bytes], Any]) -> None:
    done = asyncio.get_running_loop().create_future()
    protocol.send(request, decode, on_event, done)
    try:
        await done
    except BaseException:
        protocol.reusable = False
        protocol.transport.close()
        raise


async def sse_post(base_url: str, path: str, body: dict, on_event: Callable[[float, Any], None],
                   api_key: Optional[str] = None, decode: Callable[[bytes], Any] = _decode) -> None:
    """POST ``body`` on a new connection and call ``on_event(arrival perf_counter, event)`` for each event.

    ``event`` is ``decode(json)`` (a typed msgspec decoder that keeps only the fields a
    benchmark reads is about twice as fast as dicts), None for ``[DONE]``.  Returns at
    the end of the stream; raises HTTPError for a status other than 200, ConnectionError
    when the server closes early.
    """
    protocol = await _connect(base_url)
    try:
        await _post(protocol, _request(base_url, path, body, api_key, keep_alive=False), on_event, decode)
    finally:
        protocol.transport.close()


class Connections:
    """Keep-alive connections to one server: each carries one request at a time, then the next."""

    def __init__(self, base_url: str, api_key: Optional[str] = None) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.idle: list[_SSEProtocol] = []

    async def open(self, n: int) -> None:
        """Open connections until ``n`` are idle (before a measurement: no connection set-up inside it)."""
        missing = n - len(self.idle)
        if missing > 0:
            self.idle += await asyncio.gather(*[_connect(self.base_url) for _ in range(missing)])

    async def post(self, path: str, body: dict, on_event: Callable[[float, Any], None],
                   decode: Callable[[bytes], Any] = _decode) -> None:
        """As :func:`sse_post`, on an idle connection (a new one when none is idle)."""
        while self.idle:
            protocol = self.idle.pop()
            if not protocol.lost:
                break
        else:
            protocol = await _connect(self.base_url)
        await _post(protocol, _request(self.base_url, path, body, self.api_key, keep_alive=True), on_event, decode)
        if protocol.reusable:
            self.idle.append(protocol)

    def close(self) -> None:
        """Close every idle connection."""
        for protocol in self.idle:
            protocol.transport.close()
        self.idle.clear()
