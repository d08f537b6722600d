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
host (the grouping is one launch of its own, :mod:`kernels.moe_align`), so both forms can be captured in a
CUDA graph.  Blocks past the last expert's pairs find the expert id ``E``
and return at once.

**FP8 experts** (``--quantization fp8``): ``w13`` / ``w2`` may be :class:`kernels.fp8.Fp8Weight` stacks (e4m3
values, a float32 scale per expert and row): the kernels read the e4m3 values (half the bytes), widen them exactly
to x's dtype, and scale each row's float32 sum once: W8A16 at every batch size (:func:`kernels.moe_ref.moe_ref`).

**A rank's experts** (expert parallelism): ``w13``/``w2`` may stack only the ``E`` experts a rank holds, with
``ids`` made local by :func:`kernels.moe_ref.route_held`; a pair whose expert is held elsewhere has the id
``E``.  The per-pair form skips it (neither launch reads a weight for it: only the held selected experts'
weights are read), the grouping puts it in no group, and with ``partial`` the grouped form's per-pair rows
start at zero, so the pair adds nothing to its token's sum.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .fp8 import weight_args
from .gemv_row import _fold, lanes
from .moe_align import align_by_expert
from .pdl import pdl_args, pdl_launch, pdl_wait

__all__ = ["fused_moe", "fused_moe_small", "fused_moe_grouped", "moe_up_small", "moe_down_small", "align_by_expert",
           "grouped_config", "MoEConfig", "SmallConfig", "SMALL_MAX_PAIRS"]

SMALL_MAX_PAIRS = 32  # (token, expert) pairs up to which the per-pair form runs (untuned: a first guess)
CHUNK_TOKENS = 1024  # tokens per grouped pass: its workspace is about CHUNK_TOKENS * k * (2 I + 4 H) bytes


class MoEConfig(NamedTuple):
    """Tile sizes: ``block_m`` pairs per grouped program (at least 16, ``tl.dot``'s minimum), ``block_n``
    features per program, ``block_k`` of the reduction per step; ``experts_at_once``: the per-pair form's down
    launch streams its token's k experts side by side (k times the loads in flight per program) instead of one
    after another."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    experts_at_once: bool = False  # the per-pair down launch: a token's k experts in one tile, not in turn


class SmallConfig(NamedTuple):
    """The per-pair form's two launches, each its own tile (``block_m`` unused): gate|up's and down's."""

    up: MoEConfig
    down: MoEConfig


# Narrow tiles, as the dense skinny matmul's "row" form (kernels/gemv.py): a batch-1 step of Qwen3-MoE has 8 pairs;
# gate|up's 768 features a row each are 768 programs a pair (two warps: many programs an SM, each waiting on its
# pair's expert id before its weight loads), down's 2,048 outputs one program each.
SMALL_CONFIG = SmallConfig(MoEConfig(1, 1, 2048, 2, 4), MoEConfig(1, 1, 1024, 4, 4))
# Under Triton's interpreter (the CPU's tests) each program is a Python loop: wide tiles keep the programs few.
INTERPRETER_SMALL_CONFIG = SmallConfig(MoEConfig(1, 32, 128, 4, 3), MoEConfig(1, 32, 128, 4, 3))
# The start-up tuner's candidates (executor_proc/backends/moe_tuning.py), each launch on its own: the best of an
# H200 sweep of wider lists (`scripts/bench_kernels.py moe`, three real shapes at 1, 2 and 4 tokens).
UP_CANDIDATES = (MoEConfig(1, 1, 2048, 2, 4), MoEConfig(1, 2, 512, 4, 6), MoEConfig(1, 4, 1024, 4, 3),
                 MoEConfig(1, 8, 512, 4, 3), MoEConfig(1, 1, 2048, 4, 4), MoEConfig(1, 2, 1024, 4, 6),
                 # one warp a program: FP8 experts' best at one and four tokens (a byte a value)
                 MoEConfig(1, 4, 2048, 1, 6), MoEConfig(1, 4, 512, 1, 6))
DOWN_CANDIDATES = (MoEConfig(1, 1, 1024, 4, 4), MoEConfig(1, 2, 256, 2, 4), MoEConfig(1, 4, 512, 4, 4),
                   MoEConfig(1, 2, 512, 4, 4), MoEConfig(1, 4, 256, 4, 4),
                   MoEConfig(1, 1, 256, 4, 4, True), MoEConfig(1, 2, 256, 4, 4, True),
                   MoEConfig(1, 1, 512, 4, 3, True), MoEConfig(1, 4, 128, 4, 4, True))
