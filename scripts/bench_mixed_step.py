"""One step with a prefill chunk beside decode rows: replayed graphs (mixed-step runner) against the eager path.

For each case (``D`` decode rows at a context of ``--context`` tokens plus one prefill
chunk of ``P`` new tokens; ``D = 0``: a prefill-only step) the script runs the worker the
way the executor does, then times the step's launch alone, back to back (CUDA events,
median of ``--reps`` after warm-up):

- ``graph``: the mixed runner's body and head replays (the step padded to its bucket);
- ``eager``: the same plan through the eager path (``mixed_graphs: off``: Python launches,
  decode rows through the prefill kernel);
- ``TFLOP/s``: model FLOPs of the real tokens (2 x matmul weights per token, the LM head
  per sampled row, causal attention) / graph time;
- ``MFU``: that rate / the bf16 matmul peak measured in the same run (``--peak-size``: one
  square ``torch.matmul`` in the model's dtype, median of ``--reps`` after warm-up; 0 skips it).

With ``--profile PREFIX`` the kernels of the ``--profile-case`` replays are listed by
device time in ``PREFIX.txt``.

    python3 scripts/bench_mixed_step.py [--model llama-3.2-1b] [--cases 16x128,16x512,16x1024,0x2048]
                                         [--context 512] [--reps 20] [--json OUT.json] [--profile PREFIX]
                                         [--peak-size 8192]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from _bench_util import write_json
from bench_decode import profile_kernels
from executor_proc.build import build_worker
from executor_proc.testing.synthetic import DecodeLoop, SyntheticPlanner
from executor_proc.step.worker import EagerStep, MixedStep
from ipc.config import ExecutorConfig

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
BLOCK_SIZE = 16


def timed(fn, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn`` over ``reps`` calls (each waited for), after two warm-up calls."""
    times = []
    for i in range(reps + 2):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        if i >= 2:
            times.append(t)
    return statistics.median(times)


def step_flops(mcfg, decode: int, context: int, prefill: int, sampled: int) -> float:
    """Model FLOPs of the real tokens: matmul weights, LM head of the sampled rows, causal attention."""
    h, i, layers = mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_layers
    q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
    per_token = layers * (h * (q + 2 * kv) + q * h + 3 * h * i)
    attn_pairs = decode * (context + 1) + prefill * (prefill + 1) // 2  # (query, key) pairs, per layer and head
    attention = 2 * 2 * layers * mcfg.num_heads * mcfg.head_dim * attn_pairs
    return 2 * per_token * (decode + prefill) + 2 * h * mcfg.vocab_size * sampled + attention


def matmul_peak(size: int, dtype: torch.dtype, reps: int, cuda: bool) -> float:
    """FLOP/s of one ``size``-cubed matmul (median), the peak the step's rate is compared with."""
    a = torch.randn(size, size, dtype=dtype, device="cuda" if cuda else "cpu")
    b = torch.randn(size, size, dtype=dtype, device=a.device)
    return 2 * size ** 3 / timed(lambda: torch.matmul(a, b), reps, cuda)


