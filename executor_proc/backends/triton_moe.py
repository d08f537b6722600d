"""The mixture-of-experts layer on the Triton kernels (the Triton backend's MoE half).

``moe_front`` runs an MoE layer's post-attention norm, router and routing in one launch at 1-4 tokens
(:func:`kernels.moe_route.norm_route`); ``moe`` routes in one launch where that did not (:mod:`kernels.moe_route`)
and runs :func:`kernels.moe.fused_moe`: per (token, expert) pair up to a few dozen pairs (at every size when
batch-invariant), a grouped GEMM over the experts' blocks above, on the start-up tuner's tiles
(:mod:`executor_proc.backends.moe_tuning`).
"""

from __future__ import annotations

from typing import Optional

import torch

from executor_proc.backends.base import MoEFront, NormInput, unfused_moe_front
from executor_proc.backends.triton_linears import m_bucket
from kernels.moe import MoEConfig, SmallConfig, fused_moe, fused_moe_small
from kernels.moe_ref import route_held
from kernels.moe_route import NORM_ROUTE_MAX_TOKENS, norm_route, norm_routes_here, route, routes_here

__all__ = ["TritonMoE"]


class TritonMoE:
    """The MoE ops; the start-up tuner fills the tile tables (absent: the default tiles)."""

    batch_invariant: bool

    def __init__(self, device: torch.device) -> None:
        # (E, I, H, m_bucket) -> per-pair form's SmallConfig / grouped form's MoEConfig; absent: the defaults
        self.moe_small_choice: dict[tuple[int, int, int, int], SmallConfig] = {}
        self.moe_grouped_choice: dict[tuple[int, int, int, int], MoEConfig] = {}
        self.moe_timings: dict = {}
        # the norm, router and routing in one launch at 1-4 tokens: each token's arrival counter
        self.route_arrivals = torch.zeros(NORM_ROUTE_MAX_TOKENS, dtype=torch.int32, device=device)

    def moe_front(self, pre: NormInput, gate: torch.Tensor, top_k: int, renormalize: bool, first_expert: int,
                  num_held: int) -> MoEFront:
        """At 1-4 tokens the norm, the router and the routing in one launch (:func:`kernels.moe_route.norm_route`:
        two launches a layer fewer); else (and batch-invariant, whose router is the invariant matmul) the norm and
        the router's linear."""
        if self.batch_invariant or not norm_routes_here(pre.x, gate, top_k):
            return unfused_moe_front(self, pre, gate)
        h, residual, logits, weights, ids = norm_route(pre.x.contiguous(), pre.residual, pre.weight, pre.eps, gate,
                                                       top_k, renormalize, self.route_arrivals, first_expert, num_held)
        return MoEFront(h, residual, logits, (weights, ids))

    def moe(self, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
            renormalize: bool, first_expert: int = 0,
            routing: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """Routing in one launch (:mod:`kernels.moe_route`, where it takes the config; none where ``routing`` is
        made), then the fused experts with the tuner's tiles for this stack and size.  Batch-invariant: the
        per-pair form at every size, on the default tiles (each pair and each token's sum computed alone, in one
        order, whatever else the step holds)."""
        held, num_experts = w13.shape[0], router_logits.shape[-1]
        if routing is not None:
            weights, ids = routing
        elif routes_here(num_experts, top_k):
            weights, ids = route(router_logits, top_k, renormalize, first_expert, held)
        else:
            weights, ids = route_held(router_logits, top_k, renormalize, first_expert, held)
        if self.batch_invariant:
            return fused_moe_small(x.contiguous(), w13, w2, weights, ids)
        key = (held, w2.shape[2], w2.shape[1], m_bucket(x.shape[0]))
        return fused_moe(x.contiguous(), w13, w2, weights, ids, partial=held < num_experts,
                         small=self.moe_small_choice.get(key), grouped=self.moe_grouped_choice.get(key))
