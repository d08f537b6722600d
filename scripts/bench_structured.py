"""Structured outputs: what a JSON-schema constraint costs per token, and what grammars cost to compile.

One server (``forerun serve``, ``--step-log``) serves every batch size. For each batch it runs the
same lockstep batch unconstrained (``ignore_eos``) and with every request under a JSON schema that
keeps it generating (a required string longer than the tokens allowed: both modes end with
``length`` at the same step), alternating, ``--repeats`` times. Reported per batch and mode:

- TPOT: the p50 interval between steady decode steps (the step log; the first and last tenth of
  the batch's full-width steps left out), and the phase's wall time per step;
- the GPU's idle fraction over those steps (CUDA timing events; on the CPU the executor's waits)
  and its busy time per step;
- whether each constrained output is a prefix the schema allows (a fresh matcher accepts it);
- how many steps' sampling waited for their masks and for how long (the executor's count: the GPU
  idles only where the wait outlasts the step's forward, which the idle fraction shows).

Then each schema of :data:`SCHEMA_SET` compiles cold (a fresh copy: the scheduler's compile time)
and again (a cache hit: the request's latency against an unconstrained one).

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
import shutil
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchlib import format_table, gpu_idle_of, ipc_address, start_server, stop_server, write_json  # noqa: E402

# Schemas whose compile time is reported: the kinds of constraint agents send.
SCHEMA_SET = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 32},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}},
            "required": ["id", "tags"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum_range": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["color", "count"], "additionalProperties": False},
    "pattern_optional": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "note": {"type": "string", "maxLength": 40},
        "when": {"type": "string", "format": "date"}}, "required": ["code"], "additionalProperties": False},
    "tool_calls": {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"], "additionalProperties": False}}, "required": ["name", "parameters"],
         "additionalProperties": False},
        {"type": "object", "properties": {"name": {"const": "search"}, "parameters": {
            "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
            "required": ["query"], "additionalProperties": False}}, "required": ["name", "parameters"],
         "additionalProperties": False}]}},
}


def schema(tag: str = "") -> dict:
    """The lockstep schema: a string longer than any run's tokens can write (so every request ends with
    ``length``, like the unconstrained ones), then a fixed array."""
    return {"type": "object", "properties": {
        f"text{tag}": {"type": "string", "minLength": 20000, "maxLength": 40000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 4, "maxItems": 4}},
        "required": [f"text{tag}", "tags"], "additionalProperties": False}


async def _stats(address: str):
    from tests.server_proc import server_stats

    return await server_stats(address)


def _checker(tokenizer_path: str, vocab: int):
    """``valid(token_ids)``: whether a fresh matcher of the lockstep schema accepts the tokens (a JSON prefix)."""
    import llguidance

    from ipc.structured import load_tokenizer
    from scheduler_proc.grammar import to_grammar

    tokenizer, grammar = load_tokenizer(tokenizer_path, vocab, []), to_grammar("json_schema", schema())

    def valid(token_ids: list[int]) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return all(matcher.consume_token(t) for t in token_ids) and not matcher.is_error()
    return valid


async def _phase(address: str, batch: int, tokens: int, constrained: bool, vocab: int, valid=None) -> dict:
    """One lockstep batch: wall seconds, the step ids it ran and the scheduler's counters around it; with
    ``valid``, whether every constrained output passed it."""
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
    grammar_steps = after.grammar_steps - before.grammar_steps
    ok = all(valid(r.token_ids) for r in results) if constrained and valid else None
    return {"valid": ok, "wall_s": wall, "steps": steps, "step_ids": [before.steps, after.steps],
            "wall_ms_per_step": wall / max(steps, 1) * 1e3,
            "tokens": sum(len(r.token_ids) for r in results), "finish": sorted({r.finish_reason for r in results}),
            "grammar_steps": grammar_steps,
            "grammar_wait_steps": after.grammar_wait_steps - before.grammar_wait_steps,
            "grammar_wait_ms_per_step": (after.grammar_wait_s_total - before.grammar_wait_s_total) * 1e3
            / max(grammar_steps, 1),
            # the whole phase, for a CPU executor (no CUDA events): its step work and its waits for plans
            "step_s": after.step_time_s_total - before.step_time_s_total,
            "idle_s": after.executor_idle_s_total - before.executor_idle_s_total}


def _steady(phase: dict, log: list[dict], batch: int) -> dict:
    """The phase's steady decode steps from the step log: TPOT, GPU idle and busy time per step."""
    lo, hi = phase.pop("step_ids")
    rows = [r for r in log if lo <= r["step_id"] < hi]
    idle = gpu_idle_of(rows, batch)
    steady = [r for r in rows if r["num_rows"] == batch and r["num_tokens"] == batch]
    trim = len(steady) // 10
    steady = steady[trim:len(steady) - trim] if trim else steady
    ends = [r["t_end"] for r in steady]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    out = {"tpot_ms": statistics.median(gaps) * 1e3 if gaps else phase["wall_ms_per_step"],
           "steady_steps": idle["steps"], "gpu_idle_fraction": idle["gpu_idle_fraction"],
           "gpu_step_ms": idle["gpu_step_us_p50"] and idle["gpu_step_us_p50"] / 1e3}
    if not any(r["gpu_busy_s"] for r in steady):  # no CUDA timing events: the executor's waits for plans
        step_s, idle_s = phase["step_s"], phase["idle_s"]
        out["gpu_idle_fraction"] = idle_s / (step_s + idle_s) if step_s + idle_s > 0 else None
    return out


