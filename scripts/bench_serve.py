"""Benchmark a running forerun server through the async client SDK or its OpenAI HTTP API.

    python scripts/bench_serve.py --address ipc:///tmp/forerun/client.sock \\
        --num-requests 500 --request-rate 20 --input-len 512 --output-len 128
    python scripts/bench_serve.py --backend openai --base-url http://127.0.0.1:8000 \\
        --address ipc:///tmp/forerun/client.sock --num-requests 500 ...

``--backend openai`` sends the same workload as streaming ``/v1/completions``
requests (token-id prompts, ``stream_options.include_usage``) and times each
SSE event as the SDK path times each token message; ``--address`` is still
used once, to read the model's vocabulary for the random prompts (without it,
``--vocab-size`` ids are used).

``--http-keep-alive`` sends the HTTP requests on kept-alive connections, opened
during the warm-up (as many as can be in flight), as a pooling client or a proxy
does; without it each request opens its own connection.

Requests arrive all at once (``--request-rate inf``, the default) or as a
Poisson process, optionally capped at ``--concurrency`` in flight.
``--client-procs N`` spreads them over N client processes (round-robin, each
with its share of the warm-up, the cap and the rate) that start measuring at
the same instant: one process following hundreds of streams can be the limit
it measures.  Percentiles and throughput are taken over the union.  Prompts are
random token ids (``--dataset random``) or a small built-in set of chat prompts
(``--dataset chat``, which needs the server's tokenizer on this machine; ``--prompts-file`` another set, e.g.
``scripts/data/spec_prompts.jsonl``: edits of a given text, for speculative decoding).  Text is never
detokenized: only token arrival times are measured.  A server that speculates also reports its drafts.
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

import msgspec
from tqdm import tqdm

from ipc.client import AsyncClient, ForerunError
from benchlib import (CHAT_PROMPTS, Connections, Gate, HTTPError, format_table, latency_rows, run_processes,
                         sse_post, summarize, write_json)

# Seconds to wait for the server's answer to Hello (requests themselves have no limit by default).
HANDSHAKE_TIMEOUT = 60.0


class BenchRequest(msgspec.Struct, array_like=True):
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class HttpTimings:
    """The SDK's Timings, from SSE event arrival times (seconds since the request was sent)."""

    ttft: Optional[float]
    e2e: float
    itl: list[float]
    completion_tokens: int

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


@dataclass
class HttpResult:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: HttpTimings


@dataclass
class Outcome:
    result: Any  # GenerateResult or HttpResult
    error: Optional[str]

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.finish_reason in ("stop", "length")


class Sample(msgspec.Struct, array_like=True):
    """One request's figures (seconds since it was sent), as metrics() reads them and client processes send them."""

    ok: bool
    error: Optional[str]
    prompt_tokens: int
    completion_tokens: int
    ttft: Optional[float]
    tpot: Optional[float]
    e2e: float
    itl: list[float]


def sample(o: Outcome) -> Sample:
    """The figures of one outcome."""
    if not o.ok:
        return Sample(False, o.error, 0, 0, None, None, 0.0, [])
    r, t = o.result, o.result.timings
    return Sample(True, None, r.prompt_tokens, r.completion_tokens, t.ttft, t.tpot, t.e2e, t.itl)


class Share(msgspec.Struct):
    """What one client process runs: the options (its share of the cap and rate) and its requests."""

    options: dict[str, Any]
    seed: int
    warmup: list[BenchRequest]
    measured: list[BenchRequest]


