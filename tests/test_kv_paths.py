"""The way a prompt reaches the KV cache never changes an output (default model, float32, CPU).

Every case (a prompt and sampling options that read per-request state on the device:
repetition / frequency / presence penalties, logit_bias, min_tokens, stop strings, stop token
ids, prompt logprobs, top-n logprobs, seeds, a regex constraint) runs on a reference server
with no prefix cache and no host tier, and along every path by which a prompt's KV can come
about; tokens, finish reasons, stop strings and logprobs must be the reference's.

    path        server (block size 8)                   how the prompt's KV comes about
    cold        prefix, depth 1                         first sight of each prompt (a late arrival may share
                                                        the chat opening of an earlier one); then the device
                                                        cache is reset
    shared_hit  prefix, depth 1                         a primer published the chat opening (24 tokens, 3 full
                                                        blocks); "What ..." questions share one more token,
                                                        inside block 4, which is computed
    repeat_hit  prefix, depth 1                         the same prompt again: its full blocks from the device,
                                                        the partial last block computed
    n3          prefix, depth 1                         n = 3: completions 1 and 2 share completion 0's blocks
    restart     prefix, depth 1                         the executor killed mid-request: recomputed with the
                                                        outputs received so far
    recompute   plain, depth 0: 36 blocks, no cache     preempted, resumed by prefilling prompt and outputs
    swap        tier, depth 2: 20 blocks, host tier     queued behind a holder of 16 blocks, admitted
                                                        together: preempted, resumed from device or host copies
    host_hit    tier, depth 2: 20 blocks, host tier     sent again: evicted on the device, onloaded from the host

The reference is the plain server running five requests at a time (no preemption).  The
servers run their paths at the same time, each path's requests concurrently;
``test_path_taken`` proves from the servers' counters that each path happened, that the plain
server never looked a prompt up, and that every server ends with its pools whole (the tier
server's host pool too).

Logprobs: float32 on the CPU, a row's logprobs move by up to 2e-5 with the batch it is
computed in (the cold path, nothing cached, differs from the reference that much), so they must
agree within 1e-5 relative plus 1e-5 absolute.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import pytest

from ipc.client import AsyncClient
from tests.server_proc import assert_no_leak, reset_prefix_cache, wait_idle

pytestmark = pytest.mark.slow

BLOCK = 8  # the chat opening is 24 tokens: exactly 3 blocks
TOL = 1e-5  # relative and absolute


@dataclass(frozen=True)
class Case:
    name: str
    question: str
    sampling: dict = field(default_factory=dict)
    n: int = 1


GREEDY = dict(temperature=0.0)
CASES = [
    Case("repetition", "What is the capital of France?", dict(GREEDY, repetition_penalty=1.3)),
    Case("repetition_seeded_logprobs", "Write a haiku about the sea.",
         dict(repetition_penalty=1.2, temperature=0.9, seed=11, logprobs=3)),
    Case("frequency_presence", "What does a CPU do?", dict(GREEDY, frequency_penalty=1.5, presence_penalty=0.5)),
    Case("presence_top_p_seeded", "List three prime numbers.",
         dict(presence_penalty=1.5, temperature=0.8, top_p=0.9, top_k=40, seed=5)),
    Case("logit_bias", "Give me a synonym for happy.", dict(GREEDY, logit_bias={57: -100.0, 504: 4.0})),
    # EOS is the greedy 8th token: allowed exactly when 7 outputs are counted
    Case("min_tokens_eos", "Name a planet with rings.", dict(GREEDY, min_tokens=7, max_tokens=8, ignore_eos=False)),
    Case("min_tokens_stop_ids", "What color is the sky? One word.",
         dict(GREEDY, min_tokens=4, stop_token_ids=[314, 253], ignore_eos=False)),
    Case("stop_string", "Who wrote Romeo and Juliet?", dict(GREEDY, stop=[" of Rom"])),  # spans 2 tokens
    Case("stop_token_ids", "What is an atom?", dict(GREEDY, stop_token_ids=[260], ignore_eos=False)),
    Case("prompt_logprobs", "What is 12 times 12?", dict(GREEDY, prompt_logprobs=2, repetition_penalty=1.3)),
    Case("regex_seeded", "Describe the moon.",  # the executor's grammar matcher, advanced over outputs on resume
         dict(regex="[A-Z][a-z]+( [a-z]+)+", repetition_penalty=1.2, temperature=0.8, seed=9, ignore_eos=False)),
    Case("everything", "Answer yes or no: is water wet?",
         dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={5230: -5.0},
              min_tokens=5, stop_token_ids=[28], logprobs=2, temperature=0.7, seed=21, ignore_eos=False)),
]
N_CASES = [
    Case("n3_repetition", "Count to five.", dict(GREEDY, repetition_penalty=1.3), n=3),
    Case("n3_seeded", "What is the time?", dict(repetition_penalty=1.2, frequency_penalty=0.5, logprobs=1,
                                                temperature=0.9, seed=100), n=3),
]
PRIMER = "What is the best way to learn?"  # shares the chat opening and "What" with some cases

COMMON = ("--block-size", str(BLOCK), "--debug-checks")
HOST_BLOCKS = 256
SERVERS = {  # a request takes up to 6 blocks of 8 tokens: small pools preempt
    "prefix": ("--pipeline-depth", "1", "--max-num-seqs", "32", "--num-kv-blocks", "512"),
    "plain": ("--pipeline-depth", "0", "--max-num-seqs", "8", "--num-kv-blocks", "36", "--no-prefix-caching"),
    "tier": ("--pipeline-depth", "2", "--max-num-seqs", "8", "--num-kv-blocks", "20",
             "--num-host-kv-blocks", str(HOST_BLOCKS)),
}
REFERENCE_AT_ONCE = 5  # 36 blocks hold six requests: one more may be admitted while one drains
PATHS = ["cold", "shared_hit", "repeat_hit", "n3", "restart", "recompute", "swap", "host_hit"]


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str
    stop_str: Optional[str]
    logprobs: list
    prompt_logprobs: Optional[list]


def completions(result) -> list[Completion]:
    return [Completion(c.token_ids, c.finish_reason, c.stop_str, c.logprobs, c.prompt_logprobs)
            for c in (result.choices or [result])]


def reference_count(case: Case) -> int:
    """Reference requests for a case: completion i of a seeded n > 1 request is the n = 1 request with seed + i;
    greedy completions are all the one greedy answer."""
    return case.n if "seed" in case.sampling else 1


def sampling(case: Case, seed_offset: int = 0) -> dict:
    kw = dict(max_tokens=5, ignore_eos=True, detokenize=False)
    kw.update(case.sampling)
    if seed_offset:
        kw["seed"] = kw["seed"] + seed_offset
    return kw


async def generate(client: AsyncClient, prompts: dict[str, list[int]], cases: list[Case]) -> dict[str, list]:
    """Every case at once; each case's completions."""
    results = await asyncio.gather(*[client.generate(prompt_token_ids=prompts[c.name], n=c.n, **sampling(c))
                                     for c in cases])
    return {c.name: completions(r) for c, r in zip(cases, results)}


