"""How long does the executor wait for the scheduler?  Idle time at pipeline depths 0, 1 and 2.

    python scripts/bench_overlap.py            # scripted 1 ms and 5 ms steps, then the default model
    python scripts/bench_overlap.py --quick    # shorter runs, within a minute
    python scripts/bench_overlap.py --json out.json --client raw
    python3 scripts/bench_overlap.py --executor cuda --depths 0 1 --throughput   # a GPU: the GPU's idle time

Each configuration starts a real ``forerun serve`` (scheduler and executor
processes) with ``--step-log``, runs ``--running`` concurrent requests that all
decode in lockstep (``ignore_eos``, long ``max_tokens``), stops the server and
reads the executor's per-step records: ``t_start``, ``t_end`` and ``idle_s``
(how long the executor waited for that step's plan).  Over the steady-state
window (every request decoding, the first and last tenth trimmed):

    idle_fraction   idle time / wall time
    idle_gap_us     median and p99 of the per-step waits
    tokens_per_s    sampled tokens / wall time

``--executor cuda`` serves random weights of ``--model`` (the Llama-3.2-1B shape) on the GPU with
``--model-running`` (64) requests; the executor records CUDA timing events around every step, so
each step also has ``gpu_gap_s`` (the GPU had nothing queued before it) and ``gpu_busy_s``:

    gpu_idle_fraction   sum(gap) / (sum(gap) + sum(busy)) over the same window

and ``--throughput`` then runs ``bench_serve.py`` on the same server (256 requests of 128 random
prompt tokens, 128 new tokens, all at once).

``--client sdk`` (default) drives the server through ``ipc.client.AsyncClient``;
``--client raw`` speaks the wire protocol directly and asks for batched
``TokenDeltas``, which shows the scheduler's own limit when the SDK is not
the bottleneck (the SDK asks for batches too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

from ipc import protocol as p
from ipc.client.raw import RawConnection
from benchlib import executor_pid, percentile, start_server, stop_server, write_json

PROMPT = list(range(10, 18))  # 8 tokens: one prefill step for everyone, then pure decode
BLOCK_SIZE = 16
SCRIPTS = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (within a minute)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as a JSON list")
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--step-ms", type=float, nargs="+", default=[1.0, 5.0], help="scripted step latencies")
    ap.add_argument("--running", type=int, default=256, help="concurrent requests on the scripted executor")
    ap.add_argument("--model-running", type=int, default=None,
                    help="concurrent requests on a model (default model: 16, --quick 8; cuda: 64)")
    ap.add_argument("--model", default=os.path.join(SCRIPTS, "configs", "llama-3.2-1b"),
                    help="--executor cuda: a config folder for random weights (default: the Llama-3.2-1B shape)")
    ap.add_argument("--throughput", action="store_true",
                    help="--executor cuda: also run bench_serve.py (256 x 128 in, 128 out) on each server")
    ap.add_argument("--window-s", type=float, default=None,
                    help="steady-state seconds per scripted run (default 2, --quick 0.4)")
    ap.add_argument("--executor", choices=["scripted", "model", "both", "cuda"], default="both",
                    help="scripted steps, the default model on the CPU, both, or random weights on the GPU")
    ap.add_argument("--client", choices=["sdk", "raw"], default="sdk")
    ap.add_argument("--serve-args", default="",
                    help="more `forerun serve` flags for every server (one string), e.g. "
                         "'--speculative-method ngram'")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per configuration; the run with the median idle fraction is reported "
                         "(a shared 2-core machine stalls processes for milliseconds now and then)")
    ap.add_argument("--client-nice", type=int, default=10,
                    help="niceness of this process (the load generator), so that on a small machine it does not "
                         "take the scheduler's core; 0 to compete as equals (default %(default)s)")
    return ap.parse_args(argv)


# --------------------------------------------------------------------- clients


async def drive_sdk(address: str, n: int, max_tokens: int) -> int:
    """Run n lockstep requests through the SDK; returns the completion tokens received."""
    from ipc.client import AsyncClient

    async with AsyncClient(address, timeout=None) as client:
        results = await asyncio.gather(*[
            client.generate(prompt_token_ids=PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False) for _ in range(n)])
    for r in results:
        assert r.finish_reason == "length" and len(r.token_ids) == max_tokens, (r.finish_reason, len(r.token_ids))
    return sum(len(r.token_ids) for r in results)


async def drive_raw(address: str, n: int, max_tokens: int) -> int:
    """The same load on a bare connection that reads batched TokenDeltas."""
    async with RawConnection(address, timeout=None) as conn:
        info = await conn.hello("bench_overlap", batch_deltas=True)
        assert info.batch_deltas, info
        sampling = p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        run = await conn.run_requests([p.Generate(f"b{i}", PROMPT, sampling) for i in range(n)])
    assert all(fin.completion_tokens == max_tokens for fin in run.finished.values()), run.finished
    return sum(len(ids) for ids in run.token_ids.values())


# ----------------------------------------------------------------------- runs


def cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of a process so far (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def cpu_use(before: dict[str, Optional[float]], after: dict[str, Optional[float]], wall: float) -> dict[str, Any]:
    """Cores used by each process over the run (1.0 = one core busy the whole time)."""
    return {f"cpu_{k}": None if before[k] is None or after[k] is None else (after[k] - before[k]) / wall
            for k in before}


def read_steps(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def steady_window(steps: list[dict[str, Any]], running: int) -> list[dict[str, Any]]:
    """Steps where every request decodes (one row each), first and last tenth trimmed."""
    full = [s for s in steps if s["num_rows"] == running and s["num_tokens"] == running]
    cut = len(full) // 10
    return full[cut: len(full) - cut] if len(full) - 2 * cut >= 10 else full


def summarize(steps: list[dict[str, Any]], running: int) -> dict[str, Any]:
    win = steady_window(steps, running)
    if len(win) < 3:
        raise RuntimeError(f"only {len(win)} steady-state steps were logged")
    wall = win[-1]["t_end"] - win[0]["t_start"]
    gaps = [s["idle_s"] for s in win[1:]]  # the first step's wait lies before the window
    tokens = sum(s["num_tokens"] for s in win)
    busy = [s["t_end"] - s["t_start"] for s in win]
    gpu = {}
    if any(s.get("gpu_busy_s") for s in win):
        gpu_gaps, gpu_busy = [s["gpu_gap_s"] for s in win], [s["gpu_busy_s"] for s in win]
        gpu = {"gpu_idle_fraction": sum(gpu_gaps) / (sum(gpu_gaps) + sum(gpu_busy)),
               "gpu_gap_us_p50": percentile(gpu_gaps, 50) * 1e6, "gpu_gap_us_p99": percentile(gpu_gaps, 99) * 1e6,
               "gpu_step_us_p50": percentile(gpu_busy, 50) * 1e6}
    return {**gpu,
        "steps": len(win),
        "idle_fraction": sum(gaps) / wall,
        "idle_gap_us_p50": percentile(gaps, 50) * 1e6,
        "idle_gap_us_p99": percentile(gaps, 99) * 1e6,
        "step_ms_measured_p50": percentile(busy, 50) * 1e3,
        "tokens_per_s": tokens / wall,
    }


def drive_niced(client: str, address: str, n: int, max_tokens: int, nice: int) -> int:
    """Run the load in a thread of its own niceness: servers started from the main thread keep theirs."""
    out: list = []

    def body() -> None:
        try:
            if nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            out.append(asyncio.run((drive_sdk if client == "sdk" else drive_raw)(address, n, max_tokens)))
        except BaseException as e:  # re-raised in the caller
            out.append(e)

    thread = threading.Thread(target=body, name="load")
    thread.start()
    thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def run_one(executor: str, step_ms: Optional[float], depth: int, running: int, max_tokens: int,
            client: str, nice: int, tmp: str, model: str = "", throughput: bool = False,
            serve_args: str = "") -> dict[str, Any]:
    log = os.path.join(tmp, f"steps-{executor}-{step_ms}-{depth}-{time.monotonic_ns()}.jsonl")
    args = ["--pipeline-depth", str(depth), "--max-num-seqs", str(running), "--step-log", log,
            "--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", str(max(2048, running * len(PROMPT)))]
    if executor == "scripted":
        blocks = running * -(-(len(PROMPT) + max_tokens) // BLOCK_SIZE)
        args += ["--load-format", "scripted", "--scripted-step-ms", str(step_ms), "--num-kv-blocks", str(blocks),
                 "--max-model-len", str(len(PROMPT) + max_tokens + 16)]
    elif executor == "cuda":
        args += ["--device", "cuda", "--load-format", "dummy", "--model", model, "--max-num-seqs", "256"]
    else:
        args += ["--max-model-len", "1024"]
    args += serve_args.split()
    address = f"ipc://{tmp}/c-{time.monotonic_ns()}.sock"
    server = start_server(address, *args, run_dir=tmp, echo=False)
    try:
        pids = {"scheduler": server.pid, "executor": executor_pid(server)}

        def cpu() -> dict[str, Optional[float]]:
            return {"client": time.process_time(), **{k: cpu_seconds(pid) for k, pid in pids.items()}}

        before, t0 = cpu(), time.perf_counter()
        received = drive_niced(client, address, running, max_tokens, nice)
        elapsed = time.perf_counter() - t0
        usage = cpu_use(before, cpu(), elapsed)
        serve = _throughput(address, tmp) if throughput else None
    finally:
        stop_server(server)
    assert received == running * max_tokens, (received, running * max_tokens)
    row = {"executor": executor, "step_ms": step_ms, "depth": depth, "running": running, "client": client,
           "client_nice": nice, "max_tokens": max_tokens, "client_s": elapsed, "serve_args": serve_args}
    row.update(summarize(read_steps(log), running))
    row.update(usage)
    if serve:
        row.update(output_tokens_per_s=serve["output_throughput"], ttft_ms=serve["ttft_ms"], tpot_ms=serve["tpot_ms"])
    return row


def _throughput(address: str, tmp: str) -> dict[str, Any]:
    """bench_serve.py on the running server: 256 requests x 128 random tokens in, 128 out, all at once."""
    out = os.path.join(tmp, f"serve-{time.monotonic_ns()}.json")
    subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_serve.py"), "--address", address,
                    "--num-requests", "256", "--input-len", "128", "--output-len", "128", "--warmup", "8",
                    "--no-progress", "--json", out], check=True)
    with open(out) as f:
        return json.load(f)


def configs(args: argparse.Namespace):
    window = args.window_s or (0.4 if args.quick else 2.0)
    if args.executor in ("scripted", "both"):
        for step_ms in args.step_ms:
            # Enough steps for `window` seconds of steady state, plus the trimmed tenths.
            yield "scripted", step_ms, args.running, max(50, int(window * 1000 / step_ms * 1.25))
    if args.executor in ("model", "both"):
        running = args.model_running or (8 if args.quick else 16)
        yield "model", None, running, 10 if args.quick else 64
    if args.executor == "cuda":
        yield "cuda", None, args.model_running or 64, 32 if args.quick else 256


def print_row(row: dict[str, Any]) -> None:
    step = "-" if row["step_ms"] is None else f"{row['step_ms']:g}"
    cores = " ".join("  -" if row.get(f"cpu_{k}") is None else f"{row[f'cpu_{k}']:.2f}"
                     for k in ("scheduler", "executor", "client"))
    print(f"{row['executor']:>8} {step:>7} {row['depth']:>5} {row['running']:>7} {100 * row['idle_fraction']:>7.2f}% "
          f"{row['idle_gap_us_p50']:>9.1f} {row['idle_gap_us_p99']:>9.1f} {row['step_ms_measured_p50']:>8.2f} "
          f"{row['tokens_per_s']:>10.0f}   {cores}", flush=True)
    if "gpu_idle_fraction" in row:
        print(f"{'':>8} GPU idle {100 * row['gpu_idle_fraction']:.2f}%, gap p50 / p99 {row['gpu_gap_us_p50']:.1f} / "
              f"{row['gpu_gap_us_p99']:.1f} us, GPU step p50 {row['gpu_step_us_p50']:.1f} us"
              + (f", {row['output_tokens_per_s']:.0f} output tok/s (256 x 128/128)" if "output_tokens_per_s" in row
                 else ""), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    print(f"client: {args.client} (nice {args.client_nice}); idle = executor time waiting for its next plan, "
          f"steady-state decode window")
    print(f"{'executor':>8} {'step_ms':>7} {'depth':>5} {'running':>7} {'idle':>8} {'gap_p50us':>9} "
          f"{'gap_p99us':>9} {'step_ms~':>8} {'tokens/s':>10}   cores: sched exec client")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fr-ov-") as tmp:
        for executor, step_ms, running, max_tokens in configs(args):
            for depth in args.depths:
                runs = []
                for _ in range(args.repeat):
                    try:
                        runs.append(run_one(executor, step_ms, depth, running, max_tokens, args.client,
                                            args.client_nice, tmp, args.model, args.throughput,
                                            args.serve_args))
                    except Exception as e:  # the default model may be missing: report it, keep the other rows
                        print(f"{executor:>8} {step_ms or '-':>7} {depth:>5}: failed: {type(e).__name__}: {e}"[:400],
                              flush=True)
                        break
                if not runs:
                    continue
                runs.sort(key=lambda r: r["idle_fraction"])
                row = runs[len(runs) // 2]
                row["idle_fraction_runs"] = [r["idle_fraction"] for r in runs]
                rows.append(row)
                print_row(row)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
