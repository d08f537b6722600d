"""Mixture-of-experts in plain torch: the routing both backends run, and the experts the torch backend runs.

Shapes: ``x [T, H]``; experts stacked ``w13 [E, 2I, H]`` (gate rows then up rows, as HF's fused
``gate_up_proj``) and ``w2 [E, H, I]``; router logits ``[T, E]`` (the router's linear in the model dtype).

Routing is HF's: softmax over the experts in float32, the top-k (``torch.topk``), and, where the
config says so (``norm_topk_prob``, Mixtral always), those k weights divided by their sum.  The
experts' outputs are weighted in float32 and summed in float32, rounded once at the end (HF rounds
the weights, each weighted output and the running sum to the model dtype: the same in float32).

Under expert parallelism a rank holds a contiguous range of the experts (``w13``/``w2`` stack only those):
:func:`route_held` routes over all E experts as usual, then makes the chosen ids local and gives every pair
whose expert another rank holds the id ``len(w13)`` (one past the stack) and weight 0: no expert's loop
or group takes it, so it adds nothing here, and the ranks' partial sums add up to the whole layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import silu_and_mul_ref


def route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] float32, expert ids [T, k] int64)`` for router logits ``[T, E]``.

    Torch ops only, no host read: the CUDA path runs this too, inside its CUDA graphs.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_held(router_logits: torch.Tensor, top_k: int, renormalize: bool, first_expert: int,
               num_held: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route_ref` for a holder of experts ``first_expert .. first_expert + num_held - 1`` of the router's E:
    ids local to it, and ``num_held`` (weight 0) for a pair whose expert is held elsewhere.  Holding all E, the
    routing as it is; torch ops only, no host read (its shapes are the same whatever the routing)."""
    weights, ids = route_ref(router_logits, top_k, renormalize)
    if num_held == router_logits.shape[-1]:
        return weights, ids
    local = ids - first_expert
    here = (local >= 0) & (local < num_held)
    return torch.where(here, weights, 0.0), torch.where(here, local, num_held)


def moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
            ids: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` over each token's experts ``e = ids[t, j]``,
    in x's dtype: one expert at a time over the tokens routed to it (data-dependent shapes: not for graphs).
    A pair whose id is ``len(w13)`` (its expert held elsewhere: :func:`route_held`) is taken by no expert."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        rows, slot = torch.where(ids == e)
        if rows.numel() == 0:
            continue
        h = silu_and_mul_ref(F.linear(x[rows], w13[e]))
        out.index_add_(0, rows, F.linear(h, w2[e]).float() * weights[rows, slot, None])
    return out.to(x.dtype)
