"""Executor restart time: SIGKILL the executor mid-stream, time until tokens flow again.

Starts ``forerun serve`` with the given flags (default: the default model on
the CPU), streams greedy requests, kills the executor after ``--kill-after``
steps, and reports, per kill: the server's own restart time (spawn to
ExecutorReady, from its log) and the client's stall (the largest gap between
two token messages, kill included).  Greedy outputs are checked against an
undisturbed run of the same requests.

    .venv/bin/python scripts/bench_restart.py --json restart.json
    # on a GPU (the 1B shape, random weights):
    .venv/bin/python scripts/bench_restart.py --kills 3 --json restart_gpu.json -- \\
        --device cuda --load-format dummy --model scripts/configs/llama-3.2-1b
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc import protocol as p  # noqa: E402
from ipc.client.raw import RawConnection  # noqa: E402
from scripts._bench_util import format_table, write_json  # noqa: E402
from tests.server_proc import ServerProcess, server_stats  # noqa: E402

PROMPT = [1, 415, 2936, 9060, 285, 1142, 690, 253, 22658, 4370]


async def run_requests(address: str, n: int, max_tokens: int, on_token=None) -> tuple[dict, list[float]]:
    """n greedy requests at once; their tokens, and the gaps between token messages."""
    gaps, last = [], None
    async with RawConnection(address, timeout=600) as conn:
        await conn.hello("bench_restart", batch_deltas=True)
        for i in range(n):
            await conn.send(p.Generate(f"r{i}", PROMPT[: 4 + i], p.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(n)}
        done = 0
        while done < n:
            msg = await conn.recv()
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            if isinstance(msg, p.TokenDeltas):
                for rid, ids in zip(msg.request_ids, msg.token_ids):
                    tokens[rid] += ids
            elif isinstance(msg, p.Finished):
                tokens[msg.request_id] += msg.token_ids
                done += 1
            else:
                raise RuntimeError(f"unexpected {msg!r}")
            if on_token is not None:
                await on_token()
    return tokens, gaps


async def disturbed_run(srv: ServerProcess, n: int, max_tokens: int, kills: int, kill_after: int) -> tuple:
    state = {"kills": 0, "next_at": None, "busy": False}

    async def maybe_kill() -> None:
        if state["kills"] >= kills or state["busy"]:
            return
        state["busy"] = True
        steps = (await server_stats(srv.address)).steps
        if state["next_at"] is None:
            state["next_at"] = steps + kill_after
        if steps >= state["next_at"]:
            os.kill(srv.executor_pid(), signal.SIGKILL)
            state["kills"] += 1
            state["next_at"] = None
        state["busy"] = False

    tokens, gaps = await run_requests(srv.address, n, max_tokens, maybe_kill)
    return tokens, gaps, state["kills"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kills", type=int, default=2, help="executor SIGKILLs during the disturbed run")
    ap.add_argument("--kill-after", type=int, default=10, help="steps after (re)start before each kill")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("serve_args", nargs="*", help="flags for forerun serve (after --)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="frr", dir="/tmp")
    srv = ServerProcess(*args.serve_args, "--max-restarts", str(args.kills + 5), tmpdir=tmp, timeout=1800)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(srv.proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        want, calm_gaps = asyncio.run(run_requests(srv.address, args.requests, args.max_tokens))
        got, gaps, kills = asyncio.run(disturbed_run(srv, args.requests, args.max_tokens, args.kills, args.kill_after))
    finally:
        srv.stop()
        reader.join(timeout=10)
    restarts = [float(m.group(1)) for line in log if (m := re.search(r"executor restarted in ([\d.]+) s", line))]
    result = {
        "serve_args": " ".join(args.serve_args) or "(default model, cpu)", "requests": args.requests,
        "max_tokens": args.max_tokens, "kills": kills, "restart_s": restarts,
        "mean_restart_s": sum(restarts) / len(restarts) if restarts else None,
        "undisturbed_max_gap_s": max(calm_gaps), "client_max_stall_s": max(gaps),
        "outputs_identical": got == want,
    }
    print(format_table([(k, f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in result.items()],
                       title="executor restart (times in s)"))
    if args.json:
        write_json(args.json, result)
    return 0 if result["outputs_identical"] and len(restarts) == kills else 1


if __name__ == "__main__":
    sys.exit(main())
