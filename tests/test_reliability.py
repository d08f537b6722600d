"""The server survives its executor, its clients and its operator, as real processes.

Scripted executor throughout (the model does not matter): its oracle says
exactly which tokens each request must get, across executor restarts.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from executor_proc.testing.scripted import ScriptedRunner, expected_output
from ipc import protocol as p
from ipc.client.raw import RawConnection
from tests.server_proc import ROOT, ServerProcess, assert_no_leak, python_path, run_dir, server_stats, wait_idle

PROMPT_LEN = 5
MAX_MODEL_LEN = 256



def _expected(seed: int, max_tokens: int) -> tuple[list[int], str]:
    script = ScriptedRunner(1, 1, 1, vocab_size=1000, eos_token_id=2)
    return expected_output(script.token_at, seed=seed, prompt_len=PROMPT_LEN, max_tokens=max_tokens,
                           max_model_len=MAX_MODEL_LEN, eos_token_ids=(2,))


def _prompt(seed: int) -> list[int]:
    return [10 + (seed + i) % 50 for i in range(PROMPT_LEN)]


def _pids(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def _assert_cleaned_up(srv: ServerProcess, tmpdir: str, pids: set[int]) -> None:
    """No process of the server alive, no socket file or run directory left behind."""
    assert srv.proc.wait(timeout=15) == 0, "".join(srv.log)
    assert not [pid for pid in pids if _alive(pid)]
    assert os.listdir(tmpdir) == [], os.listdir(tmpdir)


# --------------------------------------------------------------------------- chaos soak

NUM_REQUESTS = 2000
FAULTS = [signal.SIGKILL] * 3 + [signal.SIGSTOP] + [signal.SIGKILL] * 2


async def _chaos_client(address: str, rng: random.Random) -> tuple[dict, set, list]:
    """Send NUM_REQUESTS over ~15 s with random aborts; read until all have finished."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, p.Finished] = {}
    errors: list = []
    aborted: set[str] = set()
    async with RawConnection(address, timeout=60) as conn:
        await conn.hello("chaos", batch_deltas=True)

        async def send_all() -> None:
            for i in range(NUM_REQUESTS):
                rid = f"r{i}"
                tokens[rid] = []
                await conn.send(p.Generate(rid, _prompt(i), p.SamplingParams(
                    max_tokens=1 + i % 60, temperature=0.0, seed=i)))
                if rng.random() < 0.1:
                    aborted.add(rid)
                    asyncio.get_running_loop().call_later(  # the coroutine is made when it is due
                        rng.random() * 0.5, lambda rid=rid: asyncio.ensure_future(conn.send(p.Abort(rid))))
                if i % 20 == 19:
                    await asyncio.sleep(0.15)

        sender = asyncio.create_task(send_all())
        while len(finished) + len(errors) < NUM_REQUESTS:
            msg = await conn.recv()
            if isinstance(msg, p.TokenDeltas):
                for rid, ids in zip(msg.request_ids, msg.token_ids):
                    tokens[rid].extend(ids)
            elif isinstance(msg, p.Finished):
                tokens[msg.request_id].extend(msg.token_ids)
                finished[msg.request_id] = msg
            else:
                errors.append(msg)
        await sender
    return {rid: (tokens[rid], fin.reason) for rid, fin in finished.items()}, aborted, errors


async def _inject_faults(srv: ServerProcess) -> set[int]:
    """SIGKILL / SIGSTOP the executor, each time once a new one has run 30 steps; returns every executor pid."""
    seen: set[int] = set()
    for fault in FAULTS:
        while True:
            await asyncio.sleep(0.3)
            pids = _pids(srv.proc.pid)
            if len(pids) == 1 and pids[0] not in seen:
                steps = (await server_stats(srv.address)).steps
                await asyncio.sleep(0.5)
                if (await server_stats(srv.address)).steps >= steps + 30:
                    break
        seen.add(pids[0])
        os.kill(pids[0], fault)
    return seen


async def _chaos(srv: ServerProcess) -> tuple[dict, set, list, set[int]]:
    faults = asyncio.create_task(_inject_faults(srv))
    results, aborted, errors = await _chaos_client(srv.address, random.Random(8))
    pids = await faults
    return results, aborted, errors, pids