# Grouped-form candidates (block_m is set by the rule in fused_moe, not tuned).
GROUPED_CANDIDATES = (MoEConfig(64, 64, 64, 4, 3), MoEConfig(64, 64, 128, 4, 3), MoEConfig(64, 128, 64, 4, 3),
                      MoEConfig(64, 32, 128, 4, 4), MoEConfig(64, 64, 64, 4, 5), MoEConfig(64, 128, 128, 8, 3),
                      MoEConfig(64, 32, 64, 4, 5))


@triton.jit
def _silu_mul(g, u, out_ptr):
    """gate and up rounded to out's dtype as F.linear rounds them, then silu(g) * u in float32, rounded once."""
    g = g.to(out_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)


@triton.jit
def _up_small_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, inter_ptr, num_experts, H, I, stride_xm, stride_we, stride_wn,
                     stride_se, stride_im, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     W_SCALED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                     LANES: tl.constexpr = 8):
    pair = tl.program_id(0)
    pdl_wait(USE_PDL)  # the routing before it wrote the ids
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < num_experts:  # else held by another rank: its row of inter is never read
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
        gate_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        up_rows = gate_rows + I * stride_wn
        acc_g = tl.zeros([BLOCK_N, BLOCK_K // LANES], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K // LANES], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < H
            x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            w_mask = n_mask[:, None] & k_mask[None, :]
            acc_g += _fold(tl.load(gate_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32) * x,
                           BLOCK_N, BLOCK_K, LANES)
            acc_u += _fold(tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32) * x,
                           BLOCK_N, BLOCK_K, LANES)
        pdl_launch(USE_PDL)
        g, u = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
        if W_SCALED:  # FP8 experts: each row's scale, once its sum is done
            s_row = s_ptr + expert * stride_se
            g *= tl.load(s_row + offs_n, mask=n_mask, other=0.0)
            u *= tl.load(s_row + I + offs_n, mask=n_mask, other=0.0)
        y = _silu_mul(g, u, inter_ptr)
        tl.store(inter_ptr + pair.to(tl.int64) * stride_im + offs_n, y, mask=n_mask)


@triton.jit
def _down_small_kernel(inter_ptr, w_ptr, s_ptr, ids_ptr, wts_ptr, out_ptr, num_experts, H, I, stride_im, stride_we,
                       stride_wn, stride_se, stride_om, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, W_SCALED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                       LANES: tl.constexpr = 8):
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    total = tl.zeros([BLOCK_N], tl.float32)
    pdl_wait(USE_PDL)  # gate|up before it wrote inter
    for j in range(TOP_K):  # the token's experts in routing order
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        if expert < num_experts:  # else held by another rank: it adds nothing here
            rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
            a_row = inter_ptr + pair.to(tl.int64) * stride_im
            acc = tl.zeros([BLOCK_N, BLOCK_K // LANES], tl.float32)
            for k0 in range(0, I, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < I
                a = tl.load(a_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
                acc += _fold(tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(
                    tl.float32) * a, BLOCK_N, BLOCK_K, LANES)
            part = tl.sum(acc, axis=1)
            if W_SCALED:
                part *= tl.load(s_ptr + expert * stride_se + offs_n, mask=n_mask, other=0.0)
            total += tl.load(wts_ptr + pair) * part
    pdl_launch(USE_PDL)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_small_wide_kernel(inter_ptr, w_ptr, s_ptr, ids_ptr, wts_ptr, out_ptr, num_experts, H, I, stride_im,
                            stride_we, stride_wn, stride_se, stride_om, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, W_SCALED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                            LANES: tl.constexpr = 8):
    """:func:`_down_small_kernel` with the token's k experts side by side: rows ``j * BLOCK_N + n`` of the tile
    are output feature ``n`` of expert ``j``, each weighted, then the k rows of a feature summed."""
    token = tl.program_id(0)
    offs_r = tl.arange(0, TOP_K * BLOCK_N)
    j, n = offs_r // BLOCK_N, offs_r % BLOCK_N
    offs_n = tl.program_id(1) * BLOCK_N + n
    pair = token * TOP_K + j
    pdl_wait(USE_PDL)  # gate|up before it wrote inter (and the routing the ids)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    row_mask = (offs_n < H) & (expert < num_experts)  # an expert held by another rank adds nothing here
    rows = w_ptr + expert * stride_we + offs_n.to(tl.int64) * stride_wn
    a_rows = inter_ptr + pair.to(tl.int64) * stride_im
    acc = tl.zeros([TOP_K * BLOCK_N, BLOCK_K // LANES], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (offs_k < I)[None, :]
        a = tl.load(a_rows[:, None] + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += _fold(tl.load(rows[:, None] + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * a,
                     TOP_K * BLOCK_N, BLOCK_K, LANES)
    pdl_launch(USE_PDL)
    weighted = tl.sum(acc, axis=1) * tl.load(wts_ptr + pair, mask=row_mask, other=0.0)
    if W_SCALED:
        weighted *= tl.load(s_ptr + expert * stride_se + offs_n, mask=row_mask, other=0.0)
    total = tl.sum(tl.reshape(weighted, [TOP_K, BLOCK_N]), axis=0)
    out_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + out_n, total.to(out_ptr.dtype.element_ty), mask=out_n < H)


@triton.jit
def _block_pairs(pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's expert (``num_experts``: an unused block) and its BLOCK_M pair indices and mask."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < num_pairs


@triton.jit
def _up_grouped_kernel(x_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, inter_ptr, num_pairs, num_experts, H, I,
                       stride_xm, stride_we, stride_wn, stride_se, stride_im, TOP_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
                       W_SCALED: tl.constexpr = False):
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
            wg = tl.load(gate_rows + offs_k[None, :], mask=w_mask, other=0.0).to(x.dtype)  # e4m3: exact
            wu = tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0).to(x.dtype)
            acc_g += tl.dot(x, tl.trans(wg), input_precision=DOT_PREC)
            acc_u += tl.dot(x, tl.trans(wu), input_precision=DOT_PREC)
        if W_SCALED:  # FP8 experts: each output column's scale
            s_row = s_ptr + expert.to(tl.int64) * stride_se
            acc_g *= tl.load(s_row + offs_n, mask=n_mask, other=0.0)[None, :]
            acc_u *= tl.load(s_row + I + offs_n, mask=n_mask, other=0.0)[None, :]
        y = _silu_mul(acc_g, acc_u, inter_ptr)
        tl.store(inter_ptr + pairs.to(tl.int64)[:, None] * stride_im + offs_n[None, :], y,
                 mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_grouped_kernel(inter_ptr, w_ptr, s_ptr, pairs_ptr, block_expert_ptr, wts_ptr, out_ptr, num_pairs,
                         num_experts, H, I, stride_im, stride_we, stride_wn, stride_se, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
                         W_SCALED: tl.constexpr = False):
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
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(a.dtype)
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PREC)
        if W_SCALED:
            acc *= tl.load(s_ptr + expert.to(tl.int64) * stride_se + offs_n, mask=n_mask, other=0.0)[None, :]
        acc *= tl.load(wts_ptr + pairs, mask=m_mask, other=0.0)[:, None]
        tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc,
                 mask=m_mask[:, None] & n_mask[None, :])


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    E, two_i, H = w13.shape
    assert x.dim() == 2 and x.shape[1] == H and x.stride(1) == 1, (x.shape, w13.shape)
    assert two_i % 2 == 0 and w2.shape == (E, H, two_i // 2), (w13.shape, w2.shape)
    assert w13.stride(2) == 1 and w2.stride(2) == 1 and x.dtype == w13.dtype == w2.dtype
    assert ids.shape == weights.shape and ids.shape[0] == x.shape[0] and weights.dtype == torch.float32
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _scale_stride(scale: torch.Tensor, scaled: bool) -> int:
    """An FP8 stack's scales ``[E, N]``: the stride from one expert's to the next (0: no scales)."""
    return scale.stride(0) if scaled else 0


def _dot_prec(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def moe_up_small(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """The per-pair form's first launch: ``inter [T * k, I]``, each pair's SiLU-gated features (a pair held
    elsewhere, id E: its row is left unwritten)."""
    T, k = ids.shape
    E, two_i, H = w13.shape
    I = two_i // 2
    inter = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    bn, bk = config.block_n, config.block_k
    w, s, scaled = weight_args(w13)
    _up_small_kernel[(T * k, triton.cdiv(I, bn))](x, w, s, ids, inter, E, H, I, x.stride(0), w.stride(0), w.stride(1),
                                                  _scale_stride(s, scaled), inter.stride(0), TOP_K=k, BLOCK_N=bn,
                                                  BLOCK_K=bk, W_SCALED=scaled, LANES=lanes(w),
                                                  num_warps=config.num_warps, num_stages=config.num_stages,
                                                  **pdl_args(x))
    return inter


def moe_down_small(inter: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   config: MoEConfig, dtype: torch.dtype) -> torch.Tensor:
    """The per-pair form's second launch: ``[T, H]``, each token's k experts' down projections weighted and
    summed in float32, rounded once."""
    T, k = ids.shape
    E, H, I = w2.shape
    out = torch.empty(T, H, dtype=dtype, device=inter.device)
    bn, bk = config.block_n, config.block_k
    kernel = _down_small_wide_kernel if config.experts_at_once and k & (k - 1) == 0 else _down_small_kernel
    w, s, scaled = weight_args(w2)
    kernel[(T, triton.cdiv(H, bn))](inter, w, s, ids, weights, out, E, H, I, inter.stride(0), w.stride(0),
                                    w.stride(1), _scale_stride(s, scaled), out.stride(0), TOP_K=k, BLOCK_N=bn,
                                    BLOCK_K=bk, W_SCALED=scaled, LANES=lanes(w), num_warps=config.num_warps,
                                    num_stages=config.num_stages, **pdl_args(inter))
    return out


def default_small_config() -> SmallConfig:
    """:data:`SMALL_CONFIG`, or :data:`INTERPRETER_SMALL_CONFIG` under ``TRITON_INTERPRET=1``."""
    return INTERPRETER_SMALL_CONFIG if os.environ.get("TRITON_INTERPRET") == "1" else SMALL_CONFIG


def fused_moe_small(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    config: Optional[SmallConfig] = None) -> torch.Tensor:
    """The per-pair form: ``[T, H]`` in x's dtype, reading only the selected experts' weights (of those held:
    a pair whose id is E adds nothing); ``config`` None: :func:`default_small_config`."""
    _check(x, w13, w2, weights, ids)
    config = config or default_small_config()
    if ids.shape[0] == 0:
        return torch.empty(0, w2.shape[1], dtype=x.dtype, device=x.device)
    ids, weights = ids.contiguous(), weights.contiguous()
    return moe_down_small(moe_up_small(x, w13, ids, config.up), w2, ids, weights, config.down, x.dtype)


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
    w1, s1, scaled = weight_args(w13)
    w2, s2, _ = weight_args(w2)
    launch = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=_dot_prec(x), W_SCALED=scaled,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    blocks = block_expert.shape[0]
    _up_grouped_kernel[(blocks, triton.cdiv(I, bn))](x, w1, s1, pairs, block_expert, inter, n, E, H, I, x.stride(0),
                                                     w1.stride(0), w1.stride(1), _scale_stride(s1, scaled),
                                                     inter.stride(0), TOP_K=k, **launch)
    out_pairs = (torch.zeros if partial else torch.empty)(n, H, dtype=torch.float32, device=x.device)
    _down_grouped_kernel[(blocks, triton.cdiv(H, bn))](inter, w2, s2, pairs, block_expert, weights, out_pairs, n, E, H,
                                                       I, inter.stride(0), w2.stride(0), w2.stride(1),
                                                       _scale_stride(s2, scaled), out_pairs.stride(0), **launch)
    return out_pairs.view(T, k, H).sum(dim=1).to(x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, partial: bool = False, small: Optional[SmallConfig] = None,
              grouped: Optional[MoEConfig] = None) -> torch.Tensor:
    """``[T, H]``: the per-pair form up to ``SMALL_MAX_PAIRS`` pairs (tiles ``small``, default
    :func:`default_small_config`), the grouped form above
    (tiles ``grouped``, default :class:`MoEConfig`; block_m 16 while an expert averages fewer than 32 pairs,
    else 64), ``CHUNK_TOKENS`` tokens at a time (the grouped form's float32 rows per pair, ``T * k * H * 4``
    bytes, stay bounded on long prefills).  A function of T's value only: one plan per graph.  ``partial``: a
    rank's experts, ``ids`` E for a pair held elsewhere."""
    T = x.shape[0]
    if T > CHUNK_TOKENS:
        out = torch.empty(T, w2.shape[1], dtype=x.dtype, device=x.device)
        for s in range(0, T, CHUNK_TOKENS):
            out[s:s + CHUNK_TOKENS] = fused_moe(x[s:s + CHUNK_TOKENS], w13, w2, weights[s:s + CHUNK_TOKENS],
                                                ids[s:s + CHUNK_TOKENS], partial, small, grouped)
        return out
    n, E = ids.numel(), w13.shape[0]
    if n <= SMALL_MAX_PAIRS:
        return fused_moe_small(x, w13, w2, weights, ids, small)
    return fused_moe_grouped(x, w13, w2, weights, ids, grouped_config(grouped or MoEConfig(), n, E), partial)


def grouped_config(config: MoEConfig, num_pairs: int, num_experts: int) -> MoEConfig:
    """``config`` with its ``block_m``: 16 while an expert averages fewer than 32 pairs, else 64."""
    return config._replace(block_m=16 if num_pairs < 32 * num_experts else 64)