async def _compile_times(address: str) -> dict:
    """Each schema of SCHEMA_SET cold (a fresh copy: never seen) and cached: the scheduler's compile time,
    and the request's latency (one token) against an unconstrained one."""
    from ipc.client import AsyncClient

    out = {}
    async with AsyncClient(address, timeout=600) as c:
        async def request(**kw) -> float:
            t0 = time.perf_counter()
            await c.generate(prompt_token_ids=[10, 11, 12], max_tokens=1, detokenize=False, **kw)
            return (time.perf_counter() - t0) * 1e3

        plain_ms = min([await request() for _ in range(3)])
        for name, value in SCHEMA_SET.items():
            fresh = {**value, "description": uuid.uuid4().hex}  # a new text: not in the scheduler's cache
            s0 = await _stats(address)
            cold_ms = await request(json_schema=fresh)
            s1 = await _stats(address)
            cached_ms = await request(json_schema=fresh)
            s2 = await _stats(address)
            out[name] = {"compile_cold_ms": (s1.grammar_compile_s_total - s0.grammar_compile_s_total) * 1e3,
                         "request_cold_ms": cold_ms, "request_cached_ms": cached_ms,
                         "cache_hit": s2.grammar_cache_hits - s1.grammar_cache_hits}
    return {"request_plain_ms": plain_ms, "schemas": out}


def masks_only(args) -> dict:
    """The executor's grammar work per step, no model: B slots under the schema advance by one allowed token
    (drawn at random from their masks) and compute their next masks, as the output thread does."""
    import random

    import numpy as np
    import torch

    from benchlib import summarize
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