class ShareResult(msgspec.Struct):
    samples: list[Sample]
    end: float  # perf_counter when its last request ended
    cpu_s: float  # its CPU time over the measured run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["sdk", "openai"], default="sdk",
                   help="drive the server through the SDK or its OpenAI HTTP API (default: %(default)s)")
    p.add_argument("--address", default=None,
                   help="the server's client address (ipc://PATH or tcp://HOST:PORT); needed for --backend sdk")
    p.add_argument("--base-url", default=None, help="the HTTP API, e.g. http://127.0.0.1:8000 (--backend openai)")
    p.add_argument("--model", default=None, help="model name sent over HTTP (default: the server's)")
    p.add_argument("--api-key", default=None, help="bearer token for the HTTP API")
    p.add_argument("--vocab-size", type=int, default=1000,
                   help="random prompt ids below this, over HTTP without --address (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=200,
                   help="requests to measure (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no cap)")
    p.add_argument("--client-procs", type=int, default=1,
                   help="client processes the requests are spread over (default: %(default)s)")
    p.add_argument("--http-keep-alive", action="store_true",
                   help="--backend openai: send the requests on kept-alive connections opened during the "
                        "warm-up (default: a new connection per request)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean arrivals per second of a Poisson process; inf sends all at once "
                        "(default: %(default)s)")
    p.add_argument("--dataset", choices=["random", "chat"], default="random",
                   help="random token-id prompts, or the built-in chat prompts (default: %(default)s)")
    p.add_argument("--prompts-file", default=None, metavar="PATH",
                   help="with --dataset chat: chat prompts, one JSON string per line, instead of the built-in ones "
                        "(scripts/data/spec_prompts.jsonl: prompt-lookup-friendly edits of a given text)")
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
    if args.backend == "sdk" and not args.address:
        p.error("--backend sdk needs --address")
    if args.backend == "openai" and not args.base_url:
        p.error("--backend openai needs --base-url")
    if args.backend == "openai" and args.dataset == "chat" and not args.address:
        p.error("--dataset chat needs --address (the prompts are tokenized through the SDK)")
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset == "random"
    if args.num_requests < 1 or args.output_len < 1 or args.input_len < 1:
        p.error("--num-requests, --input-len and --output-len must be at least 1")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    if not 1 <= args.client_procs <= min(args.num_requests, args.concurrency or args.num_requests):
        p.error("--client-procs must be at least 1 and at most --num-requests and --concurrency")
    if not args.request_rate > 0:
        p.error("--request-rate must be positive")
    return args


def random_requests(n: int, input_len: int, output_len: int, vocab_size: int,
                    exclude: set[int], rng: random.Random) -> list[BenchRequest]:
    """Prompts of uniformly random token ids (EOS ids left out)."""
    ids = [t for t in range(vocab_size) if t not in exclude]
    return [BenchRequest([rng.choice(ids) for _ in range(input_len)], output_len) for _ in range(n)]


async def chat_requests(client: AsyncClient, n: int, output_len: int, path: Optional[str] = None) -> list[BenchRequest]:
    """The built-in chat prompts (or ``path``'s, one JSON string a line), cycled, through the server's chat template."""
    texts = [msgspec.json.decode(line) for line in open(path) if line.strip()] if path else CHAT_PROMPTS
    encoded = [await client.encode(messages=[{"role": "user", "content": text}]) for text in texts]
    return [BenchRequest(encoded[i % len(encoded)], output_len) for i in range(n)]


async def send_one(client: Any, req: BenchRequest, args: argparse.Namespace) -> Outcome:
    """One request through ``client`` (the SDK's AsyncClient, or HTTP Connections / None); failures are recorded."""
    if args.backend == "openai":
        return await send_one_http(req, args, client)
    try:
        result = await client.generate(
            prompt_token_ids=req.prompt_token_ids, max_tokens=req.max_tokens,
            temperature=args.temperature, ignore_eos=args.ignore_eos,
            timeout=args.timeout if args.timeout is not None else math.inf, detokenize=False)
    except (ForerunError, TimeoutError, ConnectionError) as exc:
        return Outcome(None, f"{type(exc).__name__}: {exc}")
    return Outcome(result, None)


class _Choice(msgspec.Struct):
    finish_reason: Optional[str] = None


class _Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int


class _ErrorInfo(msgspec.Struct):
    message: str = ""


class _Event(msgspec.Struct):
    """The fields of an SSE event the benchmark reads (the rest is skipped by the decoder)."""

    choices: list[_Choice] = []
    usage: Optional[_Usage] = None
    error: Optional[_ErrorInfo] = None


_decode_event = msgspec.json.Decoder(_Event).decode


