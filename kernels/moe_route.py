"""Mixture-of-experts routing in one launch: softmax over the experts, top-k, renormalise, ids made local.

:func:`kernels.moe_ref.route_held` in torch is five to seven launches a layer (the float32 cast, softmax,
topk, the sum and division of renormalising, and two ``where`` under expert parallelism), each a few
microseconds of a batch-1 step that reads only ~75 MB a layer.  Here one program per token does it all
in registers: the token's ``E`` logits (``E <= 1024``) in float32, ``k`` rounds of "take the largest,
knock it out" (ties to the lower id), the chosen softmax weights ``exp(l - max) / sum exp(l - max)``,
divided by their own sum when the config renormalises.

The choice is made on the logits, not the probabilities: softmax is monotonic, and the logits are exact
(the router's output widened to float32), so which experts a token gets never hangs on the rounding of an
exponential; the weights match torch's to a few float32 ulps.  A holder of experts ``first .. first +
num_held - 1`` (expert parallelism) gets ids local to it, and ``num_held`` with weight 0 for a pair whose
expert another rank holds, as :func:`kernels.moe_ref.route_held` gives them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_launch, pdl_wait

__all__ = ["route", "routes_here", "MAX_EXPERTS"]

MAX_EXPERTS = 1024  # one program holds a token's logits in registers


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l, first, num_held, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr = False):
    token = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    pdl_wait(USE_PDL)  # the router's matmul before it wrote the logits
    logits = tl.load(logits_ptr + token.to(tl.int64) * stride_l + offs, mask=valid, other=float("-inf"))
    pdl_launch(USE_PDL)
    logits = logits.to(tl.float32)
    top = tl.max(logits, axis=0)
    total = tl.sum(tl.where(valid, tl.exp(logits - top), 0.0), axis=0)
    ks = tl.arange(0, TOP_K)
    w = tl.zeros([TOP_K], tl.float32)
    ids = tl.zeros([TOP_K], tl.int64)
    left = logits
    for j in range(TOP_K):  # the largest logit left, the lowest id among equals
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, offs, BLOCK_E), axis=0)
        w = tl.where(ks == j, tl.exp(best - top) / total, w)
        ids = tl.where(ks == j, idx.to(tl.int64), ids)
        left = tl.where(offs == idx, float("-inf"), left)
    if RENORMALIZE:
        w = w / tl.sum(w, axis=0)
    local = ids - first  # ids local to this holder; another rank's expert: num_held, weight 0
    here = (local >= 0) & (local < num_held)
    tl.store(weights_ptr + token * TOP_K + ks, tl.where(here, w, 0.0))
    tl.store(ids_ptr + token * TOP_K + ks, tl.where(here, local, num_held))

def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, first_expert: int = 0,
          num_held: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] float32, ids [T, k] int64)`` as :func:`kernels.moe_ref.route_held` gives them, in one
    launch (``num_held`` None: every expert held).  ``top_k`` must be a power of two (it is 1, 2, 4 or 8 in every
    known config; :func:`routes_here` says whether this kernel takes a shape)."""
    T, E = router_logits.shape
    num_held = E if num_held is None else num_held
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _route_kernel[(T,)](logits, weights, ids, E, logits.stride(0), first_expert, num_held, TOP_K=top_k,
                            BLOCK_E=triton.next_power_of_2(E), RENORMALIZE=renormalize, num_warps=4,
                            **pdl_args(logits))
    return weights, ids


def routes_here(num_experts: int, top_k: int) -> bool:
    """Whether :func:`route` takes this config (else the torch routing serves it)."""
    return num_experts <= MAX_EXPERTS and top_k & (top_k - 1) == 0 and 0 < top_k <= num_experts
