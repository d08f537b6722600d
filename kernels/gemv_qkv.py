"""A few tokens' attention input in one launch: (RMSNorm ->) q|k|v matmul -> rotary -> K/V into the cache.

At batch 1 a layer's attention input is three launches (norm, q|k|v GEMV, ``rope_kv_write``), two of
them tiny.  :func:`qkv_rope` is :func:`kernels.gemv_row.gemv_prologue`'s norm form with the rotary and
the cache write as its epilogue.  A program owns ``PAIRS`` rotary pairs of one head: output features
``j`` and ``j + D/2`` of head ``h`` for ``PAIRS`` consecutive ``j``, two accumulators, so the
"rotate half" rotation is elementwise between them.  Query heads are rotated into ``q_out``, key heads
rotated and value heads as they are go to the paged cache at ``kv_index`` (negative: not written).
With ``norm=None`` (x already normed, for 2-8 tokens: there every program re-reading the rows for
the norm costs more than the norm's launch) :func:`_qkv_rope_rows_kernel` serves 1 to 8 tokens, each
weight chunk multiplied into every token's pair of accumulators, and :func:`_qkv_rope_dot_kernel` the
tensor-core "dot" form of :mod:`kernels.gemv` (4-8 tokens, where the rows' accumulators outgrow the registers).

Rounding is the unfused ops': the matmul output is rounded to the model dtype, rotated in float32
from that, rounded again (:mod:`kernels.kv_write`).  Models with q/k norms (Qwen3) do not use it:
their norms sit between the matmul and the rotary.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .fp8 import weight_args
from .gemv import MAX_M, _rows_pad, _rows_products, config_fits
from .gemv_partials import _load_partials, _partials_rstd, _to_mma_rows, loads_at_once
from .gemv_row import _fold, _norm_rstd, _prologue_row, lanes
from .kv_write import inverse_scales, to_cache
from .pdl import pdl_args, pdl_launch, pdl_wait

__all__ = ["qkv_rope", "rope_pairs"]


@triton.jit
def _pair_tile(w_ptr, stride_wn, D: tl.constexpr, PAIRS: tl.constexpr):
    """This program's head, its PAIRS rotary pairs ``j`` of that head, their features ``lo`` (the partners
    are ``lo + D/2``) and the weight rows of both halves."""
    HALF = D // 2
    pid = tl.program_id(0)
    head = pid // (HALF // PAIRS)
    j = (pid % (HALF // PAIRS)) * PAIRS + tl.arange(0, PAIRS)
    lo = head * D + j
    w_lo = w_ptr + lo.to(tl.int64)[:, None] * stride_wn
    return head, j, lo, w_lo, w_lo + HALF * stride_wn


@triton.jit
def _pair_scales(ws_ptr, lo, D: tl.constexpr, W_SCALED: tl.constexpr):
    """An FP8 weight's scales of the features ``lo`` and their partners ``lo + D/2``, as ``[1, pairs]`` rows
    (``W_SCALED``; else ones, unread)."""
    mask = (lo >= 0) & W_SCALED
    s_lo = tl.load(ws_ptr + lo, mask=mask, other=1.0)
    s_hi = tl.load(ws_ptr + lo + D // 2, mask=mask, other=1.0)
    return s_lo[None, :], s_hi[None, :]


@triton.jit
def _rope_store(y_lo, y_hi, head, j, lo, token, ok, x_ptr, b_ptr, qo_ptr, kc_ptr, vc_ptr, index_ptr, pos_ptr, cs_ptr,
                stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_cs, H, HKV, k_inv, v_inv,
                D: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Both kernels' epilogue, for the float32 sums ``[tokens, pairs]`` of tokens ``token [tokens, 1]`` (stored
    where ``ok``): bias, the matmul's rounding, rotary for q and k heads, then q to ``q_out`` and k, v to the
    paged cache at their kv_index (negative: not written)."""
    HALF = D // 2
    if HAS_BIAS:
        y_lo += tl.load(b_ptr + lo).to(tl.float32)[None, :]
        y_hi += tl.load(b_ptr + lo + HALF).to(tl.float32)[None, :]
    dt = x_ptr.dtype.element_ty
    y_lo = y_lo.to(dt).to(tl.float32)  # the matmul's output, as the unfused path stores it
    y_hi = y_hi.to(dt).to(tl.float32)
    if head < H + HKV:  # q and k heads rotate
        cs = cs_ptr + tl.load(pos_ptr + token).to(tl.int64) * stride_cs + j[None, :]
        cos = tl.load(cs)
        sin = tl.load(cs + HALF)
        r_lo = y_lo * cos - y_hi * sin
        r_hi = y_hi * cos + y_lo * sin
    else:
        r_lo = y_lo
        r_hi = y_hi
    if head < H:
        q_dst = qo_ptr + token * (H * D) + lo[None, :]  # named apart from dst below: the two differ in dtype
        tl.store(q_dst, r_lo.to(qo_ptr.dtype.element_ty), mask=ok)
        tl.store(q_dst + HALF, r_hi.to(qo_ptr.dtype.element_ty), mask=ok)
    else:
        kv_index = tl.load(index_ptr + token).to(tl.int64)
        blk = kv_index // BLOCK_SIZE
        off = kv_index % BLOCK_SIZE
        if head < H + HKV:
            dst = kc_ptr + blk * stride_kcb + off * stride_kct + (head - H) * stride_kch + j[None, :]
        else:
            dst = vc_ptr + blk * stride_vcb + off * stride_vct + (head - H - HKV) * stride_vch + j[None, :]
        ok = ok & (kv_index >= 0)
        inv = k_inv if head < H + HKV else v_inv
        tl.store(dst, to_cache(r_lo, kc_ptr, inv), mask=ok)
        tl.store(dst + HALF, to_cache(r_hi, kc_ptr, inv), mask=ok)


