"""Start-up tuning of the linears: cuBLAS or a Triton matmul, per (shape, batch size).

:func:`tune_linears` times cuBLAS against the skinny matmul (batch <= 16) on the
model's own weights, on this GPU, and :func:`tune_matmuls` against the tiled
matmul of :mod:`kernels.matmul` (larger decode batches: at 64 rows it streams
gate|up and the LM head a few percent faster than cuBLAS on an H100); they return
the choices :class:`executor_proc.backends.triton_backend.TritonBackend` keys its
``linear`` by; :func:`tune_prologues` then times, at one to sixteen tokens, the chains
around the (already tuned) matmuls op by op against the fused kernels
(:func:`kernels.gemv_row.gemv_prologue`, :func:`kernels.gemv.gemv_silu`,
:func:`kernels.gemv_qkv.qkv_rope`), and returns where the fused one wins.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F

from executor_proc.backends.base import NormInput, split_heads
from executor_proc.backends.moe_tuning import moe_choices, moe_runs
from executor_proc.backends.triton_linears import FP8_GEMV_DEFAULT, ONE_TOKEN_KINDS, skinny_rows
from kernels import gemv as skinny
from kernels.gemv_partials import sumsq_fits, sumsq_programs
from kernels.capture import capturing
from kernels.fp8 import Fp8Weight
from kernels.matmul_fp8 import FP8_MATMUL_CONFIGS, Fp8MatmulConfig, w8a8_linear
from kernels.gemv_qkv import qkv_rope, rope_pairs
from kernels.matmul import MatmulConfig, invariant_matmul
from kernels.precompile import STAGE as COMPILE_STAGE, Compiles, compiled_ahead

# Tiled-matmul candidates for decode batches above 8 (the best of the H100 sweep at 64 rows,
# a sweep of matmul configs per weight): wide tiles for wide weights, narrow tiles with deep pipelines
# (more programs in flight) and a split of K for the narrow ones.
MATMUL_CANDIDATES = (MatmulConfig(128, 128, 4, 3, 1), MatmulConfig(128, 128, 8, 3, 1),
                     MatmulConfig(64, 128, 4, 5, 1), MatmulConfig(128, 128, 4, 4, 1),
                     MatmulConfig(32, 128, 4, 6, 1), MatmulConfig(64, 64, 4, 8, 1),
                     MatmulConfig(32, 256, 4, 4, 1), MatmulConfig(64, 128, 4, 4, 2))


@dataclass
class TuneJob:
    """One choice: ``baseline = (name, fn)`` against ``candidates = [(config, fn), ...]``, each fn taking one of
    ``weights`` (a pass streams them all); a config wins below ``margin`` times the baseline's time."""

    key: tuple
    baseline: tuple
    candidates: list
    weights: list
    margin: float


def _weight_groups(model) -> dict[tuple[int, int], list[torch.Tensor]]:
    """The model's decode-time weights by shape (each group is streamed layer after layer, as in a step).  Where an
    FP8 checkpoint leaves some projections of a shape float, the group is the shape's more numerous kind (FP8 on a
    tie): the choices are keyed by shape, and the other kind's weights run them too (every config serves both)."""
    groups: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
    for layer in model.model.layers:
        for w in (layer.self_attn.qkv.weight, layer.self_attn.o.weight, *_mlp_weights(layer), *_moe_linears(layer)):
            groups[tuple(w.shape)].append(w)
    groups[tuple(model.lm_head.weight.shape)].append(model.lm_head.weight)
    for shape, weights in groups.items():
        fp8 = [w for w in weights if isinstance(w, Fp8Weight)]
        if fp8 and len(fp8) != len(weights):
            groups[shape] = fp8 if 2 * len(fp8) >= len(weights) else [w for w in weights
                                                                       if not isinstance(w, Fp8Weight)]
    return groups


def _mlp_weights(layer) -> tuple:
    """A dense layer's (gate|up, down) weights; () for a mixture-of-experts layer (its experts run
    :mod:`kernels.moe`, not these kernels)."""
    mlp = layer.mlp
    return (mlp.gate_up.weight, mlp.down.weight) if getattr(mlp, "gate_up", None) is not None else ()


def _moe_linears(layer) -> tuple:
    """A mixture-of-experts layer's ordinary linears: the router, and a shared expert's gate|up and down (the
    shared expert's one-row gate stays with cuBLAS)."""
    block = layer.mlp
    if getattr(block, "w13", None) is None:
        return ()
    shared = block.shared_expert
    return (block.gate.weight, *((shared.gate_up.weight, shared.down.weight) if shared is not None else ()))


