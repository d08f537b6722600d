"""Reliability figures of docs/reliability.md, one sub-command each (``SUB --help`` for its flags).

Usage: bench_reliability.py SUB [flags]   (SUB --help: its flags)

    python scripts/bench_reliability.py flood [--frames 200000] [--json PATH]    # front-door fairness, overload
    python scripts/bench_reliability.py restart [--kills 2] [-- SERVE_FLAGS]   # executor restart time
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from subprocess import Popen

from executor_proc.testing.scripted import ScriptedRunner, expected_output
from ipc import protocol as p
from ipc.client.raw import RawConnection
from benchlib import (executor_pid, format_table, ipc_address, percentile, run_dir, start_server, stop_server,
                      write_json)

FLOOD_DOC = """Front-door fairness and overload, against a real server with the scripted executor.

Flood: one client (its own process) sends ``--frames`` junk frames as fast as
the server takes them, while another streams requests (batched deltas) one
after another; the streamer's largest gap between two token messages is the
figure (with 1 ms steps, a gap is normally 1 ms).

Overload: a second server whose steps never end (``--scripted-step-ms 60000``,
one slot) gets ``--max-waiting`` + ``--overload-extra`` requests: every one
past the limit must be refused with ``overloaded`` at once; the scheduler's
RSS is read before and with the waiting queue full.

    .venv/bin/python scripts/bench_reliability.py flood --frames 200000 --json flood.json
"""

RESTART_DOC = """Executor restart time: SIGKILL the executor mid-stream, time until tokens flow again.

Starts ``forerun serve`` with the given flags (default: the default model on
the CPU), streams greedy requests, kills the executor after ``--kill-after``
steps, and reports, per kill: the server's own restart time (spawn to
ExecutorReady, from its log) and the client's stall (the largest gap between
two token messages, kill included).  Greedy outputs are checked against an
undisturbed run of the same requests.

    .venv/bin/python scripts/bench_reliability.py restart --json restart.json
    # on a GPU (the 1B shape, random weights):
    .venv/bin/python scripts/bench_reliability.py restart --kills 3 --json restart_gpu.json -- \\
        --device cuda --load-format dummy --model scripts/configs/llama-3.2-1b
"""


# ---------------------------------------------------------------------------------------------------- flood

FLOODER = r"""
import sys, time, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
t0 = time.monotonic()
for i in range(int(sys.argv[2])):
    sock.send(b"\xc1junk")
