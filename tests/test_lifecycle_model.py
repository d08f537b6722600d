"""Real-model lifecycle at every pipeline depth: the outputs at depth 1 and 2 equal depth 0's.

One workload (default model, CPU, real processes): staggered arrivals, mixed max_tokens, greedy
and seeded sampling, stop strings, a KV pool small enough to preempt, and an abort mid-stream.  The arrivals are
paced by the engine, not the clock (each request once the one before has its first token), so that the same steps
see the same requests on a fast machine and a slow one: the pool overflows on both.

Depth 0's outputs come from the shared depth-0 server, whose pool never preempts: depths 1 and 2, preempting,
must give them.  Preemption at depth 0 is tests/test_kv_paths.py's recompute path (every sampling option).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from ipc.client import AsyncClient
from tests.server_proc import assert_no_leak, wait_idle

pytestmark = pytest.mark.slow

ABORT_AFTER = 4  # tokens the aborted request streams before its abort


async def _workload(address: str, prompts: list[list[int]]) -> dict:
    async with AsyncClient(address, timeout=300) as c:
        first_token = [asyncio.Event() for _ in range(10)]

        async def one(i: int):
            if i:
                await first_token[i - 1].wait()  # staggered arrivals
            # mixed lengths; the last stop-string request keeps room to reach its stop string
            kw = dict(max_tokens=14 if i == 9 else 6 + 4 * (i % 4), ignore_eos=i % 3 == 0)
            if i % 2:
                kw.update(temperature=0.8, top_k=40, top_p=0.9, seed=100 + i)
            else:
                kw.update(temperature=0.0)
            if i % 5 == 4:  # stop strings: matched by the scheduler, with 0..depth steps in flight
                kw.update(stop=[",", "."])
            stream = c.stream(prompt_token_ids=prompts[i % len(prompts)], **kw)
            async for _ in stream:
                first_token[i].set()
            first_token[i].set()  # the next one goes even if this one ended with no token
            r = stream.result
            return ("done", r.token_ids, r.finish_reason, r.completion_tokens)

        async def aborted():
            stream = c.stream(prompt_token_ids=prompts[5], max_tokens=60, temperature=0.0, ignore_eos=True)
            seen = []
            async for chunk in stream:
                seen += chunk.token_ids
                if len(seen) >= ABORT_AFTER:
                    await c.abort(stream.request_id)
            return ("aborted", stream.result.token_ids, stream.result.finish_reason, len(seen))

        results = await asyncio.gather(*[one(i) for i in range(10)], aborted())
        return dict(enumerate(results))


def test_outputs_equal_across_depths(servers, model_server, chat_prompt_ids):
    # 13 blocks of 8 tokens (104: the aborted request's prompt and 60 tokens fit) hold the chat opening's shared
    # blocks and about three of these requests: the rest wait or are preempted (1-4 times a depth, fast machine or
    # loaded).  The two servers start together beside the shared depth-0 one, and the three run the workload at
    # the same time (each executor serves on one thread).
    depths = (1, 2)
    with ThreadPoolExecutor(len(depths)) as pool:
        started = [pool.submit(servers, "--pipeline-depth", str(depth), "--num-kv-blocks", "13", "--block-size", "8",
                               "--max-num-seqs", "8", "--debug-checks") for depth in depths]
        reference = model_server(0)  # started here (where no test started it yet) while the pool's servers start
        srvs = dict(zip(depths, [f.result() for f in started])) | {0: reference}

    async def run(address: str):
        return await _workload(address, chat_prompt_ids), await wait_idle(address)

    async def everything():
        return await asyncio.gather(*[run(srvs[depth].address) for depth in (0, *depths)])

    outputs, preemptions = {}, 0
    for depth, (out, stats) in zip((0, *depths), asyncio.run(everything())):
        outputs[depth] = out
        assert_no_leak(stats)
        if depth:
            srvs[depth].stop()
            preemptions += stats.preemptions
    assert preemptions > 0  # the small pools really were small enough
    base = outputs[0]
    assert base[9][2] == "stop"  # a stop string ended it (it ignores EOS)
    for depth in (1, 2):
        for i, (kind, tokens, reason, count) in outputs[depth].items():
            b_kind, b_tokens, b_reason, b_count = base[i]
            if kind == "aborted":
                assert reason == b_reason == "abort"
                # Where the abort lands depends on timing; what came before it may not.
                n = min(len(tokens), len(b_tokens))
                assert n >= ABORT_AFTER and tokens[:n] == b_tokens[:n], (depth, i)
            else:
                assert (tokens, reason, count) == (b_tokens, b_reason, b_count), (depth, i)