ProgressCallback = Callable[[str, int, int], None]  # (stage, done, total), as the executor reports its load


def _quiet(stage: str, done: int, total: int) -> None:
    pass


# The skinny kernel's margin over cuBLAS: within 2% counts as a win. The tuner's pass overlaps each Triton
# matmul with the next one of its kind (PDL, kernels/pdl.py); in a step it also overlaps with its neighbours
# (norms, attention, rotary), while a cuBLAS call ends the chain on both sides.
SKINNY_MARGIN = 1.02
# The start-up's progress stages, one per tuning phase.
SKINNY_STAGE, TILED_STAGE, FUSED_STAGE = "tuning skinny matmuls", "tuning tiled matmuls", "tuning fused kernels"
MOE_STAGE = "tuning expert kernels"


def tune_linears(model, ms: list[int], reps: int = 5, margin: float = SKINNY_MARGIN,
                 progress: ProgressCallback = _quiet) -> tuple[dict, dict]:
    """Time cuBLAS and every fitting :data:`kernels.gemv.CONFIGS` on the model's weights; keep the
    skinny kernel where it takes less than ``margin`` times cuBLAS's time.  Returns (choice, ms per pass).

    Each candidate streams all the weights of one shape (more than L2 holds, as in a real step),
    captured in a CUDA graph so that launch overhead does not count; the median of ``reps``
    passes counts.  A config that fails to compile is skipped.  ``progress(stage, done, total)``: the kernels
    compiled (:data:`kernels.precompile.STAGE`), then the shapes and sizes timed ("tuning skinny matmuls").
    """
    return _tune_alone(linear_jobs(model, ms, margin), SKINNY_STAGE, reps, progress)


def linear_jobs(model, ms: list[int], margin: float = SKINNY_MARGIN) -> list[TuneJob]:
    """:func:`tune_linears`' jobs: per weight shape and batch size, cuBLAS against the fitting skinny configs."""
    jobs = []
    for (n, k), weights in _weight_groups(model).items():
        for m in (m for m in ms if m <= skinny_rows(weights[0])):
            x = torch.randn(m, k, dtype=weights[0].dtype, device=weights[0].device)
            fp8 = isinstance(weights[0], Fp8Weight)
            candidates = [(c, lambda w, c=c, x=x: skinny.gemv(x, w, config=c))
                          for c in skinny.CONFIGS + (skinny.FP8_CONFIGS if fp8 else ()) if skinny.config_fits(c, m)]
            if fp8:  # no cuBLAS W8A16: against the untuned default, any faster wins
                default = FP8_GEMV_DEFAULT[m == 1]
                baseline = ("default", lambda w, x=x: skinny.gemv(x, w, config=default))
                jobs.append(TuneJob((n, k, m), baseline, candidates, weights, 1.0))
                continue
            jobs.append(TuneJob((n, k, m), ("cublas", lambda w, x=x: F.linear(x, w)), candidates, weights, margin))
    return jobs


def tune_matmuls(model, ms: list[int], reps: int = 5, margin: float = 0.97,
                 progress: ProgressCallback = _quiet) -> tuple[dict, dict]:
    """As :func:`tune_linears` for batch sizes above 8: cuBLAS against :data:`MATMUL_CANDIDATES` of the
    tiled matmul; returns (choice, ms per pass) keyed by ``(N, K, m)``."""
    return _tune_alone(matmul_jobs(model, ms, margin), TILED_STAGE, reps, progress)


def matmul_jobs(model, ms: list[int], margin: float = 0.97) -> list[TuneJob]:
    """:func:`tune_matmuls`' jobs: per weight shape and batch size, cuBLAS against the tiled matmul's candidates."""
    jobs = []
    for (n, k), weights in _weight_groups(model).items():
        for m in ms:
            x = torch.randn(m, k, dtype=weights[0].dtype, device=weights[0].device)
            if isinstance(weights[0], Fp8Weight):  # W8A8: cuBLASLt against the Triton FP8 kernel
                candidates = [(c, lambda w, c=c, x=x: w8a8_linear(x, w, config=c)) for c in FP8_MATMUL_CONFIGS]
                jobs.append(TuneJob((n, k, m), ("cublas", lambda w, x=x: w8a8_linear(x, w)), candidates, weights,
                                    margin))
                continue
            candidates = [(c, lambda w, c=c, x=x: invariant_matmul(x, w, config=c)) for c in MATMUL_CANDIDATES]
            jobs.append(TuneJob((n, k, m), ("cublas", lambda w, x=x: F.linear(x, w)), candidates, weights, margin))
    return jobs