def mask_kernel(args) -> dict:
    """The grammar mask kernel's time per launch (CUDA graph of 20 launches, 10 replays), 128,256 columns, rows
    of the batch sizes, every column past the first 3,200 disallowed (a JSON structure position: the most writes)."""
    import torch

    from kernels.grammar_mask import apply_grammar_mask

    out, vocab = [], 128256
    for rows in args.batches:
        logits = torch.randn(rows, vocab, device="cuda")
        table = torch.randint(-2**31, 2**31 - 1, (rows + 1, -(-vocab // 32)), dtype=torch.int64).to(torch.int32).cuda()
        table[:, 100:] = 0
        slots = torch.arange(rows, device="cuda")
        for _ in range(3):
            apply_grammar_mask(logits, table, slots)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                apply_grammar_mask(logits, table, slots)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out.append({"rows": rows, "us": start.elapsed_time(end) / 200 * 1e3})
    return {"args": vars(args), "mask_kernel": out}


def run(args) -> dict:
    out = {"args": vars(args), "rows": [], "compile": None}
    folder = tempfile.mkdtemp(prefix="fs", dir="/tmp")
    log_path = os.path.join(folder, "steps.jsonl")
    flags = ["--device", args.device, "--max-num-seqs", str(max(*args.batches, 2)), "--pipeline-depth",
             str(args.depth), "--step-log", log_path, *(["--model", args.model] if args.model else []),
             *(["--load-format", args.load_format] if args.load_format else []),
             *(["--tokenizer", args.tokenizer] if args.tokenizer else []), *args.server_flag]
    address = ipc_address(folder)
    proc = start_server(address, *flags, echo=args.verbose)
    try:
        from ipc.client import Client

        with Client(address) as c:
            vocab = c.server_info.vocab_size
        from ipc.models import resolve_model

        valid = _checker(args.tokenizer or resolve_model(None, "auto").tokenizer_path, vocab)
        for batch in args.batches:
            asyncio.run(_phase(address, batch, 4, False, vocab))  # warm-up: kernels, graphs, the grammar's heads
            asyncio.run(_phase(address, batch, 4, True, vocab))
            for repeat in range(args.repeats):
                for constrained in (False, True):
                    phase = asyncio.run(_phase(address, batch, args.new_tokens, constrained, vocab, valid))
                    out["rows"].append({"batch": batch, "mode": "json_schema" if constrained else "unconstrained",
                                        "repeat": repeat, **phase})
        out["compile"] = asyncio.run(_compile_times(address))
    finally:
        stop_server(proc)
    log = [json.loads(line) for line in open(log_path)] if os.path.exists(log_path) else []
    shutil.rmtree(folder, ignore_errors=True)
    for row in out["rows"]:
        row.update(_steady(row, log, row["batch"]))
    out["summary"] = summary(out["rows"])
    return out


def summary(rows: list[dict]) -> list[dict]:
    """Per batch: the modes' TPOT (mean over repeats), the constrained one's overhead and GPU idle."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        mean = {}
        for mode in ("unconstrained", "json_schema"):
            mine = [r for r in rows if r["batch"] == batch and r["mode"] == mode]
            idle = [r["gpu_idle_fraction"] for r in mine if r["gpu_idle_fraction"] is not None]
            mean[mode] = (statistics.mean(r["tpot_ms"] for r in mine), statistics.mean(idle) if idle else None)
        (plain, plain_idle), (json_, json_idle) = mean["unconstrained"], mean["json_schema"]
        out.append({"batch": batch, "tpot_unconstrained_ms": plain, "tpot_json_schema_ms": json_,
                    "overhead": json_ / plain - 1, "gpu_idle_unconstrained": plain_idle,
                    "gpu_idle_json_schema": json_idle})
    return out


def _pct(value) -> str:
    return "-" if value is None else f"{value * 100:.2f} %"


def table(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        rows.append((f"batch {r['batch']:>3} {r['mode']:<13} #{r['repeat']}",
                     f"TPOT {r['tpot_ms']:7.3f} ms (wall {r['wall_ms_per_step']:.2f})  GPU {r['gpu_step_ms'] or 0:.3f} "
                     f"ms/step, idle {_pct(r['gpu_idle_fraction'])}  mask waits {r['grammar_wait_steps']}/"
                     f"{r['grammar_steps']} steps, {r['grammar_wait_ms_per_step']:.3f} ms/step  {r['finish']}"
                     f"{'' if r['valid'] is None else ' valid' if r['valid'] else ' INVALID'}"))
    for s in result.get("summary", []):
        rows.append((f"batch {s['batch']:>3}", f"TPOT {s['tpot_unconstrained_ms']:.3f} -> {s['tpot_json_schema_ms']:.3f}"
                     f" ms ({s['overhead'] * 100:+.2f} %); GPU idle {_pct(s['gpu_idle_unconstrained'])} -> "
                     f"{_pct(s['gpu_idle_json_schema'])}"))
    c = result["compile"] or {}
    for name, r in c.get("schemas", {}).items():
        rows.append((f"compile {name}", f"cold {r['compile_cold_ms']:.2f} ms (request {r['request_cold_ms']:.1f} ms); "
                                        f"cached: request {r['request_cached_ms']:.1f} ms (hit {r['cache_hit']})"))
    if c:
        rows.append(("unconstrained request", f"{c['request_plain_ms']:.1f} ms"))
    return format_table(rows, title="structured outputs: JSON schema vs unconstrained")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path or config (default: the default model)")
    ap.add_argument("--load-format", default=None, help="e.g. dummy, for a config's random weights")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder or tokenizer.json (needed with dummy weights)")
    ap.add_argument("--device", default="cpu", help="the server's device (cpu, cuda)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64],
                    help="comma-separated batch sizes (one server: --max-num-seqs is the largest)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each (batch, mode), alternating the modes")
    ap.add_argument("--depth", type=int, default=1, help="pipeline depth")
    ap.add_argument("--server-flag", action="append", default=[], help="an extra flag for forerun serve")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--verbose", action="store_true", help="echo the server's output")
    ap.add_argument("--masks-only", action="store_true",
                    help="no server: time the executor's grammar work per step (matchers advanced, masks computed)")
    ap.add_argument("--vocab", type=int, default=49152, help="--masks-only: the logits' width")
    ap.add_argument("--mask-kernel", action="store_true", help="no server: time the grammar mask kernel (CUDA)")
    args = ap.parse_args(argv)
    if args.mask_kernel:
        result = mask_kernel(args)
        print(format_table([(f"rows {r['rows']:>3}", f"{r['us']:.2f} us") for r in result["mask_kernel"]],
                           title="grammar mask kernel, 128,256 columns (in a CUDA graph)"))
    elif args.masks_only:
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
