"""The host KV tier's swap and chat workloads through the real planner, on a modelled clock (no GPU).

The planner (``scheduler_proc.planner``) plans against the scripted executor at pipeline depth 1;
each step lasts ``decode_ms + prefill_tokens * token_ms + onloaded_blocks * onload_ms``
(defaults fitted to the H100 runs of docs/performance.md, "Host KV tier": 8B shape). It shows
what the scheduling alone gives (preemptions, resumes, hits, TTFT in modelled time) so that a GPU
figure far from it points at the executor, not the planner.

    python scripts/sim_host_kv.py swap [--requests 32 --output-len 384 --pool-fraction 0.45]
    python scripts/sim_host_kv.py chat [--conversations 200 --first-len 256]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import os

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from executor_proc.testing.scripted import ScriptedRunner  # noqa: E402
from scheduler_proc import planner as planner_mod, steps as steps_mod  # noqa: E402
from scheduler_proc.limits import Limits  # noqa: E402
from scheduler_proc.planner import Planner  # noqa: E402
from tests.planner_harness import make_request  # noqa: E402


class Clock:
    """The modelled time, which the planner's resume clock reads as ``time.perf_counter``."""

    t = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.t


planner_mod.time = steps_mod.time = Clock


def planner(n_slots, n_blocks, block_size, max_len, budget, host_blocks, prefix=True, lag=1):
    limits = Limits(n_slots, n_blocks, block_size, max_len, budget, frozenset({2}), num_host_blocks=host_blocks)
    pl = Planner(limits, prefix_cache_id="sim" if prefix else None)
    return pl, ScriptedRunner(n_slots, n_blocks, block_size, vocab_size=50000, eos_token_id=2,
                              num_host_blocks=host_blocks, backup_lag=lag)


def step(pl, ex, inflight, a) -> list:
    """Keep two plans in flight (depth 1), run the oldest on the modelled clock; its outputs (None: idle)."""
    while len(inflight) <= 1 and (plan := pl.plan()) is not None:
        inflight.append(plan)
    if not inflight:
        return None
    plan = inflight.popleft()
    prefill = sum(n for n, p in zip(plan.num_tokens, plan.is_prefill) if p)
    Clock.t += (a.decode_ms + a.token_ms * prefill + a.onload_ms * len(plan.onloads) // 2) / 1e3
    return pl.reconcile(ex.execute(plan))


def swap(a, host_blocks: int, prefix: bool = True) -> dict:
    per = -(-(a.context_len + a.output_len) // a.block_size)
    pl, ex = planner(a.requests, int(a.requests * per * a.pool_fraction), a.block_size,
                     a.context_len + a.output_len + 16, a.budget, host_blocks, prefix)
    Clock.t = 0.0
    for i in range(a.requests):
        r = make_request(i, prompt_len=a.context_len, max_tokens=a.output_len, ignore_eos=True)
        r.prompt = [10 + (i * 7919 + j * 31) % 40000 for j in range(a.context_len)]
        pl.add(r)
    inflight: collections.deque = collections.deque()
    while step(pl, ex, inflight, a) is not None:
        pass
    return dict(wall_s=Clock.t, preemptions=pl.num_preemptions, resumes=pl.resumes.count,
                resume_ms_mean=pl.resumes.seconds / max(1, pl.resumes.count) * 1e3,
                device_hit_tokens=(pl.prefix.hit_tokens - (pl.host.hit_tokens if pl.host else 0)) if prefix else 0,
                host_hit_tokens=pl.host.hit_tokens if pl.host else 0)


def chat(a, host_blocks: int) -> dict:
    final = a.first_len + a.turns * (a.user_len + a.reply_len)
    per = -(-final // a.block_size)
    pl, ex = planner(a.concurrency, int(a.conversations * per * a.pool_fraction), a.block_size, final + 16,
                     a.budget, host_blocks)
    rng = random.Random(2)
    convs = [[rng.randrange(10, 40000) for _ in range(a.first_len)] for _ in range(a.conversations)]
    Clock.t = 0.0
    todo = collections.deque((t, i) for t in range(a.turns) for i in range(a.conversations))
    done = [0] * a.conversations
    active: dict = {}  # rid -> [conversation, t0, request, first token seen]
    ttft: list[float] = []
    inflight: collections.deque = collections.deque()
    rid = 0
    while True:
        while len(active) < a.concurrency and todo and all(d >= todo[0][0] for d in done):  # a turn is a barrier
            _, i = todo.popleft()
            r = make_request(rid, prompt_len=1, max_tokens=a.reply_len, ignore_eos=True)
            r.prompt = convs[i] + [rng.randrange(10, 40000) for _ in range(a.user_len)]
            active[rid] = [i, Clock.t, r, False]
            pl.add(r)
            rid += 1
        outputs = step(pl, ex, inflight, a)
        if outputs is None:
            if not todo and not active:
                break
            continue
        for o in outputs:
            rec = active.get(o.request.rid)
            if not rec[3]:
                rec[3] = True
                ttft.append(Clock.t - rec[1])
            if o.finish_reason:
                convs[rec[0]] = rec[2].prompt + rec[2].output
                done[rec[0]] += 1
                del active[o.request.rid]
    return dict(wall_s=Clock.t, ttft_ms_p50=statistics.median(ttft) * 1e3,
                host_hit_tokens=pl.host.hit_tokens if pl.host else 0, preemptions=pl.num_preemptions)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("swap", "chat"))
    for name, default in dict(block_size=16, budget=2048, requests=32, context_len=2048, output_len=384,
                              conversations=200, turns=4, first_len=256, user_len=32, reply_len=32,
                              concurrency=32).items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    ap.add_argument("--pool-fraction", type=float, default=None, help="default: swap 0.45, chat 0.25")
    ap.add_argument("--decode-ms", type=float, default=None, help="default: swap 8.0, chat 7.3 (H100 step logs)")
    ap.add_argument("--token-ms", type=float, default=0.02, help="per prefill token")
    ap.add_argument("--onload-ms", type=float, default=0.044, help="per onloaded block (2 MiB at 48 GB/s)")
    a = ap.parse_args(argv)
    if a.mode == "swap":
        a.pool_fraction = a.pool_fraction or 0.45
        a.decode_ms = a.decode_ms or 8.0
        per = -(-(a.context_len + a.output_len) // a.block_size)
        for name, kw in (("recompute", dict(host_blocks=0, prefix=False)), ("off", dict(host_blocks=0)),
                         ("on", dict(host_blocks=int(a.requests * per * 1.25)))):
            print(name, {k: round(v, 2) for k, v in swap(a, **kw).items()})
    else:
        a.pool_fraction = a.pool_fraction or 0.25
        a.decode_ms = a.decode_ms or 7.3
        per = -(-(a.first_len + a.turns * (a.user_len + a.reply_len)) // a.block_size)
        for name, blocks in (("device_only", 0), ("host_tier", int(a.conversations * per * 1.25))):
            print(name, {k: round(v, 2) for k, v in chat(a, blocks).items()})


if __name__ == "__main__":
    main()
