"""Tensor parallelism: three figures, each tensor-parallel size against the others, one server per size.

For each ``--sizes`` N, starts ``forerun serve --tensor-parallel-size N`` (random weights of ``--model``'s
shape, depth 1, ``--step-log``), then, through the SDK:

1. **batch-1 decode**: one request of ``--input-len`` prompt tokens and ``--decode-tokens`` new ones. Over its
   one-row decode steps: the step's GPU time on rank 0 (CUDA events; it includes the all-reduces' waits),
   the step period (successive steps' end times) and the client's TPOT. Target: TP=2 <= 60% of TP=1.
2. **GPU idle at batch ``--idle-batch``**: that many requests decode in lockstep; over the steps with all of
   them (first and last tenth trimmed) idle = sum(gap) / (sum(gap) + sum(busy)) from rank 0's CUDA events
   (``bench_overlap.py --executor cuda``'s measure). Target at TP=2, batch 64: <= 2%.
3. **throughput**: ``scripts/bench_serve.py`` with ``--requests`` x ``--input-len`` in / ``--output-len`` out,
   all at once, EOS ignored.

Phases are told apart in the step log by step ids (``ServerStats.steps`` before and after each).

    python3 scripts/bench_tp.py --device cuda --model scripts/configs/llama-3-8b --sizes 1 2 --json out.json

On the CPU (gloo), with a tiny config, it checks that the script runs (GPU figures are then zero).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _bench_util import gpu_idle_of, lockstep_decode, percentile, start_server, stop_server, write_json
from ipc.client import AsyncClient
from ipc.client.raw import RawConnection

SCRIPTS = os.path.dirname(os.path.abspath(__file__))


async def steps_done(address: str) -> int:
    """Steps the server has reconciled so far: the next step id (no restart in between)."""
    async with RawConnection(address, timeout=30) as conn:
        await conn.hello("bench_tp")
        return (await conn.stats()).steps


async def batch1_decode(address: str, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    rng = random.Random(1)
    async with AsyncClient(address, timeout=600) as c:
        r = await c.generate(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(prompt_len)],
                             max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    return {"client_tpot_ms": r.timings.tpot * 1e3 if r.timings.tpot else None}


def decode_steps(rows: list[dict]) -> dict:
    """Medians over one-row decode steps: rank 0's GPU time and the step period (end to end)."""
    steady = [r for r in rows if r["num_rows"] == 1 and r["num_tokens"] == 1]
    periods = [b["t_end"] - a["t_end"] for a, b in zip(steady, steady[1:]) if b["step_id"] == a["step_id"] + 1]
    return {
        "decode_steps": len(steady),
        "decode_gpu_us_p50": statistics.median(r["gpu_busy_s"] for r in steady) * 1e6 if steady else None,
        "decode_period_us_p50": statistics.median(periods) * 1e6 if periods else None,
        "decode_period_us_p90": percentile(periods, 90) * 1e6 if periods else None,
    }


def throughput(address: str, args, out: str) -> dict:
    subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_serve.py"), "--address", address,
                    "--num-requests", str(args.requests), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--warmup", "4", "--ignore-eos", "--no-progress",
                    "--json", out], check=True)
    figures = json.load(open(out))
    return {"output_tokens_per_s": figures["output_throughput"], "tpot_ms_p50": figures["tpot_ms"]["p50"],
            "ttft_ms_p50": figures["ttft_ms"]["p50"]}


def measure(size: int, args, vocab: int) -> dict:
    """One server at ``size`` ranks: the three phases, then its step log read once it has stopped."""
    tmp = tempfile.mkdtemp(prefix="frtp", dir="/tmp")
    log, address = os.path.join(tmp, "steps.jsonl"), f"ipc://{tmp}/c.sock"
    flags = ["--device", args.device, "--load-format", "dummy", "--model", args.model, "--tensor-parallel-size",
             str(size), "--max-num-seqs", str(args.max_num_seqs), "--pipeline-depth", "1", "--step-log", log,
             *args.server_flag]
    t0 = time.monotonic()
    proc = start_server(address, *flags, timeout=args.start_timeout)
    row = {"tp": size, "start_s": time.monotonic() - t0}
    try:
        asyncio.run(lockstep_decode(address, 4, 16, 8, vocab))  # warm-up
        first = asyncio.run(steps_done(address))
        row.update(asyncio.run(batch1_decode(address, args.input_len, args.decode_tokens, vocab)))
        mid = asyncio.run(steps_done(address))
        asyncio.run(lockstep_decode(address, args.idle_batch, args.input_len, args.idle_tokens, vocab))
        last = asyncio.run(steps_done(address))
        if args.requests:
            row.update(throughput(address, args, os.path.join(tmp, "serve.json")))
    finally:
        stop_server(proc)
    rows = [json.loads(line) for line in open(log)]
    shutil.rmtree(tmp, ignore_errors=True)
    row.update(decode_steps([r for r in rows if first <= r["step_id"] < mid]))
    row.update({f"idle_{k}": v for k, v in gpu_idle_of([r for r in rows if mid <= r["step_id"] < last],
                                                         args.idle_batch).items()})
    return row


def _fmt(value, scale=1.0, digits=1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(SCRIPTS, "configs", "llama-3-8b"),
                    help="config folder for random weights (default: the Llama-3-8B shape)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to compare")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256, help="new tokens of the batch-1 request")
    ap.add_argument("--idle-batch", type=int, default=64)
    ap.add_argument("--idle-tokens", type=int, default=256, help="new tokens of each lockstep request")
    ap.add_argument("--requests", type=int, default=256, help="throughput requests (0: skip the phase)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--start-timeout", type=float, default=480, help="seconds a server may take to start")
    ap.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                    help="an extra `forerun serve` argument (repeatable; e.g. --server-flag=--num-kv-blocks=512)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    args = ap.parse_args()
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    rows = []
    for size in args.sizes:
        rows.append(measure(size, args, vocab))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print(f"\n{'TP':>3} {'start s':>8} {'decode GPU us':>14} {'period us':>10} {'vs first':>9} {'TPOT ms':>8} "
          f"{'idle %':>7} {'idle steps':>10} {'out tok/s':>10}")
    for r in rows:
        ratio = (r["decode_period_us_p50"] / base["decode_period_us_p50"]
                 if r["decode_period_us_p50"] and base["decode_period_us_p50"] else None)
        print(f"{r['tp']:>3} {r['start_s']:>8.1f} {_fmt(r['decode_gpu_us_p50']):>14} "
              f"{_fmt(r['decode_period_us_p50']):>10} {_fmt(ratio, 100):>8}% {_fmt(r['client_tpot_ms'], 1, 2):>8} "
              f"{_fmt(r['idle_gpu_idle_fraction'], 100, 2):>7} {r['idle_steps']:>10} "
              f"{_fmt(r.get('output_tokens_per_s'), 1, 0):>10}")
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
