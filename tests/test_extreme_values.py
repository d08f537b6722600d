"""Extreme values over every field of every client message, as raw frames, against the real model server.

Each value is one the wire can carry (msgpack: int64/uint64, float64, any string): int64/uint64
limits, NaN, infinities, float32 overflow (1e39), denormals, empty and huge strings, wrong types.
Every invalid one must get an ``Error`` naming its field; every valid one must run; a normal
request sent after each must complete; the server must end with every block and slot free.
The Generate cases are sent in one batch (each followed by a normal request) to keep this fast.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import msgspec
import pytest

from ipc import protocol as p
from ipc.client import Client
from ipc.client.raw import RawConnection
from tests.server_proc import ROOT, assert_no_leak, wait_idle

U64, I64_MIN, I64_MAX = 2**64 - 1, -(2**63), 2**63 - 1
NAN, INF = math.nan, math.inf
BAD_FLOATS = [NAN, INF, -INF, 1e39, -1e39, 1.7976931348623157e308]
TINY_FLOATS = [1e-45, 5e-324, -0.0]


def sampling_cases(vocab: int, ctx: int) -> list[tuple[str, object, bool]]:
    """(field, value, valid) for every SamplingParams field."""
    cases: list[tuple[str, object, bool]] = []
    add = lambda f, vals, ok: cases.extend((f, v, ok) for v in vals)  # noqa: E731
    add("max_tokens", [U64, 2**63, I64_MAX, I64_MIN, -1, 0, ctx, 1.5, NAN, "1", None], False)
    add("max_tokens", [1], True)
    add("temperature", [U64, 2**63, I64_MIN, -1, 1e4 + 1, "0", None] + BAD_FLOATS, False)
    add("temperature", [0, 1e4, 0.7] + TINY_FLOATS, True)
    add("top_k", [U64, 2**63, I64_MIN, -2, 1.5, NAN, INF], False)
    add("top_k", [-1, 0, 1, vocab, vocab + 1, I64_MAX], True)  # the vocabulary or more: no top-k, as in vLLM
    add("top_p", [U64, I64_MIN, 0, -1, 1.0000001, 5e-324, -0.0] + BAD_FLOATS, False)
    add("top_p", [1, 0.5, 1e-45], True)
    add("min_p", [U64, I64_MIN, -1, 1.5] + BAD_FLOATS, False)
    add("min_p", [0, 1] + TINY_FLOATS, True)
    add("seed", [U64, 2**63, I64_MIN, -1, 1.5, NAN, "7"], False)
    add("seed", [I64_MAX, 0, None], True)
    add("stop_token_ids", [[U64], [I64_MIN], [vocab], [-1], [0] * (p.MAX_STOP_TOKEN_IDS + 1), [1.5], [NAN], 5], False)
    add("stop_token_ids", [[], [vocab - 1], [0] * p.MAX_STOP_TOKEN_IDS], True)
    add("ignore_eos", [1, 0, "true", None, NAN], False)
    add("ignore_eos", [True], True)
    add("bogus", [1], False)
    return cases


def top_cases(vocab: int, ctx: int) -> list[tuple[str, object, bool]]:
    """(field, value, valid) for Generate's own fields (the request id is fixed by the caller)."""
    return [("prompt_token_ids", v, False) for v in
            [[], [U64], [I64_MIN], [vocab], [-1], [1.5], [NAN], [1] * ctx, [1] * 2_000_000, "abc", None]] + [
            ("prompt_token_ids", [vocab - 1, 0], True), ("bogus", 1, False)]


def generate_frame(request_id: object, *, prompt: object = (1, 2, 3), **sampling: object) -> bytes:
    sampling.setdefault("max_tokens", 1)
    return msgspec.msgpack.encode({"type": "generate", "request_id": request_id, "prompt_token_ids": list(prompt)
                                   if isinstance(prompt, tuple) else prompt, "sampling": sampling})


def names(err: p.Error, field: str) -> bool:
    """The error names ``field`` (or an element of it: ``prompt_token_ids[0]``)."""
    return err.field == field or (err.field or "").startswith(field + "[")


