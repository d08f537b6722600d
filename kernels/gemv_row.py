"""One token's skinny matmul, the "row" form of :mod:`kernels.gemv` for M = 1, with the op before it optionally
folded into its loads.

:func:`gemv_prologue`: RMSNorm (with the residual add; every program sums the row's squares itself, an
L2-resident read of K values, rather than wait for another launch) or SiLU-mul of a gate|up row.  At batch 1
the norm and activation launches cost about as much as a small projection; whether the fused form wins is
measured per weight at start-up (:func:`executor_proc.backends.gemv_tuning.tune_prologues`).

:func:`kernels.gemv.gemv` launches the same kernel without a prologue for one row.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .fp8 import weight_args
from .pdl import pdl_args, pdl_launch, pdl_wait

__all__ = ["gemv_prologue", "lanes"]


@triton.jit
def _prologue_row(x_ptr, r_ptr, nw_ptr, offs_k, k_mask, K, rstd, PROLOGUE: tl.constexpr, ADD: tl.constexpr):
    """x's chunk ``offs_k`` as the matmul reads it, float32 (see :func:`gemv_prologue`)."""
    dt = x_ptr.dtype.element_ty
    if PROLOGUE == 2:  # silu(gate) * up, x = [gate | up]
        g = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        x = (g / (1.0 + tl.exp(-g)) * u).to(dt).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
        if ADD:
            x = (x.to(tl.float32) + tl.load(r_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)).to(dt)
        x = x.to(tl.float32)
        if PROLOGUE == 1:  # HF's RMSNorm: normalised value rounded, times the weight, rounded again
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = ((x * rstd).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)
    return x


@triton.jit
def _norm_rstd(x_ptr, r_ptr, rout_ptr, K, eps, writer, ADD: tl.constexpr, BLOCK_K: tl.constexpr):
    """RMSNorm's ``rsqrt(mean(x^2) + eps)`` of ``x (+ r)``; every program sums the (K-value, L2-resident)
    row itself rather than wait for another launch.  With ``ADD`` the ``writer`` program also stores the
    sum ``x + r`` to ``rout`` (a new tensor: the other programs still read x and r)."""
    k_out = tl.where(writer, K, 0)
    ss = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = _prologue_row(x_ptr, r_ptr, x_ptr, offs_k, k_mask, K, 1.0, 0, ADD)
        ss += x * x
        if ADD:
            tl.store(rout_ptr + offs_k, x.to(rout_ptr.dtype.element_ty), mask=offs_k < k_out)
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _fold(products, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LANES: tl.constexpr):
    """A chunk's products as the accumulator holds them: summed over each thread's ``LANES`` values of a 16-byte
    weight load first (16 of e4m3, 8 of bfloat16), so that the accumulator takes 1 / LANES of the registers it
    would (H200, 8B shapes, FP8 at one row: 121 -> 71 registers at 8 x 1024 tiles, q|k|v 8.19 -> 7.47 us)."""
    return tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // LANES, LANES]), axis=2)


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, rout_ptr, N, K, stride_wn, eps,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PROLOGUE: tl.constexpr = 0, ADD: tl.constexpr = False, W_SCALED: tl.constexpr = False,
                     USE_PDL: tl.constexpr = False, LANES: tl.constexpr = 8):
    """``W_SCALED``: w is FP8 with per-row scales at ``ws`` (:mod:`kernels.fp8`), applied to the sums.  ``LANES``:
    :func:`lanes` of the weight."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    # The first weight tile streams in while the previous kernel ends (weights are never written in flight).
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    ws = tl.load(ws_ptr + offs_n, mask=n_mask & W_SCALED, other=1.0)
    pdl_wait(USE_PDL)
    rstd = 1.0
    if PROLOGUE == 1:
        rstd = _norm_rstd(x_ptr, r_ptr, rout_ptr, K, eps, pid == 0, ADD, BLOCK_K)
    acc = _fold(w.to(tl.float32) * _prologue_row(x_ptr, r_ptr, nw_ptr, offs_k, k_mask, K, rstd, PROLOGUE, ADD)[None, :],
                BLOCK_N, BLOCK_K, LANES)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = _prologue_row(x_ptr, r_ptr, nw_ptr, offs_k, k_mask, K, rstd, PROLOGUE, ADD)
        acc += _fold(w.to(tl.float32) * x[None, :], BLOCK_N, BLOCK_K, LANES)
    pdl_launch(USE_PDL)
    y = tl.sum(acc, axis=1)
    if W_SCALED:
        y = y * ws
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if y_ptr.dtype.element_ty != tl.float32:  # rounded as F.linear rounds; a float32 out (logits) unrounded
        y = y.to(x_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def lanes(weight: torch.Tensor) -> int:
    """The values of one 16-byte load of ``weight``'s rows (the row kernel's in-thread partial sums)."""
    return 16 // weight.element_size()


def gemv_prologue(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *, config: tuple,
                  norm: Optional[tuple[torch.Tensor, float]] = None, residual: Optional[torch.Tensor] = None,
                  silu: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One token's matmul with the op before it folded into its loads (a "row" config, M = 1).

    - ``norm=(w, eps)``: ``y = linear(rms_norm(x + residual, w, eps))`` and the sum ``x + residual``
      is returned too (a new tensor; ``x`` itself without ``residual``), rounded as
      :func:`kernels.norm.fused_add_rms_norm` rounds;
    - ``silu=True``: x is ``[1, 2K]`` (gate | up) and ``y = linear(silu(gate) * up)``.

    Returns ``(y, residual sum or None)``.  Saves the norm's or the activation's launch and its
    round trip through memory, which at batch 1 cost about as much as a small projection.
    """
    assert (norm is not None) != silu, "exactly one of norm= and silu="
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1 and weight.stride(1) == 1, (x.shape, x.stride())
    assert config[0] == "row", config
    N, K = weight.shape
    assert x.shape[1] == (2 * K if silu else K) and x.dtype == weight.dtype, (x.shape, weight.shape)
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    nw, eps = norm if norm is not None else (x, 0.0)
    add = residual is not None
    rout = torch.empty_like(x) if add else x
    if add:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
    if norm is not None:
        assert nw.shape == (K,) and nw.stride(0) == 1
    _, block_n, block_k, num_warps, num_stages = config
    weight, ws, scaled = weight_args(weight)
    _gemv_row_kernel[(triton.cdiv(N, block_n),)](
        x, weight, ws, bias if bias is not None else weight, out, residual if add else x, nw, rout, N, K,
        weight.stride(0), eps, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        PROLOGUE=2 if silu else 1, ADD=add, W_SCALED=scaled, LANES=lanes(weight), num_warps=num_warps,
        num_stages=num_stages, **pdl_args(x),
    )
    return out, (rout if norm is not None else None)