def tune_prologues(backend, model, ms: tuple[int, ...] = (1,), reps: int = 5, margin: float = 0.97,
                   few: int = 3, progress: ProgressCallback = _quiet) -> tuple[dict, dict]:
    """Time the fused kernels against the ops one by one on the model's weights and keep a fused one where
    it is faster by more than ``1 - margin`` (at 2-16 tokens: where it is within :data:`SKINNY_MARGIN`).  At one
    token (``1 in ms``), through ``backend``'s own chains:
    the attention input (norm -> q|k|v -> rotary -> cache write: "qkv"), gate|up after the norm ("norm")
    and down after SiLU-mul ("silu"), every "row" config.  At the other ``ms`` (2-16 tokens), the
    epilogues (with the norm from partial sums where the norms are folded, against a chain with the norm's
    launch; otherwise alone: the norm before them is the same launch either way): q|k|v with the rotary and cache
    write ("rope": the ``few`` "row" and "dot" configs with rotary pairs that streamed the weight fastest in
    :func:`tune_linears`, per ``backend.gemv_timings``) and gate|up with SiLU-mul ("gate_silu": the
    ``few`` fastest "dot" configs), so that start-up compiles a few kernels per size, not all.
    Returns (choice, ms per pass) keyed by ``(kind, N, K, m)``.  ``backend.gemv_choice`` must already be
    tuned (the unfused chains use it)."""
    saved = backend.prologue_everywhere
    try:
        return _tune_alone(prologue_jobs(backend, model, ms, margin, few), FUSED_STAGE, reps, progress)
    finally:
        backend.prologue_everywhere = saved


def prologue_jobs(backend, model, ms: tuple[int, ...] = (1,), margin: float = 0.97, few: int = 3) -> list[TuneJob]:
    """:func:`tune_prologues`' jobs (its runs force ``backend.prologue_everywhere``: restore it after them)."""
    cfg, layers = model.config, model.model.layers
    groups: dict[tuple[str, int, int], list[torch.Tensor]] = defaultdict(list)
    for layer in layers:
        qkv = layer.self_attn.qkv.weight
        if layer.self_attn.q_norm is None:
            groups[("qkv", *qkv.shape)].append(qkv)
            groups[("rope", *qkv.shape)].append(qkv)
        else:  # q/k norms sit between the matmul and the rotary: only the input norm folds into q|k|v
            groups[("norm", *qkv.shape)].append(qkv)
        if not _mlp_weights(layer):
            continue
        gate_up, down = _mlp_weights(layer)
        groups[("norm", *gate_up.shape)].append(gate_up)
        groups[("gate_silu", *gate_up.shape)].append(gate_up)
        groups[("silu", *down.shape)].append(down)
    # an epilogue within 2% of the unfused chain wins: it saves a launch, which in a step costs more than in
    # this pass (there its neighbours are attention and the residual matmuls)
    return [TuneJob((kind, n, k, m), *_fused_runs(backend, kind, n, k, m, weights[0], cfg, few), weights,
                    margin if m == 1 else SKINNY_MARGIN)
            for (kind, n, k), weights in groups.items() for m in ms
            if (m == 1) == (kind in ONE_TOKEN_KINDS) and m <= skinny_rows(weights[0])]


