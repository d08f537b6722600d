#!/usr/bin/env python3
"""Time the sampler and the sampling features (logprobs, penalties) at batch 64.

    python3 scripts/bench_sampling.py [--json PATH] [--reps N]

On CUDA: batch 64, vocab 128256 and 49152, float32 logits, every case captured in a CUDA
graph and replayed; time per replay from CUDA events, median of ``--reps`` after warm-up.
Cases: plain greedy (torch argmax, the all-greedy step's sampler); sampled rows with the
previous row kernel (``method="rows"``) and the default path with the host flag the executor
would pass (``filtered`` only when some row has top-k/top-p); ``--sweep`` times the knobs; and the per-step extra
work of rows that ask for top-5 logprobs + repetition + frequency penalties (penalties out of
place, argmax of the penalised logits, logprobs, count update), as microseconds and as a
percentage of a ~1.3 ms 1B decode step.  Also checks that the two sampler paths agree and
counts the rows the window left to the row kernel.
Without CUDA: tiny shapes in the Triton CPU interpreter (a smoke test of the script).
Prints a table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.interpreter_patch import patch_interpreter  # noqa: E402

patch_interpreter()

from kernels.logprobs import token_logprobs  # noqa: E402
from kernels.penalties import PenaltyTables, apply_penalties, count_sampled, mark_prompt  # noqa: E402
from kernels.sampling import sample  # noqa: E402
from kernels.sampling_window import sample_window  # noqa: E402

DEV = torch.device("cuda" if ON_GPU else "cpu")
STEP_US_1B = 1300.0  # a 1B decode step at batch 64 on the H100 (docs/performance.md: ~1.33 ms)


def time_us(fn, reps: int) -> float:
    """Median microseconds of ``fn``: a replayed CUDA graph timed by events (GPU), or wall clock (CPU)."""
    if not ON_GPU:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def params(S, kind, g):
    temp = torch.full((S,), 0.0 if kind == "greedy" else 0.8)
    top_k = torch.full((S,), 50 if "top_k" in kind else 0, dtype=torch.int64)
    top_p = torch.full((S,), 0.9 if "top_p" in kind else 1.0)
    min_p = torch.full((S,), 0.05 if "min_p" in kind else 0.0)
    seed = torch.randint(0, 2**62, (S,), generator=g, dtype=torch.int64)
    pos = torch.randint(0, 2**20, (S,), generator=g, dtype=torch.int64)
    return [t.to(DEV) for t in (temp, top_k, top_p, min_p, seed, pos)]


def penalty_tables(S, V, g):
    t = PenaltyTables.allocate(S, V, DEV)
    slots = torch.arange(S, device=DEV)
    for _ in range(4):
        mark_prompt(t, slots.repeat(128), torch.randint(0, V, (S * 128,), generator=g).to(DEV))
    for _ in range(64):
        count_sampled(t, slots, torch.randint(0, V, (S,), generator=g).to(DEV))
    t.repetition[:S] = 1.3
    t.frequency[:S] = 0.5
    return t


def bench_vocab(S, V, reps, rows, sweep=False):
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(S, V, generator=g) * 4).to(DEV)
    out = torch.empty(S, dtype=torch.int64, device=DEV)

    def add(case, us, **extra):
        rows.append(dict(case=case, S=S, V=V, us=round(us, 1), **extra))
        print(f"  S={S} V={V:>6}  {case:<44} {us:9.1f} us  {extra or ''}", flush=True)

    greedy_us = time_us(lambda: torch.argmax(logits, dim=-1, out=out), reps)
    add("greedy: torch.argmax (all-greedy step)", greedy_us)
    gp = params(S, "greedy", g)
    add("greedy: sample(greedy_only=True)", time_us(lambda: sample(logits, *gp, out=out, greedy_only=True), reps))
    add("greedy: sample(filtered=False)", time_us(lambda: sample(logits, *gp, out=out, filtered=False), reps))
    for kind in ("temperature", "min_p", "top_k", "top_p", "top_k+top_p"):
        p = params(S, kind, g)
        filtered = "top" in kind
        old = time_us(lambda: sample(logits, *p, out=out, method="rows"), max(5, reps // 4))
        new = time_us(lambda: sample(logits, *p, out=out, filtered=filtered), reps)
        done = torch.empty(S, dtype=torch.int32, device=DEV)
        sample_window(logits, *p, out, done, filtered=filtered)
        mism = int((sample(logits, *p, filtered=filtered) != sample(logits, *p, method="rows")).sum())
        add(f"{kind}: rows kernel (old)", old)
        add(f"{kind}: sample(filtered={filtered}) (new)", new, left_to_row_kernel=int((done == 0).sum()),
            mismatches_vs_old=mism)
    if sweep:
        p = params(S, "top_k+top_p", g)
        add("ref: torch.topk(logits, 1024)", time_us(lambda: torch.topk(logits, 1024, dim=-1), reps))
        add("ref: torch.topk(logits, 20)", time_us(lambda: torch.topk(logits, 20, dim=-1), reps))
        for chunk in (None, 4096, 8192):
            for cand in (256, 512, 1024):
                add(f"sweep top_k+top_p chunk={chunk} cand={cand}",
                    time_us(lambda: sample(logits, *p, out=out, chunk=chunk, candidates=cand), reps))

    tables = penalty_tables(S, V, g)
    slots = torch.arange(S, device=DEV)
    pen = torch.empty(S, V, device=DEV)
    n5 = torch.full((S,), 5, dtype=torch.int32, device=DEV)
    lp_out = (torch.empty(S, 21, dtype=torch.int64, device=DEV), torch.empty(S, 21, device=DEV))

    def features():
        apply_penalties(logits, tables, slots, out=pen)
        torch.argmax(pen, dim=-1, out=out)
        token_logprobs(logits, out, n5, out=lp_out)
        count_sampled(tables, slots, out)

    off_tables = PenaltyTables.allocate(S, V, DEV)
    parts = {
        "penalties (rep 1.3 + freq 0.5, out of place)": lambda: apply_penalties(logits, tables, slots, out=pen),
        "penalties in place, no row penalised": lambda: apply_penalties(pen, off_tables, slots, out=pen),
        "logprobs top-5": lambda: token_logprobs(logits, out, n5, out=lp_out),
        "count_sampled": lambda: count_sampled(tables, slots, out),
    }
    for name, fn in parts.items():
        add(name, time_us(fn, reps))
    full = time_us(features, reps)
    extra = full - greedy_us
    add("greedy + top-5 logprobs + rep + freq penalties", full,
        extra_us=round(extra, 1), extra_pct_of_1b_step=round(100 * extra / STEP_US_1B, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows to this path")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--sweep", action="store_true", help="also time the tuning knobs (chunk, candidates)")
    args = ap.parse_args()
    rows: list[dict] = []
    shapes = [(64, 128256), (64, 49152)] if ON_GPU else [(4, 3000)]
    t0 = time.time()
    print(f"device: {torch.cuda.get_device_name() if ON_GPU else 'cpu (Triton interpreter)'}")
    for S, V in shapes:
        bench_vocab(S, V, args.reps if ON_GPU else 1, rows, args.sweep)
    print(f"done in {time.time() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if ON_GPU else "cpu", step_us_1b=STEP_US_1B,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
