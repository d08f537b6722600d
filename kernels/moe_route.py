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

:func:`norm_route` (1-4 tokens) adds the two launches before it: the post-attention RMSNorm and the router's
linear.  Each program computes its token's norm itself (a row of a few thousand values, from L2) and a few router
rows' logits, stores them, and counts itself in on the token's arrival counter (a CTA barrier, then a GPU-scope
acquire-release add, as :mod:`kernels.decode_attention`'s splits do); the last program in, which sees every
other's logits, writes the normed row and the residual stream, routes the token and re-arms the counter.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_launch, pdl_wait

__all__ = ["route", "norm_route", "norm_routes_here", "routes_here", "MAX_EXPERTS", "NORM_ROUTE_MAX_TOKENS"]

MAX_EXPERTS = 1024  # one program holds a token's logits in registers
NORM_ROUTE_MAX_TOKENS = 4  # the most tokens norm_route takes (the per-pair experts' sizes, where a launch weighs most)
NORM_ROUTE_MAX_HIDDEN = 8192  # every program holds the token's row and its block of router rows in registers


@triton.jit
def _top_k(logits, offs, valid, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr):
    """A token's float32 ``logits [BLOCK_E]`` -> ``(weights [TOP_K] float32, ids [TOP_K] int64)``."""
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
    return w, ids


@triton.jit
def _store_routing(weights_ptr, ids_ptr, token, w, ids, first, num_held, TOP_K: tl.constexpr):
    """Store a token's routing with the ids local to this holder; another rank's expert: ``num_held``, weight 0."""
    ks = tl.arange(0, TOP_K)
    local = ids - first
    here = (local >= 0) & (local < num_held)
    tl.store(weights_ptr + token * TOP_K + ks, tl.where(here, w, 0.0))
    tl.store(ids_ptr + token * TOP_K + ks, tl.where(here, local, num_held))


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l, first, num_held, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr = False):
    token = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    pdl_wait(USE_PDL)  # the router's matmul before it wrote the logits
    logits = tl.load(logits_ptr + token.to(tl.int64) * stride_l + offs, mask=valid, other=float("-inf"))
    pdl_launch(USE_PDL)
    w, ids = _top_k(logits.to(tl.float32), offs, valid, TOP_K, BLOCK_E, RENORMALIZE)
    _store_routing(weights_ptr, ids_ptr, token, w, ids, first, num_held, TOP_K)


@triton.jit
def _norm_route_kernel(x_ptr, r_ptr, nw_ptr, gw_ptr, h_ptr, rout_ptr, logits_ptr, weights_ptr, ids_ptr, arrivals_ptr,
                       H, E, eps, stride_x, stride_r, stride_h, stride_ro, stride_g, first, num_held,
                       TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                       ADD: tl.constexpr, RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Program (token, block): the token's norm (every block computes it), its ``BLOCK_N`` router logits; the
    token's last block to arrive writes the normed row and the residual stream and routes the token."""
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < E
    nw = tl.load(nw_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)  # weights: safe before the wait
    gw = tl.load(gw_ptr + rows.to(tl.int64)[:, None] * stride_g + offs_h[None, :],
                 mask=r_mask[:, None] & h_mask[None, :], other=0.0)
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + token * stride_x + offs_h, mask=h_mask, other=0.0)
    if ADD:  # as kernels/norm.py: the sum rounded to the model dtype, then the norm of it
        r = tl.load(r_ptr + token * stride_r + offs_h, mask=h_mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    h = (nw * (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)).to(x_ptr.dtype.element_ty)
    # the router's output rounded to the model dtype, as a linear's, then widened
    logit = tl.sum(gw.to(tl.float32) * h.to(tl.float32)[None, :], axis=1).to(x_ptr.dtype.element_ty)
    tl.store(logits_ptr + token * E + rows, logit.to(tl.float32), mask=r_mask)
    tl.debug_barrier()  # all of this program's stores (and its reads of x) before its arrival
    counter = arrivals_ptr + token
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    pdl_launch(USE_PDL)
    if arrived == tl.num_programs(1) - 1:  # the last one in: every block has read x and stored its logits
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # re-armed for the next call
        tl.store(h_ptr + token * stride_h + offs_h, h, mask=h_mask)
        if ADD:
            tl.store(rout_ptr + token * stride_ro + offs_h, x, mask=h_mask)
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        logits = tl.load(logits_ptr + token * E + offs, mask=valid, other=float("-inf"), cache_modifier=".cg")
        w, ids = _top_k(logits, offs, valid, TOP_K, BLOCK_E, RENORMALIZE)
        _store_routing(weights_ptr, ids_ptr, token, w, ids, first, num_held, TOP_K)


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


def norm_route(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
               gate: torch.Tensor, top_k: int, renormalize: bool, arrivals: torch.Tensor, first_expert: int = 0,
               num_held: Optional[int] = None) -> tuple[torch.Tensor, ...]:
    """The MoE layer's front in one launch: ``(h, residual stream, router logits [T, E] float32, weights, ids)``,
    ``h`` the RMSNorm of ``x + residual`` (:func:`kernels.norm.fused_add_rms_norm`'s arithmetic, its sum of
    squares perhaps in another order; ``residual`` None: of ``x``, which is then the stream), the logits
    ``linear(h, gate)`` rounded to the model dtype, and the routing :func:`route` gives for them.  ``arrivals``: int32 zeros, one per token at least, left zero.  Up to
    :data:`NORM_ROUTE_MAX_TOKENS` tokens (:func:`norm_routes_here`)."""
    T, H = x.shape
    E = gate.shape[0]
    num_held = E if num_held is None else num_held
    assert T <= arrivals.numel() and x.stride(1) == 1 and gate.stride(1) == 1 and gate.shape[1] == H
    h = torch.empty_like(x)
    stream = x if residual is None else torch.empty_like(x)
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    if T:
        r = x if residual is None else residual
        block_h = triton.next_power_of_2(H)
        block_n = max(1, min(4, 8192 // block_h))  # router rows a program: at most 8,192 weights in registers
        _norm_route_kernel[(T, triton.cdiv(E, block_n))](
            x, r, norm_weight, gate, h, stream, logits, weights, ids, arrivals, H, E, eps, x.stride(0), r.stride(0),
            h.stride(0), stream.stride(0), gate.stride(0), first_expert, num_held, TOP_K=top_k, BLOCK_H=block_h,
            BLOCK_N=block_n, BLOCK_E=triton.next_power_of_2(E), ADD=residual is not None, RENORMALIZE=renormalize,
            num_warps=4 if block_h <= 4096 else 8, **pdl_args(x))
    return h, stream, logits, weights, ids


def norm_routes_here(x: torch.Tensor, gate: torch.Tensor, top_k: int) -> bool:
    """Whether :func:`norm_route` takes these rows and this router (a float router, as many tokens as it takes)."""
    T, H = x.shape
    return (0 < T <= NORM_ROUTE_MAX_TOKENS and H <= NORM_ROUTE_MAX_HIDDEN and isinstance(gate, torch.Tensor)
            and gate.dtype == x.dtype and routes_here(gate.shape[0], top_k))
