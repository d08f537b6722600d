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

from .fp8 import Fp8Weight
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
        h = silu_and_mul_ref(_expert_linear(x[rows], w13, e))
        out.index_add_(0, rows, _expert_linear(h, w2, e).float() * weights[rows, slot, None])
    return out.to(x.dtype)


def _expert_linear(x: torch.Tensor, w, e: int) -> torch.Tensor:
    """``F.linear(x, w[e])``; for an FP8 stack (:class:`kernels.fp8.Fp8Weight`) W8A16 as the kernels compute it:
    float32 sums of x against the e4m3 values, scaled per row, rounded once to x's dtype."""
    if isinstance(w, Fp8Weight):
        return ((x.float() @ w.data[e].float().T) * w.scale[e]).to(x.dtype)
    return F.linear(x, w[e])


def align_blocks(n: int, num_experts: int, block_m: int) -> int:
    """Blocks of ``block_m`` slots that ``n`` pairs grouped by expert can need: every used expert's group one short
    of a full block (the worst case, from the shapes alone)."""
    return -(-(n + min(n, num_experts) * (block_m - 1)) // block_m)


def align_by_expert_ref(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.moe_align.align_by_expert` (the grouped form's pairs grouped by expert, padded to
    ``block_m``) in torch ops: about fifteen launches where the kernel is one."""
    flat = ids.reshape(-1)
    n = flat.numel()
    num_blocks = align_blocks(n, num_experts, block_m)
    size = num_blocks * block_m
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)  # the last: pairs held elsewhere
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    group_start = torch.cat([ends - padded, ends.new_full((1,), size)])
    order = torch.argsort(flat, stable=True)  # pair indices sorted by expert
    sorted_experts = flat.index_select(0, order)
    first_sorted = torch.cumsum(counts, 0) - counts  # each expert's first position among the sorted pairs
    rank = torch.arange(n, device=ids.device) - first_sorted.index_select(0, sorted_experts)
    dest = (group_start.index_select(0, sorted_experts) + rank).clamp_(max=size)  # held elsewhere: one spare slot
    pairs = torch.full((size + 1,), n, dtype=torch.int32, device=ids.device)
    pairs.scatter_(0, dest, order.to(torch.int32))
    pairs = pairs[:size]
    block_starts = torch.arange(num_blocks, device=ids.device, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return pairs, block_expert
