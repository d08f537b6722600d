"""Skinny decode matmuls (M = 1..8) on this GPU: cuBLAS against every :data:`kernels.gemv.CONFIGS` entry.

For each linear of the given model shapes (q|k|v, o, gate|up, down, lm_head from
``scripts/configs/<name>/config.json``, random bf16 weights, one copy per layer so that L2
does not hold them) and each M: ms of one pass over the layers (a CUDA graph of back-to-back
calls, timed as the start-up tuner times it, :func:`executor_proc.backends.gemv_tuning._time_pass`),
the fastest config and its ratio to cuBLAS.  Every config is checked against ``F.linear``
first.  ``--all`` prints every config's time, not only the best of each form.

    python3 scripts/bench_gemv.py [--models llama-3.2-1b,llama-3-8b] [--ms 1,2,4,8] [--all] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _bench_util import shapes_of, write_json  # noqa: E402
from executor_proc.backends.gemv_tuning import _time_pass  # noqa: E402  (the tuner's graph timing)
from kernels import gemv as skinny  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3.2-1b,llama-3-8b", help="config names under scripts/configs")
    ap.add_argument("--ms", default="1,2,4,8", help="row counts to time")
    ap.add_argument("--reps", type=int, default=7, help="graph replays per candidate (median)")
    ap.add_argument("--all", action="store_true", help="print every config, not only the best of each form")
    ap.add_argument("--json", default=None, help="write every timing to this JSON file")
    args = ap.parse_args()
    device = torch.device("cuda")
    ms = [int(m) for m in args.ms.split(",")]
    rows, table = [], []
    for model in args.models.split(","):
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", model, "config.json")) as f:
            layers = json.load(f)["num_hidden_layers"]
        for name, (n, k) in shapes_of(model).items():
            weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                       for _ in range(1 if name == "lm_head" else layers)]
            for m in ms:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                ref = F.linear(x.float(), weights[0].float())
                times = {"cublas": _time_pass(lambda w: F.linear(x, w), weights, args.reps)}
                for config in (c for c in skinny.CONFIGS if skinny.config_fits(c, m)):
                    err = ((skinny.gemv(x, weights[0], config=config).float() - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, (model, name, m, config, err)
                    times[config] = _time_pass(lambda w, c=config: skinny.gemv(x, w, config=c), weights, args.reps)
                gb = n * k * 2 * len(weights) / 1e9
                for key, t in times.items():
                    rows.append(dict(model=model, weight=name, n=n, k=k, m=m, config=key, ms=t, tb_s=gb / t))
                best = {}
                for key, t in times.items():
                    form = key if key == "cublas" else key[0]
                    if form not in best or t < times[best[form]]:
                        best[form] = key
                shown = times if args.all else {best[f]: times[best[f]] for f in best}
                winner = min(times, key=times.get)
                table.append(f"{model:<13}{name:<8}{m:>3}  cublas {times['cublas']:.4f}  best {times[winner]:.4f} "
                             f"({times['cublas'] / times[winner]:.2f}x, {gb / times[winner]:.2f} TB/s) {winner}")
                for key, t in sorted(shown.items(), key=lambda kv: kv[1]):
                    table.append(f"{'':>26}{t:.4f}  {key}")
            del weights
            torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    print("\n".join(table))
    if args.json:
        write_json(args.json, dict(meta=meta, rows=rows))


if __name__ == "__main__":
    main()