def _fused_runs(backend, kind: str, n: int, k: int, m: int, w0: torch.Tensor, cfg, few: int):
    """``(("unfused", fn), [(config, fn), ...])`` for :func:`tune_prologues`: each fn takes one weight."""
    x = torch.randn(m, 2 * k if kind == "silu" else k, dtype=w0.dtype, device=w0.device)
    pre = NormInput(x, torch.randn_like(x), torch.ones(k, dtype=w0.dtype, device=w0.device), 1e-5)
    cache = torch.zeros(4, 16, cfg.num_kv_heads, cfg.head_dim, dtype=w0.dtype, device=w0.device)
    plan = SimpleNamespace(positions=torch.arange(5, 5 + m, device=w0.device),
                           kv_index=torch.arange(3, 3 + m, device=w0.device))
    if kind in ONE_TOKEN_KINDS:  # the backend's own chain, its fused kernel forced on or off
        run = {"silu": lambda w: backend.silu_linear(x, w, None),
               "norm": lambda w: backend.norm_linear(pre, w, None),
               "qkv": lambda w: backend.qkv_rotate_store(pre, w, None, cache, cache, plan)}[kind]
        fp8 = skinny.FP8_CONFIGS if isinstance(w0, Fp8Weight) else ()
        configs = [c for c in skinny.CONFIGS + fp8 if c[0] == "row" and (kind != "qkv" or rope_pairs(c, cfg.head_dim))]
        return ("unfused", _forcing(backend, {}, run)), [(c, _forcing(backend, {kind: c}, run)) for c in configs]
    # With the norms folded x is the residual stream after an output projection's epilogue (down before q|k|v,
    # o before gate|up): both sides take the norm from its partial sums (TritonBackend.project_out), the unfused
    # side as the backend does (in a "dot" matmul, else the norm's launch).
    producer = (k, cfg.intermediate_size) if kind == "rope" else (k, cfg.num_heads * cfg.head_dim)
    sumsq = _partial_sums(backend, producer, m) if backend.norms_folded else None
    stream = NormInput(x, None, pre.weight, sumsq[1], sumsq[0]) if sumsq is not None else None
    if kind == "rope":
        configs = [c for c in skinny.CONFIGS
                   if c[0] in ("row", "dot") and skinny.config_fits(c, m) and rope_pairs(c, cfg.head_dim)]
        rope = dict(positions=plan.positions, cos_sin_cache=backend.cos_sin, k_cache=cache, v_cache=cache,
                    kv_index=plan.kv_index, sumsq=sumsq)
        def unfused(w):
            if stream is not None:
                return backend.qkv_rotate_store(stream, w, None, cache, cache, plan)
            q, k, v = split_heads(backend.linear(x, w, None), cfg.num_kv_heads, cfg.head_dim)
            return backend.rotate_and_store(q, k, v, cache, cache, plan)
        fused = lambda c: lambda w: qkv_rope(x, w, None, config=c, norm=None, residual=None, **rope)  # noqa: E731
    else:  # gate_silu
        configs = [c for c in skinny.CONFIGS if c[0] in ("dot", "dotT")]
        gate_up = (lambda w: backend.norm_linear(stream, w, None)[0]) if stream is not None else (  # noqa: E731
            lambda w: backend.linear(x, w, None))
        unfused = lambda w: backend.silu_and_mul(gate_up(w))  # noqa: E731
        fused = lambda c: lambda w: skinny.gemv_silu(x, w, None, config=c, sumsq=sumsq)  # noqa: E731
    timed = {c: backend.gemv_timings[(n, k, m, c)] for c in configs if (n, k, m, c) in backend.gemv_timings}
    configs = sorted(timed, key=timed.get)[:few] if timed else configs
    return ("unfused", _forcing(backend, {}, unfused)), [(c, _forcing(backend, {kind: c}, fused(c))) for c in configs]


def _partial_sums(backend, producer: tuple[int, int], m: int) -> tuple[torch.Tensor, float]:
    """Partial sums of squares as the output projection of shape ``producer`` leaves them at ``m`` tokens (one per
    program of its tuned kernel, so that the kernels timed are the ones the graphs will run; 128 where cuBLAS
    serves it), for timing the kernels that read them."""
    config = backend.gemv_choice.get((*producer, m))
    fits = config is not None and sumsq_fits(config, producer[0], m)
    return torch.ones(sumsq_programs(config, producer[0]) if fits else 128, m, device=backend.device), 1e-5


def _forcing(backend, forced: dict, run):
    """``run`` with ``backend``'s fused kernels forced to ``forced`` ({kind: config}; {}: all off) while it runs
    (the epilogue kinds' runs call their kernels directly: there it only names the candidate)."""
    def fn(w):
        backend.prologue_everywhere = forced
        return run(w)
    return fn