def run_case(worker, mcfg, decode: int, prefill: int, args) -> dict:
    """Decoders at the context, one new prompt of ``prefill`` tokens; time its step both ways."""
    cuda = worker.device.type == "cuda"
    blocks = worker.kv_cache.k[0].shape[0]
    planner = SyntheticPlanner(worker.tables.num_slots, BLOCK_SIZE, blocks)
    g = torch.Generator().manual_seed(decode * 7919 + prefill)
    prompt = lambda n: torch.randint(0, mcfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    for _ in range(decode):
        planner.add(prompt(args.context))
    loop = DecodeLoop(worker, planner)
    if decode:
        for _ in range(3):
            loop.step()
    loop.drain()
    planner.add(prompt(prefill))
    plan = planner.step()
    step = worker.prepare(plan)
    assert isinstance(step, MixedStep), type(step).__name__
    run = lambda: worker.mixed.run(step.shape, step.num_sampled, step.mode)  # noqa: E731
    graph = timed(run, args.reps, cuda)
    if args.profile and f"{decode}x{prefill}" == args.profile_case:
        profile_kernels(run, f"{args.profile}.txt")
    mixed, worker.mixed = worker.mixed, None  # the same plan through the eager path
    eager_step = worker.prepare(plan)
    worker.mixed = mixed
    assert isinstance(eager_step, EagerStep)
    eager = timed(lambda: worker.launch(eager_step), max(3, args.reps // 4), cuda)
    flops = step_flops(mcfg, decode, args.context, prefill, step.num_sampled)
    return dict(decode=decode, prefill=prefill, context=args.context, bucket_tokens=step.shape.tokens,
                bucket_rows=step.shape.rows, sampled=step.num_sampled, graph_ms=graph * 1e3, eager_ms=eager * 1e3,
                tflops=flops / graph / 1e12)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b", help="a folder of scripts/configs, or a config path")
    ap.add_argument("--cases", default="16x128,16x512,16x1024,0x2048", help="DECODE_ROWSxPREFILL_TOKENS,...")
    ap.add_argument("--context", type=int, default=512, help="tokens of context of each decode row")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per case (median)")
    ap.add_argument("--slots", type=int, default=64, help="request slots of the worker")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (cpu: interpreter-sized shapes only)")
    ap.add_argument("--dtype", default="bfloat16", help="model and KV dtype")
    ap.add_argument("--json", default=None, help="write the rows and metadata here")
    ap.add_argument("--profile", default=None, metavar="PREFIX", help="list the kernels of one case in PREFIX.txt")
    ap.add_argument("--profile-case", default="16x512", help="the DECODExPREFILL case --profile lists")
    ap.add_argument("--peak-size", type=int, default=8192,
                    help="side of the square matmul whose rate is the MFU denominator (0: no MFU)")
    args = ap.parse_args(argv)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    model = args.model if os.path.exists(args.model) else os.path.join(CONFIGS, args.model)
    budget = max(d + p for d, p in cases)
    blocks = args.slots * -(-(args.context + budget + 64) // BLOCK_SIZE)
    cfg = ExecutorConfig(model=model, load_format="dummy", device=args.device, dtype=args.dtype,
                         kernels="triton", num_slots=args.slots, num_kv_blocks=blocks, block_size=BLOCK_SIZE,
                         max_model_len=args.context + budget + 64, max_num_batched_tokens=budget,
                         mixed_graphs="auto" if args.device.startswith("cuda") else "on")
    t0 = time.perf_counter()
    built = build_worker(cfg)
    setup_s = time.perf_counter() - t0
    rows = [run_case(built.worker, built.model_config, d, p, args) for d, p in cases]
    cuda = args.device.startswith("cuda")
    peak = matmul_peak(args.peak_size, getattr(torch, args.dtype), args.reps, cuda) if args.peak_size else 0.0
    for r in rows:
        r["mfu"] = r["tflops"] * 1e12 / peak if peak else None
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                model=args.model, setup_s=setup_s, num_graphs=built.num_graphs, graph_capture_s=built.graph_capture_s,
                graph_memory_bytes=built.graph_memory_bytes, peak_tflops=peak / 1e12, peak_size=args.peak_size,
                command=" ".join(sys.argv))
    print(f"{meta['device']}  {args.model}  {built.num_graphs} graphs in {built.graph_capture_s:.1f} s, "
          f"{built.graph_memory_bytes / 2**20:.0f} MiB; matmul peak {peak / 1e12:.0f} TFLOP/s ({args.peak_size}^3)")
    print(f"{'decode':>7}{'prefill':>8}{'bucket':>10}{'graph ms':>10}{'eager ms':>10}{'TFLOP/s':>9}{'MFU':>6}")
    for r in rows:
        print(f"{r['decode']:>7}{r['prefill']:>8}{r['bucket_tokens']:>6}x{r['bucket_rows']:<3}{r['graph_ms']:>10.3f}"
              f"{r['eager_ms']:>10.2f}{r['tflops']:>9.0f}"
              + (f"{100 * r['mfu']:>5.0f}%" if r["mfu"] is not None else f"{'-':>6}"))
    if args.json:
        write_json(args.json, dict(meta=meta, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
