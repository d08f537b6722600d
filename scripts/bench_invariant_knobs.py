"""The knobs of ``--batch-invariant`` decode on this GPU: matmul configs per weight, attention splits.

For every linear of the given model shapes (q|k|v, o, gate|up, down, lm_head from
``scripts/configs/<name>/config.json``, random bf16 weights) at M = 1 and M = 64:
``F.linear`` (cuBLAS) against :func:`kernels.matmul.invariant_matmul` over a grid of
configs (BLOCK_N, BLOCK_K, warps, stages) x split-K rule (2 programs per SM, 1 per SM,
no split).  One config serves both M, as the invariance rule demands.  Each config is
checked against float64 and for invariance (row 0 at M = 64 equals the M = 1 result, bit
for bit).  Then :func:`kernels.decode_attention.decode_attention` at batch 1 and 64 over
``num_splits``, checked against float64.  Times: CUDA graphs of back-to-back calls
(rotating over weight copies so that L2 does not hold them), medians of replays.

    python3 scripts/bench_invariant_knobs.py [--models llama-3.2-1b,llama-3-8b] [--context 512] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from executor_proc.backends.gemv_tuning import _time_pass  # noqa: E402  (the tuner's graph timing)
from kernels.decode_attention import DecodeWorkspace, decode_attention  # noqa: E402
from kernels.matmul import BLOCK_M, MatmulConfig, invariant_matmul, split_k_for  # noqa: E402
from _bench_util import shapes_of  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
RULES = {"2/sm": 2, "1/sm": 1, "none": 0}
ROWS = (1, 64)
SMEM = 200 * 1024


def kernel_grid() -> list[tuple[int, int, int, int]]:
    grid = []
    for bn, bk, warps, stages in itertools.product((64, 128), (64, 128), (4, 8), (3, 4, 5)):
        if (BLOCK_M + bn) * bk * 2 * stages <= SMEM:
            grid.append((bn, bk, warps, stages))
    return grid


def config_for(kernel, rule: str, n: int, k: int, device) -> MatmulConfig:
    bn, bk, warps, stages = kernel
    split = split_k_for(n, k, bn, bk, RULES[rule], device) if RULES[rule] else 1
    return MatmulConfig(bn, bk, warps, stages, split)


def _compile_some(kernels, all_shapes) -> int:
    """Worker: run every (shape, rule, M) of some kernels once, so Triton's disk cache holds them."""
    device = torch.device("cuda")
    done = 0
    for n, k in all_shapes:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for kernel, rule, m in itertools.product(kernels, RULES, ROWS):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            invariant_matmul(x, w, config=config_for(kernel, rule, n, k, device))
            done += 1
        del w
    torch.cuda.synchronize()
    return done


