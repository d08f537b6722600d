"""Interleaved runs of ``bench_scheduler.py`` from several checkouts, for comparisons on a noisy machine.

    python scripts/bench_scheduler_trees.py base=/work/wt/base95 off=.:off on=.:on \\
        --rounds 11 --modes mixed decode --json out.json

Each ``NAME=TREE[:off|on]`` runs ``TREE/scripts/bench_scheduler.py --running 256 --no-emit`` with
``PYTHONPATH=TREE`` (``off``/``on``: its ``--prefix-caching``; nothing for a tree whose script has
no such flag).  Every round runs every variant once, in an order that alternates, so a change in
the machine's load hits all of them alike; the table gives the median over the rounds of each
run's p50 step time, and its ratio to the first variant's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from _bench_util import write_json


def run_once(tree: str, mode: str, steps: int, prefix: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.join(tree, "scripts", "bench_scheduler.py"), "--running", "256", "--modes",
               mode, "--steps", str(steps), "--no-emit", "--json", out] + (["--prefix-caching", prefix] if prefix else [])
        subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)), check=True, capture_output=True)
        with open(out) as f:
            return json.load(f)[0]["step_us_p50"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", metavar="NAME=TREE[:off|on]")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--modes", nargs="+", default=["mixed"], choices=["decode", "mixed"])
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    variants = []
    for spec in args.variants:
        name, _, where = spec.partition("=")
        tree, _, prefix = where.partition(":")
        variants.append((name, tree, prefix))
    result: dict[str, Any] = {"rounds": args.rounds, "steps": args.steps, "running": 256,
                              "variants": {n: f"{t}:{p}" if p else t for n, t, p in variants}, "modes": {}}
    for mode in args.modes:
        runs: dict[str, list[float]] = {n: [] for n, _, _ in variants}
        for r in range(args.rounds):
            for name, tree, prefix in variants if r % 2 == 0 else variants[::-1]:
                runs[name].append(run_once(tree, mode, args.steps, prefix))
        first = statistics.median(runs[variants[0][0]])
        print(f"{mode}: median of {args.rounds} runs' p50 step (us), 256 running; load {os.getloadavg()[0]:.1f}")
        for name, values in runs.items():
            med = statistics.median(values)
            print(f"  {name:>12} {med:8.1f}  x{med / first:.2f}  ({min(values):.1f} to {max(values):.1f})")
        result["modes"][mode] = {"median_p50_us": {n: statistics.median(v) for n, v in runs.items()},
                                 "runs_p50_us": runs}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
