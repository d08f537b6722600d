"""n > 1 completions and output-feature errors through a real scheduler process (scripted executor).

The scripted executor's tokens depend only on the slot's seed and the position, so
completion i of an n > 1 request must stream exactly what an n = 1 request with seed
``base + i`` streams; Abort ends every completion; errors name the field.
"""

from __future__ import annotations

import asyncio

import pytest

from ipc import protocol as p
from ipc.client.raw import RawConnection
from tests.server_proc import ServerProcess, assert_no_leak, wait_idle

PROMPT = [10 + i for i in range(9)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("n")
    srv = ServerProcess("--load-format", "scripted", "--scripted-step-ms", "0.5", "--pipeline-depth", "1",
                        "--max-num-seqs", "8", "--num-kv-blocks", "64", "--block-size", "4", "--max-model-len", "256",
                        "--debug-checks", tmpdir=str(tmp), timeout=120)
    yield srv
    srv.stop()


async def _collect(conn: RawConnection, want: int) -> dict[tuple[str, int], tuple[list[int], p.Finished]]:
    tokens: dict[tuple[str, int], list[int]] = {}
    done: dict[tuple[str, int], p.Finished] = {}
    while len(done) < want:
        msg = await conn.recv()
        assert not isinstance(msg, p.Error), msg
        if isinstance(msg, p.TokenDeltas):
            for key, ids in zip(zip(msg.request_ids, msg.indices or [0] * len(msg.request_ids)), msg.token_ids):
                assert key not in done
                tokens.setdefault(key, []).extend(ids)
            continue
        key = (msg.request_id, msg.index)
        assert key not in done
        tokens.setdefault(key, []).extend(msg.token_ids)
        if isinstance(msg, p.Finished):
            done[key] = msg
    return {k: (tokens[k], f) for k, f in done.items()}


@pytest.mark.parametrize("batch_deltas", [False, True])
def test_n_completions_equal_their_seeds_alone(server, batch_deltas):
    async def go():
        async with RawConnection(server.address, timeout=30) as conn:
            await conn.hello(batch_deltas=batch_deltas)
            sp = dict(max_tokens=12, temperature=0.8, ignore_eos=True)
            await conn.send(p.Generate("n", PROMPT, p.SamplingParams(n=3, seed=2**63 - 2, **sp)))
            many = await _collect(conn, 3)
            for i in range(3):
                await conn.send(p.Generate(f"s{i}", PROMPT, p.SamplingParams(seed=(2**63 - 2 + i) % 2**63, **sp)))
            alone = await _collect(conn, 3)
        return many, alone

    many, alone = asyncio.run(go())
    for i in range(3):
        assert many[("n", i)][0] == alone[(f"s{i}", 0)][0], i
        assert many[("n", i)][1].index == i and many[("n", i)][1].prompt_tokens == len(PROMPT)
    assert len({tuple(many[("n", i)][0]) for i in range(3)}) == 3
    assert_no_leak(asyncio.run(wait_idle(server.address)))


def test_abort_ends_every_completion_and_ids_stay_taken(server):
    async def go():
        async with RawConnection(server.address, timeout=30) as conn:
            await conn.hello(batch_deltas=False)
            sp = p.SamplingParams(n=4, max_tokens=200, ignore_eos=True, seed=5)
            await conn.send(p.Generate("a", PROMPT, sp))
            first = await conn.recv()
            assert isinstance(first, p.TokenDelta) and first.request_id == "a"
            await conn.send(p.Generate("a", PROMPT, sp))  # the id is in use while any completion runs
            await conn.send(p.Abort("a"))
            finished, dup = {}, None
            while len(finished) < 4:
                msg = await conn.recv()
                if isinstance(msg, p.Error):
                    dup = msg
                elif isinstance(msg, p.Finished):
                    finished[msg.index] = msg
            return finished, dup

    finished, dup = asyncio.run(go())
    assert dup is not None and dup.code == "duplicate_id"
    assert sorted(finished) == [0, 1, 2, 3] and {f.reason for f in finished.values()} == {"abort"}
    assert_no_leak(asyncio.run(wait_idle(server.address)))


@pytest.mark.parametrize("sampling,field", [
    (p.SamplingParams(stop=["x"]), "sampling.stop"),  # the scripted server has no tokenizer
    (p.SamplingParams(n=17), "sampling.n"),
    (p.SamplingParams(logprobs=21), "sampling.logprobs"),
    (p.SamplingParams(logit_bias={5: 200.0}), "sampling.logit_bias"),
])
def test_errors_name_the_field(server, sampling, field):
    async def go():
        async with RawConnection(server.address, timeout=30) as conn:
            await conn.hello()
            await conn.send(p.Generate("e", PROMPT, sampling))
            return await conn.recv()

    err = asyncio.run(go())
    assert isinstance(err, p.Error) and err.code == "invalid_request" and err.field == field, err
