"""Tensor and data parallelism: every many-GPU figure of docs/performance.md, one server per size.

With no flags it does what the GPUs present allow (G: those this process sees, ``--gpus`` to override):
``--sizes`` every power of two up to G; with G >= 4 also ``--big-model`` (the Llama-3-70B shape) at TP=4;
with G >= 2 also the data-parallel part.  ``--parts`` picks the parts.

**tp**: for each ``--sizes`` N, ``forerun serve --tensor-parallel-size N`` (random weights of ``--model``'s
shape, depth 1, ``--step-log``), then, through the SDK:

1. **batch-1 decode**: one request of ``--input-len`` prompt tokens and ``--decode-tokens`` new ones. Over its
   one-row decode steps: the step's GPU time on rank 0 (CUDA events; it includes the all-reduces' waits),
   the step period (successive steps' end times) and the client's TPOT. Target: TP=2 <= 60% of TP=1.
2. **GPU idle at batch ``--idle-batch``**: that many requests decode in lockstep; over the steps with all of
   them (first and last tenth trimmed) idle = sum(gap) / (sum(gap) + sum(busy)) from rank 0's CUDA events
   (``bench_overlap.py --executor cuda``'s measure). Target at TP=2, batch 64: <= 2%.
3. **throughput**: ``scripts/bench_serve.py`` with ``--requests`` x ``--input-len`` in / ``--output-len`` out,
   all at once, EOS ignored.

``--big-model`` at each ``--big-sizes`` N: phases 1 and 2.  Phases are told apart in the step log by step ids
(``ServerStats.steps`` before and after each).  ``--all-reduce nccl one-shot`` starts every server of N > 1 ranks
once per mode (``forerun serve --all-reduce``): the decode step over NCCL against the one-shot all-reduce.

**allreduce** (CUDA only; on the CPU a one-line note): for each ``--ar-ranks`` N, N rank processes time one
all-reduce of each ``--ar-bytes`` size of bfloat16 (1 KiB to 1 MiB), over NCCL and one shot
(``executor_proc/parallel/one_shot.py``, its copy into the buffer included), launched one by one (eager) and inside
a replayed CUDA graph (as decode steps run): a table, the size from which NCCL is as fast in a graph (the crossover
below which ``AUTO_MAX_BYTES`` should stay), and the rows in the JSON.

**dp**: for each ``--dp-sizes`` N, ``forerun serve --data-parallel-size N`` (random weights of ``--dp-model``'s
shape, one GPU a replica), then ``bench_serve.py`` with ``--dp-requests`` x ``--input-len`` in / ``--output-len``
out, all at once, from ``--client-procs`` processes (one is the limit at these rates): output tok/s, and each
size's against the first.  On the largest size, then, a **shared-prefix workload** through the SDK:
``--prefixes`` distinct prefixes of ``--prefix-len`` random tokens, each opening ``--prefix-requests`` prompts
(then ``--input-len`` tokens of their own), sent in waves: one request per prefix first, then the rest in
``--prefix-waves`` waves, every prefix in each, each wave once the last has finished.  The router sends a
request to the replica that holds its prefix: the servers' prefix-cache hit tokens over query tokens (the
router's sums and each replica's), against the reachable hits (every request after its prefix's first finds
the prefix).

    python3 scripts/bench_tp.py --json out.json          # every figure the GPUs present allow
    python3 scripts/bench_tp.py --dry-run --gpus 4       # the servers and commands on four GPUs
    python3 scripts/bench_tp.py --parts allreduce,tp --sizes 2 --all-reduce nccl one-shot --requests 0 \
        --json ar.json                                   # the crossover, and the decode step both ways

On the CPU (gloo), with a tiny config, it checks that the script runs (GPU figures are then zero).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from benchlib import gpu_idle_of, lockstep_decode, percentile, start_server, stop_server, write_json
from ipc.client import AsyncClient
from ipc.client.raw import RawConnection

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(SCRIPTS, "configs")
PARTS = ("tp", "dp", "allreduce")
ALL_REDUCES = ("nccl", "one-shot", "auto")  # forerun serve --all-reduce
AR_BYTES = [1024 << i for i in range(11)]  # 1 KiB .. 1 MiB
AR_GRAPH_CALLS = 20  # all-reduces captured in one graph
AR_CPU_NOTE = "allreduce: skipped (the one-shot all-reduce runs on CUDA only)"


@dataclass
class Run:
    """One server and what is measured on it."""

    part: str  # "tp" or "dp"
    model: str
    size: int  # tensor- or data-parallel size
    flags: list[str]  # `forerun serve` flags, less --address
    throughput: bool  # tp: the throughput phase too
    shared_prefix: bool = False  # dp: the shared-prefix workload after the throughput
    all_reduce: str = "auto"  # tp: forerun serve --all-reduce


def plan(args) -> list[Run]:
    """Every server of the run, in order."""
    common = ["--device", args.device, "--load-format", "dummy", "--max-num-seqs", str(args.max_num_seqs)]
    runs = []
    if "tp" in args.parts:
        for model, sizes, throughput in ((args.model, args.sizes, args.requests > 0), (args.big_model,
                                                                                        args.big_sizes, False)):
            runs += [Run("tp", model, n, [*common, "--model", model, "--tensor-parallel-size", str(n),
                                          "--pipeline-depth", "1", *(["--all-reduce", mode] if n > 1 else []),
                                          *args.server_flag], throughput, all_reduce=mode)
                     for n in sizes for mode in (args.all_reduce if n > 1 else ["-"])]  # one rank: none
    if "dp" in args.parts:
        runs += [Run("dp", args.dp_model, n, [*common, "--model", args.dp_model, "--data-parallel-size", str(n),
                                              *args.server_flag], True, n == max(args.dp_sizes))
                 for n in args.dp_sizes]
    return runs


def vocab_of(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]


# ------------------------------------------------------------------------------------------------ tp


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


def bench_serve_cmd(address: str, run: Run, args, out: str) -> list[str]:
    """``bench_serve.py``: --requests (dp: --dp-requests, from --client-procs processes) x --input-len in /
    --output-len out, all at once, EOS ignored."""
    dp = ["--warmup", str(args.dp_warmup), "--seed", "1", "--client-procs", str(args.client_procs)]
    return [sys.executable, os.path.join(SCRIPTS, "bench_serve.py"), "--address", address, "--num-requests",
            str(args.dp_requests if run.part == "dp" else args.requests), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), *(dp if run.part == "dp" else ["--warmup", "4"]), "--ignore-eos",
            "--no-progress", "--json", out]


def bench_serve(cmd: list[str]) -> dict:
    subprocess.run(cmd, check=True)
    with open(cmd[cmd.index("--json") + 1]) as f:
        figures = json.load(f)
    return {"output_tokens_per_s": figures["output_throughput"], "tpot_ms_p50": figures["tpot_ms"]["p50"],
            "ttft_ms_p50": figures["ttft_ms"]["p50"], "duration_s": figures["duration_s"],
            "client_cpu_fraction": figures.get("client_cpu_fraction")}


def measure_tp(run: Run, address: str, tmp: str, args) -> tuple[dict, tuple[int, int, int]]:
    """The tp phases on a started server: the client's figures, and the step ids that bound the batch-1 and the
    GPU-idle phases in its step log (read once it has stopped)."""
    vocab = vocab_of(run.model)
    asyncio.run(lockstep_decode(address, 4, 16, 8, vocab))  # warm-up
    first = asyncio.run(steps_done(address))
    row = asyncio.run(batch1_decode(address, args.input_len, args.decode_tokens, vocab))
    mid = asyncio.run(steps_done(address))
    asyncio.run(lockstep_decode(address, args.idle_batch, args.input_len, args.idle_tokens, vocab))
    last = asyncio.run(steps_done(address))
    if run.throughput:
        row.update(bench_serve(bench_serve_cmd(address, run, args, os.path.join(tmp, "serve.json"))))
    return row, (first, mid, last)


def step_log_figures(log: str, steps: tuple[int, int, int], idle_batch: int) -> dict:
    first, mid, last = steps
    with open(log) as f:
        rows = [json.loads(line) for line in f]
    figures = decode_steps([r for r in rows if first <= r["step_id"] < mid])
    figures.update({f"idle_{k}": v for k, v in gpu_idle_of([r for r in rows if mid <= r["step_id"] < last],
                                                           idle_batch).items()})
    return figures


# ------------------------------------------------------------------------------------------------ dp


def shared_prefix_waves(args, vocab: int) -> list[list[list[int]]]:
    """The shared-prefix prompts in waves: one per prefix, then the others spread over --prefix-waves waves
    (every prefix in each, interleaved)."""
    rng = random.Random(2)
    prefixes = [[rng.randrange(10, vocab) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]

    def prompt(prefix: list[int]) -> list[int]:
        return prefix + [rng.randrange(10, vocab) for _ in range(args.input_len)]

    rest, n = args.prefix_requests - 1, args.prefix_waves
    waves = [[prompt(p) for p in prefixes]]
    waves += [[prompt(p) for _ in range(rest // n + (w < rest % n)) for p in prefixes] for w in range(n)]
    return [w for w in waves if w]


def cache_counts(stats) -> dict:
    return {"requests": stats.requests, "query_tokens": stats.prefix_cache_query_tokens,
            "hit_tokens": stats.prefix_cache_hit_tokens}


def counts_between(before, after) -> dict:
    a, b = cache_counts(after), cache_counts(before)
    return {k: a[k] - b[k] for k in a}


async def shared_prefix(address: str, args, vocab: int) -> dict:
    """Send the waves; the prefix cache's figures over them (the router's sums, and each replica's)."""
    waves = shared_prefix_waves(args, vocab)
    async with AsyncClient(address, timeout=600) as c:
        before = await c.get_stats()
        t0 = time.perf_counter()
        for wave in waves:
            await asyncio.gather(*[c.generate(prompt_token_ids=ids, max_tokens=args.prefix_output_len,
                                              temperature=0.0, ignore_eos=True, detokenize=False) for ids in wave])
        seconds = time.perf_counter() - t0
        after = await c.get_stats()
    total = counts_between(before, after)
    earlier = {r.replica: r for r in before.replicas}
    replicas = [{"replica": r.replica, **counts_between(earlier[r.replica], r)}
                for r in after.replicas if r.replica in earlier]
    reachable = args.prefixes * (args.prefix_requests - 1) * args.prefix_len
    return {"prefixes": args.prefixes, "prefix_len": args.prefix_len, "waves": [len(w) for w in waves],
            "seconds": seconds, **total,
            "hit_fraction": total["hit_tokens"] / total["query_tokens"] if total["query_tokens"] else None,
            "reachable_hit_tokens": reachable,
            "hit_of_reachable": total["hit_tokens"] / reachable if reachable else None, "replicas": replicas}


