#!/usr/bin/env python3
"""Time paged prefill attention on a CUDA GPU against an older copy of the kernel, in one process.

    python3 scripts/bench_prefill_attention.py [--old kernels_main.prefill_attention] [--sweep] [--json PATH]

Cases (bf16, block size 16, 32 query / 8 KV heads): Llama-3.2-1B (D=64) and Llama-3-8B (D=128)
with 4 rows x 1024 fresh tokens and 4 rows x 512 new after 3584 cached, plus the 8B 2,048-token
fresh chunk.  Each kernel is checked against ``prefill_attention_ref`` on fresh random inputs,
then timed as the median of ``do_bench`` over a CUDA graph of 10 calls (no launch gaps).
TFLOP/s counts causal FLOPs (4*H*D per visible (query, key) pair) and is shown as a fraction of
the bf16 matmul rate measured in the same run (torch.matmul 8192^3, median).  ``--sweep`` times
(score rows, BLOCK_N, warps, stages) variants of the new kernel; ``--ttgir DIR`` saves the
default configs' TTGIR and counts its wgmma / async-copy ops.  Prints a short table last.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import prefill_attention as NEW  # noqa: E402
from kernels import reference as R  # noqa: E402

DEV = torch.device("cuda")
CASES = [("1B", 64, "4x1024 fresh", [(0, 1024)] * 4), ("1B", 64, "4x512 @3584", [(3584, 512)] * 4),
         ("8B", 128, "4x1024 fresh", [(0, 1024)] * 4), ("8B", 128, "4x512 @3584", [(3584, 512)] * 4),
         ("8B", 128, "1x2048 fresh", [(0, 2048)])]
H, HKV, BS = 32, 8, 16


def make(rows, D, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    lens = [p + n for p, n in rows]
    nb = [-(-n // BS) for n in lens]
    kc = torch.randn(sum(nb) + 4, BS, HKV, D, device=DEV, generator=g).bfloat16()
    vc = torch.randn_like(kc)
    perm = torch.randperm(kc.shape[0], device=DEV, generator=g).to(torch.int32)
    bt = torch.zeros(len(rows), max(nb), dtype=torch.int32, device=DEV)
    at = 0
    for r, n in enumerate(nb):
        bt[r, :n] = perm[at:at + n]
        at += n
    qlens = [n for _, n in rows]
    qs = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(sum(qlens), H, D, device=DEV, generator=g).bfloat16()
    return q, kc, vc, bt, qs, cl, max(qlens)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float("inf") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()


def graph_ms(fn, calls=10):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return do_bench(g.replay, warmup=25, rep=150, return_mode="median") / calls


def matmul_peak():
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = do_bench(lambda: torch.matmul(a, b), warmup=50, rep=300, return_mode="median")
    return 2 * 8192 ** 3 / ms / 1e9


def run_case(mod, rows, D, seed, **kw):
    """(rel err on fresh inputs, graph ms) of ``mod.prefill_attention`` for one case."""
    q, kc, vc, bt, qs, cl, mq = make(rows, D, seed)
    out = torch.full_like(q, float("nan"))
    mod.prefill_attention(q, kc, vc, bt, qs, cl, mq, D ** -0.5, out=out, **kw)
    err = rel_err(out, R.prefill_attention_ref(q, kc, vc, bt, qs, cl, D ** -0.5))
    q, kc, vc, bt, qs, cl, mq = make(rows, D, seed + 1)
    return err, graph_ms(lambda: mod.prefill_attention(q, kc, vc, bt, qs, cl, mq, D ** -0.5, out=out, **kw))


def flops(rows, D):
    return sum(4 * H * D * n * (p + (n + 1) / 2) for p, n in rows)


def sweep(results, deadline):
    """Variants of the new kernel; the best by total time per head dim (stops at ``deadline``, a host time)."""
    out = {}
    for D in (64, 128):
        cases = [c for c in CASES if c[1] == D]
        scores = []
        for bm in (32, 16):  # query tokens per program at G=4: 128 / 64 score rows
            for bn in (64, 128):
                for warps in (4, 8):
                    for stages in (3, 4):
                        if time.time() > deadline:
                            break
                        cfg = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                        try:
                            times = [run_case(NEW, rows, D, 7, **cfg) for _, _, _, rows in cases]
                        except Exception as e:  # out of shared memory / registers
                            print(f"sweep D={D} {cfg}: {type(e).__name__}", flush=True)
                            continue
                        if max(e for e, _ in times) > 2e-2:
                            print(f"sweep D={D} {cfg}: WRONG {times}", flush=True)
                            continue
                        scores.append((sum(t for _, t in times), cfg, [t for _, t in times]))
                        print(f"sweep D={D} {cfg}: " + " ".join(f"{t * 1e3:7.1f}" for _, t in times), flush=True)
        scores.sort(key=lambda s: s[0])
        out[D] = [dict(total_ms=s, cfg=c, ms=t) for s, c, t in scores]
        results.append(dict(kind="sweep", D=D, ranked=out[D][:12]))
    return out


def save_ttgir(where):
    """TTGIR of every compiled variant of the plain-grid kernel, and its op counts."""
    os.makedirs(where, exist_ok=True)
    counts = []
    caches = getattr(NEW._prefill_kernel, "device_caches", {})
    for dev_cache in caches.values():
        for i, k in enumerate(dev_cache[0].values()):
            ir = k.asm.get("ttgir", "")
            with open(os.path.join(where, f"prefill_{i}.ttgir"), "w") as f:
                f.write(ir)
            c = {op: ir.count(op) for op in ("warp_group_dot", "async_copy_global_to_local", "async_wait",
                                             "tt.dot", "scf.for")}
            md = getattr(k, "metadata", None)
            c.update(regs=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None), file=f"prefill_{i}.ttgir",
                     warps=getattr(md, "num_warps", None), stages=getattr(md, "num_stages", None),
                     smem=getattr(md, "shared", None))
            counts.append(c)
            print("ttgir", c, flush=True)
    return counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--ttgir", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--budget-s", type=float, default=240.0, help="the sweep stops this long after the start")
    args = ap.parse_args()
    t0 = time.time()
    peak = matmul_peak()
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s", flush=True)
    results = [dict(kind="peak", TFLOPs=peak)]
    kernels = [("new", NEW)] + ([("old", importlib.import_module(args.old))] if args.old else [])
    table = []
    for model, D, label, rows in CASES:
        for name, mod in kernels:
            err, ms = run_case(mod, rows, D, 1)
            tf = flops(rows, D) / ms / 1e9
            row = dict(kind="case", kernel=name, model=model, D=D, case=label, rel_err=err, ms=ms, TFLOPs=tf,
                       frac_peak=tf / peak)
            results.append(row)
            table.append(row)
            print(row, flush=True)
    ttgir = save_ttgir(args.ttgir) if args.ttgir else []
    results.append(dict(kind="ttgir", variants=ttgir))
    best = sweep(results, t0 + args.budget_s) if args.sweep else {}
    env = dict(torch=torch.__version__, triton=__import__("triton").__version__, gpu=torch.cuda.get_device_name(),
               seconds=time.time() - t0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, results=results), f, indent=1)
    print(f"\n{env}\nbf16 matmul peak (measured): {peak:.0f} TFLOP/s")
    for D, ranked in best.items():
        for r in ranked[:3]:
            print(f"sweep D={D}: {r['total_ms'] * 1e3:8.1f} us total  {r['cfg']}")
    print(f"{'model':5} {'case':14} {'kernel':6} {'us':>8} {'TFLOP/s':>8} {'%peak':>6} {'rel err':>8}")
    for r in table:
        print(f"{r['model']:5} {r['case']:14} {r['kernel']:6} {r['ms'] * 1e3:8.1f} {r['TFLOPs']:8.0f} "
              f"{100 * r['frac_peak']:5.1f}% {r['rel_err']:8.1e}")
    bad = [r for r in table if r["rel_err"] > 1e-2]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
