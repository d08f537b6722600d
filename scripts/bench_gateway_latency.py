"""The HTTP gateway's added latency per streamed token, against the SDK on the same server.

    python scripts/bench_gateway_latency.py --address ipc://.../client.sock \\
        --base-url http://127.0.0.1:8000 --streams 16 --json OUT

Best on a scripted-executor server with steps far longer than the gateway's
work (``forerun serve --load-format scripted --scripted-step-ms 20 --port
8000``).  ``--streams`` HTTP streams and a few SDK reference streams start
together with equal prompts and lengths, so the k-th token of every request
comes out of the same step; each HTTP token's arrival minus the SDK
reference's arrival of the same token is what the gateway added (decode,
detokenize, JSON, SSE, HTTP, and the client's read).  A request admitted a
step later shifts all its tokens by one step exactly; the offset is taken
modulo the step time to remove that.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Optional

from ipc.client import AsyncClient
from _bench_util import format_table, summarize, write_json
from _http_stream import sse_post


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True, help="the server's SDK address")
    p.add_argument("--base-url", required=True, help="the server's HTTP API, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="bearer token for the HTTP API")
    p.add_argument("--streams", type=int, default=16, help="concurrent HTTP streams (default: %(default)s)")
    p.add_argument("--sdk-streams", type=int, default=4, help="SDK reference streams (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=64, help="tokens per request (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of all streams at once (default: %(default)s)")
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="the server's step time, for the modulo (its --scripted-step-ms; default: %(default)s)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the figures to this JSON file")
    return p.parse_args(argv)


async def sdk_times(client: AsyncClient, seed: int, args: argparse.Namespace) -> list[float]:
    """Absolute arrival time (perf_counter) of each token of one SDK stream."""
    times = []
    async for chunk in client.stream(prompt_token_ids=[5, 6, 7, 8], max_tokens=args.output_len, seed=seed,
                                     ignore_eos=True, temperature=0.0):
        times += [time.perf_counter()] * len(chunk.token_ids)
    return times


async def http_times(seed: int, args: argparse.Namespace) -> list[float]:
    """Absolute arrival time of each token-bearing SSE event of one HTTP stream."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": args.output_len, "seed": seed, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    times = []

    def on_event(t: float, event: dict) -> None:
        if event is not None and event["choices"] and event["choices"][0]["finish_reason"] is None:
            times.append(t)

    await sse_post(args.base_url, "/v1/completions", body, on_event, args.api_key)
    return times


async def one_round(client: AsyncClient, args: argparse.Namespace) -> list[float]:
    """Added latency (s) of every HTTP token of one round."""
    sdk = [sdk_times(client, i, args) for i in range(args.sdk_streams)]
    http = [http_times(100 + i, args) for i in range(args.streams)]
    results = await asyncio.gather(*sdk, *http)
    ref_runs, http_runs = results[:args.sdk_streams], results[args.sdk_streams:]
    step = args.step_ms / 1e3
    added = []
    for k in range(args.output_len):
        ref = statistics.median(run[k] for run in ref_runs if len(run) > k)
        for run in http_runs:
            if len(run) > k:
                added.append((run[k] - ref + step / 2) % step - step / 2)
    return added


async def main_async(args: argparse.Namespace) -> dict:
    async with AsyncClient(args.address) as client:
        await one_round(client, args)  # warm-up: connections, tokenizer, first compiles
        added = []
        for _ in range(args.rounds):
            added += await one_round(client, args)
    us = summarize(added, scale=1e6)
    rows = [("HTTP streams at once", args.streams), ("tokens measured", len(added))]
    rows += [(f"{k} added latency per token (us)", v) for k, v in us.items()]
    print(format_table(rows, title="Gateway added latency"))
    figures = {"config": vars(args), "added_latency_us": us, "tokens": len(added)}
    if args.json:
        write_json(args.json, figures)
    return figures


def main(argv: Optional[list[str]] = None) -> dict:
    import uvloop

    return uvloop.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