@triton.jit
def _qkv_rope_kernel(x_ptr, r_ptr, nw_ptr, rout_ptr, w_ptr, ws_ptr, b_ptr, qo_ptr, kc_ptr, vc_ptr,
                     index_ptr, pos_ptr, cs_ptr, K, stride_wn, eps,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_cs,
                     H, HKV, k_inv, v_inv, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAIRS: tl.constexpr,
                     BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, ADD: tl.constexpr, W_SCALED: tl.constexpr = False,
                     USE_PDL: tl.constexpr = False, LANES: tl.constexpr = 8):
    head, j, lo, w_lo, w_hi = _pair_tile(w_ptr, stride_wn, D, PAIRS)
    # the first weight tiles stream in while the previous kernel ends (kernels/pdl.py)
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w0_lo = tl.load(w_lo + offs_k[None, :], mask=k_mask[None, :], other=0.0)
    w0_hi = tl.load(w_hi + offs_k[None, :], mask=k_mask[None, :], other=0.0)
    pdl_wait(USE_PDL)
    rstd = _norm_rstd(x_ptr, r_ptr, rout_ptr, K, eps, tl.program_id(0) == 0, ADD, BLOCK_K)
    x = _prologue_row(x_ptr, r_ptr, nw_ptr, offs_k, k_mask, K, rstd, 1, ADD)[None, :]
    acc_lo = _fold(w0_lo.to(tl.float32) * x, PAIRS, BLOCK_K, LANES)
    acc_hi = _fold(w0_hi.to(tl.float32) * x, PAIRS, BLOCK_K, LANES)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = _prologue_row(x_ptr, r_ptr, nw_ptr, offs_k, k_mask, K, rstd, 1, ADD)[None, :]
        acc_lo += _fold(tl.load(w_lo + offs_k[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32) * x, PAIRS,
                        BLOCK_K, LANES)
        acc_hi += _fold(tl.load(w_hi + offs_k[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32) * x, PAIRS,
                        BLOCK_K, LANES)
    pdl_launch(USE_PDL)
    token = tl.zeros([1, 1], dtype=tl.int32)  # the one token, as a [tokens, 1] column
    s_lo, s_hi = _pair_scales(ws_ptr, lo, D, W_SCALED)
    _rope_store(tl.sum(acc_lo, axis=1)[None, :] * s_lo, tl.sum(acc_hi, axis=1)[None, :] * s_hi, head, j, lo, token,
                token == 0,
                x_ptr, b_ptr, qo_ptr, kc_ptr, vc_ptr, index_ptr, pos_ptr, cs_ptr, stride_kcb, stride_kct, stride_kch,
                stride_vcb, stride_vct, stride_vch, stride_cs, H, HKV, k_inv, v_inv, D, BLOCK_SIZE, HAS_BIAS)


@triton.jit
def _qkv_rope_rows_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, qo_ptr, kc_ptr, vc_ptr, index_ptr, pos_ptr, cs_ptr, ss_ptr, M,
                          K, P, stride_wn, stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                          stride_cs, H, HKV, k_inv, v_inv, eps, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
                          P_PAD: tl.constexpr = 0,
                          W_SCALED: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """The matmul, rotary and cache write of :func:`_qkv_rope_kernel` for 1..M_PAD tokens of an already normed
    x (contiguous rows; padding rows re-read the last token and store nothing): each weight chunk is
    multiplied into every token's pair of accumulators, as :mod:`kernels.gemv`'s rows kernel does.
    ``P_PAD`` > 0: x is the residual stream before a norm folded into w; each token's sums are scaled by the
    norm's rsqrt from the producer's ``P`` partial sums of squares (:func:`kernels.gemv.gemv_residual`)."""
    head, j, lo, w_lo, w_hi = _pair_tile(w_ptr, stride_wn, D, PAIRS)
    offs_m = tl.arange(0, M_PAD)
    token = tl.minimum(offs_m, M - 1)[:, None]
    x_rows = x_ptr + token * K
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    k_mask = offs_k < K
    w_lo0 = tl.load(w_lo + offs_k, mask=k_mask, other=0.0)
    w_hi0 = tl.load(w_hi + offs_k, mask=k_mask, other=0.0)
    pdl_wait(USE_PDL)  # the first weight chunks stream in while the previous kernel ends
    x = tl.load(x_rows + offs_k, mask=k_mask, other=0.0)
    if P_PAD > 0:
        ss = _load_partials(ss_ptr, P, M, M_PAD, P_PAD)
    acc_lo = _rows_products(w_lo0, x)
    acc_hi = _rows_products(w_hi0, x)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)[None, :]
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k, mask=k_mask, other=0.0)
        acc_lo += _rows_products(tl.load(w_lo + offs_k, mask=k_mask, other=0.0), x)
        acc_hi += _rows_products(tl.load(w_hi + offs_k, mask=k_mask, other=0.0), x)
    pdl_launch(USE_PDL)
    y_lo, y_hi = tl.sum(acc_lo, axis=2), tl.sum(acc_hi, axis=2)
    if W_SCALED:
        s_lo, s_hi = _pair_scales(ws_ptr, lo, D, W_SCALED)
        y_lo, y_hi = y_lo * s_lo, y_hi * s_hi
    if P_PAD > 0:
        rstd = _partials_rstd(ss, K, eps)[:, None]
        y_lo, y_hi = y_lo * rstd, y_hi * rstd
    _rope_store(y_lo, y_hi, head, j, lo, token, (offs_m < M)[:, None],
                x_ptr, b_ptr, qo_ptr, kc_ptr, vc_ptr, index_ptr, pos_ptr, cs_ptr, stride_kcb, stride_kct, stride_kch,
                stride_vcb, stride_vct, stride_vch, stride_cs, H, HKV, k_inv, v_inv, D, BLOCK_SIZE, HAS_BIAS)


