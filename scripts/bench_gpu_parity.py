"""Greedy parity of the fast path (Triton kernels + CUDA graphs) with the eager torch path.

The default model's shape (SmolLM2-135M, ``scripts/configs/smollm2-135m``) with
random weights: ``--requests`` greedy requests of different prompt lengths are
prefilled together and decoded for ``--new-tokens`` steps through each path,
in float32 and in bfloat16.  Reported per dtype: requests whose tokens match
exactly, and the shortest common prefix.  Float32 must match exactly; in
bfloat16 the paths round differently (fused kernels vs separate torch ops), and
random weights give nearly tied logits, so an early divergence there is
rounding, not a bug.

    python3 scripts/bench_gpu_parity.py [--model smollm2-135m] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


from _bench_util import write_json
from ipc.config import ExecutorConfig
from executor_proc.build import build_worker
from executor_proc.testing.synthetic import SyntheticPlanner

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def generate(model_dir: str, kernels: str, dtype: str, prompts: list[list[int]], new_tokens: int,
             device: str) -> list[list[int]]:
    """Greedy tokens per request through one path (all requests batched)."""
    n = len(prompts)
    blocks = n * -(-(max(map(len, prompts)) + new_tokens + 16) // 16)
    cfg = ExecutorConfig(model=model_dir, plan_addr="", result_addr="", load_format="dummy", device=device,
                         dtype=dtype, num_slots=n, num_kv_blocks=blocks, block_size=16, kernels=kernels,
                         max_model_len=2048)
    worker = build_worker(cfg).worker
    planner = SyntheticPlanner(n, 16, blocks)
    for p in prompts:
        planner.add(p)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(new_tokens):
        plan = planner.step()
        host, copy = worker.copy_out(worker.launch(worker.prepare(plan)))
        if copy is not None:
            copy.synchronize()
        for i, t in enumerate(host if isinstance(host, list) else host.tolist()):
            out[i].append(t)
        if copy is not None:
            copy.release()
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model_dir = os.path.join(CONFIGS, args.model)
    vocab = __import__("json").load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (13 + 11 * i,), generator=g).tolist() for i in range(args.requests)]
    rows = []
    for dtype in args.dtypes.split(","):
        ref = generate(model_dir, "torch", dtype, prompts, args.new_tokens, args.device)
        fast = generate(model_dir, "triton", dtype, prompts, args.new_tokens, args.device)
        prefixes = [common_prefix(a, b) for a, b in zip(ref, fast)]
        rows.append(dict(dtype=dtype, requests=len(prompts), new_tokens=args.new_tokens,
                         exact=sum(a == b for a, b in zip(ref, fast)), min_prefix=min(prefixes),
                         mean_prefix=sum(prefixes) / len(prefixes), ref=ref, fast=fast))
    print(f"{'dtype':<10}{'exact':>8}{'min prefix':>12}{'mean prefix':>13}")
    for r in rows:
        print(f"{r['dtype']:<10}{r['exact']:>5}/{r['requests']:<2}{r['min_prefix']:>12}{r['mean_prefix']:>13.1f}")
    if args.json:
        write_json(args.json, dict(model=args.model, device=args.device, rows=rows))
    return 0 if all(r["exact"] == r["requests"] for r in rows if r["dtype"] == "float32") else 1


if __name__ == "__main__":
    sys.exit(main())