def measure_dp(run: Run, address: str, tmp: str, args) -> dict:
    row = bench_serve(bench_serve_cmd(address, run, args, os.path.join(tmp, "serve.json")))
    if run.shared_prefix:
        row["prefix"] = asyncio.run(shared_prefix(address, args, vocab_of(run.model)))
    return row


# ------------------------------------------------------------------------------------------------ allreduce


def time_all_reduces(rank: int, size: int, store: str, sizes: list[int], iters: int, out: str) -> None:
    """One rank of the all-reduce timing (a process of its own, on cuda:rank): every size of bfloat16 over NCCL and
    one shot, eager and in a graph; rank 0 writes the rows (microseconds a call) to ``out``."""
    import torch
    import torch.distributed as dist

    from executor_proc.parallel.group import init_group

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = init_group(f"file://{store}", rank, size, device, all_reduce="one-shot")
    rows = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=device)  # zeros: repeated sums stay finite
        ways = {"nccl": lambda: dist.all_reduce(x)}
        if group.one_shot.takes(x):
            ways["one_shot"] = lambda: group.one_shot(x)
        row = {"tp": size, "bytes": nbytes}
        for name, call in ways.items():
            row[f"{name}_eager_us"] = _eager_us(call, iters, device)
            row[f"{name}_graph_us"] = _graph_us(call, iters, device)
        rows.append(row)
    torch.cuda.synchronize(device)
    if rank == 0:
        write_json(out, {"rows": rows})
    group.barrier()
    group.exit_process(0)