def test_chaos_soak_executor_killed_and_stopped():
    tmp = run_dir()
    srv = ServerProcess("--load-format", "scripted", "--scripted-step-ms", "1", "--max-num-seqs", "32",
                        "--num-kv-blocks", "160", "--block-size", "4", "--max-model-len", str(MAX_MODEL_LEN),
                        "--max-num-batched-tokens", "64", "--executor-hang-timeout", "2", "--max-restarts", "10",
                        "--debug-checks", tmpdir=tmp, timeout=120)
    try:
        results, aborted, errors, pids = asyncio.run(asyncio.wait_for(_chaos(srv), 170))
        assert errors == []
        for i in range(NUM_REQUESTS):
            rid = f"r{i}"
            want_tokens, want_reason = _expected(i, 1 + i % 60)
            got_tokens, reason = results[rid]
            if rid in aborted and reason == "abort":
                assert got_tokens == want_tokens[:len(got_tokens)], rid
            else:
                assert (got_tokens, reason) == (want_tokens, want_reason), rid
        stats = asyncio.run(wait_idle(srv.address))
        assert_no_leak(stats)
        assert stats.preemptions > 0  # the restarts re-queued running requests
        pids.update(_pids(srv.proc.pid))
    finally:
        srv.stop()
    log = "".join(srv.log) + srv.proc.stdout.read()
    assert log.count("executor restarted in") == len(FAULTS), log
    assert "hang timeout" in log
    _assert_cleaned_up(srv, tmp, pids)


# --------------------------------------------------------------------------- clients that vanish

CLIENT = r"""
import sys, time, zmq
from ipc import protocol as p
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send(p.encode(p.Hello(p.PROTOCOL_VERSION, "vanishing", batch_deltas=True, heartbeat_s=0.5)))
for i in range(4):
    sock.send(p.encode(p.Generate(f"g{i}", [5, 6, 7], p.SamplingParams(max_tokens=3000, seed=i))))
while True:
    sock.send(p.encode(p.Ping()))
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        if sock.poll(20):
            sock.recv()
"""


async def _wait_running(address: str, predicate, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        s = await server_stats(address)
        if predicate(s):
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {s}")


def test_vanished_clients_free_their_slots_and_blocks():
    tmp = run_dir()
    srv = ServerProcess("--load-format", "scripted", "--scripted-step-ms", "2", "--max-num-seqs", "8",
                        "--num-kv-blocks", "2048", "--block-size", "16", "--max-model-len", "4096",
                        "--client-send-hwm", "1000", tmpdir=tmp, timeout=120)
    env = dict(os.environ, PYTHONPATH=python_path())
    clients = [subprocess.Popen([sys.executable, "-c", CLIENT, srv.address], env=env) for _ in range(2)]
    try:
        asyncio.run(_wait_running(srv.address, lambda s: s.num_running == 8, 30))
        os.kill(clients[0].pid, signal.SIGSTOP)  # alive and connected, but silent: the heartbeat notices
        asyncio.run(_wait_running(srv.address, lambda s: s.num_running == 4 and not s.num_draining, 5))
        clients[1].kill()  # gone: its connection drops
        asyncio.run(_wait_running(srv.address, lambda s: s.num_free_kv_blocks == s.num_kv_blocks
                                  and s.num_free_slots == s.num_slots, 5))
        asyncio.run(_slow_reader(srv.address))
    finally:
        for c in clients:
            c.kill()
            c.wait()
        srv.stop()


async def _slow_reader(address: str) -> None:
    """A client that stops reading has its requests aborted, and is told once it reads again."""
    async with RawConnection(address, timeout=10) as conn:
        await conn.hello("slow", batch_deltas=False)
        for i in range(8):  # 4,000 messages a second: the pipe and the socket buffers fill in about 3 s
            await conn.send(p.Generate(f"s{i}", [5, 6, 7], p.SamplingParams(max_tokens=4000, seed=i)))
        await _wait_running(address, lambda s: s.num_running == 8, 5)
        await _wait_running(address, lambda s: s.num_running == 0 and s.num_free_slots == s.num_slots, 7)
        errors = set()
        while len(errors) < 8:
            msg = await conn.recv()
            if isinstance(msg, p.Error):
                assert msg.code == "slow_reader", msg
                errors.add(msg.request_id)


# --------------------------------------------------------------------------- operator

def _serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "scheduler_proc.launch", "serve", "--load-format", "scripted", "--quiet", *args]