async def send_one_http(req: BenchRequest, args: argparse.Namespace, conns: Optional[Connections]) -> Outcome:
    """One streaming /v1/completions request, timed per SSE event (on a kept-alive connection of ``conns``)."""
    body = {"model": args.model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
            "temperature": args.temperature, "ignore_eos": args.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    times: list[float] = []
    seen: dict[str, Any] = {}  # "finish", "t_end", "usage", "error"
    t0 = time.perf_counter()

    def on_event(t: float, event: Optional[_Event]) -> None:
        if event is None:
            return
        if event.error is not None:
            seen.setdefault("error", event.error.message)
        if event.usage is not None:
            seen["usage"] = event.usage
        for choice in event.choices:
            if choice.finish_reason is not None:
                seen["finish"], seen["t_end"] = choice.finish_reason, t - t0
            else:
                times.append(t - t0)

    try:
        if conns is not None:
            await conns.post("/v1/completions", body, on_event, _decode_event)
        else:
            await sse_post(args.base_url, "/v1/completions", body, on_event, args.api_key, _decode_event)
    except (HTTPError, OSError, msgspec.DecodeError) as exc:
        return Outcome(None, f"{type(exc).__name__}: {exc}")
    if "error" in seen:
        return Outcome(None, f"error event: {seen['error']}")
    if "finish" not in seen or "usage" not in seen:
        return Outcome(None, "the stream ended without a finish and usage")
    n = seen["usage"].completion_tokens
    timings = HttpTimings(ttft=times[0] if times else None, e2e=seen["t_end"],
                          itl=[b - a for a, b in zip(times, times[1:])], completion_tokens=n)
    return Outcome(HttpResult(seen["finish"], seen["usage"].prompt_tokens, n, timings), None)


async def run_requests(client: Any, requests: list[BenchRequest], args: argparse.Namespace, rng: random.Random,
                       progress: Optional[tqdm] = None) -> tuple[list[Outcome], float, float, float]:
    """Send requests at the configured rate and cap; return outcomes, start and end (perf_counter), CPU seconds."""
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

    start, cpu_start = time.perf_counter(), time.process_time()
    tasks = []
    for i, req in enumerate(requests):
        # Poisson arrivals: exponential gaps between consecutive requests.
        if i and math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))
        tasks.append(asyncio.create_task(limited(req)))
    outcomes = await asyncio.gather(*tasks)
    return outcomes, start, time.perf_counter(), time.process_time() - cpu_start


async def measure(client: Any, warmup: list[BenchRequest], measured: list[BenchRequest], args: argparse.Namespace,
                  rng: random.Random, gate: Optional[Gate] = None) -> tuple[list[Sample], float, float, float]:
    """Warm up, then run the measured requests (from the gate's start time, if any).

    Returns the samples, the start and end (perf_counter) and this process's CPU seconds.
    ``client`` is the SDK's AsyncClient; over HTTP the requests go on new connections,
    or with ``--http-keep-alive`` on kept-alive ones opened before the start.
    """
    conns = Connections(args.base_url, args.api_key) if args.backend == "openai" and args.http_keep_alive else None
    sender = conns if args.backend == "openai" else client
    try:
        if warmup:
            outcomes, _, _, _ = await run_requests(sender, warmup, args, rng)
            failures = [o.error for o in outcomes if not o.ok]
            if failures:
                print(f"warning: {len(failures)} warm-up requests failed: {failures[0]}", file=sys.stderr)
        if conns is not None:
            await conns.open(min(args.concurrency or len(measured), len(measured)))
        start = None
        if gate is not None:
            start = await gate.ready()
            await asyncio.sleep(max(start - time.perf_counter(), 0.0))
        with tqdm(total=len(measured), disable=args.no_progress, desc="requests") as progress:
            outcomes, t0, end, cpu = await run_requests(sender, measured, args, rng, progress)
    finally:
        if conns is not None:
            conns.close()
    return [sample(o) for o in outcomes], t0 if start is None else start, end, cpu


def _share(n: int, i: int, total: Optional[int]) -> Optional[int]:
    return None if total is None else total // n + (i < total % n)


def run_spread(args: argparse.Namespace, warmup: list[BenchRequest],
               measured: list[BenchRequest]) -> tuple[list[Sample], float, float]:
    """Run the workload in ``--client-procs`` processes; returns the samples, the duration, the busiest one's CPU."""
    n = args.client_procs
    payloads = []
    for i in range(n):
        options = dict(vars(args), client_procs=1, concurrency=_share(n, i, args.concurrency),
                       request_rate=args.request_rate / n, no_progress=True, json=None)
        share = Share(options, args.seed + 1 + i, warmup[i::n], measured[i::n])
        payloads.append(msgspec.msgpack.encode(share))
    start, results = run_processes(client_process, payloads)
    shares = [msgspec.msgpack.decode(r, type=ShareResult) for r in results]
    return [x for r in shares for x in r.samples], max(r.end for r in shares) - start, max(r.cpu_s for r in shares)


def client_process(payload: bytes, gate: Gate) -> bytes:
    """One process of ``--client-procs``: connect, warm up, run its share from the common start."""
    share = msgspec.msgpack.decode(payload, type=Share)
    return run_loop(_client_process(argparse.Namespace(**share.options), share, gate))


async def _client_process(args: argparse.Namespace, share: Share, gate: Gate) -> bytes:
    client = None
    if args.backend == "sdk":
        client = AsyncClient(args.address, timeout=HANDSHAKE_TIMEOUT, client_name="bench_serve")
        await client.connect()
    try:
        samples, _, end, cpu = await measure(client, share.warmup, share.measured, args,
                                             random.Random(share.seed), gate)
    finally:
        if client is not None:
            await client.close()
    return msgspec.msgpack.encode(ShareResult(samples, end, cpu))