class TunePhase:
    """Jobs whose kernels start compiling at once (``ahead``: :func:`kernels.precompile.compiled_ahead`; a
    pass that records each job's launches), timed by :meth:`pick`, each job when its own kernels are ready."""

    def __init__(self, jobs: list[TuneJob], ahead: Compiles):
        self.jobs, self.ahead = jobs, ahead
        self.needs = [ahead.record(lambda job=job: _run_once(job)) for job in jobs]

    def pick(self, stage: str, progress: ProgressCallback = _quiet, reps: int = 5) -> tuple[dict, dict]:
        """:func:`_pick` for each job; (choice, ms per pass) keyed as :func:`tune_linears`' are.  ``progress``:
        the jobs timed (``stage``), and the compiles while a job waits for its kernels."""
        choice, timings = {}, {}
        if not self.jobs:  # e.g. no batch above 8 to tune for: no stage to show
            return choice, timings
        for done, (job, needs) in enumerate(zip(self.jobs, self.needs)):
            self.ahead.wait(needs)
            progress(stage, done, len(self.jobs))
            best = _pick(job.key, job.baseline, job.candidates, job.weights, reps, job.margin, timings)
            if best is not None:
                choice[job.key] = best
        progress(stage, len(self.jobs), len(self.jobs))
        return choice, timings


def _run_once(job: TuneJob) -> None:
    for _, fn in (job.baseline, *job.candidates):
        with contextlib.suppress(Exception):  # a candidate that fails is no candidate (_pick)
            fn(job.weights[0])


def _compiles(progress: ProgressCallback):
    return compiled_ahead(progress=lambda done, total: progress(COMPILE_STAGE, done, total))


def _tune_alone(jobs: list[TuneJob], stage: str, reps: int, progress: ProgressCallback) -> tuple[dict, dict]:
    with _compiles(progress) as ahead:
        return TunePhase(jobs, ahead).pick(stage, progress, reps)


def tune_all(backend, model, small: list[int], wide: list[int], progress: ProgressCallback = _quiet) -> None:
    """The start-up's tuning, into ``backend``: :func:`tune_linears` at the ``small`` batch sizes,
    :func:`tune_matmuls` at the ``wide`` ones, then :func:`tune_prologues` at the small ones, then the MoE
    layers' tiles at all (:func:`moe_jobs`; none for a dense model).  One compile pool for all: the skinny,
    tiled and MoE phases' kernels are recorded up front and the fused kernels' as soon as the skinny picks are
    known (their candidates and unfused chains depend on them), so each phase's timing overlaps the compiles of
    what comes after it."""
    saved = backend.prologue_everywhere
    try:
        with _compiles(progress) as ahead:
            skinny_phase, tiled_phase = TunePhase(linear_jobs(model, small), ahead), TunePhase(
                matmul_jobs(model, wide), ahead)
            backend.gemv_choice, backend.gemv_timings = skinny_phase.pick(SKINNY_STAGE, progress)
            moe_phase = TunePhase(moe_jobs(model, sorted(set(small + wide))), ahead)
            fused_phase = TunePhase(prologue_jobs(backend, model, tuple(small)), ahead)
            tiled, matmul_timings = tiled_phase.pick(TILED_STAGE, progress)
            _keep_faster(backend.gemv_choice, backend.gemv_timings, tiled, matmul_timings)
            backend.matmul_choice = {key: c for key, c in tiled.items() if not isinstance(c, Fp8MatmulConfig)}
            backend.fp8_matmul_choice = {key: c for key, c in tiled.items() if isinstance(c, Fp8MatmulConfig)}
            backend.gemv_timings.update(matmul_timings)
            backend.prologue_choice, backend.prologue_timings = fused_phase.pick(FUSED_STAGE, progress)
            moe_choice, moe_timings = moe_phase.pick(MOE_STAGE, progress)
            backend.moe_small_choice, backend.moe_grouped_choice = moe_choices(moe_choice)
            backend.moe_timings = moe_timings
    finally:
        backend.prologue_everywhere = saved


def _keep_faster(skinny_choice: dict, skinny_timings: dict, tiled_choice: dict, tiled_timings: dict) -> None:
    """Where a size has both a skinny pick (16 rows: the "dot" forms) and a tiled one, drop the skinny pick if the
    tiled matmul streams the weight faster by more than :data:`SKINNY_MARGIN` (the backend takes a skinny pick
    first; a tie goes to it, whose epilogues save launches), else the tiled pick."""
    for key in [key for key in skinny_choice if key in tiled_choice]:
        skinny_ms = skinny_timings[(*key, skinny_choice[key])]
        if skinny_ms > tiled_timings[(*key, tiled_choice[key])] * SKINNY_MARGIN:
            del skinny_choice[key]
        else:
            del tiled_choice[key]


