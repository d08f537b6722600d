"""The KV caches: what the device prefix cache buys, what the host tier's backups cost, what swaps and host
prefix hits buy.

    python scripts/bench_host_kv.py --mode prefix --model scripts/configs/llama-3.2-1b --json prefix.json

    python scripts/bench_host_kv.py --mode tpot --json tpot.json      # H100: 8B shape, random weights
    python scripts/bench_host_kv.py --mode swap --json swap.json
    python scripts/bench_host_kv.py --mode chat --json chat.json
    python scripts/bench_host_kv.py --mode all --json host_kv.json
    python scripts/bench_host_kv.py --device cpu --model TINY_DIR --tiny   # the CPU smoke test's settings

Each mode starts its own servers (``forerun serve --load-format dummy --model
scripts/configs/llama-3-8b`` by default) one after another and sends the same
workload to each:

* ``prefix``: ``--num-requests`` (64) requests share one random ``--prefix-len``
  (2,048) token prefix, each with its own ``--suffix-len`` (64) tokens, and
  decode ``--prefix-output-len`` (64) tokens, all sent at once (after a warm-up
  on another prefix and a ``ResetPrefixCache``).  Two servers: without prefix
  caching, and with it (device only).  Reported: TTFT p50/p90, output
  throughput, prompt tokens looked up and found.
* ``tpot``: ``--batch`` (64) requests of ``--prompt-len`` (128) tokens decode
  ``--output-len`` (256) tokens each, EOS ignored.  Three servers: the tier off,
  backups on their own stream (the default), backups on the compute stream
  (``--host-kv-backup-on-compute-stream``).  With the tier on, every block a
  decode row fills is backed up (about ``batch / block_size`` blocks a step).
  Reported: inter-token latency p50 (the decode step as a client sees it), mean
  TPOT per request, and the GPU's busy time per step from ``ServerStats``.
* ``swap``: ``--swap-requests`` (32) requests of ``--context-len`` (2,048)
  tokens plus ``--swap-output-len`` (384) outputs on a device pool of
  ``--swap-pool-fraction`` (0.45) of what they need together, so decode growth
  preempts some.  Three servers: ``recompute`` (no prefix caching: a preempted
  request recomputes its whole context), ``off`` (device-only prefix caching:
  it finds what of its KV was not evicted while it waited, and recomputes the
  rest), ``on`` (the host tier, a host pool that holds every request: its
  blocks were backed up as they filled and it resumes by copy).
  Reported: preemptions; resumes and their mean latency as the server measures
  it (``ServerStats.resume_s_total``: from the plan that readmits a preempted
  request to the reconcile of its next token: recompute or copy, plus the
  pipeline; the target's figure); the longest gap in each preempted request's
  stream (p50 and max: queueing for blocks included, as a client sees it);
  output throughput; the tokens found per tier.
* ``chat``: ``--conversations`` (200) x ``--turns`` (4): each turn resends the
  conversation so far (a ``--first-len`` (256) token opening, then
  ``--user-len`` (32) new tokens and ``--reply-len`` (32) outputs per turn).
  ``--arrival think`` (default): every conversation on its own, each turn an
  exponential think time (mean ``--think-s``) after the previous reply, the
  server running ``--concurrency`` (32) at a time and queueing the rest (TTFT
  from the send, queueing included); ``--arrival lockstep``: turn t of every
  conversation before any turn t + 1, ``--concurrency`` at a time (the first
  GPU runs: 32 admitted together, finishing together).  Device pool:
  ``--chat-pool-fraction`` (1/4) of the working set (every conversation's final
  length); host pool: 1.25 x the working set.  Device-only prefix caching vs the
  host tier: hit rate per tier, TTFT p50/p90, turns per second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from typing import Any, Optional

from ipc import protocol as p
from ipc.client import AsyncClient
from ipc.client.raw import RawConnection
from benchlib import format_table, ipc_address, percentile, run_dir, start_server, stop_server, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("prefix", "tpot", "swap", "chat")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="all", choices=MODES + ("all",), help="which measurement (all: each in turn)")
    ap.add_argument("--model", default=os.path.join(ROOT, "scripts", "configs", "llama-3-8b"),
                    help="model folder (default: the Llama-3-8B shape, random weights)")
    ap.add_argument("--load-format", default="dummy", help="as for forerun serve")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pipeline-depth", type=int, default=1)
    ap.add_argument("--host-kv-gib", type=float, default=None,
                    help="host pool for tpot and swap (default: the server's, 4 GiB on cuda)")
    ap.add_argument("--num-requests", type=int, default=64, help="prefix: requests sharing the prefix")
    ap.add_argument("--prefix-len", type=int, default=2048, help="prefix: tokens of the shared prefix")
    ap.add_argument("--suffix-len", type=int, default=64, help="prefix: each request's own tokens after it")
    ap.add_argument("--prefix-output-len", type=int, default=64, help="prefix: output tokens per request")
    ap.add_argument("--batch", type=int, default=64, help="tpot: requests decoding together")
    ap.add_argument("--prompt-len", type=int, default=128, help="tpot: prompt tokens per request")
    ap.add_argument("--output-len", type=int, default=256, help="tpot: output tokens per request")
    ap.add_argument("--swap-requests", type=int, default=32, help="swap: requests")
    ap.add_argument("--context-len", type=int, default=2048, help="swap: prompt tokens per request")
    ap.add_argument("--swap-output-len", type=int, default=384, help="swap: output tokens per request")
    ap.add_argument("--swap-pool-fraction", type=float, default=0.45,
                    help="swap: device pool as a fraction of the blocks all requests need together")
    ap.add_argument("--conversations", type=int, default=200, help="chat: conversations")
    ap.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    ap.add_argument("--first-len", type=int, default=256, help="chat: tokens of each conversation's opening")
    ap.add_argument("--user-len", type=int, default=32, help="chat: new user tokens per turn")
    ap.add_argument("--reply-len", type=int, default=32, help="chat: output tokens per turn")
    ap.add_argument("--concurrency", type=int, default=32,
                    help="chat: requests the server runs at once (--max-num-seqs; lockstep: the client's limit too)")
    ap.add_argument("--arrival", choices=("think", "lockstep"), default="think",
                    help="chat: each conversation on its own, a think time after each reply (default), or turn by "
                         "turn in lockstep")
    ap.add_argument("--think-s", type=float, default=2.5, help="chat, think: mean think time (exponential), seconds")
    ap.add_argument("--seed", type=int, default=3, help="chat, think: the think times' seed")
    ap.add_argument("--chat-pool-fraction", type=float, default=0.25, help="chat: device pool / working set")
    ap.add_argument("--tiny", action="store_true", help="a few small requests per mode (the CPU smoke test)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per server run")
    ap.add_argument("--step-log-dir", default=None, help="each server writes its --step-log here (MODE_VARIANT.jsonl)")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    if args.tiny:
        for name, value in dict(num_requests=4, prefix_len=32, suffix_len=4, prefix_output_len=4,
                                batch=4, prompt_len=8, output_len=24, swap_requests=4, context_len=40,
                                swap_output_len=24, conversations=6, turns=3, first_len=24, user_len=4,
                                reply_len=4, concurrency=3, block_size=4, think_s=0.05).items():
            setattr(args, name, value)
    return args


# ------------------------------------------------------------------ servers


def base_flags(args: argparse.Namespace, max_len: int, slots: int) -> list[str]:
    return ["--model", args.model, "--load-format", args.load_format, "--device", args.device, "--dtype", args.dtype,
            "--block-size", str(args.block_size), "--pipeline-depth", str(args.pipeline_depth),
            "--max-num-seqs", str(max(slots, 2)), "--max-model-len", str(max_len)]


def host_flags(args: argparse.Namespace, on: bool) -> list[str]:
    if not on:
        return ["--host-kv-gib", "0"]
    if args.host_kv_gib is not None:
        return ["--host-kv-gib", str(args.host_kv_gib)]
    return [] if args.device.startswith("cuda") else ["--host-kv-gib", "0.25"]


async def stats(raw: RawConnection) -> p.ServerStats:
    return await raw.stats()


def with_server(flags: list[str], args: argparse.Namespace, work, name: str = "") -> dict[str, Any]:
    """Start a server with ``flags``, run ``await work(client, raw)``, stop it; returns work's figures."""
    if args.step_log_dir and name:
        os.makedirs(args.step_log_dir, exist_ok=True)
        flags = flags + ["--step-log", os.path.join(args.step_log_dir, f"{name}.jsonl")]
    tmp = run_dir("frh")
    address = ipc_address(tmp)
    server = start_server(address, *flags, run_dir=tmp, echo=False, timeout=args.timeout)

    async def go():
        async with AsyncClient(address, timeout=args.timeout) as client, RawConnection(address, timeout=30) as raw:
            await raw.hello("bench_host_kv stats")
            return await asyncio.wait_for(work(client, raw), args.timeout)
    try:
        return asyncio.run(go())
    finally:
        stop_server(server)


