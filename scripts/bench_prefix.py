"""Prefix caching: TTFT and output throughput with and without it, in the same run.

    python scripts/bench_prefix.py --json out.json                              # CPU, default model
    python scripts/bench_prefix.py --prefix-len 512 --output-len 16             # CPU, quicker
    python scripts/bench_prefix.py --device cuda --load-format dummy \\
        --model scripts/configs/llama-3.2-1b --json prefix-1b.json             # GPU, random 1B weights

Workload: ``--num-requests`` (64) requests that share one random
``--prefix-len`` (2,048) token prefix, each with its own random
``--suffix-len`` (64) token suffix, ``--output-len`` (64) greedy tokens each,
EOS ignored, all sent at once.  It starts a server with
``--no-prefix-caching``, runs the workload, stops it, then does the same with
prefix caching on (the default).  Before the measured requests each server
serves two warm-up requests on another prefix, and the cache is reset, so the
measured run starts cold: the first requests compute the prefix, the others
share it as soon as the step that wrote it has come back.

TTFT is the time from sending a request to its first token; output
throughput is output tokens over the wall time of the whole batch.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import AsyncClient  # noqa: E402
from scripts._bench_util import format_table, percentile, write_json  # noqa: E402
from tests.server_proc import ServerProcess, reset_prefix_cache, server_stats  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="as for forerun serve (default: the default model)")
    ap.add_argument("--load-format", default="auto", help="as for forerun serve (dummy: random weights)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--pipeline-depth", type=int, default=1)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="default: the server's sizing")
    ap.add_argument("--server-arg", action="append", default=[], help="extra forerun serve flag (repeatable)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole batch")
    ap.add_argument("--json", default=None, metavar="PATH")
    return ap.parse_args(argv)


def server_flags(args: argparse.Namespace, prefix_caching: bool) -> list[str]:
    flags = ["--device", args.device, "--dtype", args.dtype, "--load-format", args.load_format,
             "--pipeline-depth", str(args.pipeline_depth), "--max-num-seqs", str(max(args.num_requests, 2)),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-model-len", str(args.prefix_len + args.suffix_len + args.output_len + 16)]
    if args.model:
        flags += ["--model", args.model]
    if args.num_kv_blocks:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if not prefix_caching:
        flags.append("--no-prefix-caching")
    return flags + args.server_arg


async def timed_request(client: AsyncClient, ids: list[int], max_tokens: int) -> tuple[float, int]:
    """(TTFT in seconds, output tokens) of one greedy request."""
    t0 = time.perf_counter()
    ttft, n = None, 0
    async for chunk in client.stream(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0,
                                     ignore_eos=True, detokenize=False):
        if ttft is None:
            ttft = time.perf_counter() - t0
        n += len(chunk.token_ids)
    return ttft, n


async def drive(address: str, args: argparse.Namespace) -> dict[str, Any]:
    async with AsyncClient(address, timeout=args.timeout) as client:
        vocab = client.server_info.vocab_size
        eos = set(client.server_info.eos_token_ids)
        rng = random.Random(0)

        def tokens(n: int) -> list[int]:
            out = []
            while len(out) < n:
                t = rng.randrange(10, vocab)
                if t not in eos:
                    out.append(t)
            return out

        warm = tokens(args.prefix_len)
        await asyncio.gather(*[timed_request(client, warm + tokens(args.suffix_len), 4) for _ in range(2)])
        await reset_prefix_cache(address)
        before = await server_stats(address)
        prefix = tokens(args.prefix_len)
        prompts = [prefix + tokens(args.suffix_len) for _ in range(args.num_requests)]
        t0 = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*[timed_request(client, ids, args.output_len) for ids in prompts]), args.timeout)
        wall = time.perf_counter() - t0
        after = await server_stats(address)
    ttfts = [r[0] * 1e3 for r in results]
    out_tokens = sum(r[1] for r in results)
    return {
        "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p90": percentile(ttfts, 90),
        "output_tok_per_s": out_tokens / wall, "wall_s": wall, "output_tokens": out_tokens,
        "hit_tokens": after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
        "query_tokens": after.prefix_cache_query_tokens - before.prefix_cache_query_tokens,
    }


def run_server(args: argparse.Namespace, prefix_caching: bool) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="frp", dir="/tmp")  # short: ipc paths are limited to 107 bytes
    server = ServerProcess(*server_flags(args, prefix_caching), tmpdir=tmp, timeout=1800)
    try:
        return asyncio.run(drive(server.address, args))
    finally:
        server.stop()


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    runs = {name: run_server(args, on) for name, on in (("off", False), ("on", True))}
    rows = [("", "off", "on")]
    for key, fmt in (("ttft_ms_p50", "{:.1f}"), ("ttft_ms_p90", "{:.1f}"), ("output_tok_per_s", "{:.1f}"),
                     ("wall_s", "{:.2f}"), ("hit_tokens", "{}"), ("query_tokens", "{}")):
        rows.append((key, fmt.format(runs["off"][key]), fmt.format(runs["on"][key])))
    print(format_table([(r[0], f"{r[1]:>12} {r[2]:>12}") for r in rows],
                       title=f"{args.num_requests} requests, prefix {args.prefix_len}, suffix {args.suffix_len}, "
                             f"output {args.output_len}, {args.device}"))
    speedup = runs["off"]["ttft_ms_p50"] / runs["on"]["ttft_ms_p50"]
    print(f"TTFT p50 {speedup:.2f}x lower with prefix caching")
    figures = {"config": vars(args), "off": runs["off"], "on": runs["on"], "ttft_p50_speedup": speedup}
    if args.json:
        write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
