"""Data-parallel replicas (``forerun serve --data-parallel-size 2``): the router and its replicas as real processes.

The routing policy, the GPU placement and the resume fields' checks are pure; the rest runs a tiny random
model (``--load-format dummy``, with the default model's tokenizer for stop strings) on two replicas behind
the router, one server shared by the file's tests.  A replica is a DP=1 server on an ipc:// address in the
router's run directory: the tests also talk to replica 0 directly, as to a server serving alone.  A resumed
Generate continues exactly, DP=2 gives DP=1's greedy tokens from both replicas, a shared prefix stays on its
replica, stats and metrics show both replicas, and SIGKILL of a replica's scheduler mid-stream loses no token
(and the replica rejoins), nor does SIGSTOP (the router kills a replica silent past the hang timeout).
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
import time

import pytest
from msgspec.structs import replace

from ipc import protocol as p
from ipc.client import AsyncClient
from ipc.client.raw import RawConnection
from ipc.config import ExecutorConfig
from ipc.models import default_model_dir
from scheduler_proc.limits import Limits
from scheduler_proc.config import ServerConfig
from scheduler_proc.replica import replica_config, replica_gpus
from scheduler_proc.replica_messages import sum_stats
from scheduler_proc.routing import PrefixIndex, choose, prefix_hashes
from scheduler_proc.validate import InvalidRequest, validate_generate
from tests.server_proc import ServerProcess, server_stats, wait_idle
from tests.test_gpu_fastpath import write_config

BLOCK = 4
MAX_TOKENS = 40
SLOTS = 4  # --max-num-seqs of each replica
HANG_S = 5  # --executor-hang-timeout: a replica silent this long is killed


# --------------------------------------------------------------------------- pure parts


def test_prefix_hashes_chain_full_blocks():
    a, b = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), prefix_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # the partial tail block has no hash
    assert prefix_hashes([9, 9, 9, 9, 1, 2, 3, 4], 4)[1] != prefix_hashes([1, 2, 3, 4], 4)[0]  # chained, not per block
    assert prefix_hashes([1, 2, 3], 4) == []


def test_prefix_index_matches_leading_blocks_and_forgets_the_oldest():
    index = PrefixIndex(capacity=3)
    index.add([10, 11])
    assert index.matched([10, 11, 12]) == 2 and index.matched([12, 10]) == 0 and index.matched([]) == 0
    index.add([20, 21])  # 10 is the least recently used: it goes
    assert index.matched([10, 11]) == 0 and index.matched([20, 21]) == 2 and len(index.entries) == 3


def test_choose_weighs_the_prefill_a_match_saves_against_the_queue():
    """A replica costs the prompt tokens it would compute plus REQUEST_TOKENS (128) a request in flight."""
    assert choose([0, 0, 0], [3, 1, 1], slack=8, blocks=6, block_size=16) == 1  # no match: least loaded, lowest index
    assert choose([3, 3], [2, 1], slack=8, blocks=6, block_size=16) == 1  # equal matches: the less loaded
    assert choose([0, 2], [0, 0], slack=8, blocks=6, block_size=16) == 1  # equal loads: the longer match
    assert choose([1], [100], slack=0, blocks=6, block_size=16) == 0
    # a 2,000-token match is worth up to 15 requests more in flight (1,920 tokens of queue), and no more
    assert choose([125, 0], [15, 0], slack=64, blocks=126, block_size=16) == 0
    assert choose([125, 0], [16, 0], slack=64, blocks=126, block_size=16) == 1
    assert choose([125, 0], [9, 0], slack=8, blocks=126, block_size=16) == 1  # never a whole batch busier
    # a chat template's opening (one block) only where it costs no queueing
    assert choose([1, 0], [1, 0], slack=8, blocks=3, block_size=16) == 1
    assert choose([1, 0], [0, 0], slack=8, blocks=3, block_size=16) == 0


def test_concurrent_requests_sharing_a_system_prompt_spread_over_the_replicas():
    """32 requests at once whose prompts share a 180-token system prompt, routed as the router does (each adds its
    prompt to its replica's index and one to its load): the replica holding the prompt takes the first two, then
    the other learns it too, and the two end up even (every one of them went to the holder while the rule was
    "the longest match unless a whole batch busier")."""
    system = list(range(100, 280))
    indexes, loads = [PrefixIndex(), PrefixIndex()], [0, 0]
    indexes[0].add(prefix_hashes(system + [1] * 40, 16))  # an earlier request left it on replica 0
    for i in range(32):
        hashes = prefix_hashes(system + [7 + i % 50] * (20 + i), 16)
        r = choose([x.matched(hashes) for x in indexes], loads, slack=64, blocks=len(hashes), block_size=16)
        indexes[r].add(hashes)
        loads[r] += 1
    assert abs(loads[0] - loads[1]) <= 2, loads


def test_replica_gpus_give_each_replica_its_own():
    assert replica_gpus(2, 1, "cpu", None) == [None, None]
    assert replica_gpus(2, 1, "cuda", ["0", "1"]) == ["0", "1"]
    assert replica_gpus(2, 2, "cuda:1", ["0", "1", "2", "3", "4"]) == ["1,2", "3,4"]
    assert replica_gpus(3, 1, "cuda", ["GPU-a", "GPU-b", "GPU-c"]) == ["GPU-a", "GPU-b", "GPU-c"]
    for args, expect in [((0, 1, "cpu", None), "at least 1"), ((2, 2, "cuda", ["0", "1", "2"]), "needs 4 GPUs"),
                         ((2, 1, "cuda", None), "CUDA_VISIBLE_DEVICES"), ((2, 1, "cuda:x", ["0", "1"]), "cuda:N")]:
        with pytest.raises(ValueError, match=expect):
            replica_gpus(*args)


def test_a_replica_that_cannot_start_names_the_flags_as_typed(monkeypatch, capsys, tmp_path):
    """A replica's start-up failure reads as a single server's (config fields as their flags), under its name: left
    in the router's run directory, which the router says once (a line per replica when each said it); without one
    the replica says it.  Stopped while starting (the router stops the others when one fails) it says nothing."""
    import msgspec

    from scheduler_proc import replica, server
    from scheduler_proc.replica_router import Replica

    cfg = replica_config(ServerConfig(executor=ExecutorConfig(device="cpu")), 1, "ipc:///tmp/r1.sock", None)
    monkeypatch.setattr(server, "SPEAKER", server.SPEAKER)  # main renames the speaker: put it back after
    said = "--model m: --tensor-parallel-size 3 does not divide the model"
    for run_dir, raised, line in ((None, ValueError("--model m: tensor_parallel_size 3 does not divide the model"),
                                   f"forerun: replica 1: {said}\n"),
                                  (str(tmp_path), ValueError("--model m: tensor_parallel_size 3 does not divide the "
                                                             "model"), ""),
                                  (None, KeyboardInterrupt(), "")):
        def refuse(*args, raised=raised):
            raise raised

        monkeypatch.setattr("ipc.models.resolve_model", refuse)
        with monkeypatch.context() as m:
            m.setattr(signal, "signal", lambda *args: None)  # main's handlers stay out of the test process
            if run_dir is None:
                m.delenv("FORERUN_RUN_DIR", raising=False)
            else:
                m.setenv("FORERUN_RUN_DIR", run_dir)
            assert replica.main([msgspec.json.encode(cfg).decode()]) == 1
        assert capsys.readouterr().err == line
    router_side = Replica(1, cfg, None, str(tmp_path))
    assert router_side.exit_reason(starting=True) == f"replica 1: {said}"  # read once, then gone
    assert not os.listdir(tmp_path)


def test_a_replica_config_names_the_replica_to_its_executor():
    cfg = ServerConfig(executor=ExecutorConfig(device="cuda:1"))
    rep = replica_config(cfg, 1, "ipc:///tmp/r1.sock", "2")
    assert (rep.replica, rep.executor.replica, rep.executor.device) == (1, 1, "cuda:0")  # its reports name it
    assert cfg.executor.replica is None


def test_resume_fields_are_checked_and_named():
    limits = Limits(num_slots=4, num_kv_blocks=64, block_size=BLOCK, max_model_len=64, max_num_batched_tokens=64,
                    vocab_size=97)
    ok = dict(max_tokens=8)
    for gen, field in [
            (p.Generate("r", [1], p.SamplingParams(**ok), resume_output_ids=[5] * 8), "resume_output_ids"),
            (p.Generate("r", [1], p.SamplingParams(**ok), resume_output_ids=[97]), "resume_output_ids"),
            (p.Generate("r", [1], p.SamplingParams(n=2, **ok), resume_output_ids=[5]), "sampling.n"),
            (p.Generate("r", [1], p.SamplingParams(n=2, **ok), completion_index=1), "sampling.n"),
            (p.Generate("r", [1], p.SamplingParams(**ok), completion_index=p.MAX_N), "completion_index")]:
        with pytest.raises(InvalidRequest) as e:
            validate_generate(gen, limits)
        assert e.value.field == field, e.value.message
    validate_generate(p.Generate("r", [1], p.SamplingParams(**ok), resume_output_ids=[5] * 7, completion_index=3),
                      limits)


def test_stats_sum_keeps_each_replica():
    a = p.ServerStats(10, 5, 4, 2, 1, 0, 0, 0, 3, 7, replica=0, grammar_compile_buckets=[1, 2], device_peak_bytes=9)
    b = p.ServerStats(10, 6, 4, 3, 1, 1, 0, 0, 4, 8, replica=1, draining=True, device_free_min_bytes=5)
    total = sum_stats([b, a], draining=False)
    assert (total.num_kv_blocks, total.num_free_kv_blocks, total.requests, total.draining) == (20, 11, 15, True)
    assert total.grammar_compile_buckets == [1, 2] and total.device_peak_bytes == 9
    assert total.device_free_min_bytes == 5 and [s.replica for s in total.replicas] == [0, 1]


# --------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    """Two replicas behind a router; ``dp.single``: replica 0's own address (a server serving alone)."""
    tmp = tmp_path_factory.mktemp("dp")
    srv = ServerProcess("--load-format", "dummy", "--model", write_config(tmp), "--tokenizer", default_model_dir(),
                        "--max-model-len", "256", "--block-size", str(BLOCK), "--max-num-seqs", str(SLOTS),
                        "--debug-checks",
                        "--executor-threads", "1", "--data-parallel-size", "2", "--executor-hang-timeout", str(HANG_S),
                        tmpdir=str(tmp), timeout=120)
    srv.single = "ipc://" + glob.glob(f"{tmp}/forerun-*/replica0.sock")[0]
    yield srv
    srv.stop()
    # the replicas' run directories live in the router's: none is left, the killed replicas' included
    assert not glob.glob(f"{tmp}/forerun-*"), glob.glob(f"{tmp}/forerun-*/*")


def prompts(n: int, shared: list[int] = ()) -> list[list[int]]:
    return [list(shared) + [5 + (7 * i + j) % 80 for j in range(6 + i % 5)] for i in range(n)]


async def _generate(address: str, requests: list[list[int]], **sampling) -> list[list[int]]:
    async with AsyncClient(address, timeout=60) as client:
        results = await asyncio.gather(*[client.generate(prompt_token_ids=ids, detokenize=False, **sampling)
                                         for ids in requests])
    return [r.token_ids for r in results]


async def _raw(address: str, *gens: p.Generate) -> dict[tuple[str, int], tuple[list[int], p.Finished]]:
    """Each (request id, completion)'s streamed tokens and Finished."""
    out: dict = {}
    async with RawConnection(address, timeout=60) as conn:
        await conn.hello("test", batch_deltas=True)
        for gen in gens:
            await conn.send(gen)
        open_ = sum(g.sampling.n for g in gens)
        while open_:
            msg = await conn.recv()
            if isinstance(msg, p.TokenDeltas):
                for i, rid in enumerate(msg.request_ids):
                    out.setdefault((rid, msg.indices[i] if msg.indices else 0), ([], None))[0].extend(msg.token_ids[i])
            elif isinstance(msg, p.Finished):
                tokens = out.setdefault((msg.request_id, msg.index), ([], None))[0]
                out[(msg.request_id, msg.index)] = (tokens + msg.token_ids, msg)
                open_ -= 1
            else:
                raise AssertionError(f"unexpected {msg!r}")
    return out


def _replica_pid(router: ServerProcess, index: int) -> int:
    """The pid of replica ``index``'s scheduler: the router's child whose command line holds its config."""
    for pid in subprocess.run(["pgrep", "-P", str(router.proc.pid)], capture_output=True, text=True).stdout.split():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except FileNotFoundError:
            continue
        if b"scheduler_proc.replica" in cmdline and f'"replica":{index}'.encode() in cmdline:
            return int(pid)
    raise AssertionError(f"no replica {index} under the router")


# --------------------------------------------------------------------------- through the processes


def test_a_resumed_request_continues_exactly(dp):
    """resume_output_ids + completion_index: penalties, min_tokens, a stop token, stop strings and seeded sampling
    go on as in the uninterrupted request, and only the new tokens are sent."""
    prompt = [11, 12, 13, 14, 15, 16]
    sampling = p.SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=7, repetition_penalty=1.3,
                                frequency_penalty=0.5, presence_penalty=0.3, min_tokens=10, stop_token_ids=[40])
    whole = asyncio.run(_raw(dp.address, p.Generate("whole", prompt, sampling),
                             p.Generate("pair", prompt, replace(sampling, n=2))))
    tokens, fin = whole[("whole", 0)]
    second, _ = whole[("pair", 1)]
    assert len(tokens) > 14 and len(second) > 9
    # a stop string over two tokens: the resumed matcher must hold the first
    stop = next(text for j in range(12, len(tokens) - 1) if (text := _text(tokens[j:j + 2])).strip())
    stopped = asyncio.run(_raw(dp.address, p.Generate("s", prompt, replace(sampling, stop=[stop]))))
    stop_tokens, stop_fin = stopped[("s", 0)]
    assert stop_fin.reason == "stop" and stop_fin.stop_str == stop
    cuts = (1, 5, 12, len(tokens) - 1)
    resumed = asyncio.run(_raw(dp.address, *[
        p.Generate(f"r{k}", prompt, sampling, resume_output_ids=tokens[:k]) for k in cuts], *[
        p.Generate("c1", prompt, sampling, resume_output_ids=second[:9], completion_index=1),
        p.Generate("st", prompt, replace(sampling, stop=[stop]), resume_output_ids=stop_tokens[:-1])]))
    for k in cuts:
        got, got_fin = resumed[(f"r{k}", 0)]
        assert got == tokens[k:], k
        assert (got_fin.reason, got_fin.completion_tokens) == (fin.reason, fin.completion_tokens)
    assert resumed[("c1", 1)][0] == second[9:]
    got, got_fin = resumed[("st", 0)]
    assert got == stop_tokens[-1:] and (got_fin.reason, got_fin.stop_str) == ("stop", stop)


