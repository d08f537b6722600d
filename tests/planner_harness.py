"""Drive a Planner against a ScriptedExecutor in-process, at a given pipeline depth."""

from __future__ import annotations

from dataclasses import dataclass, field

from executor_proc.scripted import ScriptedExecutor
from ipc.protocol import SamplingParams
from scheduler_proc.planner import Planner, PlannerLimits
from scheduler_proc.request import Request

EOS = 2


@dataclass
class Trace:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finishes: dict[str, list[str]] = field(default_factory=dict)
    steps: int = 0


def make_request(rid: int, prompt_len: int, max_tokens: int, *, seed=None, stop=(), ignore_eos=False) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=list(stop), ignore_eos=ignore_eos)
    return Request(
        rid=rid, client=b"c", request_id=f"r{rid}", prompt=[5 + (rid * 7 + i) % 90 for i in range(prompt_len)],
        sampling=sp, seed=rid if seed is None else seed, max_tokens=max_tokens, stop_ids=frozenset(stop),
    )


def run(
    specs, *, depth: int, num_slots=4, num_blocks=64, block_size=4, max_len=512, budget=64,
    eos_at=None, arrivals=None, aborts=None, check=True, max_steps=10_000,
) -> tuple[Trace, Planner, ScriptedExecutor]:
    """Run requests to completion.

    ``specs``: list of dicts for make_request.  ``arrivals[i]``: plan index at
    which request i arrives (default 0).  ``aborts[i]``: plan index before which
    request i is aborted.
    """
    limits = PlannerLimits(num_slots, num_blocks, block_size, max_len, budget, frozenset({EOS}))
    planner = Planner(limits)
    reqs = [make_request(i, **s) for i, s in enumerate(specs)]
    # eos_at[i] = k: request i's k-th generated token is EOS (the executor wants a position).
    eos_pos = {reqs[i].seed: len(reqs[i].prompt) + k for i, k in (eos_at or {}).items()}
    ex = ScriptedExecutor(num_slots, num_blocks, block_size, eos_token_id=EOS, eos_at=eos_pos)
    arrivals = arrivals or {}
    aborts = aborts or {}
    trace = Trace({r.request_id: [] for r in reqs}, {r.request_id: [] for r in reqs})
    sent = []  # plans sent, not yet executed (the executor's queue)
    tick = 0

    def emit(outputs):
        for out in outputs:
            trace.tokens[out.request.request_id] += out.new_tokens
            if out.finish_reason:
                trace.finishes[out.request.request_id].append(out.finish_reason)

    while True:
        for i, r in enumerate(reqs):
            if arrivals.get(i, 0) == tick:
                planner.add(r)
            if aborts.get(i) == tick and arrivals.get(i, 0) <= tick:
                out = planner.abort(r)
                if out:
                    emit([out])
        if check:
            planner.check_integrity()
        while planner.num_inflight <= depth:
            plan = planner.plan()
            if plan is None:
                break
            sent.append(plan)
            if check:
                planner.check_integrity()
        if not sent:
            pending_arrivals = any(a > tick for a in arrivals.values())
            pending_aborts = any(a > tick for a in aborts.values())
            if not planner.has_work and not planner.draining and not pending_arrivals and not pending_aborts:
                break
            tick += 1
            assert tick < max_steps, "no progress"
            continue
        result = ex.execute(sent.pop(0))
        emit(planner.reconcile(result))
        if check:
            planner.check_integrity()
        trace.steps += 1
        tick += 1
        assert tick < max_steps, "no progress"
    return trace, planner, ex
