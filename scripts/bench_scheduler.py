"""Per-step scheduler cost against the number of running requests, without an executor.

    python scripts/bench_scheduler.py              # 16, 64, 256, 1024 running, decode and mixed
    python scripts/bench_scheduler.py --quick      # within a minute
    python scripts/bench_scheduler.py --json out.json --profile 256
    python scripts/bench_scheduler.py --running 256 --prefix-caching both   # on vs off

One step, timed: decode the executor's StepResult bytes, ``Planner.reconcile``,
``Planner.plan`` for the next step and msgspec-encode the plan: what the
server does on its critical path at pipeline depth 1 (two steps in flight).
``emit`` is timed apart: the server's ``_emit_step`` turning the outputs into
client messages (one batched TokenDeltas per client, or one TokenDelta per
request for clients that do not batch), encoded, with the socket send stubbed
out (a ZeroMQ send adds about 2 us per message on the 2-core CI machine).

Modes:

* ``decode``: every request decodes (steady state), a new KV block every 16 tokens;
* ``mixed``: requests finish after 16..256 tokens and new ones (prompts of
  64..512 tokens) take their places, so steps mix decode rows, prefill chunks,
  admissions, finishes and releases.

``--prefix-caching on`` (the server's default) looks up every admitted prompt,
publishes its full blocks as their steps come back and its generated ones when
it finishes, and evicts cached blocks to make room; prompts are random, so every
lookup misses: the cost of the bookkeeping, not the gain of a hit.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import sys
import time
from typing import Any, Optional


from ipc import protocol as p
from scheduler_proc.limits import Limits
from scheduler_proc.planner import Planner
from scheduler_proc.request import Request
from benchlib import percentile, write_json

BLOCK_SIZE = 16
BUDGET = 2048


class _DiscardSocket:
    """Stands in for the client socket: the bench times the server's Python work, not the kernel's."""

    def send(self, data, *args, **kwargs) -> None:
        pass


def make_server(planner: Planner, batch: bool):
    """A Server with only what ``_emit_step`` touches (no executor, no event loop): its frontend is the real
    one's send path over a socket that discards what it is given."""
    from scheduler_proc.frontend import Frontend
    from scheduler_proc.server import Server

    frontend = Frontend.__new__(Frontend)
    frontend.now = _DiscardSocket()
    frontend.batch_clients = {b"client"} if batch else set()
    frontend.slow, frontend.gone = set(), set()
    server = Server.__new__(Server)
    server.planner = planner
    server.requests = {}
    server.frontend = frontend
    return server


class Workload:
    """Requests for one (running, mode) case, fed to the planner as the steps go."""

    def __init__(self, running: int, mode: str, seed: int = 0):
        self.rng = random.Random(seed)
        self.mode = mode
        self.running = running
        self.rid = 0
        max_len = 1 << 20
        self.limits = Limits(num_slots=running, num_kv_blocks=running * 64, block_size=BLOCK_SIZE,
                                    max_model_len=max_len, max_num_batched_tokens=max(BUDGET, running),
                                    eos_token_ids=frozenset({2}))

    def new_request(self) -> Request:
        rng = self.rng
        if self.mode == "decode":
            prompt_len, max_tokens = rng.randint(8, 64), 1 << 19
        else:
            prompt_len, max_tokens = rng.randint(64, 512), rng.randint(16, 256)
        sp = p.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.rid += 1
        prompt = [rng.randrange(4, 49000) for _ in range(prompt_len)]
        return Request(rid=self.rid, client=b"client", request_id=f"{self.rid:032x}", prompt=prompt,
                       sampling=sp, seed=self.rid, max_tokens=max_tokens, stop_ids=frozenset())


def result_bytes(planner: Planner, rng: random.Random) -> bytes:
    """What the executor would send for the oldest in-flight step."""
    step = planner.inflight[0]
    return p.encode(p.StepResult(step.step_id, [rng.randint(4, 49000) for _ in step.samplers]))