def _eager_us(call, iters: int, device) -> float:
    """One call launched after another: microseconds each (host launch included)."""
    import torch

    for _ in range(5):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) * 1e3 / iters


def _graph_us(call, iters: int, device) -> float:
    """AR_GRAPH_CALLS calls captured in one graph, replayed: microseconds each (no host work, as in a decode step)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(AR_GRAPH_CALLS):
            call()
    graph.replay()
    replays = max(1, iters // AR_GRAPH_CALLS)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) * 1e3 / (replays * AR_GRAPH_CALLS)


def measure_all_reduces(size: int, args) -> list[dict]:
    """Start ``size`` rank processes (multicast off, as a server's), wait for them, return rank 0's rows."""
    from scheduler_proc.executor_process import NO_MULTICAST_ENV

    os.environ.update(NO_MULTICAST_ENV)  # the ranks inherit it
    tmp = tempfile.mkdtemp(prefix="frar", dir="/tmp")
    out = os.path.join(tmp, "rows.json")
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=time_all_reduces, args=(r, size, os.path.join(tmp, "store"), args.ar_bytes,
                                                          args.ar_iters, out)) for r in range(size)]
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + args.start_timeout
        # A rank that fails leaves the others waiting for it: stop waiting at the first failure.
        while any(p.is_alive() for p in procs) and not any(p.exitcode for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = [proc.exitcode for proc in procs]
        if any(code != 0 for code in codes):
            raise RuntimeError(f"all-reduce timing at TP={size} failed: the ranks' exit codes {codes} (None: still "
                               "running, stopped; a rank's traceback is above)")
        with open(out) as f:
            return json.load(f)["rows"]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(tmp, ignore_errors=True)


def one_shot_faster_below(rows: list[dict], size: int) -> int | None:
    """The first size (bytes) at which one shot is no faster than NCCL in a graph at ``size`` ranks (None: faster
    at every size timed): ``AUTO_MAX_BYTES[size]`` should stay below it."""
    for r in sorted((r for r in rows if r["tp"] == size), key=lambda r: r["bytes"]):
        if r.get("one_shot_graph_us") is None or r["one_shot_graph_us"] >= r["nccl_graph_us"]:
            return r["bytes"]
    return None


def _size(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 and nbytes % 2**20 == 0 else f"{nbytes / 1024:g} KiB"


def print_all_reduces(rows: list[dict], crossovers: dict[int, int | None]) -> None:
    print("\nall-reduce of bfloat16, microseconds a call (eager: launched one by one; graph: "
          f"{AR_GRAPH_CALLS} in a replayed CUDA graph)")
    print(f"{'TP':>3} {'size':>9} {'NCCL eager':>11} {'one-shot eager':>15} {'NCCL graph':>11} "
          f"{'one-shot graph':>15} {'graph speed-up':>15}")
    for r in rows:
        one = r.get("one_shot_graph_us")
        speed_up = f"{r['nccl_graph_us'] / one:.2f}x" if one else "-"
        print(f"{r['tp']:>3} {_size(r['bytes']):>9} {r['nccl_eager_us']:>11.1f} "
              f"{_fmt(r.get('one_shot_eager_us')):>15} {r['nccl_graph_us']:>11.1f} {_fmt(one):>15} {speed_up:>15}")
    for size, nbytes in crossovers.items():
        where = f"below {_size(nbytes)}" if nbytes is not None else "at every size timed"
        print(f"TP={size}: one shot faster than NCCL in a graph {where} "
              "(executor_proc/parallel/one_shot.py AUTO_MAX_BYTES)")


# ------------------------------------------------------------------------------------------------ driver


def measure(run: Run, args) -> dict:
    """Start the run's server, measure, stop it."""
    tmp = tempfile.mkdtemp(prefix="frtp", dir="/tmp")
    address, log = f"ipc://{tmp}/c.sock", os.path.join(tmp, "steps.jsonl")
    flags = [*run.flags, "--step-log", log] if run.part == "tp" else run.flags
    t0 = time.monotonic()
    proc = start_server(address, *flags, timeout=args.start_timeout)
    row = {"model": os.path.basename(run.model.rstrip("/")), run.part: run.size, "start_s": time.monotonic() - t0}
    if run.part == "tp":
        row["all_reduce"] = run.all_reduce
    try:
        if run.part == "tp":
            figures, steps = measure_tp(run, address, tmp, args)
        else:
            figures = measure_dp(run, address, tmp, args)
    finally:
        stop_server(proc)
    row.update(figures)
    if run.part == "tp":
        row.update(step_log_figures(log, steps, args.idle_batch))
    shutil.rmtree(tmp, ignore_errors=True)
    return row


def dry_run(runs: list[Run], args) -> None:
    """Every server and command, nothing started."""
    address, out = "ipc://TMP/c.sock", "TMP/serve.json"
    on_gpu = args.device.startswith("cuda")
    if "allreduce" in args.parts and not on_gpu:
        print(AR_CPU_NOTE)
    for size in args.ar_ranks if "allreduce" in args.parts and on_gpu else []:
        print(f"all-reduce timing at TP={size}: {size} rank processes, bfloat16 of "
              f"{', '.join(map(_size, args.ar_bytes))}, NCCL and one shot, eager and in a graph "
              f"({args.ar_iters} calls each)")
    for run in runs:
        step_log = ["--step-log", "TMP/steps.jsonl"] if run.part == "tp" else []
        print(f"forerun serve --address {address} --quiet {shlex.join(run.flags + step_log)}")
        if run.part == "tp":
            print(f"  warm-up: 4 x 16 in / 8 out; batch 1: {args.input_len} in / {args.decode_tokens} out; "
                  f"GPU idle: {args.idle_batch} x {args.input_len} in / {args.idle_tokens} out (SDK)")
            if run.throughput:
                print("  " + shlex.join(bench_serve_cmd(address, run, args, out)))
        else:
            print("  " + shlex.join(bench_serve_cmd(address, run, args, out)))
            if run.shared_prefix:
                waves = [len(w) for w in shared_prefix_waves(args, 1000)]
                print(f"  shared prefix: {args.prefixes} prefixes of {args.prefix_len} tokens, "
                      f"{args.prefix_requests} requests each (+{args.input_len} own tokens, "
                      f"{args.prefix_output_len} out), waves of {waves} (SDK)")


def _fmt(value, scale=1.0, digits=1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def print_tables(tp_rows: list[dict], dp_rows: list[dict]) -> None:
    if tp_rows:
        print(f"\n{'model':>13} {'TP':>3} {'all-reduce':>10} {'start s':>8} {'decode GPU us':>14} {'period us':>10} "
              f"{'vs first':>8} {'TPOT ms':>8} {'idle %':>7} {'idle steps':>10} {'out tok/s':>10}")
    for r in tp_rows:
        base = next((b for b in tp_rows if b["model"] == r["model"]), r)
        ratio = (r["decode_period_us_p50"] / base["decode_period_us_p50"]
                 if r["decode_period_us_p50"] and base["decode_period_us_p50"] else None)
        print(f"{r['model']:>13} {r['tp']:>3} {r['all_reduce']:>10} {r['start_s']:>8.1f} "
              f"{_fmt(r['decode_gpu_us_p50']):>14} {_fmt(r['decode_period_us_p50']):>10} {_fmt(ratio, 100):>7}% "
              f"{_fmt(r['client_tpot_ms'], 1, 2):>8} "
              f"{_fmt(r['idle_gpu_idle_fraction'], 100, 2):>7} {r['idle_steps']:>10} "
              f"{_fmt(r.get('output_tokens_per_s'), 1, 0):>10}")
    if dp_rows:
        print(f"\n{'model':>13} {'DP':>3} {'start s':>8} {'out tok/s':>10} {'vs first':>9} {'run s':>7} "
              f"{'TTFT p50 ms':>12} {'TPOT p50 ms':>12}")
    for r in dp_rows:
        print(f"{r['model']:>13} {r['dp']:>3} {r['start_s']:>8.1f} {r['output_tokens_per_s']:>10.0f} "
              f"{r['vs_first']:>8.2f}x {r['duration_s']:>7.2f} {_fmt(r['ttft_ms_p50']):>12} "
              f"{_fmt(r['tpot_ms_p50'], 1, 2):>12}")
        if "prefix" in r:
            p = r["prefix"]
            each = ", ".join(f"replica {x['replica']}: {x['hit_tokens']:,} of {x['query_tokens']:,} "
                             f"({x['requests']} requests)" for x in p["replicas"])
            print(f"  shared prefix at DP={r['dp']}: {p['hit_tokens']:,} of {p['query_tokens']:,} query tokens hit "
                  f"({_fmt(p['hit_fraction'], 100)}%; {_fmt(p['hit_of_reachable'], 100)}% of the "
                  f"{p['reachable_hit_tokens']:,} reachable); {each}")


def count_gpus(args) -> int:
    """GPUs to plan for: --gpus, else those this process sees (0 on the CPU)."""
    if args.gpus is not None or not args.device.startswith("cuda"):
        return args.gpus or 0
    from scheduler_proc.replica import visible_gpus

    visible = visible_gpus()
    return len(visible) if visible is not None else -1


def parse_args(argv=None) -> tuple[argparse.Namespace, int]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=None, metavar="LIST",
                    help="comma-separated parts: tp, dp, allreduce (default: tp, and dp with 2 or more GPUs; "
                         "allreduce times NCCL against the one-shot all-reduce, CUDA only)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (default: %(default)s)")
    ap.add_argument("--gpus", type=int, default=None, metavar="G",
                    help="GPUs to plan the defaults for (default: those visible: CUDA_VISIBLE_DEVICES, else "
                         "nvidia-smi's)")
    ap.add_argument("--dry-run", action="store_true", help="print every server and command, start nothing")
    ap.add_argument("--model", default=os.path.join(CONFIGS, "llama-3-8b"),
                    help="tp: config folder for random weights (default: the Llama-3-8B shape)")
    ap.add_argument("--sizes", type=int, nargs="+", metavar="N", default=None,
                    help="tp: tensor-parallel sizes of --model (default: every power of two up to the GPUs; "
                         "1 2 on the CPU)")
    ap.add_argument("--big-model", default=os.path.join(CONFIGS, "llama-3-70b"),
                    help="tp: config folder of a model measured without the throughput phase (default: the "
                         "Llama-3-70B shape)")
    ap.add_argument("--big-sizes", type=int, nargs="*", metavar="N", default=None,
                    help="tp: tensor-parallel sizes of --big-model (default: 4 with 4 or more GPUs, else none)")
    ap.add_argument("--all-reduce", nargs="+", choices=ALL_REDUCES, default=["auto"], metavar="MODE",
                    help="tp: forerun serve --all-reduce of every server of 2 or more ranks, a server per mode "
                         f"({', '.join(ALL_REDUCES)}; e.g. nccl one-shot) (default: auto, the server's)")
    ap.add_argument("--ar-ranks", type=int, nargs="+", metavar="N", default=None,
                    help="allreduce: group sizes timed (2, 4 or 8) (default: the --sizes among them)")
    ap.add_argument("--ar-bytes", type=int, nargs="+", metavar="B", default=AR_BYTES,
                    help="allreduce: all-reduce sizes in bytes, bfloat16 (default: 1 KiB, 2 KiB, ... 1 MiB)")
    ap.add_argument("--ar-iters", type=int, default=200, help="allreduce: calls timed per size and way (default: "
                                                              "200)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="every server's --max-num-seqs (default: 256)")
    ap.add_argument("--input-len", type=int, default=128,
                    help="prompt tokens of every request (shared-prefix prompts: after the prefix) (default: 128)")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tp: new tokens of the batch-1 request")
    ap.add_argument("--idle-batch", type=int, default=64, help="tp: requests decoding in lockstep for GPU idle")
    ap.add_argument("--idle-tokens", type=int, default=256, help="tp: new tokens of each lockstep request")
    ap.add_argument("--requests", type=int, default=256, help="tp: throughput requests of --model (0: skip the "
                                                              "phase)")
    ap.add_argument("--output-len", type=int, default=128, help="new tokens of each throughput request")
    ap.add_argument("--dp-model", default=os.path.join(CONFIGS, "llama-3.2-1b"),
                    help="dp: config folder for random weights (default: the Llama-3.2-1B shape)")
    ap.add_argument("--dp-sizes", type=int, nargs="+", metavar="N", default=[1, 2],
                    help="dp: data-parallel sizes, one GPU a replica (default: 1 2)")
    ap.add_argument("--dp-requests", type=int, default=512, help="dp: throughput requests (default: 512)")
    ap.add_argument("--dp-warmup", type=int, default=16, help="dp: bench_serve.py --warmup (default: 16)")
    ap.add_argument("--client-procs", type=int, default=2, help="dp: bench_serve.py --client-procs (default: 2)")
    ap.add_argument("--prefixes", type=int, default=8, help="dp: distinct shared prefixes (default: 8)")
    ap.add_argument("--prefix-len", type=int, default=512, help="dp: tokens of each prefix (default: 512)")
    ap.add_argument("--prefix-requests", type=int, default=32, help="dp: requests opening with each prefix "
                                                                    "(default: 32)")
    ap.add_argument("--prefix-waves", type=int, default=3,
                    help="dp: waves after the first (one request a prefix) the other requests go in (default: 3)")
    ap.add_argument("--prefix-output-len", type=int, default=16, help="dp: new tokens of each shared-prefix "
                                                                      "request (default: 16)")
    ap.add_argument("--start-timeout", type=float, default=480, help="seconds a server may take to start")
    ap.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                    help="an extra `forerun serve` argument for every server (repeatable; e.g. "
                         "--server-flag=--num-kv-blocks=512)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    args = ap.parse_args(argv)

    if args.device != "cpu" and not args.device.startswith("cuda"):
        ap.error(f"--device must be cuda or cpu, got {args.device!r}")
    if args.gpus is not None and args.gpus < 0:
        ap.error("--gpus must be 0 or more")
    if args.parts is not None and (not args.parts or any(p not in PARTS for p in args.parts.split(","))):
        ap.error(f"--parts takes a comma-separated list of {', '.join(PARTS)}, got {args.parts!r}")
    gpus = count_gpus(args)
    if gpus < 0:
        if not args.dry_run:
            ap.error("cannot count the GPUs (no CUDA_VISIBLE_DEVICES, no nvidia-smi): pass --gpus G")
        print("(GPUs not counted here: planning for 2; --gpus G for another count)")
        gpus = 2
    on_gpu = args.device.startswith("cuda")
    if on_gpu and gpus == 0:
        ap.error("no GPUs visible: --device cpu, or --gpus G")
    if args.sizes is None:
        args.sizes = [1 << i for i in range(gpus.bit_length())] if on_gpu else [1, 2]
    if args.big_sizes is None:
        args.big_sizes = [4] if on_gpu and gpus >= 4 else []
    parts = args.parts.split(",") if args.parts is not None else ["tp", *(["dp"] if on_gpu and gpus >= 2 else [])]
    args.parts = parts
    if not on_gpu and "one-shot" in args.all_reduce:
        ap.error("--all-reduce one-shot needs --device cuda (on the cpu the ranks all-reduce over gloo)")
    if args.ar_ranks is None:
        args.ar_ranks = [n for n in args.sizes if n in (2, 4, 8)]
    if on_gpu and "allreduce" in parts and (not args.ar_ranks or max(args.ar_ranks) > gpus):
        ap.error(f"--parts allreduce needs --ar-ranks (or --sizes) of 2, 4 or 8, at most the {gpus} GPUs visible")
    if any(n not in (2, 4, 8) for n in args.ar_ranks):
        ap.error("--ar-ranks takes 2, 4 or 8 (the one-shot all-reduce's group sizes)")
    if any(b < 4 or b % 4 for b in args.ar_bytes):
        ap.error("--ar-bytes must be positive multiples of 4")
    for name in ("ar_iters", "max_num_seqs", "input_len", "decode_tokens", "idle_batch", "idle_tokens", "output_len",
                 "dp_requests", "client_procs", "prefixes", "prefix_len", "prefix_requests", "prefix_waves",
                 "prefix_output_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.requests < 0 or args.dp_warmup < 0:
        ap.error("--requests and --dp-warmup must be 0 or more")
    if args.client_procs > args.dp_requests:
        ap.error("--client-procs must be at most --dp-requests")
    for flag, sizes, part in (("--sizes", args.sizes, "tp"), ("--big-sizes", args.big_sizes, "tp"),
                              ("--dp-sizes", args.dp_sizes, "dp")):
        if any(n < 1 for n in sizes):
            ap.error(f"{flag} must be at least 1")
        if on_gpu and part in parts and sizes and max(sizes) > gpus:
            ap.error(f"{flag} {max(sizes)} needs {max(sizes)} GPUs, {gpus} visible")
    for flag, model, used in (("--model", args.model, "tp" in parts and args.sizes),
                              ("--big-model", args.big_model, "tp" in parts and args.big_sizes),
                              ("--dp-model", args.dp_model, "dp" in parts)):
        if used and not os.path.isfile(os.path.join(model, "config.json")):
            ap.error(f"{flag} {model}: no config.json there")
    return args, gpus


def main(argv=None) -> None:
    args, gpus = parse_args(argv)
    runs = plan(args)
    if args.dry_run:
        dry_run(runs, args)
        return
    ar_rows, crossovers = [], {}
    if "allreduce" in args.parts and not args.device.startswith("cuda"):
        print(AR_CPU_NOTE)
    elif "allreduce" in args.parts:
        for size in args.ar_ranks:
            rows = measure_all_reduces(size, args)
            ar_rows += rows
            crossovers[size] = one_shot_faster_below(rows, size)
            print(json.dumps({"tp": size, "all_reduce_rows": rows}), flush=True)
    tp_rows, dp_rows = [], []
    for run in runs:
        row = measure(run, args)
        (tp_rows if run.part == "tp" else dp_rows).append(row)
        print(json.dumps(row), flush=True)
    for r in dp_rows:
        r["vs_first"] = r["output_tokens_per_s"] / (dp_rows[0]["output_tokens_per_s"] or 1)
    if ar_rows:
        print_all_reduces(ar_rows, crossovers)
    print_tables(tp_rows, dp_rows)
    if args.json:
        write_json(args.json, {"args": vars(args), "gpus": gpus, "rows": tp_rows, "dp_rows": dp_rows,
                               "allreduce_rows": ar_rows, "one_shot_faster_below": crossovers})


if __name__ == "__main__":
    main()
