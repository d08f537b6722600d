"""Split-KV decode attention's launch config at the decode step's shapes: a sweep, one table.

For each case (model shape, batch, context) the script times ``kernels.decode_attention`` for
every (num_splits, BLOCK_N, num_warps, num_stages) in the grid as a CUDA graph of 10 calls
(median of ``--reps`` replays; the in-kernel merge included), checks the best config against
the reference, and prints, per case, the default config's time and the best few, with the KV
read rate as a fraction of the device copy bandwidth measured in the same run.

    python3 scripts/bench_decode_attention.py [--cases 8b:64:512,1b:64:512,1b:1:512] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from _bench_util import write_json
from executor_proc.backends.gemv_tuning import _time_pass
from kernels.decode_attention import DecodeWorkspace, _default_config, decode_attention, default_num_splits
from kernels.reference import decode_attention_ref

SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64)}  # (heads, KV heads, head_dim)
BLOCK_SIZE = 16


def graph_time(fn, reps: int, calls: int = 10) -> float:
    """Seconds per call: ``calls`` back-to-back calls in one CUDA graph, median of ``reps`` replays (the
    start-up tuner's timing)."""
    return _time_pass(lambda _: fn(), [None] * calls, reps) / calls / 1e3


def copy_bandwidth(reps: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_time(lambda: dst.copy_(src), reps, calls=2)


def run_case(model: str, batch: int, ctx: int, bandwidth: float, args) -> dict:
    H, Hkv, D = SHAPES[model]
    g = torch.Generator(device="cuda").manual_seed(batch * ctx + D)
    per_row = -(-ctx // BLOCK_SIZE)
    blocks = batch * per_row + 8
    kc = torch.randn(blocks, BLOCK_SIZE, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    bt = torch.randperm(blocks, device="cuda", generator=g)[:batch * per_row].view(batch, per_row).int()
    cl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    ws = DecodeWorkspace(batch, H, D, max_splits=16, device="cuda")
    kv_bytes = 2 * batch * ctx * Hkv * D * 2
    default = (default_num_splits(batch, Hkv, "cuda", head_dim=D), *_default_config(D))
    results = {}
    for cfg in itertools.product(args.splits, args.block_n, args.warps_stages):
        splits, block_n, (warps, stages) = cfg
        key = (splits, block_n, warps, stages)
        try:
            results[key] = graph_time(lambda: decode_attention(q, kc, vc, bt, cl, D ** -0.5, out=out, workspace=ws,
                                                               num_splits=splits, block_n=block_n, num_warps=warps,
                                                               num_stages=stages), args.reps)
        except Exception as e:  # noqa: BLE001 - out of shared memory etc.: skip the config
            print(f"  skip {key}: {type(e).__name__}", flush=True)
    if default not in results:
        results[default] = graph_time(lambda: decode_attention(q, kc, vc, bt, cl, D ** -0.5, out=out, workspace=ws),
                                      args.reps)
    ranked = sorted(results.items(), key=lambda kv: kv[1])
    best = ranked[0][0]
    decode_attention(q, kc, vc, bt, cl, D ** -0.5, out=out, workspace=ws, num_splits=best[0], block_n=best[1],
                     num_warps=best[2], num_stages=best[3])
    ref = decode_attention_ref(q[:4].float(), kc.float(), vc.float(), bt[:4], cl[:4], D ** -0.5)
    err = ((out[:4].float() - ref).abs().max() / ref.abs().max()).item()
    frac = lambda t: kv_bytes / t / bandwidth  # noqa: E731
    return dict(model=model, batch=batch, ctx=ctx, default=list(default), default_us=results[default] * 1e6,
                default_frac=frac(results[default]), best=list(best), best_us=ranked[0][1] * 1e6,
                best_frac=frac(ranked[0][1]), best_rel_err=err,
                top=[dict(config=list(k), us=t * 1e6, frac=frac(t)) for k, t in ranked[:8]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="8b:64:512,1b:64:512,8b:1:512,1b:1:512",
                    help="MODEL:BATCH:CONTEXT,... (MODEL: 8b or 1b head shapes)")
    ap.add_argument("--splits", default="1,2,4,8,16", help="num_splits values to try")
    ap.add_argument("--block-n", default="32,64,128", help="BLOCK_N values to try")
    ap.add_argument("--warps-stages", default="2x3,4x2,4x3,4x4,8x3", help="num_warps x num_stages pairs to try")
    ap.add_argument("--reps", type=int, default=20, help="graph replays per config (median)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    args.splits = [int(x) for x in args.splits.split(",")]
    args.block_n = [int(x) for x in args.block_n.split(",")]
    args.warps_stages = [tuple(int(v) for v in x.split("x")) for x in args.warps_stages.split(",")]
    bandwidth = copy_bandwidth(args.reps)
    rows = []
    for case in args.cases.split(","):
        model, batch, ctx = case.split(":")
        rows.append(run_case(model, int(batch), int(ctx), bandwidth, args))
        r = rows[-1]
        print(f"{case}: default {r['default']} {r['default_us']:.1f} us ({r['default_frac']:.0%}); "
              + "; ".join(f"{t['config']} {t['us']:.1f} ({t['frac']:.0%})" for t in r["top"][:4]), flush=True)
    print(f"\n{torch.cuda.get_device_name()}  copy {bandwidth / 1e12:.2f} TB/s  (splits, BLOCK_N, warps, stages)")
    print(f"{'case':<14}{'default':>20}{'us':>8}{'BW':>6}{'best':>22}{'us':>8}{'BW':>6}{'err':>9}")
    for r in rows:
        print(f"{r['model']}:{r['batch']}:{r['ctx']:<8}{str(tuple(r['default'])):>20}{r['default_us']:>8.1f}"
              f"{r['default_frac']:>6.0%}{str(tuple(r['best'])):>22}{r['best_us']:>8.1f}{r['best_frac']:>6.0%}"
              f"{r['best_rel_err']:>9.1e}")
    if args.json:
        write_json(args.json, dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                             copy_bandwidth=bandwidth, command=" ".join(sys.argv)), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
