"""Executor start-up, stage by stage: where the seconds before the first step go.

Each case builds the executor's worker (:func:`executor_proc.build.build_worker`: load, tune, KV cache,
CUDA graphs) in a fresh Python process with its own Triton cache, and times every stage its progress
reports, in the order they came (a stage that comes back after another is a new row: the kernels
compiled for each tuning phase, then for the graphs).  A case is ``NAME=THREADS`` (the compile pool,
``FORERUN_COMPILE_THREADS``; 0: every kernel compiles at its first launch); ``--warm`` runs the first
case again on its now-filled cache.

    # on a GPU (the 8B shape, random weights, every graph):
    python3 scripts/bench_startup.py --model scripts/configs/llama-3-8b --cases ahead=16,serial=0 --warm \\
        --json startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from benchlib import format_table, write_json

RESULT = "STARTUP-RESULT "  # the line a child prints its measurements on


def child(args: argparse.Namespace) -> None:
    """Build the worker here, timing each stage; print the result as one JSON line."""
    t0 = time.perf_counter()
    import torch

    from executor_proc.backends.gemv_tuning import tuner_report
    from executor_proc.build import build_worker
    from ipc.config import ExecutorConfig

    imported = time.perf_counter()
    segments: list[list] = [["importing", 0.0]]  # [stage, seconds from t0 at its first report]
    calls = _time_calls()
    compiles = _count_compiles(lambda: segments[-1][0])

    def progress(stage: str, done: int, total: int) -> None:
        if segments[-1][0] != stage:
            segments.append([stage, time.perf_counter() - t0])

    cfg = ExecutorConfig(model=args.model, load_format="dummy", device=args.device,
                         num_slots=args.num_slots)
    if args.device.startswith("cuda"):  # torch's CUDA start (context, lazy init): its own row
        segments.append(["cuda init", imported - t0])
        torch.zeros(1, device=args.device)
    segments.append(["building", time.perf_counter() - t0])
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    built = build_worker(cfg, progress)
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    if built.device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    rows = [(stage, (segments[i + 1][1] if i + 1 < len(segments) else total) - start)
            for i, (stage, start) in enumerate(segments)]
    backend = built.worker.model.backend
    print(RESULT + json.dumps({
        "total_s": total, "stages": rows, "calls": calls, "compiles": compiles, "num_graphs": built.num_graphs, "graph_capture_s": built.graph_capture_s,
        "graph_memory_bytes": built.graph_memory_bytes, "num_kv_blocks": built.num_kv_blocks, "tuner": tuner_report(backend)}), flush=True)


def _time_calls() -> dict:
    """Wrap the start-up's steps (module attributes looked up at call time) to add up their seconds."""
    import executor_proc.backends.gemv_tuning as tuning
    import executor_proc.build as build
    import executor_proc.model.loader as loader

    seconds: dict = {}

    def wrap(module, name):
        fn = getattr(module, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t
        setattr(module, name, timed)

    import executor_proc.model.llama as llama
    from executor_proc.model.llama import CausalLM

    for method in ("__init__", "to_empty", "tie_weights", "use_backend", "fuse_projections", "fold_norms"):
        wrap(CausalLM, method)
    for module, names in ((build, ("resolve_device", "load_model", "select_backend", "KVCache", "HostKV",
                                   "SlotTables", "Worker", "_capture_graphs")),
                          (loader, ("build_model", "init_dummy_weights")), (llama, ("rope_inv_freq",)),
                          (tuning, ("tune_linears", "tune_matmuls", "tune_prologues"))):
        for name in names:
            wrap(module, name)
    return seconds


def _count_compiles(stage) -> dict:
    """Count Triton's compiles (cache hits included) by the stage they fell in and the thread that ran them:
    ``main`` compiles happened at a launch, ``pool`` ones ahead of it (kernels/precompile.py)."""
    import threading

    from triton.runtime.jit import JITFunction

    counts: dict = {}
    compile_fn, main = JITFunction._do_compile, threading.main_thread()

    def counted(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return compile_fn(self, *args, **kwargs)
        finally:
            where = "main" if threading.current_thread() is main else "pool"
            row = counts.setdefault(f"{stage()} [{where}]", [0, 0.0, {}])
            row[0] += 1
            row[1] += time.perf_counter() - t
            row[2][self.__name__] = row[2].get(self.__name__, 0) + 1
    JITFunction._do_compile = counted
    return counts


def _failure(returncode: int, model: str) -> str:
    """Why a case's process ended, in words: a signal by name (SIGKILL: most often the kernel's out-of-memory
    killer, as for the default 8B shape's random weights on a machine without the memory)."""
    if returncode >= 0:
        return f"exit status {returncode}"
    sig = signal.Signals(-returncode).name
    if sig == "SIGKILL":
        return f"killed by {sig} (out of memory? --model {model} may need more than this machine has)"
    return f"killed by {sig}"


def run_case(args: argparse.Namespace, name: str, threads: int, cache: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache, FORERUN_COMPILE_THREADS=str(threads))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--device", args.device,
           "--num-slots", str(args.num_slots)]
    if args.profile:
        cmd += ["--profile", os.path.join(args.profile, name.replace(" ", "_") + ".prof")]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"bench_startup: case {name} took more than --timeout {args.timeout:g} s")
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        sys.exit(f"bench_startup: case {name} failed: {_failure(proc.returncode, args.model)}\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT):])
    warnings = [line for line in proc.stderr.splitlines() if "Warning" in line]
    return {"case": name, "threads": threads, "wall_s": wall, "warnings": warnings, **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model config folder, loaded with random weights (default: the 8B shape; "
                                     "with --device cpu the 135M one)")
    ap.add_argument("--device", default="cuda", help="the device to build on (default: cuda)")
    ap.add_argument("--num-slots", type=int, default=64,
                    help="requests at once; the decode graphs go up to this batch (default: 64)")
    ap.add_argument("--cases", default="ahead=16,serial=0",
                    help="comma-separated NAME=THREADS: the compile pool's size per case (0: compile at each "
                         "launch), each from an empty Triton cache (default: ahead=16,serial=0)")
    ap.add_argument("--warm", action="store_true", help="also run the first case again on its filled cache")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one case may take (default: 300)")
    ap.add_argument("--profile", metavar="DIR",
                    help="profile each case's main thread (cProfile) into DIR/CASE.prof (slows the Python parts)")
    ap.add_argument("--json", help="write every case's stages and the tuner's picks here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        shape = "smollm2-135m" if args.device == "cpu" else "llama-3-8b"
        args.model = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", shape)
    if args.child:
        return child(args)
    cases = [(name, int(threads)) for name, threads in (c.split("=") for c in args.cases.split(","))]
    results = []
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as root:  # each case's Triton cache
        for i, (name, threads) in enumerate(cases):
            results.append(run_case(args, name, threads, os.path.join(root, f"cache{i}")))
        if args.warm:
            name, threads = cases[0]
            results.append(run_case(args, f"{name} warm", threads, os.path.join(root, "cache0")))
    for r in results:
        rows = [(stage, f"{s:.1f} s") for stage, s in r["stages"]]
        rows += [("built after", f"{r['total_s']:.1f} s"), ("process wall", f"{r['wall_s']:.1f} s"),
                 ("graphs", f"{r['num_graphs']} in {r['graph_capture_s']:.1f} s, "
                            f"{r['graph_memory_bytes'] / 2**20:.0f} MiB"), ("KV blocks", str(r["num_kv_blocks"]))]
        rows += [(f"  {name}()", f"{s:.1f} s") for name, s in r["calls"].items()]
        rows += [(f"  compiles in {where}", f"{n} in {s:.1f} s") for where, (n, s, _) in r["compiles"].items()]
        print(format_table(rows, title=f"{r['case']} (compile threads {r['threads']})"))
        for where, (_, _, names) in r["compiles"].items():
            if where.endswith("[main]"):
                print(f"  at a launch in {where}:", ", ".join(f"{k} x{v}" for k, v in names.items()))
        for w in r["warnings"][:5]:
            print("  warning:", w)
    if len(results) > 1:
        first = {k: v.get("chosen") for k, v in results[0]["tuner"].items()}
        for r in results[1:]:
            picks = {k: v.get("chosen") for k, v in r["tuner"].items()}
            differ = sorted(k for k in first.keys() | picks.keys() if first.get(k) != picks.get(k))
            print(f"tuner picks, {r['case']} vs {results[0]['case']}: {len(differ)} of {len(first)} differ",
                  *differ[:8])
    if args.json:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        write_json(args.json, {"model": args.model, "device": device, "cases": results})


if __name__ == "__main__":
    main()