sock.setsockopt(zmq.LINGER, -1)
sock.close()  # returns once every frame has been handed to the server
print(time.monotonic() - t0)
"""
FLOOD_PROMPT = [5, 6, 7, 8]
STREAM_MAX_TOKENS = 300


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def stream_during_flood(address: str, frames: int) -> dict:
    """Stream requests back to back while the flooder runs; the gaps between token messages."""
    script = ScriptedRunner(1, 1, 1, vocab_size=1000, eos_token_id=2)
    gaps: list[float] = []
    ok = True
    async with RawConnection(address, timeout=30) as conn:
        await conn.hello("streamer", batch_deltas=True)
        flooder = subprocess.Popen([sys.executable, "-c", FLOODER, address, str(frames)], stdout=subprocess.PIPE,
                                   text=True)
        t_start = time.monotonic()
        last, n = None, 0
        while flooder.poll() is None or n < 2:
            want, _ = expected_output(script.token_at, seed=n, prompt_len=len(FLOOD_PROMPT),
                                      max_tokens=STREAM_MAX_TOKENS, max_model_len=4096, eos_token_ids=(2,))
            await conn.send(p.Generate(f"s{n}", FLOOD_PROMPT, p.SamplingParams(max_tokens=STREAM_MAX_TOKENS, seed=n)))
            got: list[int] = []
            while True:
                msg = await conn.recv()
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if isinstance(msg, p.TokenDeltas):
                    got += msg.token_ids[0]
                elif isinstance(msg, p.Finished):
                    got += msg.token_ids
                    break
                else:
                    raise RuntimeError(f"unexpected {msg!r}")
            ok = ok and got == want
            n += 1
        flood_s = float(flooder.communicate()[0])
    return {"frames_sent": frames, "flood_s": flood_s, "stream_s": time.monotonic() - t_start, "stream_requests": n,
            "stream_ok": ok, "max_gap_during_flood_s": max(gaps), "p99_gap_s": percentile(gaps, 99)}


async def overload(address: str, scheduler_pid: int, max_waiting: int, extra: int) -> dict:
    rss_before = rss_mib(scheduler_pid)
    async with RawConnection(address, timeout=30) as conn:
        await conn.hello("overload", batch_deltas=True)
        t0 = time.monotonic()
        for i in range(max_waiting + 1 + extra):  # one runs (the only slot), max_waiting wait
            await conn.send(p.Generate(f"o{i}", FLOOD_PROMPT * 4, p.SamplingParams(max_tokens=16)))
        refusals = 0
        while refusals < extra:
            msg = await conn.recv()
            if isinstance(msg, p.Error) and msg.code == "overloaded":
                refusals += 1
        elapsed = time.monotonic() - t0
        stats = await conn.stats()
        rss_full = rss_mib(scheduler_pid)
    return {"max_waiting": max_waiting, "overload_extra": extra, "overloaded_refusals": refusals,
            "num_waiting": stats.num_waiting, "refused_within_s": elapsed, "scheduler_rss_idle_mib": rss_before,
            "scheduler_rss_queue_full_mib": rss_full}


def flood(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_reliability.py flood", description=FLOOD_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=200_000, help="junk frames the flooder sends")
    ap.add_argument("--step-ms", type=float, default=1.0, help="scripted step time of the flood server")
    ap.add_argument("--max-waiting", type=int, default=4096, help="the overload server's --max-waiting")
    ap.add_argument("--overload-extra", type=int, default=100, help="requests sent past the limit")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures here")
    args = ap.parse_args(argv)
    tmp = run_dir("frb")
    address = ipc_address(tmp)
    srv = start_server(address, "--load-format", "scripted", "--scripted-step-ms", str(args.step_ms),
                       run_dir=tmp, echo=False, timeout=120)
    try:
        result = asyncio.run(stream_during_flood(address, args.frames))
    finally:
        stop_server(srv)
    address = ipc_address(tmp)
    srv = start_server(address, "--load-format", "scripted", "--scripted-step-ms", "60000", "--max-num-seqs", "1",
                       "--max-waiting", str(args.max_waiting), "--shutdown-timeout", "0",
                       run_dir=tmp, echo=False, timeout=120)
    try:
        result.update(asyncio.run(overload(address, srv.pid, args.max_waiting, args.overload_extra)))
    finally:
        stop_server(srv)
    print(format_table([(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in result.items()],
                       title="flood and overload (times in s, memory in MiB)"))
    if args.json:
        write_json(args.json, result)
    return 0


# -------------------------------------------------------------------------------------------------- restart

RESTART_PROMPT = [1, 415, 2936, 9060, 285, 1142, 690, 253, 22658, 4370]


async def run_requests(address: str, n: int, max_tokens: int, on_token=None) -> tuple[dict, list[float]]:
    """n greedy requests at once; their tokens, and the gaps between token messages."""
    gaps, last = [], None
    async with RawConnection(address, timeout=600) as conn:
        info = await conn.hello("bench_restart", batch_deltas=True)
        prompt = [t % info.vocab_size for t in RESTART_PROMPT]  # the default model's ids, folded into any vocabulary
        for i in range(n):
            await conn.send(p.Generate(f"r{i}", prompt[: 4 + i], p.SamplingParams(
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


async def disturbed_run(address: str, server: Popen, n: int, max_tokens: int, kills: int, kill_after: int) -> tuple:
    state = {"kills": 0, "next_at": None, "busy": False}
    async with RawConnection(address, timeout=10) as stats_conn:
        await stats_conn.hello("bench_restart stats")  # the server answers nothing but Hello and Ping before a Hello

        async def maybe_kill() -> None:
            if state["kills"] >= kills or state["busy"]:
                return
            state["busy"] = True
            steps = (await stats_conn.stats()).steps
            if state["next_at"] is None:
                state["next_at"] = steps + kill_after
            if steps >= state["next_at"]:
                os.kill(executor_pid(server), signal.SIGKILL)
                state["kills"] += 1
                state["next_at"] = None
            state["busy"] = False

        tokens, gaps = await run_requests(address, n, max_tokens, maybe_kill)
    return tokens, gaps, state["kills"]


def restart(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_reliability.py restart", description=RESTART_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kills", type=int, default=2, help="executor SIGKILLs during the disturbed run")
    ap.add_argument("--kill-after", type=int, default=10, help="steps after (re)start before each kill")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("serve_args", nargs="*", help="flags for forerun serve (after --)")
    args = ap.parse_args(argv)
    tmp = run_dir("frr")
    address = ipc_address(tmp)
    srv = start_server(address, *args.serve_args, "--max-restarts", str(args.kills + 5),
                       run_dir=tmp, echo=False, timeout=1800)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(srv.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        want, calm_gaps = asyncio.run(run_requests(address, args.requests, args.max_tokens))
        got, gaps, kills = asyncio.run(disturbed_run(address, srv, args.requests, args.max_tokens, args.kills,
                                                     args.kill_after))
    finally:
        stop_server(srv)
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


SUBCOMMANDS = {"flood": flood, "restart": restart}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SUBCOMMANDS:
        print(__doc__)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return SUBCOMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