def moe_jobs(model, ms: list[int]) -> list[TuneJob]:
    """The fused MoE kernels' tiles (:mod:`executor_proc.backends.moe_tuning`): any candidate faster than the
    default tiles wins."""
    return [TuneJob(key, baseline, candidates, layers, 1.0)
            for key, baseline, candidates, layers in moe_runs(model, ms)]


def _pick(key: tuple, baseline: tuple, candidates: list, weights: list[torch.Tensor], reps: int, margin: float,
          timings: dict):
    """Time ``baseline = (name, fn)`` and every ``(config, fn)`` over ``weights``, recording each under
    ``(*key, name or config)``; the fastest config if it takes less than ``margin`` times the baseline,
    else None.  A config that fails to build (on this GPU or Triton) is simply not a candidate."""
    name, fn = baseline
    best_t, best = _time_pass(fn, weights, reps) * margin, None
    timings[(*key, name)] = best_t / margin
    for config, fn in candidates:
        try:
            t = _time_pass(fn, weights, reps)
        except Exception:
            continue
        timings[(*key, config)] = t
        if t < best_t:
            best_t, best = t, config
    return best


def _time_pass(fn, weights: list[torch.Tensor], reps: int) -> float:
    """Median ms of one pass over ``weights``, replayed as a CUDA graph (as in a decode step: no launch gaps).
    The events that time it are inside the graph, so the host's pace (other threads compiling, the GIL) does
    not count."""
    for w in weights[:2]:
        fn(w)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    start, end = _timing_events()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, weights[0].device):
        if start.external:
            start.record()
        for w in weights:
            fn(w)
        if end.external:
            end.record()
    graph.replay()
    times = []
    for _ in range(reps):
        if not start.external:
            start.record()
        graph.replay()
        if not end.external:
            end.record()
        torch.cuda.current_stream().synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def _timing_events() -> tuple:
    """Two timing events, recorded inside a graph where torch can (``external``, torch >= 2.8), else around
    its replay; each carries ``external``."""
    try:
        events = (torch.cuda.Event(enable_timing=True, external=True),
                  torch.cuda.Event(enable_timing=True, external=True))
        external = True
    except TypeError:
        events, external = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)), False
    for e in events:
        e.external = external
    return events


def tuner_report(backend) -> dict:
    """What the start-up tuner measured and picked, JSON-ready: per weight shape and batch, cuBLAS's time per
    pass over the layers, the best Triton config's (skinny GEMV up to 8 rows, tiled matmul above) and the pick;
    per fused kind, the unfused chain's time, the best fused config's and the pick (none: unfused)."""
    report: dict = {}
    for (n, k, m, what), ms in getattr(backend, "gemv_timings", {}).items():
        row = report.setdefault(f"{n}x{k} m={m}", {"cublas_ms": None, "best_gemv_ms": None, "best_gemv": None})
        if what == "cublas":
            row["cublas_ms"] = ms
        elif row["best_gemv_ms"] is None or ms < row["best_gemv_ms"]:
            row["best_gemv_ms"], row["best_gemv"] = ms, list(what)
    choices = {**getattr(backend, "gemv_choice", {}), **getattr(backend, "matmul_choice", {}),
               **getattr(backend, "fp8_matmul_choice", {})}
    for (n, k, m), config in choices.items():
        report.setdefault(f"{n}x{k} m={m}", {})["chosen"] = list(config)
    for (kind, n, k, m, what), ms in getattr(backend, "prologue_timings", {}).items():
        row = report.setdefault(f"{kind}+{n}x{k} m={m}", {"unfused_ms": None, "best_fused_ms": None})
        if what == "unfused":
            row["unfused_ms"] = ms
        elif row["best_fused_ms"] is None or ms < row["best_fused_ms"]:
            row["best_fused_ms"], row["best_fused"] = ms, list(what)
    for (kind, n, k, m), config in getattr(backend, "prologue_choice", {}).items():
        report.setdefault(f"{kind}+{n}x{k} m={m}", {})["chosen"] = list(config)
    for (kind, e, i, h, m, what), ms in getattr(backend, "moe_timings", {}).items():
        row = report.setdefault(f"{kind} E={e} I={i} H={h} m={m}", {"default_ms": None, "best_ms": None})
        if what == "default":
            row["default_ms"] = ms
        elif row["best_ms"] is None or ms < row["best_ms"]:
            row["best_ms"], row["best"] = ms, list(what)
    return report
