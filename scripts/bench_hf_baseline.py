"""Offline throughput: forerun's worker (Triton kernels + CUDA graphs) vs HF transformers continuous batching.

Workload: ``--requests`` requests of ``--prompt-len`` random tokens, ``--new-tokens``
new tokens each (greedy, EOS ignored), Llama-3.2-1B shape with random weights, bf16.

- forerun: the executor's worker driven by :class:`executor_proc.testing.synthetic.SyntheticPlanner`
  (``--slots`` slots, at most ``--prefill-budget`` prompt tokens admitted per step,
  decode rows + prefill rows mixed as the real planner does, two steps in flight).
  No scheduler process and no sockets: this is the executor's share only.
- HF: ``model.generate_batch`` (transformers' continuous batching) with its default
  config, and with ``use_cuda_graph=True``.

    python3 scripts/bench_hf_baseline.py [--model llama-3.2-1b] [--engines forerun,hf] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch


from benchlib import write_json
from ipc.config import ExecutorConfig
from executor_proc.build import build_worker
from executor_proc.testing.synthetic import DecodeLoop, SyntheticPlanner

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def prompts(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]


def run_forerun(args, model_dir: str, inputs: list[list[int]]) -> dict:
    block = 16
    blocks = args.slots * -(-(args.prompt_len + args.new_tokens + block) // block)
    cuda = args.device.startswith("cuda")
    cfg = ExecutorConfig(model=model_dir, plan_addr="", result_addr="", load_format="dummy", device=args.device,
                         dtype="bfloat16" if cuda else "float32", num_slots=args.slots, num_kv_blocks=blocks, block_size=block,
                         max_model_len=args.prompt_len + args.new_tokens + block)
    t0 = time.perf_counter()
    worker = build_worker(cfg).worker
    setup_s = time.perf_counter() - t0

    def once(reqs: list[list[int]]) -> tuple[float, int, int]:
        planner = SyntheticPlanner(args.slots, block, blocks, max_prefill_tokens=args.prefill_budget)
        for p in reqs:
            planner.add(p, max_new_tokens=args.new_tokens)
        loop = DecodeLoop(worker, planner)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        steps = 0
        while not planner.done:
            loop.step()
            steps += 1
        loop.drain()
        return time.perf_counter() - t, sum(len(x) for x in loop.tokens), steps

    once(inputs[: args.slots // 4])  # warm-up: compiles the prefill kernels' variants
    elapsed, tokens, steps = once(inputs)
    return dict(engine="forerun", elapsed_s=elapsed, tokens=tokens, steps=steps, tok_s=tokens / elapsed,
                setup_s=setup_s)


def run_hf(args, model_dir: str, inputs: list[list[int]], cuda_graph: bool) -> dict:
    import transformers
    from transformers.generation import ContinuousBatchingConfig, GenerationConfig

    name = f"hf generate_batch{' +cuda_graph' if cuda_graph else ''}"
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        config.eos_token_id = None
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                  attn_implementation="sdpa").eval()
        model.generation_config.eos_token_id = None
        gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        cb = ContinuousBatchingConfig(use_cuda_graph=cuda_graph)
        model.generate_batch(inputs=inputs[:8], generation_config=gen, continuous_batching_config=cb)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate_batch(inputs=inputs, generation_config=gen, continuous_batching_config=cb)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        tokens = sum(len(o.generated_tokens) for o in out.values())
        row = dict(engine=name, elapsed_s=elapsed, tokens=tokens, tok_s=tokens / elapsed,
                   transformers=transformers.__version__)
    except Exception as e:  # report the baseline's failure instead of losing the run
        row = dict(engine=name, error=f"{type(e).__name__}: {e}"[:500])
    finally:
        model = None
        gc.collect()
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--engines", default="forerun,hf")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--prefill-budget", type=int, default=2048)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (forerun only: a check that the script runs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model_dir = os.path.join(CONFIGS, args.model)  # a name under scripts/configs, or a config folder
    vocab = __import__("json").load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    inputs = prompts(args, vocab)
    engines = args.engines.split(",")
    rows = []
    if "forerun" in engines:
        rows.append(run_forerun(args, model_dir, inputs))
        gc.collect()  # free the worker's memory before HF sizes its KV cache
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "hf" in engines:
        rows += [run_hf(args, model_dir, inputs, cuda_graph=False), run_hf(args, model_dir, inputs, cuda_graph=True)]
    print(f"{args.requests} requests x {args.prompt_len} prompt x {args.new_tokens} new, {args.model}, "
          f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}")
    print(f"{'engine':<28}{'tokens':>8}{'seconds':>9}{'tok/s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:<28} failed: {r['error'][:120]}")
        else:
            print(f"{r['engine']:<28}{r['tokens']:>8}{r['elapsed_s']:>9.2f}{r['tok_s']:>9.0f}")
    if args.json:
        write_json(args.json, dict(args=vars(args), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
