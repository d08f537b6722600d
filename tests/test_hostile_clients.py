"""Hostile HTTP and SDK clients against one real `forerun serve` (scripted executor), and its clean stop.

One server for the module: HTTP on a free port, the SDK socket on tcp:// with a key read from a file
(--api-key-file), 10 ms steps.  Each test leaves it serving; the last one stops it with SIGINT to its
process group, as a terminal's Ctrl-C does, with streams in flight.  docs/reliability.md, "Hostile
clients", lists what each test checks.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from ipc import protocol as p
from ipc.client import AsyncClient, UnauthorizedError
from ipc.client.raw import RawConnection
from tests.server_proc import python_path, run_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "hostile-test-key-5f0c"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 6, 7]  # token ids: the scripted executor's vocabulary is 1000


def free_ports(n: int) -> list[int]:
    """``n`` different free ports (all bound at once: one closed before the next is asked for may come back)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


class Serve:
    """`forerun serve` in its own session (so that killpg reaches it and its children), output collected."""

    def __init__(self, *args: str) -> None:
        self.run_dir = run_dir("frh")
        env = dict(os.environ, PYTHONPATH=python_path(), PYTHONUNBUFFERED="1", FORERUN_RUN_DIR=self.run_dir)
        env.pop("FORERUN_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "scheduler_proc.launch", "serve", "--quiet", *args],
                                     env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.reader.join(timeout=2)
                raise RuntimeError(f"no {text!r} in the output:\n" + "\n".join(self.lines))
            time.sleep(0.05)

    def finish(self, timeout: float = 60.0) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=5)
        return rc

    def children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api_key"
    key_file.write_text(KEY + "\n")
    port, sdk_port = free_ports(2)
    srv = Serve("--load-format", "scripted", "--scripted-step-ms", "10", "--tokenizer", default_model_dir,
                "--max-num-seqs", "16", "--port", str(port), "--host", "127.0.0.1",
                "--address", f"tcp://127.0.0.1:{sdk_port}", "--api-key-file", str(key_file),
                "--shutdown-timeout", "20")
    srv.wait_for("OpenAI-compatible API at")
    srv.port, srv.address = port, f"tcp://127.0.0.1:{sdk_port}"
    yield srv
    if srv.proc.poll() is None:
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.finish()


def request(port: int, method: str, path: str, body=None, headers=None, timeout: float = 30.0):
    """(status, headers, body) of one request; ``body``: bytes as they are, else JSON."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, data, {"Content-Type": "application/json", **AUTH, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def stream_events(port: int, body: dict, timeout: float = 60.0) -> list[bytes]:
    """Every SSE data payload of a streaming request, [DONE] included (an exception if the stream hangs)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json", **AUTH})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return [line[len(b"data: "):].strip() for line in resp if line.startswith(b"data: ")]
    finally:
        conn.close()


def completion_tokens(events: list[bytes]) -> int:
    """The usage event's count (the stream asked for it; -1: no usage event, the stream was cut)."""
    usage = [json.loads(e)["usage"] for e in events if e != b"[DONE]" and b'"usage":{' in e]
    return usage[-1]["completion_tokens"] if usage else -1


def gateway_pid(server) -> int:
    return next(pid for pid in server.children() if b"ipc.gateway.process" in open(f"/proc/{pid}/cmdline", "rb").read())


def rss_mib(pid: int) -> float:
    return int(open(f"/proc/{pid}/status").read().split("VmRSS:")[1].split()[0]) / 1024