@dataclass
class PathRun:
    outputs: dict[str, list[Completion]]
    before: object  # ServerStats before and after the path's requests
    after: object
    note: dict = field(default_factory=dict)

    def delta(self, counter: str) -> int:
        return getattr(self.after, counter) - getattr(self.before, counter)


async def run_path(address: str, client: AsyncClient, prompts, cases) -> PathRun:
    before = await wait_idle(address)
    outputs = await generate(client, prompts, cases)
    return PathRun(outputs, before, await wait_idle(address))


async def reference_runs(address: str, client: AsyncClient, prompts) -> PathRun:
    """(case, completion index) -> the reference's completion, a few requests at a time (no preemption); an
    n = 3 case as three n = 1 requests."""
    singles = [(c, i) for c in CASES + N_CASES for i in range(reference_count(c))]
    at_once = asyncio.Semaphore(REFERENCE_AT_ONCE)

    async def one(case: Case, i: int):
        async with at_once:
            return await client.generate(prompt_token_ids=prompts[case.name], **sampling(case, i))

    before = await wait_idle(address)
    results = await asyncio.gather(*[one(c, i) for c, i in singles])
    outputs = {(c.name, i): completions(r)[0] for (c, i), r in zip(singles, results)}
    return PathRun(outputs, before, await wait_idle(address))


async def plain_paths(address: str, prompts) -> dict[str, PathRun]:
    """The reference, then preemption with recompute."""
    async with AsyncClient(address, timeout=600) as client:
        reference = await reference_runs(address, client, prompts)
        return {"reference": reference, "recompute": await run_path(address, client, prompts, CASES)}


