"""Structured outputs: what a JSON-schema constraint costs per token, and what its grammar costs to compile.

For each batch size, one server (``forerun serve``) runs the same lockstep batch twice:
unconstrained (``ignore_eos``), then every request under a JSON schema that keeps it generating
(a long required string); then, at batch 1, a fresh schema (cold compile) and the same one again
(cached).  Reported per batch and mode: TPOT (the phase's wall time / its steps), the GPU's idle
fraction between steps (ServerStats: CUDA timing events; on the CPU the executor's waits), and the
grammar's compile time (the scheduler's, from ServerStats) cold and cached; for the constrained phase,
how many steps' sampling waited for their masks and for how long (the executor's own count: the GPU
idles only where the wait outlasts the step's forward, which the idle fraction shows).

    python scripts/bench_structured.py --model scripts/configs/llama-3-8b --load-format dummy \\
        --tokenizer PATH --device cuda --batches 1,64 --json docs/bench/structured.json

A random-weight model has no tokenizer: ``--tokenizer`` names any tokenizer.json (its vocabulary may be
smaller than the model's: the masks disallow the columns past it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_util import format_table, ipc_address, start_server, stop_server, write_json  # noqa: E402


def schema(tag: str = "") -> dict:
    """A schema that keeps a random-weight model generating: a long string, then a fixed array."""
    return {"type": "object", "properties": {
        f"text{tag}": {"type": "string", "minLength": 200, "maxLength": 400},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 4, "maxItems": 4}},
        "required": [f"text{tag}", "tags"], "additionalProperties": False}


async def _stats(address: str):
    from tests.server_proc import server_stats

    return await server_stats(address)


async def _phase(address: str, batch: int, tokens: int, constrained: bool, vocab: int) -> dict:
    """One lockstep batch: wall seconds, steps and the scheduler's counters around it."""
    import random

    from ipc.client import AsyncClient

    rng = random.Random(0)
    before = await _stats(address)
    async with AsyncClient(address, timeout=3600) as c:
        kw = dict(json_schema=schema()) if constrained else dict(ignore_eos=True)
        t0 = time.perf_counter()
        results = await asyncio.gather(*[
            c.generate(prompt_token_ids=[rng.randrange(10, min(vocab, 30000)) for _ in range(16)],
                       max_tokens=tokens, temperature=1.0, seed=i, detokenize=False, **kw) for i in range(batch)])
        wall = time.perf_counter() - t0
    after = await _stats(address)
    steps = after.steps - before.steps
    busy = after.gpu_busy_s_total - before.gpu_busy_s_total
    gap = after.gpu_gap_s_total - before.gpu_gap_s_total
    if busy <= 0:  # no CUDA timing events: the executor's waits for plans
        busy = after.step_time_s_total - before.step_time_s_total
        gap = after.executor_idle_s_total - before.executor_idle_s_total
    grammar_steps = after.grammar_steps - before.grammar_steps
    waits = {"grammar_steps": grammar_steps, "grammar_wait_steps": after.grammar_wait_steps - before.grammar_wait_steps,
             "grammar_wait_ms_per_step": (after.grammar_wait_s_total - before.grammar_wait_s_total) * 1e3
             / max(grammar_steps, 1)}
    return {**waits, "wall_s": wall, "steps": steps, "tpot_ms": wall / max(steps, 1) * 1e3,
            "tokens": sum(len(r.token_ids) for r in results), "finish": sorted({r.finish_reason for r in results}),
            "gpu_idle_fraction": gap / (busy + gap) if busy + gap > 0 else None}


async def _compile_times(address: str) -> dict:
    """Cold compile (a schema never seen) and a cached one, from the scheduler's compile counters."""
    from ipc.client import AsyncClient

    async with AsyncClient(address, timeout=600) as c:
        s0 = await _stats(address)
        fresh = schema(uuid.uuid4().hex[:8])
        t0 = time.perf_counter()
        await c.generate(prompt_token_ids=[10, 11, 12], json_schema=fresh, max_tokens=1, detokenize=False)
        cold_wall = time.perf_counter() - t0
        s1 = await _stats(address)
        t0 = time.perf_counter()
        await c.generate(prompt_token_ids=[10, 11, 12], json_schema=fresh, max_tokens=1, detokenize=False)
        cached_wall = time.perf_counter() - t0
        s2 = await _stats(address)
        t0 = time.perf_counter()
        await c.generate(prompt_token_ids=[10, 11, 12], max_tokens=1, detokenize=False)
        plain_wall = time.perf_counter() - t0
    return {"compile_cold_ms": (s1.grammar_compile_s_total - s0.grammar_compile_s_total) * 1e3,
            "request_cold_ms": cold_wall * 1e3, "request_cached_ms": cached_wall * 1e3,
            "request_plain_ms": plain_wall * 1e3, "cache_hit": s2.grammar_cache_hits - s1.grammar_cache_hits}