@triton.jit
def _qkv_rope_dot_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, qo_ptr, kc_ptr, vc_ptr, index_ptr, pos_ptr, cs_ptr, ss_ptr, M,
                         K, P, stride_wn, stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                         stride_cs, H, HKV, k_inv, v_inv, eps, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, HAS_BIAS: tl.constexpr,
                         NORM_ROWS: tl.constexpr = 0, P_PAD: tl.constexpr = 1, W_SCALED: tl.constexpr = False,
                         USE_PDL: tl.constexpr = False):
    """:func:`_qkv_rope_rows_kernel` in :mod:`kernels.gemv`'s "dot" form, for 2 to 16 tokens: the tokens are the
    padded M side of ``tl.dot``, the PAIRS low and the PAIRS high weight rows of the program's pairs its two N
    sides (as :func:`kernels.gemv.gemv_silu` streams gate and up rows).  ``NORM_ROWS`` > 0: the norm from the
    producer's ``P`` partial sums, as the "dot" matmul applies it."""
    head, j, lo, w_lo, w_hi = _pair_tile(w_ptr, stride_wn, D, PAIRS)
    offs_m = tl.arange(0, 16)
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m[:, None] * K
    acc_lo = tl.zeros([16, PAIRS], tl.float32)
    acc_hi = tl.zeros([16, PAIRS], tl.float32)
    pdl_wait(USE_PDL)
    if NORM_ROWS > 0:
        ss = _load_partials(ss_ptr, P, M, NORM_ROWS, P_PAD)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)[None, :]
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k, mask=m_mask[:, None] & k_mask, other=0.0)
        w_lo_k = tl.load(w_lo + offs_k, mask=k_mask, other=0.0).to(x.dtype)  # FP8 widened (a no-op otherwise)
        w_hi_k = tl.load(w_hi + offs_k, mask=k_mask, other=0.0).to(x.dtype)
        acc_lo += tl.dot(x, tl.trans(w_lo_k), input_precision=DOT_PREC)
        acc_hi += tl.dot(x, tl.trans(w_hi_k), input_precision=DOT_PREC)
    pdl_launch(USE_PDL)
    if W_SCALED:
        s_lo, s_hi = _pair_scales(ws_ptr, lo, D, W_SCALED)
        acc_lo, acc_hi = acc_lo * s_lo, acc_hi * s_hi
    if NORM_ROWS > 0:
        rstd = _to_mma_rows(_partials_rstd(ss, K, eps), offs_m, NORM_ROWS)
        acc_lo, acc_hi = acc_lo * rstd, acc_hi * rstd
    _rope_store(acc_lo, acc_hi, head, j, lo, tl.minimum(offs_m, M - 1)[:, None], m_mask[:, None],
                x_ptr, b_ptr, qo_ptr, kc_ptr, vc_ptr, index_ptr, pos_ptr, cs_ptr, stride_kcb, stride_kct, stride_kch,
                stride_vcb, stride_vct, stride_vch, stride_cs, H, HKV, k_inv, v_inv, D, BLOCK_SIZE, HAS_BIAS)