class Tokens:
    """Random token ids that are not EOS."""

    def __init__(self, client: AsyncClient, seed: int):
        self.vocab, self.eos = client.server_info.vocab_size, set(client.server_info.eos_token_ids)
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            t = self.rng.randrange(10, self.vocab)
            if t not in self.eos:
                out.append(t)
        return out


async def stream(client: AsyncClient, ids: list[int], max_tokens: int) -> tuple[list[float], list[int]]:
    """(arrival time of each chunk, tokens in it) of one greedy request, EOS ignored; times from its send."""
    t0 = time.perf_counter()
    times, counts = [], []
    async for chunk in client.stream(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0,
                                     ignore_eos=True, detokenize=False):
        times.append(time.perf_counter() - t0)
        counts.append(len(chunk.token_ids))
    return times, counts


async def warm_up(client: AsyncClient, tokens: "Tokens", block_size: int) -> None:
    """Before the clock: a prefill alone, then a short prefill beside its decode row (the eager steps' kernels,
    both tile shapes, compile here rather than in the measured run)."""
    second = None
    async for _ in client.stream(prompt_token_ids=tokens(block_size * 2), max_tokens=8, temperature=0.0,
                                 ignore_eos=True, detokenize=False):
        second = second or asyncio.ensure_future(stream(client, tokens(block_size // 2 + 1), 4))
    await second


def tier_hits(before: p.ServerStats, after: p.ServerStats) -> dict[str, Any]:
    query = after.prefix_cache_query_tokens - before.prefix_cache_query_tokens
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    host = after.prefix_cache_host_hit_tokens - before.prefix_cache_host_hit_tokens
    return {"query_tokens": query, "device_hit_tokens": hits - host, "host_hit_tokens": host,
            "device_hit_rate": (hits - host) / query if query else 0.0, "host_hit_rate": host / query if query else 0.0,
            "preemptions": after.preemptions - before.preemptions, "resumes": after.resumes - before.resumes,
            "resume_ms_mean": (after.resume_s_total - before.resume_s_total) / (after.resumes - before.resumes) * 1e3
            if after.resumes > before.resumes else None}


# ------------------------------------------------------------------- prefix


def run_prefix(args: argparse.Namespace) -> dict[str, Any]:
    """Requests sharing a long prefix, all at once: a server without prefix caching, then one with it."""
    flags = base_flags(args, args.prefix_len + args.suffix_len + args.prefix_output_len + 16, args.num_requests)
    flags += ["--max-num-batched-tokens", "2048", "--host-kv-gib", "0"]

    async def work(client, raw):
        tokens = Tokens(client, 3)
        warm = tokens(args.prefix_len)
        await asyncio.gather(*[stream(client, warm + tokens(args.suffix_len), 4) for _ in range(2)])
        await raw.send(p.ResetPrefixCache())  # answered with ServerStats
        await raw.recv()
        before = await stats(raw)
        prefix = tokens(args.prefix_len)
        t0 = time.perf_counter()
        runs = await asyncio.gather(*[stream(client, prefix + tokens(args.suffix_len), args.prefix_output_len)
                                      for _ in range(args.num_requests)])
        wall = time.perf_counter() - t0
        after = await stats(raw)
        ttfts = [times[0] * 1e3 for times, _ in runs]
        out = {"ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p90": percentile(ttfts, 90), "wall_s": wall,
               "output_tok_per_s": sum(sum(c) for _, c in runs) / wall}
        out.update(tier_hits(before, after))
        return out

    out = {name: with_server(flags + extra, args, work, f"prefix_{name}")
           for name, extra in (("off", ["--no-prefix-caching"]), ("on", []))}
    out["ttft_p50_speedup"] = out["off"]["ttft_ms_p50"] / out["on"]["ttft_ms_p50"]
    return out


# --------------------------------------------------------------------- tpot


def run_tpot(args: argparse.Namespace) -> dict[str, Any]:
    """Decode at ``--batch`` with the tier off, backups on their stream, backups on the compute stream."""
    flags = base_flags(args, args.prompt_len + args.output_len + 16, args.batch)
    flags += ["--max-num-batched-tokens", str(max(2048, args.prompt_len))]
    variants = {"off": host_flags(args, False), "backup_stream": host_flags(args, True),
                "compute_stream": host_flags(args, True) + ["--host-kv-backup-on-compute-stream"]}

    async def work(client, raw):
        tokens = Tokens(client, 0)
        # Warm-up at the measured shape (admission chunks, batch-64 decode): kernels compile before the clock.
        await asyncio.gather(*[stream(client, tokens(args.prompt_len), 2 * args.block_size) for _ in range(args.batch)])
        before = await stats(raw)
        runs = await asyncio.gather(*[stream(client, tokens(args.prompt_len), args.output_len)
                                      for _ in range(args.batch)])
        after = await stats(raw)
        gaps = [b - a for times, _ in runs for a, b in zip(times, times[1:])]
        tpot = [(t[-1] - t[0]) / max(1, sum(c) - c[0]) for t, c in runs]
        steps = max(1, after.steps - before.steps)
        return {"itl_ms_p50": percentile(gaps, 50) * 1e3, "itl_ms_p90": percentile(gaps, 90) * 1e3,
                "tpot_ms_mean": sum(tpot) / len(tpot) * 1e3,
                "gpu_busy_ms_per_step": (after.gpu_busy_s_total - before.gpu_busy_s_total) / steps * 1e3,
                "step_ms_mean": (after.step_time_s_total - before.step_time_s_total) / steps * 1e3,
                "host_blocks": after.num_host_kv_blocks}

    out = {name: with_server(flags + extra, args, work, f"tpot_{name}") for name, extra in variants.items()}
    base = out["off"]["itl_ms_p50"]
    for name in ("backup_stream", "compute_stream"):
        out[name]["itl_overhead_pct"] = (out[name]["itl_ms_p50"] / base - 1) * 100
    return out


# --------------------------------------------------------------------- swap


def run_swap(args: argparse.Namespace) -> dict[str, Any]:
    """Long contexts on a device pool too small for all of them: recompute (no prefix caching), device-only
    prefix caching (a preempted request finds what of its KV was not evicted yet), swap (the host tier)."""
    per_request = -(-(args.context_len + args.swap_output_len) // args.block_size)
    pool = max(per_request + 1, int(args.swap_requests * per_request * args.swap_pool_fraction))
    host_blocks = str(int(args.swap_requests * per_request * 1.25))  # every request's blocks fit on the host
    flags = base_flags(args, args.context_len + args.swap_output_len + 16, args.swap_requests)
    flags += ["--num-kv-blocks", str(pool), "--max-num-batched-tokens", str(max(2048, args.block_size))]

    async def work(client, raw):
        tokens = Tokens(client, 1)
        await warm_up(client, tokens, args.block_size)
        before = await stats(raw)
        t0 = time.perf_counter()
        runs = await asyncio.gather(*[stream(client, tokens(args.context_len), args.swap_output_len)
                                      for _ in range(args.swap_requests)])
        wall = time.perf_counter() - t0
        after = await stats(raw)
        decode_gaps = sorted(max((b - a for a, b in zip(t, t[1:])), default=0.0) for t, _ in runs)
        step_ms = (after.step_time_s_total - before.step_time_s_total) / max(1, after.steps - before.steps) * 1e3
        # A request's longest gap well above a step is its preemption: out of the batch until it resumed.
        resumed = [g * 1e3 for g in decode_gaps if g * 1e3 > 20 * step_ms]
        out = {"wall_s": wall, "output_tok_per_s": sum(sum(c) for _, c in runs) / wall,
               "resume_gap_ms_p50": percentile(resumed, 50), "resume_gap_ms_max": max(resumed, default=None),
               "resumed_requests": len(resumed), "device_blocks": pool, "step_ms_mean": step_ms}
        out.update(tier_hits(before, after))
        return out

    variants = {"recompute": ["--no-prefix-caching"], "off": host_flags(args, False),
                "on": ["--num-host-kv-blocks", host_blocks]}
    out = {name: with_server(flags + extra, args, work, f"swap_{name}") for name, extra in variants.items()}
    for base in ("recompute", "off"):
        if out[base]["resume_ms_mean"] and out["on"]["resume_ms_mean"]:
            out[f"resume_speedup_vs_{base}"] = out[base]["resume_ms_mean"] / out["on"]["resume_ms_mean"]
        out[f"throughput_ratio_vs_{base}"] = out["on"]["output_tok_per_s"] / out[base]["output_tok_per_s"]
    return out


# --------------------------------------------------------------------- chat


def run_chat(args: argparse.Namespace) -> dict[str, Any]:
    """Multi-turn chat resending the conversation; device pool a quarter of the working set."""
    final_len = args.first_len + args.turns * (args.user_len + args.reply_len)
    working_set = args.conversations * -(-final_len // args.block_size)
    device_pool = max(-(-final_len // args.block_size) + 1, int(working_set * args.chat_pool_fraction))
    flags = base_flags(args, final_len + 16, args.concurrency) + ["--num-kv-blocks", str(device_pool)]
    variants = {"device_only": ["--host-kv-gib", "0"],
                "host_tier": ["--num-host-kv-blocks", str(int(working_set * 1.25))]}

    async def work(client, raw):
        tokens = Tokens(client, 2)
        convs = [tokens(args.first_len) for _ in range(args.conversations)]
        await warm_up(client, tokens, args.block_size)
        before = await stats(raw)
        ttfts: list[float] = []

        async def turn(i: int) -> None:
            ids = convs[i] + tokens(args.user_len)
            t0 = time.perf_counter()
            reply: list[int] = []
            async for chunk in client.stream(prompt_token_ids=ids, max_tokens=args.reply_len, temperature=0.0,
                                             ignore_eos=True, detokenize=False):
                if not reply:
                    ttfts.append(time.perf_counter() - t0)
                reply += chunk.token_ids
            convs[i] = ids + reply

        t0 = time.perf_counter()
        await (chat_lockstep if args.arrival == "lockstep" else chat_think)(args, turn)
        wall = time.perf_counter() - t0
        after = await stats(raw)
        out = {"ttft_ms_p50": percentile(ttfts, 50) * 1e3, "ttft_ms_p90": percentile(ttfts, 90) * 1e3,
               "wall_s": wall, "turns_per_s": len(ttfts) / wall, "device_blocks": device_pool,
               "working_set_blocks": working_set}
        out.update(tier_hits(before, after))
        return out

    out = {name: with_server(flags + extra, args, work, f"chat_{name}") for name, extra in variants.items()}
    out["ttft_p50_speedup"] = out["device_only"]["ttft_ms_p50"] / out["host_tier"]["ttft_ms_p50"]
    return out


async def chat_lockstep(args: argparse.Namespace, turn) -> None:
    """Turn t of every conversation before any turn t + 1, ``--concurrency`` at a time (the first GPU runs)."""
    gate = asyncio.Semaphore(args.concurrency)

    async def gated(i: int) -> None:
        async with gate:
            await turn(i)
    for _ in range(args.turns):
        await asyncio.gather(*[gated(i) for i in range(args.conversations)])


async def chat_think(args: argparse.Namespace, turn) -> None:
    """Every conversation on its own: each turn ``Exp(--think-s)`` after the previous reply (the first after the
    start); the server admits ``--concurrency`` at a time and queues the rest (the wait counts in TTFT)."""
    async def conversation(i: int) -> None:
        rng = random.Random(args.seed * 100_003 + i)
        for _ in range(args.turns):
            await asyncio.sleep(rng.expovariate(1 / args.think_s))
            await turn(i)
    await asyncio.gather(*[conversation(i) for i in range(args.conversations)])


# --------------------------------------------------------------------- main


def table(mode: str, figures: dict[str, Any]) -> str:
    names = [k for k, v in figures.items() if isinstance(v, dict)]
    keys = [k for k in figures[names[0]] if isinstance(figures[names[0]][k], (int, float))]
    for n in names[1:]:
        keys += [k for k in figures[n] if k not in keys and isinstance(figures[n][k], (int, float))]

    def cell(v):
        return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
    rows = [("", " ".join(f"{n:>15}" for n in names))]
    rows += [(k, " ".join(f"{cell(figures[n].get(k)):>15}" for n in names)) for k in keys]
    rows += [(k, cell(v)) for k, v in figures.items() if not isinstance(v, dict)]
    return format_table(rows, title=f"host KV tier: {mode}")


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    runners = {"prefix": run_prefix, "tpot": run_tpot, "swap": run_swap, "chat": run_chat}
    modes = MODES if args.mode == "all" else (args.mode,)
    figures: dict[str, Any] = {"config": vars(args)}
    for mode in modes:
        figures[mode] = runners[mode](args)
        print(table(mode, figures[mode]), flush=True)
    if args.json:
        write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