def _refused(*args: str, expect: str) -> None:
    """`forerun serve` exits 1 at once with one clear line on stderr, no traceback."""
    run = subprocess.run(_serve_cmd(*args), capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=python_path()))
    assert run.returncode == 1, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0] and "Traceback" not in run.stderr, run.stderr
    assert "ready at" not in run.stdout


async def _sigterm_clients(srv: ServerProcess) -> dict:
    async with RawConnection(srv.address, timeout=10) as conn:
        await conn.send(p.Ping())
        assert isinstance(await conn.recv(), p.Pong)
        await conn.hello("sigterm", batch_deltas=True)
        for i in range(4):
            await conn.send(p.Generate(f"long{i}", [5, 6, 7], p.SamplingParams(max_tokens=3000, seed=i)))
            await conn.send(p.Generate(f"short{i}", [5, 6, 7], p.SamplingParams(max_tokens=60, seed=i)))
        await conn.recv()
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        await conn.send(p.Generate("late", [5, 6, 7], p.SamplingParams(max_tokens=5)))
        ends = {}
        while len(ends) < 9:
            msg = await conn.recv()
            if isinstance(msg, (p.Finished, p.Error)):
                ends[msg.request_id] = (msg, time.monotonic() - t0)
    return ends


def test_sigterm_with_stderr_gone_still_stops_the_server():
    """The shell or supervisor that started the server is gone (its stdout/stderr pipe has no reader) and
    then the executor dies: the server restarts it and SIGTERM still stops it, everything cleaned up.
    The restart's line on stderr used to raise BrokenPipeError inside the supervising task, which died:
    no restart, no shutdown check, the server ignored SIGTERM forever."""
    tmp = run_dir()
    srv = ServerProcess("--load-format", "scripted", "--scripted-step-ms", "2", "--max-num-seqs", "4",
                        "--num-kv-blocks", "64", "--block-size", "16", tmpdir=tmp, timeout=120)
    pids = {srv.proc.pid, *_pids(srv.proc.pid)}
    srv.proc.stdout.close()  # the only reader of the server's stdout and stderr
    os.kill(srv.executor_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not [pid for pid in _pids(srv.proc.pid) if pid not in pids]:
        time.sleep(0.2)  # the restarted executor
    assert [pid for pid in _pids(srv.proc.pid) if pid not in pids], "no executor restart"
    pids.update(_pids(srv.proc.pid))
    time.sleep(1.0)
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        srv.stop()
        raise AssertionError("the server ignored SIGTERM once its stderr was gone") from None
    _assert_cleaned_up(srv, tmp, pids)


def test_version_flag_prints_the_installed_version():
    from ipc.version import forerun_version

    run = subprocess.run([sys.executable, "-m", "scheduler_proc.launch", "--version"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=dict(os.environ, PYTHONPATH=python_path()))
    assert run.returncode == 0 and run.stdout.strip() == f"forerun {forerun_version()}", run
    assert forerun_version() != "unknown"  # the README's set-up installs the package


def test_sigterm_the_moment_the_server_is_ready_stops_it_cleanly():
    """A supervisor that stops the server as soon as it says "ready" (the signal lands before the event loop has
    installed its handlers): the graceful shutdown all the same, exit 0, no traceback or asyncio warning."""
    tmp = run_dir()
    srv = ServerProcess("--load-format", "scripted", tmpdir=tmp, timeout=120)
    srv.proc.send_signal(signal.SIGTERM)
    rest = srv.proc.communicate(timeout=30)[0]
    out = "".join(srv.log) + rest
    assert srv.proc.returncode == 0, out
    assert "forerun: stopped" in out and not any(w in out for w in ("Traceback", "Warning", "never awaited")), out


def _drain_after_a_group_sigterm(*flags: str) -> str:
    """A scripted server in its own session, one request of 200 tokens running, then ``kill -TERM -PGID``: the
    request must end with all its tokens and the server stop cleanly; its whole output."""
    srv = ServerProcess("--load-format", "scripted", "--scripted-step-ms", "5", *flags, tmpdir=run_dir(),
                        timeout=120, new_session=True)

    async def drained() -> p.Finished | p.Error:
        async with RawConnection(srv.address, timeout=30) as conn:
            await conn.hello("group-sigterm", batch_deltas=True)
            await conn.send(p.Generate("r", [5, 6, 7], p.SamplingParams(max_tokens=200, ignore_eos=True)))
            await conn.recv()
            os.killpg(srv.proc.pid, signal.SIGTERM)
            while not isinstance(msg := await conn.recv(), (p.Finished, p.Error)):
                pass
            return msg

    end = asyncio.run(drained())
    out = "".join(srv.log) + srv.proc.communicate(timeout=60)[0]
    assert isinstance(end, p.Finished) and end.reason == "length" and end.completion_tokens == 200, (end, out)
    assert srv.proc.returncode == 0 and "forerun: stopped" in out, out
    return out


def test_sigterm_to_the_whole_process_group_drains_without_restarting_the_executor():
    """``kill -TERM -PGID`` (a supervisor stopping the group): the executor ignores it as it does SIGINT, the server
    drains its running request to the end and stops; the executor was once killed by it and restarted mid-drain."""
    out = _drain_after_a_group_sigterm()
    assert "restarting" not in out, out


def test_sigterm_to_the_whole_process_group_drains_data_parallel_replicas_too():
    """``kill -TERM -PGID`` with two replicas: the replicas, in sessions of their own, hear it from their router
    only (once: a second SIGTERM means at once), so a running request still drains to its end."""
    _drain_after_a_group_sigterm("--data-parallel-size", "2")


def test_past_the_restart_limit_every_request_is_told_the_limit():
    """The executor dies twice in a row with the same requests in flight, the second death past --max-restarts:
    every live request gets the fail-stop's reason (the limit, the server shutting down), not the one-request
    "in flight at two executor failures in a row" it once got first."""
    srv = ServerProcess("--load-format", "scripted", "--scripted-step-ms", "300", "--max-restarts", "1",
                        tmpdir=run_dir(), timeout=120)

    async def run() -> list:
        async with RawConnection(srv.address, timeout=60) as conn:
            await conn.hello("limit", batch_deltas=True)
            for i in range(3):
                await conn.send(p.Generate(f"r{i}", [5, 6, 7], p.SamplingParams(max_tokens=500, ignore_eos=True)))
            await conn.recv()
            first = srv.executor_pid()
            os.kill(first, signal.SIGKILL)
            while (await server_stats(srv.address)).executor_restarts < 1:  # the new one is up, its step in flight
                await asyncio.sleep(0.02)
            os.kill(srv.executor_pid(), signal.SIGKILL)  # before its first 300 ms step is back
            ends = []
            while len(ends) < 3:
                msg = await conn.recv()
                if isinstance(msg, (p.Finished, p.Error)):
                    ends.append(msg)
            return ends

    try:
        ends = asyncio.run(run())
    finally:
        out = "".join(srv.log) + srv.proc.communicate(timeout=60)[0]
    assert all(isinstance(e, p.Error) and e.code == "executor_failed" for e in ends), (ends, out)
    assert all("more than 1 executor restarts" in e.message and "not retried" not in e.message for e in ends), ends


def test_sigterm_second_server_and_startup_errors():
    tmp = run_dir()
    srv = ServerProcess("--load-format", "scripted", "--scripted-step-ms", "5", "--max-num-seqs", "8",
                        "--num-kv-blocks", "1200", "--block-size", "16", "--max-model-len", "4096",
                        "--shutdown-timeout", "2", tmpdir=tmp, timeout=120)
    pids = {srv.proc.pid, *_pids(srv.proc.pid)}
    _refused("--address", srv.address, expect="already serving")
    ends = asyncio.run(_sigterm_clients(srv))
    assert ends["late"][0].code == "shutting_down"
    for i in range(4):
        fin, t = ends[f"short{i}"]
        # 60 steps of 5 ms finish well inside the 2 s drain; 3,000 are cut at its end (the upper bound leaves a
        # loaded machine room: it only tells the drain's deadline from running to the end, 15 s).
        assert isinstance(fin, p.Finished) and fin.completion_tokens == 60, ends
        err, t = ends[f"long{i}"]
        assert isinstance(err, p.Error) and err.code == "shutting_down" and 1.5 < t < 8, ends
    _assert_cleaned_up(srv, tmp, pids)

    # A socket file nobody listens on (a SIGKILLed server's) is replaced; other start-up errors are one line.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(srv.address[len("ipc://"):])
    stale.close()
    again = ServerProcess("--load-format", "scripted", tmpdir=tmp, timeout=120, address=srv.address)
    again.stop()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    _refused("--address", f"tcp://127.0.0.1:{busy.getsockname()[1]}", expect="in use")
    busy.close()
    _refused("--address", "udp://x", expect="must start with ipc:// or tcp://")
    _refused("--address", "ipc:///tmp/" + "x" * 120, expect="longer than 107 bytes")
    _refused("--address", "ipc:///nonexistent-dir/s.sock", expect="no such directory")
    _refused("--port", "70000", expect="--port must be in [0, 65535], got 70000")
    _refused("--device", "tpu", expect="device must be cpu, cuda or cuda:N, got 'tpu'")
    _refused("--step-log", "/nonexistent-dir/steps.jsonl", expect="--step-log /nonexistent-dir/steps.jsonl: No such")
    _refused("--load-format", "dummy", "--model", os.path.join(ROOT, "scripts", "configs", "smollm2-135m"),
             "--tokenizer", "/nonexistent-dir", expect="--tokenizer '/nonexistent-dir' does not exist")


# --------------------------------------------------------------------------- flood and overload

def test_flood_does_not_stall_another_clients_stream(tmp_path):
    out = tmp_path / "flood.json"
    run = subprocess.run([sys.executable, "scripts/bench_reliability.py", "flood", "--frames", "200000",
                          "--json", str(out)],
                         capture_output=True, text=True, timeout=150, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=python_path()))
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["frames_sent"] == 200000
    assert result["stream_ok"]
    assert result["max_gap_during_flood_s"] < 1.0, result
    assert result["overloaded_refusals"] == result["overload_extra"], result


def test_max_waiting_counts_the_requests_no_free_slot_takes():
    """Ten requests at once on two free slots and ``--max-waiting 3``: five are taken (two run, three wait), five
    refused as overloaded (the requests the free slots were about to take counted as waiting: three taken)."""
    srv = ServerProcess("--load-format", "scripted", "--scripted-step-ms", "60000", "--max-num-seqs", "2",
                        "--max-waiting", "3", "--shutdown-timeout", "0", tmpdir=run_dir("mw"), timeout=120)

    async def flood() -> list:
        async with RawConnection(srv.address, timeout=30) as conn:
            await conn.hello("mw", batch_deltas=True)
            for i in range(10):
                await conn.send(p.Generate(f"w{i}", [5, 6, 7, 8], p.SamplingParams(max_tokens=4)))
            refused = []
            while len(refused) < 5:
                msg = await conn.recv()
                if isinstance(msg, p.Error) and msg.code == "overloaded":
                    refused.append(msg.request_id)
            stats = await conn.stats()
            return refused, stats.num_running + stats.num_waiting
    try:
        refused, taken = asyncio.run(flood())
    finally:
        srv.stop()
    assert sorted(refused) == [f"w{i}" for i in range(5, 10)] and taken == 5, (refused, taken)


def test_triton_kernels_on_the_cpu_run_in_triton_s_interpreter(tmp_path, monkeypatch):
    """`--kernels triton --device cpu` serves with no TRITON_INTERPRET in the environment: the executor chooses
    Triton's interpreter before the kernels are defined (without it every step failed: Triton found no GPU driver)."""
    from ipc.client import AsyncClient
    from ipc.client_protocol import SamplingParams
    from tests.test_gpu_fastpath import write_config

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = write_config(tmp_path, layers=1)
    srv = ServerProcess("--model", model, "--load-format", "dummy", "--device", "cpu", "--kernels", "triton",
                        "--max-num-seqs", "2", tmpdir=run_dir(), timeout=120)

    async def generate():
        async with AsyncClient(srv.address) as client:
            return await client.generate(prompt_token_ids=[5, 6, 7], detokenize=False,
                                         sampling=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))

    try:
        out = asyncio.run(generate())
        assert len(out.token_ids) == 3 and out.finish_reason == "length", out
    finally:
        srv.stop()