def rope_pairs(config: tuple, head_dim: int) -> Optional[int]:
    """Rotary pairs per program for a :data:`kernels.gemv.CONFIGS` entry, or None where they do not tile half
    a head: a "row" config's BLOCK_N features as BLOCK_N / 2 pairs; a "dot" config's BLOCK_N pairs (2 BLOCK_N
    features, as its SiLU form streams 2 BLOCK_N rows)."""
    form, block_n = config[0], config[1]
    pairs = block_n // 2 if form == "row" else block_n if form == "dot" else 0
    return pairs if pairs >= 1 and (head_dim // 2) % pairs == 0 else None


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *, config: tuple,
             norm: Optional[tuple[torch.Tensor, float]], residual: Optional[torch.Tensor], positions: torch.Tensor,
             cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kv_index: torch.Tensor, sumsq: Optional[tuple[torch.Tensor, float]] = None,
             kv_scale: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``rope_kv_write(split(linear(rms_norm(x + residual)))))``: one token with the norm (``norm=(w, eps)``),
    or 1 to ``ROW_MAX_M`` tokens of an already normed x (``norm=None``, no residual), or of the residual
    stream before a norm folded into the weight (``sumsq=(partial sums, eps)`` from
    :func:`kernels.gemv.gemv_residual`: the norm's rsqrt scales the sums, as :func:`kernels.gemv.gemv_silu`).

    x ``[M, hidden]`` contiguous; weight ``[(H + 2 Hkv) D, hidden]`` (q|k|v rows); caches
    ``[num_blocks, block_size, Hkv, D]``; positions, kv_index ``[M]`` on the device; cos_sin_cache as
    :func:`kernels.kv_write.rope_kv_write` takes it; a "row" ``config`` that fits M rows
    (:func:`kernels.gemv.config_fits`), or without the norm a "dot" one (:func:`_qkv_rope_dot_kernel`).
    ``kv_scale``: an FP8 cache's (K, V) scales (stored = value / scale).
    Returns (rotated q ``[M, H, D]``, the residual sum as :func:`kernels.gemv_row.gemv_prologue` returns it,
    None without the norm).
    """
    _, block_size, hkv, d = k_cache.shape
    pairs = rope_pairs(config, d)
    m, (n, k) = x.shape[0], weight.shape
    heads = n // d
    assert pairs is not None and config_fits(config, m) and (norm is None or m == 1), (config, d, m)
    assert config[0] == "row" or (norm is None and m <= MAX_M), "the 'dot' form takes 1-16 already normed tokens"
    assert n % d == 0 and heads > 2 * hkv and x.dim() == 2 and x.shape[1] == k and x.is_contiguous()
    assert weight.stride(1) == 1 and v_cache.shape == k_cache.shape and k_cache.stride(3) == 1
    assert v_cache.stride(3) == 1 and positions.shape == (m,) and kv_index.shape == (m,)
    assert cos_sin_cache.stride(1) == 1 and (norm is not None or residual is None)
    q_out = torch.empty(m, heads - 2 * hkv, d, dtype=x.dtype, device=x.device)
    _, _, block_k, num_warps, num_stages = config
    grid = (heads * (d // 2 // pairs),)
    weight, ws, scaled = weight_args(weight)
    b = bias if bias is not None else weight
    caches = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
              v_cache.stride(2), cos_sin_cache.stride(0), heads - 2 * hkv, hkv, *inverse_scales(kv_scale))
    meta = dict(D=d, BLOCK_SIZE=block_size, PAIRS=pairs, BLOCK_K=block_k, HAS_BIAS=bias is not None, W_SCALED=scaled,
                num_warps=num_warps, num_stages=num_stages, **pdl_args(x))
    if norm is None:
        ss, eps = sumsq if sumsq is not None else (x, 0.0)
        if sumsq is not None:
            assert ss.dtype == torch.float32 and ss.dim() == 2 and ss.shape[1] == m and ss.is_contiguous(), ss.shape
            assert loads_at_once(ss.shape[0], m), ss.shape
        p_pad = triton.next_power_of_2(ss.shape[0]) if sumsq is not None else 0
        args = (x, weight, ws, b, q_out, k_cache, v_cache, kv_index, positions, cos_sin_cache, ss, m, k, ss.shape[0],
                weight.stride(0), *caches, eps)
        if m > 0 and config[0] == "dot":
            _qkv_rope_dot_kernel[grid](*args, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
                                       NORM_ROWS=_rows_pad(m) if sumsq is not None else 0, P_PAD=max(1, p_pad), **meta)
        elif m > 0:
            _qkv_rope_rows_kernel[grid](*args, M_PAD=_rows_pad(m), P_PAD=p_pad, **meta)
        return q_out, None
    assert sumsq is None, "sumsq= is for 2-8 tokens without norm="
    nw, eps = norm
    add = residual is not None
    rout = torch.empty_like(x) if add else x
    _qkv_rope_kernel[grid](x, residual if add else x, nw, rout, weight, ws, b, q_out, k_cache, v_cache, kv_index,
                           positions, cos_sin_cache, k, weight.stride(0), eps, *caches, ADD=add, LANES=lanes(weight),
                           **meta)
    return q_out, rout