def precompile(grid, all_shapes, workers: int) -> float:
    t0 = time.perf_counter()
    chunks = [grid[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.starmap(_compile_some, [(c, all_shapes) for c in chunks if c])
    return time.perf_counter() - t0


def graph_ms(calls, reps: int = 15) -> float:
    """Median ms per call of ``calls`` captured back to back in one CUDA graph."""
    return _time_pass(lambda call: call(), calls, reps) / len(calls)


def rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def sweep_linear(n: int, k: int, grid, device) -> dict:
    copies = max(1, min(16, -(-(256 << 20) // (n * k * 2))))
    ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    calls_n = max(8, copies)
    xs = {m: torch.randn(m, k, device=device, dtype=torch.bfloat16) for m in ROWS}
    ref = F.linear(xs[64].double(), ws[0].double())
    res = {"cublas": {m: graph_ms([lambda i=i, m=m: F.linear(xs[m], ws[i % copies]) for i in range(calls_n)])
                      for m in ROWS}, "configs": []}
    res["cublas_err"] = rel_err(F.linear(xs[64], ws[0]), ref)
    for kernel, rule in itertools.product(grid, RULES):
        cfg = config_for(kernel, rule, n, k, device)
        if rule != "2/sm" and any(r["config"] == list(cfg) for r in res["configs"]):
            continue  # the same split as another rule: timed already
        full = invariant_matmul(xs[64], ws[0], config=cfg)
        row = {"config": list(cfg), "rule": rule, "err": rel_err(full, ref),
               "invariant": bool(torch.equal(invariant_matmul(xs[64][:1].clone(), ws[0], config=cfg), full[:1]))}
        for m in ROWS:
            row[m] = graph_ms([lambda i=i, m=m: invariant_matmul(xs[m], ws[i % copies], config=cfg)
                               for i in range(calls_n)])
        res["configs"].append(row)
    del ws
    return res


def sweep_attention(name: str, context: int, device) -> dict:
    with open(os.path.join(CONFIGS, name, "config.json")) as f:
        c = json.load(f)
    heads, kvh = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or c["hidden_size"] // heads
    bs, layers, out = 16, 4, {}
    for b in ROWS:
        nblk = b * context // bs
        caches = [(torch.randn(nblk, bs, kvh, d, device=device, dtype=torch.bfloat16),
                   torch.randn(nblk, bs, kvh, d, device=device, dtype=torch.bfloat16)) for _ in range(layers)]
        bt = torch.randperm(nblk, device=device, dtype=torch.int32).view(b, -1)
        lens = torch.full((b,), context, device=device, dtype=torch.int32)
        q = torch.randn(b, heads, d, device=device, dtype=torch.bfloat16)
        ws, o = DecodeWorkspace(b, heads, d, device=device), torch.empty_like(q)
        kc, vc = (t[bt.long()].reshape(b, context, kvh, d).double() for t in caches[0])
        qd = q.double().view(b, kvh, heads // kvh, d)
        p = torch.softmax(torch.einsum("bkgd,bnkd->bkgn", qd, kc) * d ** -0.5, dim=-1)
        ref = torch.einsum("bkgn,bnkd->bkgd", p, vc).reshape(b, heads, d)
        for s in (1, 2, 4, 8, 16):
            got = decode_attention(q, *caches[0], bt, lens, d ** -0.5, workspace=ws, num_splits=s)
            ms = graph_ms([lambda i=i: decode_attention(q, *caches[i % layers], bt, lens, d ** -0.5, out=o,
                                                        workspace=ws, num_splits=s) for i in range(8)])
            out[f"b{b}_s{s}"] = {"ms": ms, "err": rel_err(got, ref)}
        del caches
    return out


def best(rows, key):
    ok = [r for r in rows if r["invariant"] and r["err"] < 1e-2]
    return min(ok, key=key) if ok else None


def summarize(model: str, shapes, lin: dict, attn: dict, layers: int) -> list[str]:
    lines = [f"== {model}: us per call (M=1 / M=64); cfg = (BN, BK, warps, stages, split)"]
    totals = {k: [0.0, 0.0] for k in ("cublas", "current", "best64", "bestsum")}
    for what, (n, k) in shapes.items():
        r, times = lin[what], layers if what != "lm_head" else 1
        cur = next(x for x in r["configs"] if x["config"][:4] == [64, 64, 4, 3] and x["rule"] == "2/sm")
        picks = {"cublas": r["cublas"], "current": cur,
                 "best64": best(r["configs"], lambda x: (x[64], x[1])) or cur,
                 "bestsum": best(r["configs"], lambda x: x[1] + x[64]) or cur}
        for key, p in picks.items():
            for j, m in enumerate(ROWS):
                totals[key][j] += times * p[m]
        lines.append(f"{what:8s} {n}x{k}: cublas {1e3 * r['cublas'][1]:6.1f}/{1e3 * r['cublas'][64]:6.1f}  "
                     f"current {1e3 * cur[1]:6.1f}/{1e3 * cur[64]:6.1f}  "
                     + "  ".join(f"{key} {tuple(picks[key]['config'])} {1e3 * picks[key][1]:6.1f}/"
                                 f"{1e3 * picks[key][64]:6.1f}" for key in ("best64", "bestsum")))
    lines.append("step linears ms (M=1 / M=64): " + "  ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in totals.items()))
    lines.append("attention us/layer: " + "  ".join(f"{k} {1e3 * v['ms']:.1f}" for k, v in attn.items())
                 + f"  (x{layers} layers; max err {max(v['err'] for v in attn.values()):.1e})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    models = args.models.split(",")
    grid = kernel_grid()
    shapes = {m: shapes_of(m) for m in models}
    all_shapes = sorted({s for v in shapes.values() for s in v.values()})
    t_compile = precompile(grid, all_shapes, args.workers)
    print(f"{len(grid)} kernel configs x {len(RULES)} split rules x {len(all_shapes)} shapes; "
          f"compiled in {t_compile:.0f} s", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "grid": grid, "models": {}}
    import triton
    result["triton"] = triton.__version__
    lines = []
    for model in models:
        t0 = time.perf_counter()
        lin = {what: sweep_linear(n, k, grid, device) for what, (n, k) in shapes[model].items()}
        attn = sweep_attention(model, args.context, device)
        with open(os.path.join(CONFIGS, model, "config.json")) as f:
            layers = json.load(f)["num_hidden_layers"]
        bad = [(w, r["config"]) for w, v in lin.items() for r in v["configs"] if not r["invariant"] or r["err"] >= 1e-2]
        result["models"][model] = {"linear": {w: {**v, "shape": list(shapes[model][w])} for w, v in lin.items()},
                                   "attention": attn, "layers": layers, "failed_checks": bad}
        lines += summarize(model, shapes[model], lin, attn, layers)
        lines.append(f"failed checks: {bad[:6]}{'...' if len(bad) > 6 else ''} ({time.perf_counter() - t0:.0f} s)")
        print("\n".join(lines[-9:]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