async def killed_mid_request(srv, client: AsyncClient, prompts) -> PathRun:
    """Every case at once; the executor is killed once two requests have two tokens, and restarted."""
    before = await wait_idle(srv.address)
    received = {c.name: 0 for c in CASES}
    streams = [client.stream(prompt_token_ids=prompts[c.name], **sampling(c)) for c in CASES]

    async def read(case: Case, stream) -> None:
        async for chunk in stream:
            received[case.name] += len(chunk.token_ids)

    readers = [asyncio.create_task(read(c, s)) for c, s in zip(CASES, streams)]
    while sum(n >= 2 for n in received.values()) < 2 and not any(r.done() for r in readers):
        await asyncio.sleep(0.005)
    at_kill = dict(received)
    os.kill(srv.executor_pid(), signal.SIGKILL)
    await asyncio.gather(*readers)
    outputs = {c.name: completions(s.result) for c, s in zip(CASES, streams)}
    return PathRun(outputs, before, await wait_idle(srv.address), note=dict(at_kill=at_kill))


async def prefix_paths(srv, prompts) -> dict[str, PathRun]:
    address = srv.address
    async with AsyncClient(address, timeout=600) as client:
        cold = await run_path(address, client, prompts, CASES)
        await reset_prefix_cache(address)
        await client.generate(prompt_token_ids=prompts["primer"], max_tokens=1, temperature=0.0, detokenize=False)
        shared = await run_path(address, client, prompts, CASES)
        repeat = await run_path(address, client, prompts, CASES)
        n3 = await run_path(address, client, prompts, N_CASES)
        restart = await killed_mid_request(srv, client, prompts)
    return {"cold": cold, "shared_hit": shared, "repeat_hit": repeat, "n3": n3, "restart": restart}


# 16 of the tier server's 20 blocks, sharing none with a case: 24 more tokens take it to 19.
HOLDER = list(range(1000, 1000 + 16 * BLOCK))


async def queued_behind_holder(address: str, client: AsyncClient, prompts) -> PathRun:
    """Every case sent while a holder keeps all but four blocks (a cold case needs five): they wait, and are
    admitted together when it ends, four of them filling the pool; the first to cross into a new block (the
    repetition case at its third token) preempts the last admitted.  Sent together instead, the cases would
    preempt only if enough of them arrived in one step, which a busy machine does not promise."""
    before = await wait_idle(address)
    holder = client.stream(prompt_token_ids=HOLDER, max_tokens=3 * BLOCK, temperature=0.0, ignore_eos=True,
                           detokenize=False)
    chunks = aiter(holder)
    await anext(chunks)  # admitted and prefilled: it holds its blocks until its last token

    async def drain() -> None:
        async for _ in chunks:
            pass

    outputs, _ = await asyncio.gather(generate(client, prompts, CASES), drain())
    return PathRun(outputs, before, await wait_idle(address))


async def tier_paths(address: str, prompts) -> dict[str, PathRun]:
    async with AsyncClient(address, timeout=600) as client:
        swap = await queued_behind_holder(address, client, prompts)
        host = await run_path(address, client, prompts, CASES)
    return {"swap": swap, "host_hit": host}