async def expect_error(conn: RawConnection, frame: bytes, field: str) -> p.Error:
    await conn.send_frames(frame)
    reply = await conn.recv()
    assert isinstance(reply, p.Error), (field, reply)
    assert names(reply, field) and reply.code in ("invalid_request", "protocol"), (field, reply)
    return reply


async def sweep_hello(address: str) -> None:
    cases = [("protocol_version", v) for v in (U64, I64_MIN, -1, 1.5, NAN, "1", None)]
    cases += [("client_name", v) for v in ("x" * 257, "x" * 1_000_000, 5, None)]
    cases += [("batch_deltas", v) for v in (1, "yes", None)]
    cases += [("heartbeat_s", v) for v in [U64, I64_MIN, -1, 0.01, 60.5, "1", None] + BAD_FLOATS + TINY_FLOATS[:2]]
    cases += [("bogus", 1)]
    for field, value in cases:
        async with RawConnection(address, timeout=10) as conn:
            hello = {"type": "hello", "protocol_version": p.PROTOCOL_VERSION, field: value}
            await expect_error(conn, msgspec.msgpack.encode(hello), field)
            # The same connection can still say a proper Hello.
            assert isinstance(await conn.hello("after-bad-hello"), p.ServerInfo)
    for hb in (0, 0.05, 60, 1):
        async with RawConnection(address, timeout=10) as conn:
            await conn.send(p.Hello(p.PROTOCOL_VERSION, "", heartbeat_s=hb))
            assert isinstance(await conn.recv(), p.ServerInfo), hb


async def sweep_small_messages(conn: RawConnection) -> None:
    """Abort, GetStats, Ping and unknown types: each bad one answered with an Error naming the field."""
    for value in ("", "x" * (p.MAX_REQUEST_ID_LEN + 1), "x" * 1_000_000, U64, NAN, None, ["a"]):
        await expect_error(conn, msgspec.msgpack.encode({"type": "abort", "request_id": value}), "request_id")
    await expect_error(conn, msgspec.msgpack.encode({"type": "abort"}), "request_id")
    await expect_error(conn, msgspec.msgpack.encode({"type": "abort", "request_id": "a", "x": 1}), "x")
    await expect_error(conn, msgspec.msgpack.encode({"type": "get_stats", "bogus": U64}), "bogus")
    await expect_error(conn, msgspec.msgpack.encode({"type": "ping", "bogus": NAN}), "bogus")
    for frame in (msgspec.msgpack.encode({"type": "nope"}), msgspec.msgpack.encode({}), b"",
                  msgspec.msgpack.encode(U64), msgspec.msgpack.encode("x" * 100_000)):
        await conn.send_frames(frame)
        reply = await conn.recv()
        assert isinstance(reply, p.Error) and reply.code in ("invalid_request", "bad_frame"), reply
    assert isinstance(await conn.stats(), p.ServerStats)


async def sweep_request_ids(conn: RawConnection) -> None:
    for value in ("", "x" * (p.MAX_REQUEST_ID_LEN + 1), "x" * 1_000_000, U64, I64_MIN, NAN, None):
        await expect_error(conn, generate_frame(value), "request_id")
    run = await conn.run_requests([p.Generate("é" * p.MAX_REQUEST_ID_LEN, [1, 2], p.SamplingParams(max_tokens=1))])
    assert len(run.finished) == 1