def _text(ids: list[int]) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(default_model_dir(), "tokenizer.json"))
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_two_replicas_give_one_servers_tokens(dp):
    requests = prompts(8)
    want = asyncio.run(_generate(dp.single, requests, max_tokens=12, temperature=0.0))
    before = asyncio.run(server_stats(dp.address))
    assert asyncio.run(_generate(dp.address, requests, max_tokens=12, temperature=0.0)) == want
    after = asyncio.run(wait_idle(dp.address))
    served = [a.requests - b.requests for a, b in zip(after.replicas, before.replicas)]
    assert sum(served) == 8 and min(served) > 0, served  # the least loaded replica gets each one
    assert after.num_free_kv_blocks == after.num_kv_blocks and after.num_free_slots == after.num_slots


def test_a_shared_prefix_stays_on_the_replica_holding_it(dp):
    """Requests one after another (the loads even) that share a prefix go where it is cached."""
    shared = [60 + i % 30 for i in range(6 * BLOCK)]
    asyncio.run(_generate(dp.address, prompts(1, shared), max_tokens=2, temperature=0.0))
    before = asyncio.run(wait_idle(dp.address))
    for prompt in prompts(4, shared)[1:]:
        asyncio.run(_generate(dp.address, [prompt], max_tokens=2, temperature=0.0))
    after = asyncio.run(wait_idle(dp.address))
    served = [a.requests - b.requests for a, b in zip(after.replicas, before.replicas)]
    hits = [a.prefix_cache_hit_tokens - b.prefix_cache_hit_tokens for a, b in zip(after.replicas, before.replicas)]
    holder = served.index(3)
    assert served[1 - holder] == 0 and hits[holder] >= 3 * len(shared), (served, hits)