def bench_case(running: int, mode: str, steps: int, warmup: int, emit: bool, prefix: bool = False) -> dict[str, Any]:
    wl = Workload(running, mode)
    planner = Planner(wl.limits, prefix_cache_id="bench" if prefix else None)
    for _ in range(running):
        planner.add(wl.new_request())
    servers = {"batched": make_server(planner, True), "per_request": make_server(planner, False)} if emit else {}
    rng = random.Random(1)
    decoder = p.executor_output_decoder
    timings: dict[str, list[float]] = {k: [] for k in ("step", "reconcile", "plan", "encode", *servers)}
    planner.plan()
    planner.plan()  # depth 1: two steps in flight
    for i in range(warmup + steps):
        data = result_bytes(planner, rng)
        t0 = time.perf_counter()
        outputs = planner.reconcile(decoder.decode(data))
        t1 = time.perf_counter()
        plan = planner.plan()
        t2 = time.perf_counter()
        p.encode(plan)
        t3 = time.perf_counter()
        for name, server in servers.items():
            te = time.perf_counter()
            server._emit_step(outputs)
            timings[name].append(time.perf_counter() - te) if i >= warmup else None
        if i >= warmup:
            timings["step"].append(t3 - t0)
            timings["reconcile"].append(t1 - t0)
            timings["plan"].append(t2 - t1)
            timings["encode"].append(t3 - t2)
        # Keep `running` requests in the system: finished ones are replaced (mixed mode).
        for _ in range(running - len(planner.running) - len(planner.waiting)):
            planner.add(wl.new_request())
    row: dict[str, Any] = {"running": running, "mode": mode, "prefix": "on" if prefix else "off", "steps": steps}
    for name, values in timings.items():
        us = [v * 1e6 for v in values]
        suffix = "" if name == "step" else f"_{name}"
        if name in servers:
            suffix = f"_emit_{name}"
        row[f"step_us_p50{suffix}" if name == "step" else f"us_p50{suffix}"] = percentile(us, 50)
        if name == "step":
            row["step_us_p99"] = percentile(us, 99)
            row["step_us_mean"] = sum(us) / len(us)
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [("running", "running", "{}"), ("mode", "mode", "{}"), ("prefix", "prefix cache", "{}"),
            ("step_us_p50", "step p50", "{:.1f}"),
            ("step_us_p99", "step p99", "{:.1f}"), ("us_p50_reconcile", "reconcile", "{:.1f}"),
            ("us_p50_plan", "plan", "{:.1f}"), ("us_p50_encode", "encode", "{:.1f}"),
            ("us_p50_emit_batched", "emit batched", "{:.1f}"), ("us_p50_emit_per_request", "emit per-req", "{:.1f}")]
    cols = [c for c in cols if c[0] in rows[0]]
    print("per step, microseconds (p50 unless marked); step = decode result + reconcile + plan + encode")
    print("  ".join(f"{title:>12}" for _, title, _ in cols))
    for row in rows:
        print("  ".join(f"{fmt.format(row[key]):>12}" for key, _, fmt in cols), flush=True)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--modes", nargs="+", default=["decode", "mixed"], choices=["decode", "mixed"])
    ap.add_argument("--steps", type=int, default=None, help="timed steps per case (default 5000, --quick 1000)")
    ap.add_argument("--quick", action="store_true", help="fewer steps (within a minute)")
    ap.add_argument("--no-emit", action="store_true", help="do not time the server's _emit_step")
    ap.add_argument("--prefix-caching", choices=["on", "off", "both"], default="both",
                    help="run the planner with prefix caching on, off, or each case both ways")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as a JSON list")
    ap.add_argument("--profile", type=int, default=None, metavar="RUNNING",
                    help="cProfile the decode case with this many running requests and print the top functions")
    return ap.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    steps = args.steps or (1000 if args.quick else 5000)
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(bench_case, args.profile, "decode", steps, 20, not args.no_emit, args.prefix_caching != "off")
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        return 0
    gc.collect()
    rows = []
    prefix = {"on": [True], "off": [False], "both": [False, True]}[args.prefix_caching]
    for mode in args.modes:
        for running in args.running:
            for on in prefix:
                rows.append(bench_case(running, mode, steps, warmup=max(50, steps // 10), emit=not args.no_emit,
                                       prefix=on))
    print_table(rows)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
