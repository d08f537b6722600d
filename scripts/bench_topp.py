#!/usr/bin/env python3
"""Check and time the sampler's filtering paths (top-k / top-p) on the GPU.

    python3 scripts/bench_topp.py [--json PATH] [--reps N] [--methods select,window] [--sweep] [--wide] [--profile]

For vocab 32000 and 128256 x rows 1, 8, 64 and the modes greedy, top-k 50, top-p 0.9,
top-k 50 + top-p 0.9 and mixed rows (greedy, temperature, min-p, top-k, top-p, both, top-p + min-p,
top-k 1), logits ``randn * 4`` at temperature 0.8 (the mixed mode draws its temperatures in [0.5, 1]):

1. exactness: ``kernels.sampling.sample`` (default path) against the torch reference
   ``kernels.sampling_ref.sample`` on fresh logits and seeds (``--checks`` draws per shape and
   mode), and the number of rows the window left to the one-program-per-row kernel;
2. time: median microseconds of CUDA-graph replays timed by CUDA events, after warm-up,
   rotating over three logits buffers (so the 33 MB of a 64 x 128k batch is not always in L2),
   for ``--methods``: ``select`` (the default path) and ``window`` (``torch.topk`` window, the
   default before the select path), and, for reference, ``torch.topk(logits, 50)`` alone.

``--sweep`` also times the select path's knobs (block, warps, buckets, capacity, rank blocking) at
64 x 128256; ``--wide`` (and ``--sweep``) ``torch.topk(logits, 50)`` alone and a wide nucleus
(``randn * 1`` logits at T = 1.5, top-p 0.9: tens of thousands of tokens, more than the window
holds, so the row kernel runs).  ``--profile`` prints the per-kernel times of two cases (torch
profiler, eager).  ``--baseline PATH`` (an earlier ``kernels/sampling_select.py``, e.g.
``git show 401f5f5:kernels/sampling_select.py > /tmp/kernels_baseline.py``) times its
``sample_select`` against this one's, alternately in the same process, per filtered case.
Without CUDA: tiny shapes in the Triton CPU interpreter (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after TRITON_INTERPRET)

from kernels.interpreter_patch import patch_interpreter  # noqa: E402

patch_interpreter()

from kernels.sampling import sample  # noqa: E402
from kernels.sampling_ref import sample as sample_ref  # noqa: E402
from kernels.sampling_select import sample_select  # noqa: E402

DEV = torch.device("cuda" if ON_GPU else "cpu")
MODES = ("greedy", "top_k", "top_p", "top_k+top_p", "mixed")


def params(S: int, mode: str, g: torch.Generator) -> list[torch.Tensor]:
    """Per-row sampling parameters for a mode (see the module docstring)."""
    temp = torch.full((S,), 0.8)
    top_k = torch.zeros(S, dtype=torch.int64)
    top_p = torch.ones(S)
    min_p = torch.zeros(S)
    if mode == "greedy":
        temp[:] = 0.0
    if "top_k" in mode:
        top_k[:] = 50
    if "top_p" in mode:
        top_p[:] = 0.9
    if mode == "mixed":
        temp = torch.rand(S, generator=g) * 0.5 + 0.5
        for i in range(S):
            kind = i % 8
            if kind == 0:
                temp[i] = 0.0
            elif kind == 2:
                min_p[i] = 0.05
            elif kind == 3:
                top_k[i] = 50
            elif kind == 4:
                top_p[i] = 0.9
            elif kind == 5:
                top_k[i], top_p[i] = 40, 0.95
            elif kind == 6:
                top_p[i], min_p[i] = 0.95, 0.05
            elif kind == 7:
                top_k[i] = 1
    seed = torch.randint(0, 2**62, (S,), generator=g, dtype=torch.int64)
    pos = torch.randint(0, 2**20, (S,), generator=g, dtype=torch.int64)
    return [t.to(DEV) for t in (temp, top_k, top_p, min_p, seed, pos)]


def time_us(fns, reps: int) -> float:
    """Median us per call over ``fns`` (one per logits buffer), as replayed CUDA graphs (GPU) or wall clock."""
    if not ON_GPU:
        t = time.perf_counter()
        fns[0]()
        return (time.perf_counter() - t) * 1e6
    graphs = []
    for fn in fns:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs.append(graph)
    for _ in range(10):
        for graph in graphs:
            graph.replay()
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graphs[i % len(graphs)].replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def check(S: int, V: int, mode: str, draws: int, g: torch.Generator) -> tuple[int, int]:
    """(mismatching rows, rows left to the row kernel) of the default path against the reference."""
    bad = left = 0
    for _ in range(draws):
        logits = (torch.randn(S, V, generator=g) * 4).to(DEV)
        p = params(S, mode, g)
        bad += int((sample(logits, *p) != sample_ref(logits, *p)).sum())
        out = torch.empty(S, dtype=torch.int64, device=DEV)
        done = torch.empty(S, dtype=torch.int32, device=DEV)
        sample_select(logits, *p, out, done)
        left += int((done == 0).sum())
    return bad, left


def bench_shape(S: int, V: int, args, rows: list[dict]) -> None:
    g = torch.Generator().manual_seed(S * 7 + V)
    bufs = [(torch.randn(S, V, generator=g) * 4).to(DEV) for _ in range(3 if ON_GPU else 1)]
    out = torch.empty(S, dtype=torch.int64, device=DEV)
    for mode in MODES:
        p = params(S, mode, g)
        bad, left = check(S, V, mode, args.checks, g)
        row = dict(S=S, V=V, mode=mode, mismatches=bad, rows_checked=S * args.checks, left_to_row_kernel=left)
        if mode == "greedy":
            row["select_us"] = time_us([lambda x=x: sample(x, *p, out=out, greedy_only=True) for x in bufs], args.reps)
            row["window_us"] = row["select_us"]  # the all-greedy step runs the argmax on both paths
        else:
            for method in args.methods.split(","):
                row[f"{method}_us"] = time_us([lambda x=x: sample(x, *p, out=out, method=method) for x in bufs],
                                              args.reps)
        if args.baseline and mode != "greedy":
            row["select_only_us"], row["baseline_us"] = interleaved(args, bufs, p)
        rows.append(row)
        print(f"  V={V:>6} S={S:>2}  {mode:<12} select {row['select_us']:8.1f} us   window "
              f"{row.get('window_us', float('nan')):8.1f} us   mismatches {bad}/{S * args.checks}  left {left}",
              flush=True)


def load_baseline(path: str):
    """An earlier copy of kernels/sampling_select.py (e.g. from ``git show``), imported as kernels._baseline."""
    spec = importlib.util.spec_from_file_location("kernels._baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def interleaved(args, bufs, p) -> tuple[float, float]:
    """(this sample_select, the baseline's) median us, timed alternately (3 rounds each): same clocks, same L2."""
    S = bufs[0].shape[0]
    out = torch.empty(S, dtype=torch.int64, device=DEV)
    done = torch.empty(S, dtype=torch.int32, device=DEV)
    ours, base = [], []
    for _ in range(3):
        ours.append(time_us([lambda x=x: sample_select(x, *p, out, done) for x in bufs], args.reps))
        base.append(time_us([lambda x=x: args.baseline.sample_select(x, *p, out, done) for x in bufs], args.reps))
    return statistics.median(ours), statistics.median(base)


def sweep(args, rows: list[dict]) -> None:
    S, V = (64, 128256) if ON_GPU else (4, 3000)
    g = torch.Generator().manual_seed(5)
    bufs = [(torch.randn(S, V, generator=g) * 4).to(DEV) for _ in range(3 if ON_GPU else 1)]
    out = torch.empty(S, dtype=torch.int64, device=DEV)
    done = torch.empty(S, dtype=torch.int32, device=DEV)
    rows.append(dict(S=S, V=V, mode="torch.topk(logits, 50) alone",
                     select_us=time_us([lambda x=x: torch.topk(x, 50, dim=-1) for x in bufs], args.reps)))
    print(f"  torch.topk(50) alone: {rows[-1]['select_us']:.1f} us")
    knobs = (dict(), dict(block=2048, warps=(4, 8)), dict(warps=(8, 16)), dict(buckets=128), dict(capacity=1024),
             dict(rank=(256, 32)), dict(rank=(64, 256)))
    for mode in ("top_k", "top_p", "top_k+top_p") if args.sweep else ():
        p = params(S, mode, g)
        for knob in knobs:
            us = time_us([lambda x=x: sample_select(x, *p, out, done, **knob) for x in bufs], args.reps)
            rows.append(dict(S=S, V=V, mode=f"sweep {mode} {knob or 'defaults'}", select_us=us))
            print(f"  sweep {mode:<12} {str(knob or 'defaults'):<28}: {us:8.1f} us", flush=True)
    flat = [(torch.randn(S, V, generator=g)).to(DEV) for _ in range(len(bufs))]
    p = params(S, "top_p", g)
    p[0][:] = 1.5
    bad = int((sample(flat[0], *p) != sample_ref(flat[0], *p)).sum())
    sample_select(flat[0], *p, out, done)
    row = dict(S=S, V=V, mode="top_p wide nucleus (randn*1, T=1.5)", mismatches=bad,
               left_to_row_kernel=int((done == 0).sum()))
    for method in args.methods.split(","):
        row[f"{method}_us"] = time_us([lambda x=x: sample(x, *p, out=out, method=method) for x in flat],
                                      max(5, args.reps // 10))
    rows.append(row)
    print(f"  {row['mode']}: {row}", flush=True)


def profile(rows: list[dict]) -> None:
    S, V = 64, 128256
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(S, V, generator=g) * 4).to(DEV)
    for mode in ("top_k", "top_p"):
        p = params(S, mode, g)
        sample(x, *p)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                sample(x, *p)
            torch.cuda.synchronize()
        kernels = {e.key: round(e.device_time_total / e.count, 1) for e in prof.key_averages() if e.device_time_total}
        rows.append(dict(S=S, V=V, mode=f"profile {mode} (us per kernel, eager)", kernels=kernels))
        print(f"profile {mode} (us per kernel, 20 eager calls): {kernels}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows to this path")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--checks", type=int, default=3, help="fresh logits draws per shape and mode for exactness")
    ap.add_argument("--methods", default="select,window", help="sampler paths to time (select, window)")
    ap.add_argument("--sweep", action="store_true", help="time the select path's knobs")
    ap.add_argument("--wide", action="store_true", help="time torch.topk alone and a nucleus wider than the window")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--baseline", help="a copy of an earlier kernels/sampling_select.py: its sample_select timed "
                    "against this one's, alternately, per filtered shape and mode")
    args = ap.parse_args()
    args.baseline = load_baseline(args.baseline) if args.baseline else None
    rows: list[dict] = []
    shapes = [(S, V) for V in (32000, 128256) for S in (1, 8, 64)] if ON_GPU else [(1, 1000), (5, 3000)]
    t0 = time.time()
    device = torch.cuda.get_device_name() if ON_GPU else "cpu (Triton interpreter)"
    print(f"device: {device}")
    for S, V in shapes:
        bench_shape(S, V, args, rows)
    if args.sweep or args.wide:
        sweep(args, rows)
    if args.profile and ON_GPU:
        profile(rows)
    print(f"\n{'V':>6} {'S':>3} {'mode':<12} {'select us':>10} {'window us':>10} {'mism':>6} {'left':>5}"
          f" {'ours/base':>14}")
    for r in rows:
        if "mismatches" in r and not r["mode"].startswith("top_p wide"):
            vs = f"{r['select_only_us']:.1f}/{r['baseline_us']:.1f}" if "baseline_us" in r else ""
            print(f"{r['V']:>6} {r['S']:>3} {r['mode']:<12} {r['select_us']:>10.1f} {r.get('window_us', 0):>10.1f} "
                  f"{r['mismatches']:>6} {r['left_to_row_kernel']:>5} {vs:>14}")
    print(f"done in {time.time() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, triton=triton.__version__, reps=args.reps,
                           command=" ".join(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
