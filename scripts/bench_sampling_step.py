"""Decode step cost of the sampling features: plain greedy rows vs rows asking for logprobs and penalties.

One worker, 1B shape (``scripts/configs/llama-3.2-1b``, random bf16 weights), batch
``--batch`` (64), context ``--context``; for each case the same requests are admitted
again with the case's sampling, prefilled, then ``--steps`` decode steps run the way
the executor runs them (prepare -> launch -> copy out, two in flight).  Reported per
case: wall ms per step, GPU ms per step (CUDA events over the loop), the bucket's graph
replayed alone, and the cost over plain greedy (the issue's target: <= 10% for top-5
logprobs + repetition 1.3 + frequency 0.5).

Rows that ask for nothing run the same graph as before these features (the plain
greedy mode: forward, argmax, last_token); compare ``plain`` here with
``scripts/bench_decode.py --models llama-3.2-1b --batch 64`` on the previous commit
for "same as before".

    python3 scripts/bench_sampling_step.py [--batch 64] [--context 512] [--steps 200] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from _bench_util import write_json
from executor_proc.build import build_worker
from executor_proc.testing.synthetic import DecodeLoop, SyntheticPlanner
from ipc.config import ExecutorConfig
from ipc.protocol import SlotSampling

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
BLOCK_SIZE = 16


def cases(context: int) -> dict[str, SlotSampling]:
    g = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, num_prompt_tokens=context)
    return {
        "plain greedy": SlotSampling(**g),
        "top-5 logprobs + rep 1.3 + freq 0.5": SlotSampling(**g, logprobs=5, repetition_penalty=1.3,
                                                            frequency_penalty=0.5),
        "top-5 logprobs": SlotSampling(**g, logprobs=5),
        "rep 1.3 + freq 0.5": SlotSampling(**g, repetition_penalty=1.3, frequency_penalty=0.5),
        "plain sampled (T=0.8)": SlotSampling(**{**g, "temperature": 0.8, "seed": 1}),
        "plain sampled + top-5 logprobs + penalties": SlotSampling(**{**g, "temperature": 0.8, "seed": 1},
                                                                    logprobs=5, repetition_penalty=1.3,
                                                                    frequency_penalty=0.5),
    }


def run_case(worker, sampling: SlotSampling, args, vocab: int, blocks: int) -> dict:
    planner = SyntheticPlanner(args.batch, BLOCK_SIZE, blocks)
    g = torch.Generator().manual_seed(0)
    for _ in range(args.batch):
        planner.add(torch.randint(0, vocab, (args.context,), generator=g).tolist(), sampling)
    loop = DecodeLoop(worker, planner)
    for _ in range(1 + args.warmup):  # prefill, then decode (the first one may capture this mode's graph)
        loop.step()
    loop.drain()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(args.steps):
        loop.step()
    end.record()
    loop.drain()
    end.synchronize()
    wall = (time.perf_counter() - t0) / args.steps
    bucket = worker.graphs.bucket_for(args.batch)
    mode = worker.prepare(planner.step()).mode  # the mode this case's decode steps run
    torch.cuda.synchronize()
    n = args.steps
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        worker.graphs.run(bucket, mode)
    e.record()
    e.synchronize()
    return dict(mode=mode._asdict(), step_ms=wall * 1e3, gpu_ms=start.elapsed_time(end) / args.steps,
                replay_ms=s.elapsed_time(e) / n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    max_len = args.context + args.warmup + args.steps + 64
    blocks = args.batch * -(-max_len // BLOCK_SIZE)
    cfg = ExecutorConfig(model=os.path.join(CONFIGS, args.model), plan_addr="", result_addr="", load_format="dummy",
                         device="cuda", dtype="bfloat16", num_slots=args.batch, num_kv_blocks=blocks,
                         block_size=BLOCK_SIZE, max_model_len=max_len, cuda_graph_max_batch=args.batch)
    built = build_worker(cfg)
    setup_s = time.perf_counter() - t_start
    rows = {}
    for name, sampling in cases(args.context).items():
        rows[name] = run_case(built.worker, sampling, args, built.model_config.vocab_size, blocks)
    base = rows["plain greedy"]
    print(f"{torch.cuda.get_device_name()}  {args.model}  batch {args.batch}  context {args.context}  "
          f"setup {setup_s:.1f} s")
    print(f"{'case':<45}{'step ms':>9}{'gpu ms':>9}{'replay ms':>11}{'vs plain':>10}")
    for name, r in rows.items():
        r["over_plain"] = r["replay_ms"] / base["replay_ms"] - 1
        print(f"{name:<45}{r['step_ms']:>9.3f}{r['gpu_ms']:>9.3f}{r['replay_ms']:>11.3f}{100 * r['over_plain']:>9.1f}%")
    target = rows["top-5 logprobs + rep 1.3 + freq 0.5"]["over_plain"]
    print(f"target (logprobs + penalties <= 10% over plain greedy): {'ok' if target <= 0.10 else 'MISS'}"
          f"  total {time.perf_counter() - t_start:.1f} s")
    if args.json:
        write_json(args.json, dict(gpu=torch.cuda.get_device_name(), model=args.model, batch=args.batch,
                                   context=args.context, steps=args.steps, setup_s=setup_s, cases=rows,
                                   command=" ".join(sys.argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
