"""The whole two-process pipeline on a GPU: GPU idle time between decode steps, and SDK throughput.

For each pipeline depth, starts ``forerun serve --device cuda`` (random weights of a real model's
shape, Triton kernels, CUDA graphs) with ``--step-log``, then:

1. **GPU idle at batch 64**: 64 requests decode in lockstep through the SDK; the executor records
   CUDA timing events around every step, so ``gpu_gap_s`` is the time the GPU sat with nothing
   queued between the previous step's end and this step's start. Over the pure-decode steps with
   all 64 rows (first and last tenth trimmed): idle = sum(gap) / (sum(gap) + sum(busy)).
2. **Throughput** (``--throughput``): ``scripts/bench_serve.py`` with 256 requests of 128 random
   prompt tokens and 128 new tokens, all at once, EOS ignored.

    python3 scripts/bench_gpu_pipeline.py --depths 0 1 --throughput --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from _bench_util import start_server, stop_server
from ipc.client import AsyncClient

SCRIPTS = os.path.dirname(os.path.abspath(__file__))


async def lockstep_decode(address: str, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    rng = random.Random(0)
    async with AsyncClient(address, timeout=600) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*[
            c.generate(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(prompt_len)], max_tokens=new_tokens,
                       temperature=0.0, ignore_eos=True, detokenize=False) for _ in range(batch)])
        return time.perf_counter() - t0


def gpu_idle(step_log: str, batch: int) -> dict:
    return gpu_idle_of([json.loads(line) for line in open(step_log)], batch)


def gpu_idle_of(rows: list[dict], batch: int) -> dict:
    """The GPU's idle fraction over step-log rows of ``batch`` decoding rows (None without CUDA events)."""
    steady = [r for r in rows if r["num_rows"] == batch and r["num_tokens"] == batch]
    trim = len(steady) // 10
    steady = steady[trim:len(steady) - trim] if trim else steady
    busy = sum(r["gpu_busy_s"] for r in steady)
    gaps = [r["gpu_gap_s"] for r in steady]
    return {
        "steps": len(steady),
        "gpu_idle_fraction": sum(gaps) / (sum(gaps) + busy) if sum(gaps) + busy > 0 else None,
        "gpu_gap_us_p50": statistics.median(gaps) * 1e6 if gaps else None,
        "gpu_gap_us_p99": sorted(gaps)[int(0.99 * (len(gaps) - 1))] * 1e6 if gaps else None,
        "gpu_step_us_p50": statistics.median(r["gpu_busy_s"] for r in steady) * 1e6 if steady else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(SCRIPTS, "configs", "llama-3.2-1b"),
                    help="config folder for random weights (default: the Llama-3.2-1B shape)")
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 1], help="pipeline depths to measure")
    ap.add_argument("--batch", type=int, default=64, help="requests decoding in lockstep for the idle measurement")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens each lockstep request generates")
    ap.add_argument("--throughput", action="store_true", help="also run bench_serve (256 x 128 in, 128 out)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    args = ap.parse_args()
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    rows = []
    for depth in args.depths:
        tmp = tempfile.mkdtemp(prefix="frg", dir="/tmp")
        log, address = os.path.join(tmp, "steps.jsonl"), f"ipc://{tmp}/c.sock"
        proc = start_server(address, "--device", "cuda", "--load-format", "dummy", "--model", args.model, "--max-num-seqs", "256",
                            "--pipeline-depth", str(depth), "--step-log", log)
        try:
            asyncio.run(lockstep_decode(address, 8, 16, 8, vocab))  # warm-up
            wall = asyncio.run(lockstep_decode(address, args.batch, 128, args.new_tokens, vocab))
            tput = None
            if args.throughput:
                out = os.path.join(tmp, "serve.json")
                subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_serve.py"), "--address", address,
                                "--num-requests", "256", "--input-len", "128", "--output-len", "128",
                                "--warmup", "8", "--no-progress", "--json", out], check=True)
                tput = json.load(open(out))
        finally:
            stop_server(proc)
        row = {"depth": depth, "batch": args.batch, "lockstep_wall_s": wall, **gpu_idle(log, args.batch)}
        if tput:
            row.update(output_tokens_per_s=tput["output_throughput"], ttft_ms=tput["ttft_ms"], tpot_ms=tput["tpot_ms"],
                       itl_ms=tput["itl_ms"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'depth':>5} {'steps':>6} {'GPU idle':>9} {'gap p50 us':>11} {'gap p99 us':>11} {'step us':>9} {'out tok/s':>10}")
    for r in rows:
        print(f"{r['depth']:>5} {r['steps']:>6} {100 * (r['gpu_idle_fraction'] or 0):>8.2f}% "
              f"{r['gpu_gap_us_p50'] or 0:>11.1f} {r['gpu_gap_us_p99'] or 0:>11.1f} {r['gpu_step_us_p50'] or 0:>9.1f} "
              f"{r.get('output_tokens_per_s') or 0:>10.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
