"""What the start-up tuner times for mixture-of-experts layers: the fused kernels' tiles per expert shape and size.

The experts' weights stream through :mod:`kernels.moe`, not the dense linears' kernels, so they get their own
candidates: per ``(E, I, H)`` stack shape and batch size ``m`` (the decode graphs' buckets), the per-pair
form's gate|up launch against :data:`kernels.moe.UP_CANDIDATES` and its down launch against
:data:`kernels.moe.DOWN_CANDIDATES`, each alone (their tiles are independent), while ``m * k`` pairs stay
within :data:`kernels.moe.SMALL_MAX_PAIRS`; above, the whole grouped form against
:data:`kernels.moe.GROUPED_CANDIDATES`.  Each pass streams every MoE layer's stacks with a fixed random routing
(``k`` distinct experts a token), as a step reads them.  :func:`executor_proc.backends.gemv_tuning.tune_all`
times these runs with the linears' and keeps a candidate that beats the default tiles.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch

from kernels import moe as fused


class Experts(NamedTuple):
    """One layer's stacked experts, as a tuning pass takes them (``device``: where the pass runs)."""

    w13: torch.Tensor  # or an FP8 stack (kernels.fp8.Fp8Weight), as the layer serves it
    w2: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.w13.device


def _expert_groups(model) -> dict[tuple[int, int, int, int], list[Experts]]:
    """``(E, I, H, k)`` -> every MoE layer's stacks of that shape."""
    groups: dict[tuple[int, int, int, int], list[Experts]] = defaultdict(list)
    for layer in model.model.layers:
        block = layer.mlp
        if getattr(block, "w13", None) is not None:
            E, H, I = block.w2.shape
            groups[(E, I, H, block.top_k)].append(Experts(*block.expert_stacks()))
    return groups


def _routing(m: int, k: int, E: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed routing of ``m`` tokens to ``k`` distinct experts each: (weights [m, k] float32, ids [m, k]).  A
    rank holding fewer than k experts (expert parallelism) gets each of them and id ``E`` (held elsewhere) for
    the rest, as the routing gives it."""
    g = torch.Generator().manual_seed(m)
    held = torch.full((max(0, k - E),), E, dtype=torch.int64)
    ids = torch.stack([torch.cat([torch.randperm(E, generator=g)[:k], held]) for _ in range(m)])
    weights = torch.softmax(torch.randn(m, k, generator=g), dim=-1)
    return weights.to(device), ids.to(device)


def moe_runs(model, ms: list[int]) -> list[tuple]:
    """``(key, baseline, candidates, weights)`` per MoE stack shape and size in ``ms``: ``("moe_up" | "moe_down" |
    "moe_grouped", E, I, H, m)``, the default tiles' run as ``("default", fn)``, ``[(config, fn), ...]``, the
    layers' :class:`Experts`."""
    runs = []
    for (E, I, H, k), layers in _expert_groups(model).items():
        first = layers[0]
        for m in ms:
            weights, ids = _routing(m, k, E, first.device)
            x = torch.randn(m, H, dtype=first.w13.dtype, device=first.device)
            if m * k <= fused.SMALL_MAX_PAIRS:
                inter = fused.moe_up_small(x, first.w13, ids, fused.SMALL_CONFIG.up)
                up = lambda c, x=x, ids=ids: lambda e: fused.moe_up_small(x, e.w13, ids, c)  # noqa: E731
                down = lambda c, i=inter, ids=ids, w=weights: lambda e: fused.moe_down_small(  # noqa: E731
                    i, e.w2, ids, w, c, i.dtype)
                for kind, make, default, candidates in (("moe_up", up, fused.SMALL_CONFIG.up, fused.UP_CANDIDATES),
                                                         ("moe_down", down, fused.SMALL_CONFIG.down,
                                                          fused.DOWN_CANDIDATES)):
                    runs.append(((kind, E, I, H, m), ("default", make(default)),
                                 [(c, make(c)) for c in candidates if c != default], layers))
                continue
            n = m * k
            grouped = lambda c, x=x, ids=ids, w=weights, n=n: lambda e: fused.fused_moe_grouped(  # noqa: E731
                x, e.w13, e.w2, w, ids, fused.grouped_config(c, n, E), partial=k > E)
            runs.append((("moe_grouped", E, I, H, m), ("default", grouped(fused.MoEConfig())),
                         [(c, grouped(c)) for c in fused.GROUPED_CANDIDATES if c != fused.MoEConfig()], layers))
    return runs


def moe_choices(choice: dict) -> tuple[dict, dict]:
    """The tuner's picks as the backend keys them: ``(E, I, H, m) -> SmallConfig`` (either launch's default tile
    where no candidate beat it) and ``(E, I, H, m) -> MoEConfig`` for the grouped form."""
    small, grouped = {}, {}
    for (kind, *shape), config in choice.items():
        key = tuple(shape)
        if kind == "moe_grouped":
            grouped[key] = config
        elif kind in ("moe_up", "moe_down"):
            tiles = small.get(key, fused.SMALL_CONFIG)
            small[key] = tiles._replace(**{kind[4:]: config})
    return small, grouped
