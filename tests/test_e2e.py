"""End to end: real scheduler and executor processes, the default model, the SDK.

At pipeline depth 1, the default.  Depth 0 (and 2) give the same tokens as depth 1, greedy and seeded, through
preemption, stop strings and aborts (tests/test_lifecycle_model.py), so the parity with HF here holds for them too
without a server and a run each."""

from __future__ import annotations

import asyncio
import math
import os
import signal

import msgspec
import pytest

from ipc import protocol as p
from ipc.client import AsyncClient, Client, ForerunError
from ipc.client.raw import RawConnection
from tests.conftest import CHAT_PROMPTS
from tests.server_proc import assert_no_leak, server_stats, wait_idle

pytestmark = pytest.mark.slow


async def test_greedy_parity_with_hf_concurrent(model_server, chat_prompt_ids, hf_greedy):
    srv = model_server(1)
    async with AsyncClient(srv.address, timeout=300) as c:
        results = await asyncio.gather(*[
            c.generate(prompt_token_ids=ids, max_tokens=16, temperature=0.0) for ids in chat_prompt_ids])
        for i, (r, ref) in enumerate(zip(results, hf_greedy)):
            assert r.token_ids == ref, f"prompt {i} {CHAT_PROMPTS[i]!r}: {r.text!r}"
            assert r.finish_reason == ("stop" if ref[-1] == 2 else "length")
            assert r.completion_tokens == len(ref) and r.prompt_tokens == len(chat_prompt_ids[i])
        assert_no_leak(await wait_idle(srv.address))


async def test_seeded_sampling_independent_of_batch(model_server, chat_prompt_ids):
    srv = model_server(1)
    kw = dict(max_tokens=16, temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, seed=1234, ignore_eos=True)
    async with AsyncClient(srv.address, timeout=300) as c:
        alone = await c.generate(prompt_token_ids=chat_prompt_ids[0], **kw)
        others = [c.generate(prompt_token_ids=chat_prompt_ids[i], max_tokens=16, temperature=1.0, seed=i,
                             ignore_eos=True) for i in range(1, 5)]
        batched, again, *_ = await asyncio.gather(  # the same prompt with the next seed, in the same batch
            c.generate(prompt_token_ids=chat_prompt_ids[0], **kw),
            c.generate(prompt_token_ids=chat_prompt_ids[0], **{**kw, "seed": 1235}), *others)
    assert alone.token_ids == batched.token_ids
    assert len(alone.token_ids) == 16
    assert again.token_ids != alone.token_ids  # the seed matters


async def test_streaming_and_text(model_server):
    srv = model_server(1)
    async with AsyncClient(srv.address, timeout=300) as c:
        chunks = []
        stream = c.stream(messages=[{"role": "user", "content": "What is the capital of France?"}],
                          max_tokens=32, temperature=0.0)
        async for chunk in stream:
            chunks.append(chunk)
        result = stream.result
    assert len(chunks) >= 2
    assert "".join(ch.text_delta for ch in chunks) == result.text
    assert "Paris" in result.text
    assert result.finish_reason == "stop" and result.token_ids[-1] == 2


async def test_abort_mid_stream_others_unaffected(model_server, chat_prompt_ids, hf_greedy):
    srv = model_server(1)
    async with AsyncClient(srv.address, timeout=300) as c:
        victim = c.stream(prompt_token_ids=chat_prompt_ids[1], max_tokens=200, temperature=0.0, ignore_eos=True)
        others = [asyncio.create_task(c.generate(prompt_token_ids=chat_prompt_ids[i], max_tokens=16, temperature=0.0))
                  for i in (2, 3, 4)]
        n = 0
        async for _ in victim:
            n += 1
            if n == 5:
                await c.abort(victim.request_id)
        assert victim.result.finish_reason == "abort"
        assert 5 <= victim.result.completion_tokens < 200
        done = await asyncio.gather(*others)
        for i, r in zip((2, 3, 4), done):
            assert r.token_ids == hf_greedy[i]
        assert_no_leak(await wait_idle(srv.address))


async def test_max_tokens_and_eos_finishes(model_server, chat_prompt_ids, hf_greedy):
    srv = model_server(1)
    first = hf_greedy[0][0]
    async with AsyncClient(srv.address, timeout=300) as c:  # at once: they share steps (outputs are batch-invariant)
        short, long, stopped = await asyncio.gather(
            c.generate(prompt_token_ids=chat_prompt_ids[0], max_tokens=3, temperature=0.0),
            c.generate(prompt_token_ids=chat_prompt_ids[0], max_tokens=200, temperature=0.0),
            c.generate(prompt_token_ids=chat_prompt_ids[0], max_tokens=20, temperature=0.0, stop_token_ids=[first]))
        r = short
        assert r.finish_reason == "length" and r.token_ids == hf_greedy[0][:3]
        r = long
        assert r.finish_reason == "stop" and r.token_ids[-1] == 2
        r = stopped
        assert r.finish_reason == "stop" and r.token_ids == [first]


@pytest.fixture(scope="module")
def small_pool_server(module_servers):
    """A KV pool of 16 blocks of 16 (the preemption and executor-restart tests share it)."""
    return module_servers("--num-kv-blocks", "16", "--max-num-seqs", "12", "--debug-checks")


