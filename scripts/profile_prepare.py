"""The executor's host time per step: ``Worker.prepare`` (+ ``launch``) of decode and mixed steps, with cProfile.

Real plans from the scheduler's planner (``--decode-rows`` running requests, then a new prompt of
``--prefill`` tokens every few steps) go through a real worker (random weights of
``scripts/configs/<model>``); each step is prepared, launched and waited for.  Prints the median host
ms of prepare and launch for decode and mixed steps, then the functions that took the ``--profile``
steps' prepare time (cProfile, by own time).  On a GPU, the host work of a step is what the GPU waits
for when nothing else is queued (docs/performance.md, "host time of a mixed step").

    python3 scripts/profile_prepare.py [--model smollm2-135m] [--device cuda] [--prefill 512] [--decode-rows 12]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from executor_proc.build import build_worker  # noqa: E402
from ipc.config import ExecutorConfig  # noqa: E402
from ipc.protocol import StepResult  # noqa: E402
from scheduler_proc.limits import Limits  # noqa: E402
from scheduler_proc.planner import Planner  # noqa: E402
from tests.planner_harness import make_request  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a config name under scripts/configs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    ap.add_argument("--prefill", type=int, default=512, help="tokens of each new prompt")
    ap.add_argument("--decode-rows", type=int, default=12, help="requests decoding beside the prompts")
    ap.add_argument("--every", type=int, default=4, help="a new prompt every this many steps (0: none)")
    ap.add_argument("--steps", type=int, default=200, help="steps to run")
    ap.add_argument("--host-kv-gib", type=float, default=1.0, help="host KV tier size (0: off)")
    ap.add_argument("--top", type=int, default=20, help="cProfile lines to print")
    ap.add_argument("--profile", choices=("mixed", "decode", "backup", "none"), default="mixed",
                    help="which steps cProfile records: with a prefill chunk, decode only, decode with host-tier "
                         "backups, or none (host times without the profiler's overhead)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    cfg = ExecutorConfig(model=os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", args.model),
                         load_format="dummy", device=args.device, dtype="bfloat16" if cuda else "float32",
                         kernels="auto", num_slots=64, num_kv_blocks=4096, block_size=16, max_model_len=4096,
                         max_num_batched_tokens=1024, host_kv_gib=args.host_kv_gib,
                         mixed_graphs="auto" if cuda else "on")
    built = build_worker(cfg)
    worker = built.worker
    limits = Limits(64, built.num_kv_blocks, 16, built.max_model_len, 1024, frozenset({-1}),
                    num_host_blocks=built.num_host_blocks)
    planner = Planner(limits, prefix_cache_id="m")
    for i in range(args.decode_rows):
        planner.add(make_request(i, prompt_len=64, max_tokens=args.steps * 4))
    times: dict[str, list[tuple[float, float]]] = {"decode": [], "backup": [], "mixed": []}
    profile = cProfile.Profile()
    next_id = args.decode_rows
    for step in range(args.steps):
        if args.every and step % args.every == 0:
            planner.add(make_request(next_id, prompt_len=args.prefill, max_tokens=8))
            next_id += 1
        plan = planner.plan()
        if plan is None:
            break
        kind = "mixed" if any(plan.is_prefill) else "backup" if plan.backups else "decode"
        t0 = time.perf_counter()
        if kind == args.profile and step > max(args.every, 4) * 2:
            profile.enable()
        prepared = worker.prepare(plan)
        t1 = time.perf_counter()
        profile.disable()
        tokens = worker.launch(prepared)
        t2 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        worker.backups_done_through(plan.step_id)
        planner.reconcile(StepResult(plan.step_id, values, backups_done_step_id=plan.step_id))
        if step > max(args.every, 4) * 2:
            times[kind].append((t1 - t0, t2 - t1))
    print(f"{args.device} {args.model}: {args.decode_rows} decode rows, a {args.prefill}-token prompt every "
          f"{args.every} steps, host KV tier {'on' if built.num_host_blocks else 'off'}")
    for kind, values in times.items():
        if values:
            print(f"  {kind:<7} steps {len(values):>4}  prepare ms p50 {statistics.median(v[0] for v in values) * 1e3:.3f}"
                  f"  launch ms p50 {statistics.median(v[1] for v in values) * 1e3:.3f}")
    if not times.get(args.profile):
        print(f"  no {args.profile} steps to profile")
        return
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