# The default model's chat template for one user turn (its system prompt included), rendered.
CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def runs(module_servers, default_model_dir):
    """Start the servers together and run every path on them at once: the prompts, and each path's run (the
    reference's too)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(default_model_dir, "tokenizer.json"))
    questions = {c.name: c.question for c in CASES + N_CASES} | {"primer": PRIMER}
    prompts = {k: tokenizer.encode(CHAT.format(q), add_special_tokens=False).ids for k, q in questions.items()}
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(SERVERS)) as pool:
        started = {name: pool.submit(module_servers, *args, *COMMON) for name, args in SERVERS.items()}
        servers = {name: f.result() for name, f in started.items()}

    async def everything():
        return await asyncio.gather(prefix_paths(servers["prefix"], prompts),
                                    plain_paths(servers["plain"].address, prompts),
                                    tier_paths(servers["tier"].address, prompts))

    paths = {k: v for part in asyncio.run(asyncio.wait_for(everything(), 600)) for k, v in part.items()}
    for srv in servers.values():
        srv.stop()
    print(f"kv paths: servers and paths {time.monotonic() - t0:.1f} s")
    return prompts, paths


def assert_same(got: Completion, want: Completion, where: str) -> None:
    fields = lambda c: (c.token_ids, c.finish_reason, c.stop_str)  # noqa: E731
    assert fields(got) == fields(want), where
    assert len(got.logprobs) == len(want.logprobs), where
    for k, (g, w) in enumerate(zip(got.logprobs, want.logprobs)):
        assert_logprobs_close(g, w, f"{where}: logprobs[{k}]")
    assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None), where
    for k, (g, w) in enumerate(zip(got.prompt_logprobs or [], want.prompt_logprobs or [])):
        assert (g is None) == (w is None), f"{where}: prompt_logprobs[{k}]"
        if g is not None:
            assert_logprobs_close(g, w, f"{where}: prompt_logprobs[{k}]")


def assert_logprobs_close(g, w, where: str) -> None:
    close = lambda a, b: math.isclose(a, b, rel_tol=TOL, abs_tol=TOL)  # noqa: E731
    assert close(g.logprob, w.logprob), (where, g, w)
    assert len(g.top_ids) == len(w.top_ids), (where, g, w)
    for gi, wi, gl, wl in zip(g.top_ids, w.top_ids, g.top_logprobs, w.top_logprobs):
        assert close(gl, wl), (where, g, w)
        assert gi == wi or close(gl, wl), (where, g, w)  # ids of equal logprobs may swap places


def cases_of(path: str) -> list[Case]:
    return N_CASES if path == "n3" else CASES


@pytest.mark.parametrize("path,case", [(p, c.name) for p in PATHS for c in cases_of(p)])
def test_same_outputs_as_without_cache(runs, path, case):
    _, paths = runs
    reference = paths["reference"].outputs
    got = paths[path].outputs[case]
    spec = next(c for c in CASES + N_CASES if c.name == case)
    assert len(got) == spec.n
    n = reference_count(spec)
    for i, completion in enumerate(got):
        assert_same(completion, reference[(case, i % n)], f"{path}/{case}[{i}]")


def test_path_taken(runs):
    """Each path's counters prove that its requests reached the cache the way its name says."""
    prompts, paths = runs
    opening = 3 * BLOCK
    assert paths["reference"].delta("preemptions") == 0, paths["reference"].after
    hit = {p: paths[p].delta("prefix_cache_hit_tokens") for p in PATHS}
    assert hit["cold"] <= opening * len(CASES), paths["cold"].after  # nothing of a prompt's own
    owed = sum(1 for c in CASES if "prompt_logprobs" in c.sampling)  # owed prompt logprobs: no hit
    repeat_min = sum((len(prompts[c.name]) - 1) // BLOCK * BLOCK for c in CASES if "prompt_logprobs" not in c.sampling)
    assert hit["repeat_hit"] >= repeat_min, (hit, repeat_min)
    assert hit["shared_hit"] >= opening * (len(CASES) - owed), hit
    assert hit["n3"] >= sum(2 * ((len(prompts[c.name]) - 1) // BLOCK * BLOCK) for c in N_CASES), hit
    swap = paths["swap"]
    assert swap.delta("preemptions") > 0 and swap.delta("resumes") > 0 and hit["swap"] > 0, swap.after
    assert paths["host_hit"].delta("prefix_cache_host_hit_tokens") >= opening, paths["host_hit"].after
    recompute = paths["recompute"]
    assert recompute.delta("preemptions") > 0 and hit["recompute"] == 0, recompute.after
    # without prefix caching nothing is looked up, from start-up on (the reference's requests too)
    assert recompute.after.prefix_cache_query_tokens == recompute.after.prefix_cache_hit_tokens == 0, recompute.after
    restart = paths["restart"]
    assert restart.delta("executor_restarts") == 1, restart.after
    at_kill = restart.note["at_kill"]  # some request had outputs and more to come
    assert any(0 < n < len(restart.outputs[c][0].token_ids) for c, n in at_kill.items()), at_kill
    for last in ("restart", "recompute", "host_hit"):  # each server's last path: every block and slot back
        assert_no_leak(paths[last].after)
    tier = paths["host_hit"].after
    assert tier.num_free_host_kv_blocks == tier.num_host_kv_blocks == HOST_BLOCKS, tier
