"""Benchmark a running forerun server through the async client SDK.

    python scripts/bench_serve.py --address ipc:///tmp/forerun/client.sock \\
        --num-requests 500 --request-rate 20 --input-len 512 --output-len 128

Requests arrive all at once (``--request-rate inf``, the default) or as a
Poisson process, optionally capped at ``--concurrency`` in flight.  Prompts are
random token ids (``--dataset random``) or a small built-in set of chat prompts
(``--dataset chat``, which needs the server's tokenizer on this machine).  Text
is never detokenized: only token arrival times are measured.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

# Run from a checkout without installing the package.

from tqdm import tqdm

from ipc.client import AsyncClient, ForerunError, GenerateResult
from _bench_util import CHAT_PROMPTS, format_table, latency_rows, summarize, write_json

# Seconds to wait for the server's answer to Hello (requests themselves have no limit by default).
HANDSHAKE_TIMEOUT = 60.0



@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class Outcome:
    result: Optional[GenerateResult]
    error: Optional[str]

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.finish_reason in ("stop", "length")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True,
                   help="the server's client address (ipc://PATH or tcp://HOST:PORT)")
    p.add_argument("--num-requests", type=int, default=200,
                   help="requests to measure (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no cap)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean arrivals per second of a Poisson process; inf sends all at once "
                        "(default: %(default)s)")
    p.add_argument("--dataset", choices=["random", "chat"], default="random",
                   help="random token-id prompts, or the built-in chat prompts (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=256,
                   help="prompt tokens per request for --dataset random (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128,
                   help="max_tokens of every request (default: %(default)s)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="keep generating past EOS so every request makes --output-len tokens "
                        "(default: on for random prompts, off for chat)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts and the arrival times (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2,
                   help="requests sent and discarded before measuring (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds allowed per request, counted as failed past it (default: no limit)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the figures to this JSON file")
    p.add_argument("--no-progress", action="store_true",
                   help="hide the progress bar")
    args = p.parse_args(argv)
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset == "random"
    if args.num_requests < 1 or args.output_len < 1 or args.input_len < 1:
        p.error("--num-requests, --input-len and --output-len must be at least 1")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be positive")
    return args


def random_requests(n: int, input_len: int, output_len: int, vocab_size: int,
                    exclude: set[int], rng: random.Random) -> list[BenchRequest]:
    """Prompts of uniformly random token ids (EOS ids left out)."""
    ids = [t for t in range(vocab_size) if t not in exclude]
    return [BenchRequest([rng.choice(ids) for _ in range(input_len)], output_len) for _ in range(n)]


async def chat_requests(client: AsyncClient, n: int, output_len: int) -> list[BenchRequest]:
    """The built-in chat prompts, cycled, through the server's chat template."""
    encoded = [await client.encode(messages=[{"role": "user", "content": text}]) for text in CHAT_PROMPTS]
    return [BenchRequest(encoded[i % len(encoded)], output_len) for i in range(n)]


async def send_one(client: AsyncClient, req: BenchRequest, args: argparse.Namespace) -> Outcome:
    """One request; failures are recorded, not raised."""
    try:
        result = await client.generate(
            prompt_token_ids=req.prompt_token_ids, max_tokens=req.max_tokens,
            temperature=args.temperature, ignore_eos=args.ignore_eos,
            timeout=args.timeout if args.timeout is not None else math.inf, detokenize=False)
    except (ForerunError, TimeoutError, ConnectionError) as exc:
        return Outcome(None, f"{type(exc).__name__}: {exc}")
    return Outcome(result, None)


async def run_requests(client: AsyncClient, requests: list[BenchRequest], args: argparse.Namespace,
                       rng: random.Random, progress: Optional[tqdm] = None) -> tuple[list[Outcome], float]:
    """Send requests at the configured rate and cap; return outcomes and wall time."""
    limit = asyncio.Semaphore(args.concurrency) if args.concurrency else None

    async def limited(req: BenchRequest) -> Outcome:
        if limit is None:
            outcome = await send_one(client, req, args)
        else:
            async with limit:
                outcome = await send_one(client, req, args)
        if progress is not None:
            progress.update(1)
        return outcome

    start = time.perf_counter()
    tasks = []
    for i, req in enumerate(requests):
        # Poisson arrivals: exponential gaps between consecutive requests.
        if i and math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))
        tasks.append(asyncio.create_task(limited(req)))
    outcomes = await asyncio.gather(*tasks)
    return outcomes, time.perf_counter() - start


def metrics(outcomes: list[Outcome], duration: float) -> dict[str, Any]:
    """Throughput and latency figures of one run (latencies in ms)."""
    done = [o.result for o in outcomes if o.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.completion_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": summarize([r.timings.ttft for r in done if r.timings.ttft is not None], scale=1e3),
        "tpot_ms": summarize([r.timings.tpot for r in done if r.timings.tpot is not None], scale=1e3),
        "itl_ms": summarize([gap for r in done for gap in r.timings.itl], scale=1e3),
        "e2e_ms": summarize([r.timings.e2e for r in done], scale=1e3),
    }


def report(m: dict[str, Any]) -> str:
    """The results table."""
    rows: list[tuple[str, Any]] = [
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", m["duration_s"]),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total output tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", m["request_throughput"]),
        ("Output token throughput (tok/s)", m["output_throughput"]),
        ("Total token throughput (tok/s)", m["total_token_throughput"]),
    ]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        rows += latency_rows(name, m[key])
    return format_table(rows, title="Serving Benchmark Result")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    """Connect, build the workload, warm up, measure, print and return the figures."""
    rng = random.Random(args.seed)
    async with AsyncClient(args.address, timeout=HANDSHAKE_TIMEOUT, client_name="bench_serve") as client:
        info = client.server_info
        print(f"server: {info.model_name} on {info.device} ({info.dtype}), "
              f"max_model_len {info.max_model_len}, pipeline depth {info.pipeline_depth}")
        total = args.warmup + args.num_requests
        if args.dataset == "random":
            workload = random_requests(total, args.input_len, args.output_len, info.vocab_size,
                                       set(info.eos_token_ids), rng)
        else:
            workload = await chat_requests(client, total, args.output_len)
        warmup, measured = workload[:args.warmup], workload[args.warmup:]
        if warmup:
            outcomes, _ = await run_requests(client, warmup, args, rng)
            failures = [o.error for o in outcomes if not o.ok]
            if failures:
                print(f"warning: {len(failures)} warm-up requests failed: {failures[0]}", file=sys.stderr)
        with tqdm(total=len(measured), disable=args.no_progress, desc="requests") as progress:
            outcomes, duration = await run_requests(client, measured, args, rng, progress)
    errors = [o.error for o in outcomes if o.error]
    if errors:
        print(f"warning: {len(errors)} requests failed, first: {errors[0]}", file=sys.stderr)
    m = metrics(outcomes, duration)
    print(report(m))
    figures = {
        "config": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()},
        "server": {"model_name": info.model_name, "device": info.device, "dtype": info.dtype,
                   "max_model_len": info.max_model_len, "pipeline_depth": info.pipeline_depth},
        **m,
    }
    if args.json:
        write_json(args.json, figures)
    return figures


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Entry point: parse the flags and run the benchmark (on uvloop when installed)."""
    args = parse_args(argv)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_async(args))
    return uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