def test_requests_sharing_only_a_short_opening_spread_over_both_replicas(dp):
    """Eight prompts at once that share one block (a chat template's opening) and differ after: the match saves
    less than a request in flight costs, so they go where the load is least, four and four (they once followed the
    opening until its replica was a whole batch busier: five and three here, every chat on one replica at 64
    slots)."""
    opening = [90 + i % 7 for i in range(BLOCK)]
    requests = [opening + [5 + (11 * i + j) % 80 for j in range(2 * BLOCK + i)] for i in range(8)]
    before = asyncio.run(wait_idle(dp.address))
    # long enough that none ends before the last is routed (an early finish evens the loads: five and three)
    asyncio.run(_generate(dp.address, requests, max_tokens=64, ignore_eos=True, temperature=0.0))
    after = asyncio.run(wait_idle(dp.address))
    served = [a.requests - b.requests for a, b in zip(after.replicas, before.replicas)]
    assert sum(served) == 8 and max(served) - min(served) <= 1, served


def test_stats_and_metrics_show_both_replicas(dp):
    from ipc.gateway.metrics import render

    stats = asyncio.run(server_stats(dp.address))
    assert [s.replica for s in stats.replicas] == [0, 1]
    assert stats.num_kv_blocks == sum(s.num_kv_blocks for s in stats.replicas) > 0
    text = render(stats, "dpt").decode()
    for replica in ("0", "1"):
        assert f'forerun:num_requests_running{{model_name="dpt",replica="{replica}"}}' in text
        assert f'forerun:prefix_cache_hits_total{{model_name="dpt",replica="{replica}"}}' in text
        assert f'forerun:replica_up{{model_name="dpt",replica="{replica}"}} 1.0' in text
        assert f'forerun:replica_restarts_total{{model_name="dpt",replica="{replica}"}}' in text
    # a replica down (restarting, or down for good) has no series of its own, but its up gauge says 0
    down = replace(stats, replicas=stats.replicas[:1], replicas_down=[1], replica_restarts=[0, 3])
    text = render(down, "dpt").decode()
    assert 'forerun:replica_up{model_name="dpt",replica="1"} 0.0' in text
    assert 'forerun:replica_restarts_total{model_name="dpt",replica="1"} 3.0' in text
    assert 'forerun:num_requests_running{model_name="dpt",replica="1"}' not in text