@pytest.fixture(scope="module")
def preempted_and_killed(small_pool_server, chat_prompt_ids):
    """One run for the preemption and executor-restart tests below.

    8 requests of ~37 + 16 tokens, EOS ignored (each one crosses into a 4th block), need ~25 blocks of 16 (the chat
    opening's first block shared); 16 blocks force preemption (their prompts alone fill them: the running requests'
    decode blocks must come from preempted ones, whatever the arrival times).  Once the prompts are prefilled and
    some tokens streamed, the executor is SIGKILLed: the scheduler restarts it and recomputes the requests it held,
    and the pool still preempts afterwards.  The preemption test checks HF's greedy tokens (up to HF's EOS, as EOS
    is ignored here), that nothing leaked and that preemptions were counted; the restart test the same tokens and a
    new executor.  One run serves both: a restart in a full, preempting pool is the harder case of the two."""
    srv = small_pool_server

    async def run():
        before = await server_stats(srv.address)
        async with AsyncClient(srv.address, timeout=300) as c:
            tasks = [asyncio.create_task(c.generate(prompt_token_ids=ids, max_tokens=16, temperature=0.0,
                                                    ignore_eos=True)) for ids in chat_prompt_ids[:8]]
            while (await server_stats(srv.address)).steps < before.steps + 8:  # prompts prefilled, tokens streamed
                await asyncio.sleep(0.05)
            old = srv.executor_pid()
            os.kill(old, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        return dict(before=before, results=results, old=old, new=srv.executor_pid(), alive=srv.proc.poll() is None,
                    idle=await wait_idle(srv.address))

    return asyncio.run(run())


def test_preemption_small_kv_pool_same_greedy_output(preempted_and_killed, hf_greedy):
    # HF's tokens up to its EOS must come first.
    run = preempted_and_killed
    for r, ref in zip(run["results"], hf_greedy):
        assert r.token_ids[:len(ref)] == ref and len(r.token_ids) == 16
    s = run["idle"]
    assert_no_leak(s)
    assert s.preemptions > run["before"].preemptions, s  # the pool really was too small


BAD_SAMPLING = [
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 10**6), ("temperature", -0.1),
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
    ("min_p", -0.1), ("min_p", 1.5), ("top_k", -2), ("stop_token_ids", [10**7]),
]


async def test_bad_input_each_gets_clear_error_and_server_keeps_serving(model_server, chat_prompt_ids):
    srv = model_server(1)
    good = chat_prompt_ids[0]
    async with AsyncClient(srv.address, timeout=120) as c:
        cases = [
            (dict(prompt_token_ids=[]), "prompt_token_ids"),
            (dict(prompt_token_ids=[1] * 9000), "prompt_token_ids"),
            (dict(prompt_token_ids=[1, 2, 49152]), "prompt_token_ids"),
            (dict(prompt_token_ids=[1, -3]), "prompt_token_ids"),
        ] + [(dict(prompt_token_ids=good, **{k: v}), f"sampling.{k}") for k, v in BAD_SAMPLING]
        for kwargs, field in cases:
            with pytest.raises(ForerunError) as e:
                await c.generate(max_tokens=kwargs.pop("max_tokens", 4), **kwargs)
            assert e.value.field == field, (kwargs, e.value)
            assert e.value.code == "invalid_request"
            ok = await c.generate(prompt_token_ids=good, max_tokens=1, temperature=0.0)  # admitted, run, finished
            assert ok.completion_tokens == 1

    # Raw frames: unknown fields, garbage, multi-frame, oversized.
    async with RawConnection(srv.address, timeout=10) as conn:
        bad = msgspec.msgpack.encode({"type": "generate", "request_id": "u1", "prompt_token_ids": [1, 2],
                                      "sampling": {"max_tokens": 2, "bogus": 1}})
        await conn.send_frames(bad)
        err = await conn.recv()
        assert isinstance(err, p.Error) and err.field == "sampling.bogus" and err.request_id == "u1"
        await conn.send_frames(b"\xc1\xff garbage")
        err = await conn.recv()
        assert isinstance(err, p.Error) and err.code == "bad_frame"
        await conn.send_frames(b"a", b"b")
        err = await conn.recv()
        assert isinstance(err, p.Error) and err.code == "bad_frame"
        await conn.send_frames(b"\x00" * (17 * 1024 * 1024))
        err = await conn.recv()
        assert isinstance(err, p.Error) and err.code == "bad_frame" and "limit" in err.message
        await conn.send(p.Hello(protocol_version=999))
        err = await conn.recv()
        assert isinstance(err, p.Error) and err.code == "protocol"
    with Client(srv.address, timeout=120) as c:
        assert c.generate(prompt_token_ids=good, max_tokens=3, temperature=0.0).completion_tokens == 3


def test_executor_sigkill_mid_stream_is_invisible_but_for_a_delay(preempted_and_killed, hf_greedy):
    """The scheduler restarts the executor and recomputes: greedy outputs identical to HF's, no error."""
    run = preempted_and_killed
    for i, (r, ref) in enumerate(zip(run["results"], hf_greedy)):
        assert r.token_ids[:len(ref)] == ref, f"prompt {i}"
    assert run["new"] != run["old"] and run["alive"]
    assert_no_leak(run["idle"])
