"""Skinny matmul for decode: ``y [M, N] = x [M, K] @ W[N, K]^T (+ b)`` with small M (<= 16).

At M = 1..8 a projection is a pure weight stream; cuBLAS's heuristics leave
some shapes at 50-60% of the copy bandwidth on an H100 (Llama-3-8B's o_proj:
21 us for 33.5 MB, 64 CTAs on 132 SMs).  One program owns ``BLOCK_N`` output
features and streams their weight rows along K in ``BLOCK_K`` chunks
(contiguous loads, ``num_stages`` in flight), accumulating in float32 and
rounding once, like cuBLAS.  Two forms:

- ``"dot"``: the M rows of x are the padded M dimension of ``tl.dot`` (any M <= 16);
- ``"row"``: M = 1 only; elementwise products accumulated per (feature, k lane)
  and reduced once at the end (no tensor-core layout shuffles).

No split-K and no atomics, so the result is deterministic.

Whether it beats cuBLAS depends on the shape: :func:`executor_proc.backends.triton_backend`
times both (and the configs in :data:`CONFIGS`) on the model's own weights at
start-up and keeps the faster per (N, K, M).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


__all__ = ["gemv", "CONFIGS", "MAX_M"]

MAX_M = 16
# (form, BLOCK_N, BLOCK_K, num_warps, num_stages); "row" configs serve M = 1 only.
CONFIGS = (("dot", 16, 256, 4, 4), ("dot", 16, 512, 4, 3), ("dot", 32, 256, 4, 4), ("dot", 64, 128, 4, 4),
           ("row", 4, 1024, 4, 4), ("row", 8, 512, 4, 4), ("row", 16, 512, 8, 3), ("row", 16, 256, 4, 4))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def config_fits(config: tuple, m: int) -> bool:
    """Whether a :data:`CONFIGS` entry serves ``m`` rows."""
    return config[0] == "dot" or m == 1


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
         config: tuple = CONFIGS[0], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x ``[M, K]`` with ``M <= 16``; weight ``[N, K]``, both K-contiguous."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.shape[0] <= MAX_M and x.stride(1) == 1 and weight.stride(1) == 1
    assert x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    M, K = x.shape
    N = weight.shape[0]
    if bias is not None:
        assert bias.shape == (N,) and bias.stride(0) == 1
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1
    if M == 0:
        return out
    form, block_n, block_k, num_warps, num_stages = config
    assert config_fits(config, M), (config, M)
    if form == "row":
        _gemv_row_kernel[(triton.cdiv(N, block_n),)](
            x, weight, bias if bias is not None else weight, out, N, K, weight.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        )
        return out
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, M_PAD=16, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )
    return out
