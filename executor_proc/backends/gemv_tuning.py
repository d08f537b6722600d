"""Start-up tuning of the linears: cuBLAS or the Triton skinny matmul, per (shape, batch size).

:func:`tune_linears` times both on the model's own weights, on this GPU, and
returns the choice :class:`executor_proc.backends.triton_backend.TritonBackend`
keys its ``linear`` by.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

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
