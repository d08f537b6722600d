"""Fused mixture-of-experts: each token through its top-k experts' SiLU-gated MLPs, weighted and summed.

``x [T, H]``, experts stacked ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``,
routing ``weights [T, k]`` (float32) and ``ids [T, k]`` from :func:`kernels.moe_ref.route_ref`.
Each (token, expert) pair ``p = t * k + j`` goes through two launches: gate|up with the SiLU-mul in the
epilogue, into ``inter [T * k, I]`` (rounded to x's dtype, as the unfused ops round), then down.  Two forms:

- **small batches** (:func:`fused_moe_small`, up to ``SMALL_MAX_PAIRS`` pairs): one program per pair and
  ``BLOCK_N`` features streams only that pair's expert's rows (elementwise products, one reduction at the
  end, like :mod:`kernels.gemv`'s "row" form); the down launch has one program per token and ``BLOCK_N``
  outputs that streams its k experts' ``w2`` rows in turn and sums their weighted outputs in float32,
  rounding once.  Only the selected experts' weights are read;
- **larger batches** (:func:`fused_moe_grouped`): the pairs are grouped by expert on the device
  (:func:`align_by_expert`: each expert's pairs padded to a multiple of ``BLOCK_M``), and each program
  takes one ``BLOCK_M`` block of one expert's pairs through ``tl.dot`` against that expert's weights: a
  grouped GEMM, each expert's weights read once per block.  Down writes each pair's weighted float32
  row; the k rows of a token are summed after it (in a fixed order: no atomics, deterministic).

Every shape is a function of ``T``, ``k``, ``E`` and the block sizes, and nothing is read back to the
host (the grouping is torch ops: a scatter-add, a cumsum, a stable argsort and a searchsorted), so both
forms can be captured in a CUDA graph.  Blocks past the last expert's pairs find the expert id ``E``
and return at once.

**A rank's experts** (expert parallelism): ``w13``/``w2`` may stack only the ``E`` experts a rank holds, with
``ids`` made local by :func:`kernels.moe_ref.route_held`; a pair whose expert is held elsewhere has the id
``E``.  The per-pair form skips it (neither launch reads a weight for it: only the held selected experts'
weights are read), the grouping puts it in no group, and with ``partial`` the grouped form's per-pair rows
start at zero, so the pair adds nothing to its token's sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["fused_moe", "fused_moe_small", "fused_moe_grouped", "align_by_expert", "MoEConfig",
           "SMALL_MAX_PAIRS"]

SMALL_MAX_PAIRS = 32  # (token, expert) pairs up to which the per-pair form runs (untuned: a first guess)
CHUNK_TOKENS = 1024  # tokens per grouped pass: its workspace is about CHUNK_TOKENS * k * (2 I + 4 H) bytes


class MoEConfig(NamedTuple):
    """Tile sizes: ``block_m`` pairs per grouped program (at least 16, ``tl.dot``'s minimum), ``block_n``
    features per program, ``block_k`` of the reduction per step."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


SMALL_CONFIG = MoEConfig(16, 32, 128, 4, 3)


@triton.jit
def _silu_mul(g, u, out_ptr):
    """gate and up rounded to out's dtype as F.linear rounds them, then silu(g) * u in float32, rounded once."""
    g = g.to(out_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)


@triton.jit
def _up_small_kernel(x_ptr, w_ptr, ids_ptr, inter_ptr, num_experts, H, I, stride_xm, stride_we, stride_wn,
                     stride_im, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < num_experts:  # else held by another rank: its row of inter is never read
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
        gate_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        up_rows = gate_rows + I * stride_wn
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < H
            x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            w_mask = n_mask[:, None] & k_mask[None, :]
            acc_g += tl.load(gate_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
            acc_u += tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
        y = _silu_mul(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), inter_ptr)
        tl.store(inter_ptr + pair.to(tl.int64) * stride_im + offs_n, y, mask=n_mask)


@triton.jit
def _down_small_kernel(inter_ptr, w_ptr, ids_ptr, wts_ptr, out_ptr, num_experts, H, I, stride_im, stride_we,
                       stride_wn, stride_om, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOP_K):  # the token's experts in routing order
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        if expert < num_experts:  # else held by another rank: it adds nothing here
            rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
            a_row = inter_ptr + pair.to(tl.int64) * stride_im
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k0 in range(0, I, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < I
                a = tl.load(a_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
                acc += tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(
                    tl.float32) * a
            total += tl.load(wts_ptr + pair) * tl.sum(acc, axis=1)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _block_pairs(pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's expert (``num_experts``: an unused block) and its BLOCK_M pair indices and mask."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < num_pairs


@triton.jit
def _up_grouped_kernel(x_ptr, w_ptr, pairs_ptr, block_expert_ptr, inter_ptr, num_pairs, num_experts, H, I,
                       stride_xm, stride_we, stride_wn, stride_im, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    expert, pairs, m_mask = _block_pairs(pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if expert < num_experts:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        x_rows = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * stride_xm
        gate_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        up_rows = gate_rows + I * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < H
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = n_mask[:, None] & k_mask[None, :]
            acc_g += tl.dot(x, tl.trans(tl.load(gate_rows + offs_k[None, :], mask=w_mask, other=0.0)),
                            input_precision=DOT_PREC)
            acc_u += tl.dot(x, tl.trans(tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0)),
                            input_precision=DOT_PREC)
        y = _silu_mul(acc_g, acc_u, inter_ptr)
        tl.store(inter_ptr + pairs.to(tl.int64)[:, None] * stride_im + offs_n[None, :], y,
                 mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_grouped_kernel(inter_ptr, w_ptr, pairs_ptr, block_expert_ptr, wts_ptr, out_ptr, num_pairs, num_experts,
                         H, I, stride_im, stride_we, stride_wn, stride_om, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    expert, pairs, m_mask = _block_pairs(pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if expert < num_experts:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        a_rows = inter_ptr + pairs.to(tl.int64)[:, None] * stride_im
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < I
            a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PREC)
        acc *= tl.load(wts_ptr + pairs, mask=m_mask, other=0.0)[:, None]
        tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc,
                 mask=m_mask[:, None] & n_mask[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``p = t * k + j`` of ``ids [T, k]`` grouped by expert, each group padded to ``block_m``:
    ``(pairs [num_blocks * block_m] int32, pair index or T * k for padding; block_expert [num_blocks] int32,
    each block's expert or num_experts past the last group)``.  Within a group, pairs keep their order.

    ``num_blocks`` covers the worst case (every used expert's group one short of a block), from the shapes
    alone; torch ops on the device, no host read.  An id of ``num_experts`` (a pair whose expert another rank
    holds) joins no group.
    """
    flat = ids.reshape(-1)
    n = flat.numel()
    num_blocks = triton.cdiv(n + min(n, num_experts) * (block_m - 1), block_m)
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


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    E, two_i, H = w13.shape
    assert x.dim() == 2 and x.shape[1] == H and x.stride(1) == 1, (x.shape, w13.shape)
    assert two_i % 2 == 0 and w2.shape == (E, H, two_i // 2), (w13.shape, w2.shape)
    assert w13.stride(2) == 1 and w2.stride(2) == 1 and x.dtype == w13.dtype == w2.dtype
    assert ids.shape == weights.shape and ids.shape[0] == x.shape[0] and weights.dtype == torch.float32
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _dot_prec(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def fused_moe_small(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    config: MoEConfig = SMALL_CONFIG) -> torch.Tensor:
    """The per-pair form: ``[T, H]`` in x's dtype, reading only the selected experts' weights (of those held:
    a pair whose id is E adds nothing)."""
    _check(x, w13, w2, weights, ids)
    T, k = ids.shape
    E, H, I = w2.shape
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    ids, weights = ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    inter = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    bn, bk = config.block_n, config.block_k
    launch = dict(TOP_K=k, BLOCK_N=bn, BLOCK_K=bk, num_warps=config.num_warps, num_stages=config.num_stages)
    _up_small_kernel[(T * k, triton.cdiv(I, bn))](x, w13, ids, inter, E, H, I, x.stride(0), w13.stride(0),
                                                  w13.stride(1), inter.stride(0), **launch)
    _down_small_kernel[(T, triton.cdiv(H, bn))](inter, w2, ids, weights, out, E, H, I, inter.stride(0),
                                                w2.stride(0), w2.stride(1), out.stride(0), **launch)
    return out


def fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, config: MoEConfig = MoEConfig(), partial: bool = False) -> torch.Tensor:
    """The grouped form: pairs grouped by expert (:func:`align_by_expert`), a grouped GEMM per projection.
    ``partial``: ``ids`` may hold E (experts held elsewhere), whose per-pair rows no program writes: they start
    at zero (a memset the whole-model path skips)."""
    _check(x, w13, w2, weights, ids)
    T, k = ids.shape
    E, H, I = w2.shape
    if T == 0:
        return torch.empty(0, H, dtype=x.dtype, device=x.device)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    pairs, block_expert = align_by_expert(ids, E, bm)
    weights = weights.reshape(-1).contiguous()
    n = T * k
    inter = torch.empty(n, I, dtype=x.dtype, device=x.device)
    launch = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=_dot_prec(x), num_warps=config.num_warps,
                  num_stages=config.num_stages)
    blocks = block_expert.shape[0]
    _up_grouped_kernel[(blocks, triton.cdiv(I, bn))](x, w13, pairs, block_expert, inter, n, E, H, I, x.stride(0),
                                                     w13.stride(0), w13.stride(1), inter.stride(0), TOP_K=k,
                                                     **launch)
    out_pairs = (torch.zeros if partial else torch.empty)(n, H, dtype=torch.float32, device=x.device)
    _down_grouped_kernel[(blocks, triton.cdiv(H, bn))](inter, w2, pairs, block_expert, weights, out_pairs, n, E, H, I,
                                                       inter.stride(0), w2.stride(0), w2.stride(1),
                                                       out_pairs.stride(0), **launch)
    return out_pairs.view(T, k, H).sum(dim=1).to(x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, partial: bool = False) -> torch.Tensor:
    """``[T, H]``: the per-pair form up to ``SMALL_MAX_PAIRS`` pairs, the grouped form above (block_m 16 while
    an expert averages fewer than 32 pairs, else 64), ``CHUNK_TOKENS`` tokens at a time (the grouped form's
    float32 rows per pair, ``T * k * H * 4`` bytes, stay bounded on long prefills).  A function of T's value
    only: one plan per graph.  ``partial``: a rank's experts, ``ids`` E for a pair held elsewhere."""
    T = x.shape[0]
    if T > CHUNK_TOKENS:
        out = torch.empty(T, w2.shape[1], dtype=x.dtype, device=x.device)
        for s in range(0, T, CHUNK_TOKENS):
            out[s:s + CHUNK_TOKENS] = fused_moe(x[s:s + CHUNK_TOKENS], w13, w2, weights[s:s + CHUNK_TOKENS],
                                                ids[s:s + CHUNK_TOKENS], partial)
        return out
    n, E = ids.numel(), w13.shape[0]
    if n <= SMALL_MAX_PAIRS:
        return fused_moe_small(x, w13, w2, weights, ids)
    return fused_moe_grouped(x, w13, w2, weights, ids, MoEConfig(block_m=16 if n < 32 * E else 64), partial)