def metrics(samples: list[Sample], duration: float) -> dict[str, Any]:
    """Throughput and latency figures of one run (latencies in ms)."""
    done = [r for r in samples if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.completion_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(samples) - len(done),
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": summarize([r.ttft for r in done if r.ttft is not None], scale=1e3),
        "tpot_ms": summarize([r.tpot for r in done if r.tpot is not None], scale=1e3),
        "itl_ms": summarize([gap for r in done for gap in r.itl], scale=1e3),
        "e2e_ms": summarize([r.e2e for r in done], scale=1e3),
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
        ("Client processes", m.get("client_procs", 1)),
        ("Client CPU / duration (busiest process)", m.get("client_cpu_fraction", float("nan"))),
    ]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        rows += latency_rows(name, m[key])
    return format_table(rows, title="Serving Benchmark Result")


async def server_facts(args: argparse.Namespace, client: Optional[AsyncClient]) -> dict[str, Any]:
    """What the workload needs from the server: vocabulary, EOS ids, model name."""
    if client is not None:
        info = client.server_info
        return {"model_name": info.model_name, "device": info.device, "dtype": info.dtype,
                "max_model_len": info.max_model_len, "pipeline_depth": info.pipeline_depth,
                "vocab_size": info.vocab_size, "eos_token_ids": info.eos_token_ids}
    models = await asyncio.to_thread(get_json, args.base_url.rstrip("/") + "/v1/models", args.api_key)
    card = models["data"][0]
    # Without the SDK's ServerInfo: ids below --vocab-size; 0..2 are EOS/BOS in the supported tokenizers.
    return {"model_name": card["id"], "max_model_len": card.get("max_model_len"),
            "vocab_size": args.vocab_size, "eos_token_ids": [0, 1, 2]}


def spec_figures(before: Any, after: Any) -> dict[str, Any]:
    """The run's speculative decoding (ServerStats before and after it; empty when the server did not speculate)."""
    rows = after.spec_rows - before.spec_rows
    if not rows:
        return {}
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return {"spec_rows": rows, "spec_draft_tokens": after.spec_draft_tokens - before.spec_draft_tokens,
            "spec_accepted_tokens": accepted, "mean_accepted_length": (rows + accepted) / rows}


def get_json(url: str, api_key: Optional[str] = None) -> Any:
    """GET a JSON document (blocking)."""
    import json
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        return json.loads(r.read())


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    """Connect, build the workload, warm up, measure, print and return the figures."""
    rng = random.Random(args.seed)
    client = None
    if args.address:
        client = AsyncClient(args.address, timeout=HANDSHAKE_TIMEOUT, client_name="bench_serve")
        await client.connect()
    try:
        info = await server_facts(args, client)
        args.model = args.model or info["model_name"]
        print(f"server: {info['model_name']}, max_model_len {info['max_model_len']}, backend {args.backend}")
        total = args.warmup + args.num_requests
        if args.dataset == "random":
            workload = random_requests(total, args.input_len, args.output_len, info["vocab_size"],
                                       set(info["eos_token_ids"]), rng)
        else:
            workload = await chat_requests(client, total, args.output_len, args.prompts_file)
        warmup, measured = workload[:args.warmup], workload[args.warmup:]
        before = await client.get_stats() if client is not None else None
        if args.client_procs > 1:
            samples, duration, client_cpu = await asyncio.to_thread(run_spread, args, warmup, measured)
        else:
            samples, start, end, client_cpu = await measure(client, warmup, measured, args, rng)
            duration = end - start
        spec = spec_figures(before, await client.get_stats()) if client is not None else {}
    finally:
        if client is not None:
            await client.close()
    errors = [r.error for r in samples if r.error]
    if errors:
        print(f"warning: {len(errors)} requests failed, first: {errors[0]}", file=sys.stderr)
    m = metrics(samples, duration)
    # Near 1.0 means this client (its busiest process), not the server, may be what limits the run.
    m["client_cpu_fraction"] = client_cpu / duration
    m["client_procs"] = args.client_procs
    m.update(spec)
    print(report(m))
    if spec:
        print(f"speculation: {spec['spec_draft_tokens']} drafts, {spec['spec_accepted_tokens']} accepted, "
              f"{spec['mean_accepted_length']:.2f} tokens per speculative row")
    figures = {
        "config": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()},
        "server": {k: v for k, v in info.items() if k != "eos_token_ids"},
        **m,
    }
    if args.json:
        write_json(args.json, figures)
    return figures


def run_loop(coro: Any) -> Any:
    """Run a coroutine on uvloop when installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Entry point: parse the flags and run the benchmark."""
    return run_loop(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