async def _streams(address: str, requests: list[list[int]], kill=None, kill_at: int = 0,
                   max_tokens: int = MAX_TOKENS) -> tuple[list[list[int]], list[int]]:
    """Greedy streams; with ``kill``, called once ``kill_at`` streams have tokens (default: every stream, so that
    each replica's streams are in flight, not all of one replica's done before the other's start on a loaded host):
    the tokens each had then."""
    counts = [0] * len(requests)
    at_kill: list[int] = []

    async with AsyncClient(address, timeout=60) as client:
        async def one(i: int) -> list[int]:
            tokens: list[int] = []
            async for chunk in client.stream(prompt_token_ids=requests[i], max_tokens=max_tokens, temperature=0.0,
                                             detokenize=False):
                tokens += chunk.token_ids
                counts[i] = len(tokens)
                if kill is not None and not at_kill and sum(c > 0 for c in counts) >= (kill_at or len(counts)):
                    at_kill.extend(counts)
                    kill()
            return tokens

        return await asyncio.gather(*[one(i) for i in range(len(requests))]), at_kill


def test_a_killed_replica_loses_no_token_and_rejoins(dp):
    """SIGKILL of replica 0's scheduler (its executor dies with it) mid-stream: every stream ends with the tokens
    of an undisturbed run; the router restarts the replica, which serves again."""
    requests = prompts(12)
    want, _ = asyncio.run(_streams(dp.address, requests))
    victim = _replica_pid(dp, 0)
    got, at_kill = asyncio.run(_streams(dp.address, requests, kill=lambda: os.kill(victim, signal.SIGKILL)))
    assert got == want
    assert any(0 < n < MAX_TOKENS for n in at_kill), at_kill  # some were mid-stream
    _assert_rejoins(dp, 0, victim, requests[:4], want[:4])


