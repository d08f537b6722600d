"""Decode step time through the worker and its CUDA graphs, against the weights-read floor.

For each model shape (random weights from ``scripts/configs/<name>/config.json``,
bf16): prefill ``--batch`` requests of ``--context`` tokens, then run decode
steps the way the executor does (prepare -> launch -> copy out, up to two steps
in flight, the oldest waited for on its copy event).  Reported per step:

- ``step``: wall time of the pipelined loop / steps (what a client sees);
- ``gpu``: CUDA-event time over the same loop / steps;
- ``host``: CPU time of prepare + launch + copy_out per step (must stay under ``gpu``);
- ``replay``: back-to-back replays of the bucket's graph alone;
- ``eager``: the same decode step without a graph (Triton kernels, Python launches);
- ``floor``: bytes of weights read per step / device copy bandwidth measured here
  (``+kv`` adds the KV cache read at this context).

    python3 scripts/bench_decode.py [--models llama-3.2-1b,llama-3-8b] [--batch 1] [--context 512]
                                    [--steps 200] [--json OUT.json] [--profile PREFIX] [--batch-invariant]
                                    [--quantization none,fp8] [--prefill 2048]

``--quantization none,fp8`` runs each model once per setting (FP8 weights: targets and floors of their own);
``--kv-cache-dtype fp8`` puts the KV cache in e4m3; ``--prefill N`` also times one eager forward of an N-token
prefill chunk (``prefill_tok_s``).

``--batch-invariant`` builds the worker with batch-invariant kernels (one matmul tile and split of K for
every batch size, the batch-1 attention split count), to measure what that mode costs.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Optional

import torch


from benchlib import write_json
from ipc.config import ExecutorConfig
from executor_proc.backends.gemv_tuning import tuner_report
from executor_proc.build import build_worker
from executor_proc.step.sample import GREEDY
from executor_proc.testing.synthetic import DecodeLoop, SyntheticPlanner
from kernels.pdl import pdl_enabled

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
# Targets: the batch-1 step (ms), and above one row the share of the weights + KV read floor.
TARGET_MS = {"llama-3.2-1b": 1.1, "llama-3-8b": 5.6}
TARGET_FLOOR_KV = {"llama-3-8b": 0.85}
TARGET_MS_FP8 = {"llama-3.2-1b": 0.75, "llama-3-8b": 3.1}
TARGET_FLOOR_KV_FP8 = {"llama-3-8b": 0.80}
BLOCK_SIZE = 16


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read + written (median of ``reps``)."""
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / sorted(times[2:])[reps // 2]


def weight_bytes_per_step(model, batch: int = 1) -> int:
    """Bytes of weights one decode step reads: every parameter, except an untied embedding (one row read) and,
    in a mixture-of-experts layer, the experts no row chose: of E experts with top-k routing, a step of B rows
    reads E * (1 - (1 - k/E)^B) of them on average (uniform routing; k at batch 1)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    for module in model.modules():
        experts = [getattr(module, name, None) for name in ("w13", "w2")]
        if getattr(module, "top_k", None) and all(isinstance(w, torch.nn.Parameter) for w in experts):
            e, k = experts[0].shape[0], module.top_k
            idle = (1 - k / e) ** batch  # the share of experts no row chose
            total -= int(sum(w.numel() * w.element_size() for w in experts) * idle)
    return total


def kv_bytes(mcfg, context: int, batch: int, item: int = 2) -> int:
    return 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * item * context * batch


def time_calls(fn, n: int) -> float:
    """Seconds per call of ``fn`` enqueued ``n`` times back to back (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def profile_kernels(fn, path: str, reps: int = 10) -> None:
    """Per-kernel device time of ``reps`` calls of ``fn`` (graph replays are traced kernel by kernel)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
    except Exception as e:  # the profile is a diagnostic: never lose the benchmark for it
        table = f"profiler failed: {type(e).__name__}: {e}"
    with open(path, "w") as f:
        f.write(table + "\n")


def time_prefill(worker, tokens: int, reps: int = 5) -> float:
    """Seconds of one eager forward (logits of the last token) of a ``tokens``-token prefill chunk."""
    return time_calls(prefill_call(worker, tokens), reps)


def profile_prefill(worker, tokens: int, path: str) -> None:
    """Per-kernel device time of :func:`time_prefill`'s forward."""
    profile_kernels(prefill_call(worker, tokens), path, reps=3)


def prefill_call(worker, tokens: int):
    """A function running one eager forward of a ``tokens``-token prefill chunk (blocks 1.. of the cache)."""
    from executor_proc.step.batch import ForwardBatch

    dev, bs = worker.device, worker.block_size
    pos = torch.arange(tokens, device=dev)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    # blocks 1.. in order (the cache is sized for them: bench_model), overwriting the decode rows' KV
    table = (1 + torch.arange(-(-tokens // bs), device=dev)).int()[None, :]
    batch = ForwardBatch(input_ids=pos % worker.model.config.vocab_size, positions=pos, kv_index=bs + pos,
                         query_start=i32([0, tokens]), context_lens=i32([tokens]), block_tables=table,
                         sample_index=torch.tensor([tokens - 1], device=dev),
                         sample_slots=torch.zeros(1, dtype=torch.long, device=dev),
                         host_query_lens=[tokens], host_context_lens=[tokens], block_size=bs)
    return lambda: worker.model(batch, worker.kv_cache)


def bench_model(name: str, args, bandwidth: Optional[float], quantization: str = "none") -> dict:
    steps, warmup, batch, context = args.steps, args.warmup, args.batch, args.context
    cuda = args.device.startswith("cuda")
    max_len = context + warmup + steps + 64
    blocks = max(batch * -(-max_len // BLOCK_SIZE), 1 + -(-args.prefill // BLOCK_SIZE))
    cfg = ExecutorConfig(model=os.path.join(CONFIGS, name), plan_addr="", result_addr="", load_format="dummy",
                         device=args.device, dtype="bfloat16" if cuda else "float32", num_slots=batch,
                         num_kv_blocks=blocks, block_size=BLOCK_SIZE, max_model_len=max_len,
                         cuda_graph_max_batch=batch, max_num_batched_tokens=max(1024, args.prefill),
                         batch_invariant=args.batch_invariant, quantization=quantization,
                         kv_cache_dtype=args.kv_cache_dtype)
    stages: dict[str, float] = {}
    t0 = time.perf_counter()
    built = build_worker(cfg, lambda stage, done, total: stages.setdefault(stage, time.perf_counter() - t0))
    setup_s = time.perf_counter() - t0
    worker, mcfg = built.worker, built.model_config
    planner = SyntheticPlanner(batch, BLOCK_SIZE, blocks)
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        planner.add(torch.randint(0, mcfg.vocab_size, (context,), generator=g).tolist())
    loop = DecodeLoop(worker, planner)
    loop.step()  # prefill (eager)
    for _ in range(warmup):
        loop.step()
    loop.drain()
    if not cuda:  # the CPU has no graphs and no events: the loop's wall time only
        t_wall = time.perf_counter()
        for _ in range(steps):
            loop.step()
        loop.drain()
        wall = (time.perf_counter() - t_wall) / steps
        return dict(model=name, quantization=quantization, batch=batch, device=args.device, context=context,
                    steps=steps, setup_s=setup_s,
                    step_ms=wall * 1e3, gpu_ms=None, host_ms=None, replay_ms=None, eager_ms=None, floor_ms=None,
                    floor_kv_ms=None, target_ms=None, linear_kernels={},
                    tokens_valid=all(0 <= t < mcfg.vocab_size for toks in loop.tokens for t in toks))
    torch.cuda.synchronize()
    loop.host_s = 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t_wall = time.perf_counter()
    start.record()
    for _ in range(steps):
        loop.step()
    end.record()
    loop.drain()
    end.synchronize()
    wall = (time.perf_counter() - t_wall) / steps
    gpu = start.elapsed_time(end) / 1e3 / steps
    host = loop.host_s / steps
    bucket = worker.graphs.bucket_for(batch)
    replay = time_calls(lambda: worker.graphs.run(bucket, GREEDY), steps)
    view = worker.graphs.view(bucket)
    eager = time_calls(lambda: worker.graphs.step_fn(view, GREEDY), max(10, steps // 10))
    if args.profile:
        profile_kernels(lambda: worker.graphs.run(bucket, GREEDY), f"{args.profile}.{name}.{quantization}.txt")
    prefill = time_prefill(worker, args.prefill) if args.prefill else None
    if args.prefill and args.profile:
        profile_prefill(worker, args.prefill, f"{args.profile}.{name}.{quantization}.prefill.txt")
    linears = tuner_report(worker.model.backend)
    w_bytes = weight_bytes_per_step(worker.model, batch)
    kv = kv_bytes(mcfg, context + warmup + steps // 2, batch, worker.kv_cache.k[0].element_size())
    floor = w_bytes / bandwidth
    fp8 = quantization == "fp8"
    target_ms, target_kv = (TARGET_MS_FP8, TARGET_FLOOR_KV_FP8) if fp8 else (TARGET_MS, TARGET_FLOOR_KV)
    row = dict(model=name, quantization=quantization, batch=batch, batch_invariant=args.batch_invariant,
               prologues=not args.no_prologues,
               pdl=pdl_enabled(torch.device("cuda", 0)),
               context=context, steps=steps,
               setup_s=setup_s, stage_start_s=stages,
               step_ms=wall * 1e3, gpu_ms=gpu * 1e3, host_ms=host * 1e3, replay_ms=replay * 1e3,
               eager_ms=eager * 1e3, weight_bytes=w_bytes, kv_bytes=kv, floor_ms=floor * 1e3,
               floor_kv_ms=(w_bytes + kv) / bandwidth * 1e3, target_ms=target_ms.get(name) if args.batch == 1 else None,
               target_floor_kv=target_kv.get(name) if args.batch > 1 else None,
               prefill_tokens=args.prefill, prefill_ms=prefill * 1e3 if prefill else None,
               prefill_tok_s=args.prefill / prefill if prefill else None,
               linear_kernels=linears,
               tokens_valid=all(0 <= t < mcfg.vocab_size for toks in loop.tokens for t in toks))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.2-1b,llama-3-8b",
                    help="names under scripts/configs, or config folders, comma-separated")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (the loop's wall time only: a check that it runs)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="write per-kernel times of graph replays to PREFIX.<model>.txt")
    ap.add_argument("--batch-invariant", action="store_true", help="batch-invariant kernels (the cost of that mode)")
    ap.add_argument("--quantization", default="none",
                    help="comma-separated weight quantizations to run each model with: none, fp8 (e.g. none,fp8)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="the paged KV cache's dtype (fp8: e4m3, half the bytes per token)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="also time one eager forward of an N-token prefill chunk (0: off)")
    ap.add_argument("--no-prologues", action="store_true",
                    help="never fold the norm / SiLU-mul / rotary into the 1-8-row matmuls, nor the layers' norms into "
                         "them (the baseline for those fusions)")
    args = ap.parse_args(argv)
    import triton

    if args.no_prologues:
        import executor_proc.backends.gemv_tuning as tuning

        tuning.prologue_jobs = lambda backend, model, *a, **kw: []  # tune_all looks it up at call time
        os.environ["FORERUN_FOLD_NORMS"] = "0"  # and no norm from partial sums (select.folds_norms)

    cuda = args.device.startswith("cuda")
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device) if cuda else None
    rows = []
    for name in args.models.split(","):
        for quantization in args.quantization.split(","):
            rows.append(bench_model(name, args, bandwidth, quantization))
            gc.collect()  # the model, its KV cache and graphs go before the next one is built
            if cuda:
                torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__,
                triton=triton.__version__, copy_bandwidth_tb_s=bandwidth / 1e12 if bandwidth else None,
                command=" ".join(sys.argv))
    if not cuda:
        for r in rows:
            print(f"{r['model']} {r['quantization']}  batch {r['batch']}  {r['step_ms']:.3f} ms per step (cpu)")
        if args.json:
            write_json(args.json, dict(meta=meta, rows=rows))
        return 0
    head = f"{'model':<14}{'q':>5}{'B':>3}{'step ms':>9}{'gpu ms':>8}{'host ms':>8}{'replay':>8}{'eager':>8}" \
           f"{'floor':>7}{'+kv':>7}{'%floor':>7}{'%+kv':>6}{'target':>7}"
    print(f"{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  copy {meta['copy_bandwidth_tb_s']:.2f} TB/s")
    print(head)
    for r in rows:
        target, share = r["target_ms"], r.get("target_floor_kv")
        verdict = ("ok" if r["step_ms"] <= target else "MISS") if target is not None else (
            ("ok" if r["floor_kv_ms"] / r["step_ms"] >= share else "MISS") if share is not None else "-")
        print(f"{r['model']:<14}{r['quantization']:>5}{r['batch']:>3}{r['step_ms']:>9.3f}{r['gpu_ms']:>8.3f}"
              f"{r['host_ms']:>8.3f}"
              f"{r['replay_ms']:>8.3f}{r['eager_ms']:>8.2f}{r['floor_ms']:>7.3f}{r['floor_kv_ms']:>7.3f}"
              f"{100 * r['floor_ms'] / r['step_ms']:>6.0f}%{100 * r['floor_kv_ms'] / r['step_ms']:>5.1f}%{verdict:>7}"
              + (f"  prefill {r['prefill_tokens']}: {r['prefill_ms']:.2f} ms {r['prefill_tok_s']:,.0f} tok/s"
                 if r.get("prefill_ms") else ""))
    for r in rows:
        for shape, t in r["linear_kernels"].items():
            forms = (("unfused", "best_fused"), ("default", "best"), ("cublas", "best_gemv"))
            base, best = next((b, f) for b, f in forms if b + "_ms" in t)
            chosen = "chosen" in t or (base == "default" and (t["best_ms"] or 1e9) < (t["default_ms"] or 0))
            print(f"  {r['model']} {r['quantization']} {shape:<18} {base} {t[base + '_ms'] or 0:.3f} ms  "
                  f"{best} {t[best + '_ms'] or 0:.3f} ms  -> {t.get('best') or best if chosen else base}")
    if args.json:
        write_json(args.json, dict(meta=meta, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
