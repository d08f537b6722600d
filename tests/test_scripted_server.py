"""The scheduler and the scripted executor as real processes, at pipeline depths 0, 1 and 2.

Requests go through the SDK (one TokenDelta per request and step) and through a
bare socket that asks for batched TokenDeltas; both must receive exactly the
script's tokens, across preemptions (the KV pool is small) and EOS at chosen
positions (``--scripted-eos-at``).  The server's ``--step-log`` must hold one
record per step.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from executor_proc.testing.scripted import ScriptedRunner, expected_output
from ipc import protocol as p
from ipc.client import AsyncClient
from ipc.client.raw import RawConnection
from tests.server_proc import ServerProcess, wait_idle

PROMPT_LEN = 5
NUM_REQUESTS = 24
MAX_MODEL_LEN = 256
EOS_AT = {3: PROMPT_LEN + 4, 7: PROMPT_LEN, 11: PROMPT_LEN + 20}  # seed -> absolute position of EOS


def expected(seed: int, max_tokens: int) -> tuple[list[int], str]:
    script = ScriptedRunner(1, 1, 1, vocab_size=1000, eos_token_id=2, eos_at=EOS_AT)
    return expected_output(script.token_at, seed=seed, prompt_len=PROMPT_LEN, max_tokens=max_tokens,
                           max_model_len=MAX_MODEL_LEN, eos_token_ids=(2,))


def prompt(seed: int) -> list[int]:
    return [10 + (seed + i) % 50 for i in range(PROMPT_LEN)]


@pytest.fixture(params=[0, 1, 2], ids=lambda d: f"depth{d}")
def server(request, tmp_path):
    log = tmp_path / "steps.jsonl"
    eos = [a for seed, pos in EOS_AT.items() for a in ("--scripted-eos-at", f"{seed}:{pos}")]
    srv = ServerProcess("--load-format", "scripted", "--scripted-step-ms", "0.2", "--pipeline-depth",
                        str(request.param), "--max-num-seqs", "8", "--num-kv-blocks", "24", "--block-size", "4",
                        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "16",
                        "--step-log", str(log), "--debug-checks", *eos, tmpdir=str(tmp_path), timeout=120)
    srv.step_log = log
    yield srv
    srv.stop()


async def _sdk_requests(address: str) -> dict[int, tuple[list[int], str]]:
    async with AsyncClient(address, timeout=60) as client:
        results = await asyncio.gather(*[
            client.generate(prompt_token_ids=prompt(seed), max_tokens=10 + seed % 20, temperature=0.0, seed=seed,
                            detokenize=False) for seed in range(NUM_REQUESTS)])
    return {seed: (r.token_ids, r.finish_reason) for seed, r in enumerate(results)}


async def _raw_batched_requests(address: str) -> tuple[dict[int, tuple[list[int], str]], int]:
    """The same requests on a bare connection that reads TokenDeltas; also returns how many batches came."""
    async with RawConnection(address, timeout=30) as conn:
        info = await conn.hello("test", batch_deltas=True)
        assert info.batch_deltas
        # run_requests also checks: no request twice in a batch, no tokens after a finish, counts match.
        run = await conn.run_requests([
            p.Generate(f"s{seed}", prompt(seed), p.SamplingParams(max_tokens=10 + seed % 20, temperature=0.0,
                                                                  seed=seed))
            for seed in range(NUM_REQUESTS)])
    assert all(fin.prompt_tokens == PROMPT_LEN for fin in run.finished.values())
    done = {int(rid[1:]): (run.token_ids[rid], fin.reason) for rid, fin in run.finished.items()}
    return done, run.batches


def test_sdk_and_batched_clients_get_the_script_exactly(server):
    want = {seed: expected(seed, 10 + seed % 20) for seed in range(NUM_REQUESTS)}
    assert asyncio.run(_sdk_requests(server.address)) == want
    got, batches = asyncio.run(_raw_batched_requests(server.address))
    assert got == want and batches > 0
    assert {reason for _, reason in want.values()} == {"stop", "length"}
    stats = asyncio.run(wait_idle(server.address))
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_free_slots == stats.num_slots, stats

    server.stop()
    records = [json.loads(line) for line in server.step_log.read_text().splitlines()]
    assert [r["step_id"] for r in records] == list(range(len(records))) == list(range(stats.steps))
    assert all(r["idle_s"] >= 0 and r["t_end"] >= r["t_start"] and r["num_rows"] >= r["num_tokens"] for r in records)
    assert all(0 <= r["gc_s"] <= r["prepare_s"] + r["launch_s"] + 0.01 for r in records)
    # the scheduler's times, on the executor's clock: plan sent, executor has it, result sent, scheduler has it
    bad = [r for r in records if not 0 <= r["plan_s"] <= r["t_sent"] <= r["t_start"] <= r["t_end"] <= r["t_recv"]]
    assert not bad, [(r["plan_s"], r["t_sent"], r["t_start"], r["t_end"], r["t_recv"]) for r in bad[:3]]
    # prefill tokens: within the step budget (16), and every prompt's first pass among them (the prompts share
    # no block, so the first round computes all of them)
    assert all(0 <= r["num_prefill"] <= 16 for r in records)
    assert sum(r["num_prefill"] for r in records) >= NUM_REQUESTS * PROMPT_LEN


def test_gc_clock_times_every_collection():
    """The executor's GcClock (the step log's gc_s) adds up the collector's runs, whichever thread ran them."""
    import gc
    import threading

    from executor_proc.main import GcClock

    clock = GcClock()
    try:
        before = clock.total_s
        gc.collect()
        after_main = clock.total_s
        worker = threading.Thread(target=gc.collect)
        worker.start()
        worker.join()
        assert before < after_main < clock.total_s
    finally:
        gc.callbacks.remove(clock._callback)


def test_step_log_appends_in_small_batches(tmp_path):
    """The step log writes every FLUSH_EVERY records (a flush stalls the serving loop: small batches), the
    rest at flush(); each line is one step's record with the scheduler's times."""
    from ipc.protocol import StepResult
    from scheduler_proc.step_log import FLUSH_EVERY, KEYS, StepLog
    from scheduler_proc.steps import InflightStep

    path = tmp_path / "steps.jsonl"
    log = StepLog(str(path))
    n = 2 * FLUSH_EVERY + 7
    for i in range(n):
        log.sent(i, 1.0)
        log.received(i)
        spec = [(None, 4), (None, 0)] if i == 6 else ()  # a step of two speculative rows: 4 drafts and none
        log.record(StepResult(i, [1, 2], t_start=2.0 + i, t_end=3.0 + i, idle_s=0.5),
                   InflightStep(i, [], [], [], spec=spec))
    assert len(path.read_text().splitlines()) == 2 * FLUSH_EVERY
    log.flush()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step_id"] for r in records] == list(range(n)) and all(tuple(r) == KEYS for r in records)
    assert records[5]["t_end"] == 8.0 and records[5]["num_tokens"] == 2 and records[5]["t_recv"] >= records[5]["t_sent"]
    assert [r["num_drafts"] for r in records[5:8]] == [0, 4, 0]