def _assert_rejoins(dp, index: int, victim: int, requests: list[list[int]], want: list[list[int]]) -> None:
    """Replica ``index`` comes back (a new process), answers stats again, and serves ``requests`` as before."""
    deadline = time.monotonic() + 60
    while True:
        stats = asyncio.run(server_stats(dp.address))
        if [s.replica for s in stats.replicas] == [0, 1] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [s.replica for s in stats.replicas] == [0, 1] and _replica_pid(dp, index) != victim
    assert stats.replicas_down == [] and stats.replica_restarts[index] >= 1, stats.replica_restarts
    assert asyncio.run(_generate(dp.address, requests, max_tokens=MAX_TOKENS, temperature=0.0)) == want


def test_a_stuck_replica_is_killed_and_its_streams_go_on(dp):
    """SIGSTOP of replica 1's scheduler mid-stream: its process lives but answers nothing, not even the router's
    pings; after --executor-hang-timeout the router kills it, every stream ends with the tokens of an undisturbed
    run, and the replica rejoins.  Prompts no earlier test sent (a first token of their own): no replica holds
    their prefixes, so the load spreads them over both replicas, and the second run follows the first's routing.
    The stop comes when as many streams have tokens as both replicas have slots, and the streams are long (160
    tokens): on a loaded host one replica's process may get no CPU for a while, and with every stream's tokens
    awaited (queued ones start only after a replica's first streams end) or with 40-token streams, replica 1 had
    finished all of its streams before the stop."""
    requests = [[85 + i] + ids for i, ids in enumerate(prompts(12))]
    long = 4 * MAX_TOKENS
    want, _ = asyncio.run(_streams(dp.address, requests, max_tokens=long))
    victim = _replica_pid(dp, 1)
    t0 = time.monotonic()
    got, at_stop = asyncio.run(_streams(dp.address, requests, kill=lambda: os.kill(victim, signal.SIGSTOP),
                                        kill_at=2 * SLOTS, max_tokens=long))
    waited = time.monotonic() - t0
    assert got == want
    assert any(0 < n < long for n in at_stop), at_stop  # some were mid-stream
    assert waited >= HANG_S, waited  # its streams waited for the timeout
    _assert_rejoins(dp, 1, victim, requests[:4], [w[:MAX_TOKENS] for w in want[:4]])  # greedy: a prefix


def test_replicas_past_their_restarts_stay_down_and_the_last_one_stops_the_server(tmp_path_factory):
    """``--max-restarts 0``: replica 0's executor killed, the replica stops (saying so, not that the server does) and
    stays down; when the other dies too, the server says that every replica is down for good and exits (with no
    request in flight, no line says any was re-sent)."""
    srv = ServerProcess("--load-format", "scripted", "--data-parallel-size", "2", "--max-restarts", "0",
                        tmpdir=str(tmp_path_factory.mktemp("dpr")), timeout=120)

    def children(pid: int) -> list[int]:
        return sorted(int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                     text=True).stdout.split())

    replicas = children(srv.proc.pid)
    assert len(replicas) == 2, replicas
    executor = children(replicas[0])
    assert len(executor) == 1, executor
    os.kill(executor[0], signal.SIGKILL)
    time.sleep(1.5)
    os.kill(replicas[1], signal.SIGKILL)
    out = "".join(srv.log) + srv.proc.communicate(timeout=60)[0]
    assert "re-sent" not in out and out.count("it stays down") == 2, out  # no request was in flight
    assert "replica 0 stops" in out and out.count("the server is shutting down") == 1, out
    assert "every replica is down for good" in out, out

