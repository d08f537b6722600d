"""Start-up tuning of the linears: cuBLAS or the Triton skinny matmul, per (shape, batch size).

:func:`tune_linears` times both on the model's own weights, on this GPU, and
returns the choice :class:`executor_proc.backends.triton_backend.TritonBackend`
keys its ``linear`` by; :func:`tune_prologues` then times, at batch 1, the norm or
SiLU-mul and the (already tuned) matmul as two launches against the fused
:func:`kernels.gemv.gemv_prologue`, and returns where the fused one wins.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from executor_proc.backends.base import NormInput
from kernels import gemv as skinny


def _weight_groups(model) -> dict[tuple[int, int], list[torch.Tensor]]:
    """The model's decode-time weights by shape (each group is streamed layer after layer, as in a step)."""
    groups: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for w in (attn.qkv.weight, attn.o_proj.weight, mlp.gate_up.weight, mlp.down_proj.weight):
            groups[tuple(w.shape)].append(w)
    groups[tuple(model.lm_head.weight.shape)].append(model.lm_head.weight)
    return groups


def tune_linears(model, ms: list[int], reps: int = 5, margin: float = 0.97) -> tuple[dict, dict]:
    """Time cuBLAS and every fitting :data:`kernels.gemv.CONFIGS` on the model's weights; keep the
    skinny kernel where it is faster by more than ``1 - margin``.  Returns (choice, ms per pass).

    Each candidate streams all the weights of one shape (more than L2 holds, as in a real step),
    captured in a CUDA graph so that launch overhead does not count; the median of ``reps``
    passes counts.  A config that fails to compile is skipped.
    """
    choice, timings = {}, {}
    for (n, k), weights in _weight_groups(model).items():
        for m in ms:
            x = torch.randn(m, k, dtype=weights[0].dtype, device=weights[0].device)
            best_t, best = _time_pass(lambda w: F.linear(x, w), weights, reps) * margin, None
            timings[(n, k, m, "cublas")] = best_t / margin
            for config in [c for c in skinny.CONFIGS if skinny.config_fits(c, m)]:
                try:
                    t = _time_pass(lambda w: skinny.gemv(x, w, config=config), weights, reps)
                except Exception:  # a config this GPU or Triton cannot build is simply not a candidate
                    continue
                timings[(n, k, m, config)] = t
                if t < best_t:
                    best_t, best = t, config
            if best is not None:
                choice[(n, k, m)] = best
    return choice, timings


def tune_prologues(backend, model, reps: int = 5, margin: float = 0.97) -> tuple[dict, dict]:
    """For q|k|v and gate|up (after a norm with its residual add) and down (after SiLU-mul), at one
    token: time ``backend``'s two-launch path against every "row" config of the fused matmul, keep the
    fused one where it is faster by more than ``1 - margin``.  Returns (choice, ms per pass) keyed by
    ``(kind, N, K)``.  ``backend.gemv_choice`` must already be tuned (the two-launch path uses it)."""
    layers = model.model.layers
    groups = {("norm", *w.shape): [] for w in (layers[0].self_attn.qkv.weight, layers[0].mlp.gate_up.weight)}
    for layer in layers:
        for kind, w in (("norm", layer.self_attn.qkv.weight), ("norm", layer.mlp.gate_up.weight),
                        ("silu", layer.mlp.down_proj.weight)):
            groups.setdefault((kind, *w.shape), []).append(w)
    choice, timings = {}, {}
    saved = backend.prologue_everywhere
    try:
        for (kind, n, k), weights in groups.items():
            w0 = weights[0]
            x = torch.randn(1, 2 * k if kind == "silu" else k, dtype=w0.dtype, device=w0.device)
            pre = NormInput(x, torch.randn_like(x), torch.ones(k, dtype=w0.dtype, device=w0.device), 1e-5)
            run = (lambda w: backend.silu_linear(x, w, None)) if kind == "silu" else (lambda w: backend.norm_linear(pre, w, None))
            backend.prologue_everywhere = None
            best_t, best = _time_pass(run, weights, reps) * margin, None
            timings[(kind, n, k, "two launches")] = best_t / margin
            for config in [c for c in skinny.CONFIGS if c[0] == "row"]:
                backend.prologue_everywhere = config
                try:
                    t = _time_pass(run, weights, reps)
                except Exception:  # a config this GPU or Triton cannot build is simply not a candidate
                    continue
                timings[(kind, n, k, config)] = t
                if t < best_t:
                    best_t, best = t, config
            if best is not None:
                choice[(kind, n, k)] = best
    finally:
        backend.prologue_everywhere = saved
    return choice, timings


def _time_pass(fn, weights: list[torch.Tensor], reps: int) -> float:
    """Median ms of one pass over ``weights``, replayed as a CUDA graph (as in a decode step: no launch gaps)."""
    for w in weights[:2]:
        fn(w)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]