def masks_only(args) -> dict:
    """The executor's grammar work per step, no model: B slots under the schema advance by one allowed token
    (drawn at random from their masks) and compute their next masks, as the output thread does."""
    import random

    import numpy as np
    import torch

    from _bench_util import summarize
    from executor_proc.step.grammar import build_grammar_slots
    from ipc.models import resolve_model
    from ipc.protocol import Admit, SlotSampling, StepPlan
    from scheduler_proc.grammar import to_grammar

    tokenizer = args.tokenizer or resolve_model(None, "auto").tokenizer_path
    rows = []
    for batch in args.batches:
        slots = build_grammar_slots(tokenizer, args.vocab, [2], batch, torch.device("cpu"))
        sampling = SlotSampling(1.0, 0, 1.0, 0.0, 0, num_prompt_tokens=1, grammar=to_grammar("json_schema", schema()))
        admits = [Admit(i, sampling, [1]) for i in range(batch)]
        t0 = time.perf_counter()
        rows_of = slots.stage(StepPlan(0, list(range(batch)), [1] * batch, [0] * batch, [False] * batch,
                                       [True] * batch, admits=admits), list(range(batch)))
        slots.bind(rows_of)  # the matchers are built (on the grammar thread) and their first masks there
        admit_ms = (time.perf_counter() - t0) * 1e3
        rng, times = random.Random(0), []
        for step in range(args.new_tokens):
            tokens = []
            for _, st, _ in rows_of.rows:
                bits = np.unpackbits(st.mask.view(np.uint8), bitorder="little")
                allowed = np.flatnonzero(bits)
                tokens.append(int(allowed[rng.randrange(len(allowed))]))
            t0 = time.perf_counter()
            slots.advance(rows_of, tokens)
            times.append(time.perf_counter() - t0)
            rows_of = slots.stage(StepPlan(step + 1, list(range(batch)), [1] * batch, [step + 1] * batch,
                                           [False] * batch, [True] * batch), list(range(batch)))
            slots.bind(rows_of)
        ms = summarize([t * 1e3 for t in times])
        rows.append({"batch": batch, "admit_ms": admit_ms, "advance_ms": ms})
    return {"args": vars(args), "masks": rows}


def run(args) -> dict:
    out = {"args": vars(args), "rows": [], "compile": None}
    for batch in args.batches:
        folder = tempfile.mkdtemp(prefix="fs", dir="/tmp")
        flags = ["--device", args.device, "--max-num-seqs", str(max(batch, 2)), "--pipeline-depth", str(args.depth),
                 *(["--model", args.model] if args.model else []),
                 *(["--load-format", args.load_format] if args.load_format else []),
                 *(["--tokenizer", args.tokenizer] if args.tokenizer else []), *args.server_flag]
        address = ipc_address(folder)
        proc = start_server(address, *flags, echo=args.verbose)
        try:
            from ipc.client import Client

            with Client(address) as c:
                vocab = c.server_info.vocab_size
            asyncio.run(_phase(address, batch, 4, False, vocab))  # warm-up: kernels, graphs, the grammar's tokenizer
            asyncio.run(_phase(address, min(batch, 2), 4, True, vocab))
            for constrained in (False, True):
                phase = asyncio.run(_phase(address, batch, args.new_tokens, constrained, vocab))
                row = {"batch": batch, "mode": "json_schema" if constrained else "unconstrained", **phase}
                out["rows"].append(row)
            if out["compile"] is None:
                out["compile"] = asyncio.run(_compile_times(address))
        finally:
            stop_server(proc)
    return out


def table(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        idle = r.get("gpu_idle_fraction")
        rows.append((f"batch {r['batch']:>3} {r['mode']:<13}",
                     f"TPOT {r['tpot_ms']:7.2f} ms   steps {r['steps']:4d}   idle "
                     f"{'-' if idle is None else f'{idle * 100:5.1f} %'}   mask waits {r['grammar_wait_steps']}/"
                     f"{r['grammar_steps']} steps, {r['grammar_wait_ms_per_step']:.2f} ms/step"))
    c = result["compile"] or {}
    if c:
        rows.append(("compile (cold)", f"{c['compile_cold_ms']:.1f} ms in the scheduler; request {c['request_cold_ms']:.1f} ms"))
        rows.append(("cached", f"request {c['request_cached_ms']:.1f} ms (cache hit {c['cache_hit']}); "
                               f"unconstrained {c['request_plain_ms']:.1f} ms"))
    return format_table(rows, title="structured outputs: JSON schema vs unconstrained")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path or config (default: the default model)")
    ap.add_argument("--load-format", default=None, help="e.g. dummy, for a config's random weights")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder or tokenizer.json (needed with dummy weights)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--depth", type=int, default=1, help="pipeline depth")
    ap.add_argument("--server-flag", action="append", default=[], help="an extra flag for forerun serve")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--verbose", action="store_true", help="echo the server's output")
    ap.add_argument("--masks-only", action="store_true",
                    help="no server: time the executor's grammar work per step (matchers advanced, masks computed)")
    ap.add_argument("--vocab", type=int, default=49152, help="--masks-only: the logits' width")
    args = ap.parse_args(argv)
    if args.masks_only:
        result = masks_only(args)
        print(format_table([(f"batch {r['batch']:>3}", f"admit {r['admit_ms']:.1f} ms; advance + masks per step "
                                                         f"p50 {r['advance_ms']['p50']:.2f} ms, p90 "
                                                         f"{r['advance_ms']['p90']:.2f} ms") for r in result["masks"]],
                           title="grammar work per step (host, no model)"))
    else:
        result = run(args)
        print(table(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