def test_large_bodies_with_streams_in_flight(server):
    """10 MB: a 413 at once; text too long for the context: a 400 before tokenizing; the largest text that
    passes is tokenized off the event loop.  Streams meanwhile complete and /health answers throughout;
    the worker's memory stays within what the limits allow (it grew by 1.2 GiB without them)."""
    rss_before = rss_mib(gateway_pid(server))
    health: list[tuple[int, float]] = []
    stop = threading.Event()

    def poll_health() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            status = request(server.port, "GET", "/health")[0]
            health.append((status, time.monotonic() - t0))
            time.sleep(0.05)

    with ThreadPoolExecutor(8) as pool:
        poller = pool.submit(poll_health)
        streams = [pool.submit(stream_events, server.port, {"prompt": PROMPT, "max_tokens": 150, "seed": i,
                                                             "ignore_eos": True}) for i in range(3)]
        time.sleep(0.3)
        t0 = time.monotonic()
        status, _, body = request(server.port, "POST", "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "a " * 5_000_000}]})
        assert status == 413 and b"4194304 bytes" in body and b"--max-request-bytes" in body, body
        assert time.monotonic() - t0 < 2.0
        status, _, body = request(server.port, "POST", "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "a " * 1_000_000}]})
        assert status == 400 and b"characters" in body, body
        # Just under the character bound: templated and tokenized (in the pool), then refused as too long.
        heavy = [pool.submit(request, server.port, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "ab " * 80_000}]}) for _ in range(2)]
        for f in heavy:
            status, _, body = f.result()
            assert status == 400 and b"tokens" in body, body
        results = [f.result() for f in streams]
        stop.set()
        poller.result()
    for events in results:
        assert events[-1] == b"[DONE]" and completion_tokens(events) == 150, events[-3:]
    assert health and all(status == 200 for status, _ in health), health
    assert max(latency for _, latency in health) < 1.0, health
    assert rss_mib(gateway_pid(server)) - rss_before < 150, (rss_before, rss_mib(gateway_pid(server)))
    status, _, body = request(server.port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200, body


def test_malformed_bodies_are_400_naming_the_problem(server):
    cases = [
        ("/v1/completions", b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", b"nests"),
        ("/v1/completions", b'{"prompt": "ab\xff\xfecd", "max_tokens": 2}', b"UTF-8"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logit_bias": {" 5 ": 1}}, b"logit_bias"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logit_bias": {"1_0": 1}}, b"logit_bias"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logit_bias": {"\u0663": 1}}, b"logit_bias"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, b"role"),
        ("/tokenize", {"prompt": "a " * 1_000_000}, b"characters"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', b"messages"),
        ("/v1/completions", b"not json", b"JSON"),
    ]
    for path, body, word in cases:
        status, _, answer = request(server.port, "POST", path, body)
        assert status == 400 and word in answer, (path, body[:60], status, answer)
    status, _, answer = request(server.port, "POST", "/v1/completions", {"prompt": PROMPT, "model": "m" * 1_000_000})
    assert status == 404 and len(answer) < 2048, len(answer)  # the echo is cut
    ok = {"prompt": PROMPT, "max_tokens": 2, "logit_bias": {"5": 1}}
    assert request(server.port, "POST", "/v1/completions", ok, {"Authorization": f"bearer {KEY}"})[0] == 200
    assert request(server.port, "POST", "/v1/completions", ok, {"Authorization": "Bearer wrong"})[0] == 401
    assert not any("Traceback" in line for line in server.lines), server.lines


def test_gateway_forgotten_by_the_scheduler_recovers(server):
    """The gateway's loop stops (SIGSTOP) past its heartbeat: the scheduler forgets it and aborts its stream.
    Once it runs again the stream ends with an error event and [DONE], and the next request says Hello again."""
    gateway = gateway_pid(server)
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_events, server.port, {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True})
        time.sleep(1.0)
        os.kill(gateway, signal.SIGSTOP)
        try:
            time.sleep(p.HEARTBEAT_MISSES * 1.0 + 1.5)  # the gateway's heartbeat is 1 s
        finally:
            os.kill(gateway, signal.SIGCONT)
        t0 = time.monotonic()
        events = stream.result(timeout=30)
    assert events[-1] == b"[DONE]" and b'"error"' in events[-2], events[-2:]
    assert time.monotonic() - t0 < 5.0
    assert request(server.port, "GET", "/health")[0] == 200
    status, _, body = request(server.port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200, body


def test_port_in_use_refuses_to_start(server):
    """The port of a running server, and a port another program holds: one line and exit 1, before the model."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        for port in (server.port, other.getsockname()[1]):
            srv = Serve("--load-format", "scripted", "--port", str(port))
            assert srv.finish() == 1
            assert any(f"cannot listen on http://127.0.0.1:{port}: the port is in use" in line
                       for line in srv.lines), srv.lines
            assert not os.listdir(srv.run_dir), os.listdir(srv.run_dir)


def test_sdk_socket_needs_the_key_and_tells_no_paths(server, default_model_dir):
    async def main() -> None:
        for key in ("", "wrong"):
            with pytest.raises(UnauthorizedError):
                async with AsyncClient(server.address, api_key=key, connect_timeout=5):
                    pass
        async with RawConnection(server.address, timeout=10) as conn:
            await conn.send(p.Hello(p.PROTOCOL_VERSION, "no-key"))
            assert (await conn.recv()).code == "unauthorized"
            await conn.send(p.ResetPrefixCache())  # an admin message without the key
            assert (await conn.recv()).code == "hello_first"
        async with AsyncClient(server.address, api_key=KEY) as client:
            info = client.server_info
            assert info.has_tokenizer
            assert not any("/" in str(v) for v in msgspec.structs.asdict(info).values()), info
            assert (await client.reset_prefix_cache()).num_kv_blocks > 0
            result = await client.generate(prompt_token_ids=PROMPT, max_tokens=3, ignore_eos=True)
            assert len(result.token_ids) == 3
            assert (await client.get_tokenizer()).encode("hi")  # built from the files the server sent
    asyncio.run(main())
    for pid in [server.proc.pid] + server.children():
        assert KEY.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
    # Without a key a tcp:// address beyond loopback is refused at start-up.
    srv = Serve("--load-format", "scripted", "--address", f"tcp://0.0.0.0:{free_port()}")
    assert srv.finish() == 1
    assert any("no API key is set" in line and "--allow-unauthenticated" in line for line in srv.lines), srv.lines


def drain_and_stop(srv, signal_it) -> None:
    """Signal a serving server with streams in flight; check the drain, its output and what it leaves."""
    children = srv.children()
    assert len(children) == 2, children  # the executor and one gateway worker
    before = len(srv.lines)
    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream_events, srv.port, {"prompt": PROMPT, "max_tokens": 200, "seed": i,
                                                          "ignore_eos": True}) for i in range(2)]
        time.sleep(0.5)
        signal_it()
        time.sleep(0.3)
        assert request(srv.port, "GET", "/health")[0] == 503
        status, headers, body = request(srv.port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 503 and headers.get("retry-after") and b"shutting_down" in body, (status, body)
        results = [f.result(timeout=60) for f in streams]
    for events in results:
        assert events[-1] == b"[DONE]" and completion_tokens(events) == 200, events[-3:]
    assert srv.finish() == 0
    after = srv.lines[before:]
    assert [line.split(":")[:2] for line in after] == [["forerun", " shutting down"], ["forerun", " stopped"]], after
    assert not any(word in line for line in srv.lines for word in ("Traceback", "failed", "restarting", "leaked"))
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid
    assert not os.listdir(srv.run_dir), os.listdir(srv.run_dir)  # the run directory and its socket files


def test_sigterm_drains_and_stops_cleanly():
    """SIGTERM to the server process alone (a supervisor's stop), its SDK socket on ipc:// in its run directory
    (no tokenizer: token ids only, a faster start)."""
    srv = Serve("--load-format", "scripted", "--scripted-step-ms", "10", "--port", str(free_port()),
                "--shutdown-timeout", "20")
    try:
        srv.wait_for("OpenAI-compatible API at")
        srv.port = int(next(line for line in srv.lines if "OpenAI-compatible" in line).split(":")[-1].split("/")[0])
        drain_and_stop(srv, lambda: srv.proc.send_signal(signal.SIGTERM))
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)


def test_a_gateway_worker_that_dies_while_serving_is_started_again():
    """A gateway worker killed while serving (the OOM killer, a crash in native code): the server says so in one
    line and starts another, /health answers again (connections wait in the port's backlog meanwhile: the server
    holds it), /metrics counts it; the server still stops cleanly.  It used to stay dead: with one worker every
    connection hung unanswered."""
    srv = Serve("--load-format", "scripted", "--scripted-step-ms", "10", "--port", str(free_port()))
    try:
        srv.wait_for("OpenAI-compatible API at")
        port = int(next(line for line in srv.lines if "OpenAI-compatible" in line).split(":")[-1].split("/")[0])
        worker = next(pid for pid in srv.children()
                      if b"ipc.gateway.process" in open(f"/proc/{pid}/cmdline", "rb").read())
        os.kill(worker, signal.SIGKILL)
        srv.wait_for("gateway worker 0 exited with status -9; starting it again", timeout=10)
        assert request(port, "GET", "/health")[0] == 200  # answered by the new worker
        status, _, body = request(port, "GET", "/metrics")
        assert status == 200 and b'forerun:api_worker_restarts_total{model_name="scripted"} 1.0' in body, body[-2000:]
        assert worker not in srv.children() and len(srv.children()) == 2
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.finish() == 0 and not os.listdir(srv.run_dir)
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)


def test_a_gateway_worker_that_keeps_exiting_stops_the_server(monkeypatch, tmp_path):
    """More than MAX_WORKER_RESTARTS exits within a minute: the server is stopped (exit 1) rather than started again
    without end; each exit before that is one line and a restart."""
    from types import SimpleNamespace

    from scheduler_proc import launch

    class Exited:
        pid, returncode = 12345, 1

        def poll(self):
            return 1

    ready = tmp_path / "gateway-0.ready"
    ready.write_text("")
    restarts = []
    gateways = SimpleNamespace(configs=[SimpleNamespace(ready_file=str(ready))], procs=[Exited()],
                               restart=lambda i: restarts.append(i))
    server, failed, killed = SimpleNamespace(api_worker_restarts=0), threading.Event(), []
    monkeypatch.setattr(launch, "WATCH_INTERVAL_S", 0.001)
    monkeypatch.setattr(launch.os, "kill", lambda pid, sig: killed.append(sig))
    launch._watch_gateways(gateways, server, threading.Event(), failed)
    assert restarts == [0] * launch.MAX_WORKER_RESTARTS and server.api_worker_restarts == launch.MAX_WORKER_RESTARTS
    assert failed.is_set() and killed == [signal.SIGTERM]


def test_ctrl_c_drains_and_stops_cleanly(server):
    """SIGINT to the process group (a terminal's Ctrl-C) with streams in flight: /health 503 and new requests
    503 + Retry-After while draining, the streams finish, one line per step, no traceback, exit 0, nothing left."""
    drain_and_stop(server, lambda: os.killpg(server.proc.pid, signal.SIGINT))