async def sweep_generate(conn: RawConnection, vocab: int, ctx: int) -> tuple[int, int]:
    """Every Generate case in one batch, each followed by a normal request; returns (refused, ran)."""
    expected: dict[str, tuple[str, object, bool]] = {}
    frames = []
    cases = [(f"sampling.{f}", v, ok) for f, v, ok in sampling_cases(vocab, ctx)] + top_cases(vocab, ctx)
    for i, (field, value, ok) in enumerate(cases):
        rid = f"case{i}"
        if field.startswith("sampling."):
            frames.append(generate_frame(rid, **{field.split(".", 1)[1]: value}))
        elif field == "prompt_token_ids":
            frames.append(generate_frame(rid, prompt=value))
        else:
            frames.append(msgspec.msgpack.encode({"type": "generate", "request_id": rid,
                                                  "prompt_token_ids": [1], field: value}))
        expected[rid] = (field, value, ok)
        frames.append(generate_frame(f"ok{i}", temperature=0))
        expected[f"ok{i}"] = ("", None, True)
    for frame in frames:
        await conn.send_frames(frame)
    refused = ran = 0
    outcome: dict[str, object] = {}
    while len(outcome) < len(expected):
        msg = await conn.recv()
        if isinstance(msg, p.Error):
            assert msg.request_id in expected, msg
            outcome[msg.request_id] = msg
        elif isinstance(msg, p.Finished):
            outcome[msg.request_id] = msg
    for rid, (field, value, ok) in expected.items():
        got = outcome[rid]
        shown = repr(value)[:60]
        if ok:
            assert isinstance(got, p.Finished) and got.reason in ("length", "stop"), (field, shown, got)
            ran += 1
        else:
            assert isinstance(got, p.Error), (field, shown, got)
            assert got.code == "invalid_request" and names(got, field), (field, shown, got)
            refused += 1
    return refused, ran


async def test_extreme_values_over_every_field_of_every_message(model_server):
    srv = model_server(1)
    await sweep_hello(srv.address)
    async with RawConnection(srv.address, timeout=60) as conn:
        info = await conn.hello("sweep", batch_deltas=True)
        await sweep_small_messages(conn)
        await sweep_request_ids(conn)
        refused, ran = await sweep_generate(conn, info.vocab_size, info.max_model_len)
    assert refused > 80 and ran > 100, (refused, ran)  # ran: the valid cases and one normal request each
    with Client(srv.address, timeout=120) as client:
        assert client.generate(prompt_token_ids=[1, 2, 3], max_tokens=3, temperature=0.0).completion_tokens == 3
    assert_no_leak(await wait_idle(srv.address))


async def test_server_gone_when_the_server_is_killed_mid_stream(servers):
    """SIGKILL of the scheduler (scripted executor): the SDK fails the stream with ServerGoneError within 5 s."""
    import time

    from ipc.client import AsyncClient, ServerGoneError

    srv = servers("--load-format", "scripted", "--scripted-step-ms", "20")
    async with AsyncClient(srv.address, timeout=120) as client:
        if not client.server_info.server_id:
            pytest.skip("this server predates heartbeats (no server_id, no Pong)")
        stream = client.stream(prompt_token_ids=[1, 2, 3], max_tokens=4000, ignore_eos=True,
                               detokenize=False)
        assert (await stream.next_chunk()).token_ids
        srv.proc.kill()
        t0 = time.monotonic()
        with pytest.raises(ServerGoneError):
            while await asyncio.wait_for(stream.next_chunk(), 10) is not None:
                pass
        assert time.monotonic() - t0 < 20  # HEARTBEAT_MISSES x 1 s, not the 60 s timeout (any load)


def test_forerun_chat_prints_one_line_for_expected_failures(model_server, tmp_path):
    def chat(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "scheduler_proc.launch", "chat", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    nothing = chat("--address", f"ipc://{tmp_path}/nobody.sock", "--timeout", "1", "hi")
    assert nothing.returncode == 1 and "Traceback" not in nothing.stderr
    assert nothing.stderr.strip().splitlines() == [
        f"forerun: [server_gone] no server answered at ipc://{tmp_path}/nobody.sock within 1 s"]
    bad = chat("--address", model_server(1).address, "--max-tokens", "0", "hi")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("forerun: [invalid_request] --max-tokens must be at least 1"), bad.stderr


def test_a_top_k_of_the_vocabulary_or_more_is_no_top_k():
    """vLLM reads a top_k at or past the vocabulary as no top-k: the executor's slot gets 0 (off), as for -1."""
    from types import SimpleNamespace

    from scheduler_proc.outputs import slot_sampling

    def slot_top_k(top_k: int) -> int:
        req = SimpleNamespace(sampling=p.SamplingParams(top_k=top_k), seed=None, prompt=[1, 2], grammar=None)
        return slot_sampling(req, [0], vocab_size=100).top_k

    assert [slot_top_k(k) for k in (-1, 0, 1, 99, 100, 101, 2**63 - 1)] == [0, 0, 1, 99, 0, 0, 0]
