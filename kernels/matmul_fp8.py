"""W8A8 matmul for FP8 weights at more than 8 rows (larger decode batches, prefill): FP8 tensor cores.

``y [M, N] = (q_x q_w^T) * xs[:, None] * s[None, :] (+ b)``, rounded once to x's dtype, where
``q_x, xs = quantize_rows(x)`` is each row of x in e4m3 with its own dynamic scale (one launch,
:func:`quantize_rows`) and ``q_w, s`` the per-output-channel FP8 weight (:class:`kernels.fp8.Fp8Weight`).
Two kernels do the product, and the start-up tuner keeps the faster per (shape, batch size)
(:func:`executor_proc.backends.gemv_tuning.matmul_jobs`):

- ``torch._scaled_mm`` with row-wise scales (cuBLASLt's FP8 GEMM; bf16 output only), the default;
- :func:`fp8_matmul`, a Triton ``tl.dot`` on e4m3 tiles (any output dtype, PDL-launched).  On Hopper its tiles
  come in through the TMA unit (host-side tensor descriptors; ``FORERUN_FP8_TMA=0``: per-thread loads): the same
  products in the same order, bit for bit, and on an H200 (8B shapes, one weight at a time past the L2) within 1%
  at 64 rows, up to 11% less time at 128-256 (down at 256 rows: 30.1 -> 26.8 us; docs/performance.md).

Both equal :func:`kernels.fp8.fp8_linear_ref` up to the order of the float32 sums.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .e4m3 import row_scale, scaled_to_e4m3
from .fp8 import FP8, Fp8Weight
from .pdl import pdl_args, pdl_launch, pdl_wait

try:  # host-side tensor descriptors (Triton >= 3.4): the TMA form on Hopper
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer form everywhere
    TensorDescriptor = None

__all__ = ["Fp8MatmulConfig", "FP8_MATMUL_CONFIGS", "quantize_rows", "fp8_matmul", "scaled_mm", "w8a8_linear",
           "w8a8_quantized"]

QUANT_BLOCK_K = 1024
ONE_PASS_MAX_K = 16384


class Fp8MatmulConfig(NamedTuple):
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


# Candidates the tuner times against cuBLASLt: small-M tiles for decode batches, wide ones for prefill.  At 16-128
# rows on an H200 (8B shapes, docs/performance.md) the weight streams need deep pipelines and, for the narrow
# weights (N = 4,096), narrow tiles: 64 x 32 puts 128 programs on 132 SMs where 64 x 64 leaves half of them idle.
# At 256 rows 64 x 128 tiles 256 deep beat cuBLASLt on the narrow weights (o 9.9 against 13.8 us, down 29.2
# against 36.9), 128 x 256 x 4 stages on gate|up (52.9 against 55.4) and 128 x 128 x 5 stages tie it on q|k|v.
# A tile whose stages do not fit a GPU's shared memory fails to build there and the tuner passes over it.
FP8_MATMUL_CONFIGS = (Fp8MatmulConfig(64, 128, 128, 4, 4), Fp8MatmulConfig(64, 64, 256, 4, 5),
                      Fp8MatmulConfig(64, 32, 256, 4, 7), Fp8MatmulConfig(64, 64, 256, 4, 6),
                      Fp8MatmulConfig(128, 128, 128, 8, 4), Fp8MatmulConfig(128, 256, 128, 8, 3),
                      Fp8MatmulConfig(64, 128, 256, 4, 4), Fp8MatmulConfig(128, 256, 128, 8, 4),
                      Fp8MatmulConfig(128, 128, 128, 8, 5))


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr,
                          ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One program per row: its absolute maximum, then the row divided by ``max / 448`` in e4m3 (``ONE_PASS``:
    the whole row held in registers, read once; else read twice, a chunk at a time)."""
    row = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    if ONE_PASS:
        offs = tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), axis=0))
        tl.store(s_ptr + row, scale)
        tl.store(q_ptr + row * stride_qm + offs, scaled_to_e4m3(x, scale), mask=offs < K)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = row_scale(tl.max(amax, axis=0))
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * stride_qm + offs, scaled_to_e4m3(x, scale), mask=offs < K)
    pdl_launch(USE_PDL)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.fp8.quantize_rows_ref` in one launch: ``(q [M, K] e4m3, xs [M] float32)``."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        width = triton.next_power_of_2(K)
        one_pass = width <= ONE_PASS_MAX_K  # at most 64 values a thread
        _quantize_rows_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0),
                                    BLOCK_K=width if one_pass else QUANT_BLOCK_K, ONE_PASS=one_pass,
                                    num_warps=8 if width > 4096 else 4, **pdl_args(x))
    return q, s


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (row tile, column tile), in grouped order: GROUP_M row tiles share each weight tile while it
    is in L2."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * tiles_n)) % size_m, (pid % (GROUP_M * tiles_n)) // size_m


@triton.jit
def _store_scaled(acc, xs_ptr, ws, b_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS: tl.constexpr):
    """``acc * xs[m] * s[n] (+ b)``, rounded once to y's dtype."""
    xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    acc = acc * (xs[:, None] * ws[None, :])
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _fp8_matmul_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, USE_PDL: tl.constexpr = False):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    ws = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    pdl_wait(USE_PDL)  # x and its scales are the step's data
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    pdl_launch(USE_PDL)
    _store_scaled(acc, xs_ptr, ws, b_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS)


@triton.jit
def _fp8_matmul_tma_kernel(x_desc, xs_ptr, w_desc, ws_ptr, b_ptr, y_ptr, M, N, K, stride_ym, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    """:func:`_fp8_matmul_kernel` with its tiles brought in by the TMA unit (tensor descriptors of x and w; the
    descriptor's bounds zero what lies past M, N or K): no per-thread addresses or masks in the loop."""
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    ws = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    pdl_wait(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        acc = tl.dot(x_desc.load([pid_m * BLOCK_M, k0]), w_desc.load([pid_n * BLOCK_N, k0]).T, acc)
    pdl_launch(USE_PDL)
    _store_scaled(acc, xs_ptr, ws, b_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS)


@functools.cache
def _tma_supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("FORERUN_FP8_TMA", "1") == "0":
        return False
    return TensorDescriptor is not None and torch.cuda.get_device_capability(device_index) >= (9, 0)


def _takes_tma(xq: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether the TMA form serves this product: Hopper or later, both operands' rows 16-byte aligned."""
    if not xq.is_cuda or not _tma_supported(xq.device.index if xq.device.index is not None
                                            else torch.cuda.current_device()):
        return False
    return all(t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (xq, weight.data))


def fp8_matmul(xq: torch.Tensor, xs: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor] = None, *,
               config: Fp8MatmulConfig = FP8_MATMUL_CONFIGS[0],
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(xq wq^T) * xs[:, None] * s[None, :] (+ bias)`` on the FP8 tensor cores, rounded to ``out_dtype``."""
    M, K = xq.shape
    N = weight.shape[0]
    assert xq.dtype == FP8 and xq.stride(1) == 1 and weight.shape[1] == K and weight.stride(1) == 1
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    bm, bn, bk, num_warps, num_stages = config
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    b = bias if bias is not None else weight.scale
    launch = dict(HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=num_warps,
                  num_stages=num_stages, **pdl_args(xq))
    if _takes_tma(xq, weight):
        _fp8_matmul_tma_kernel[grid](TensorDescriptor.from_tensor(xq, [bm, bk]), xs,
                                     TensorDescriptor.from_tensor(weight.data, [bn, bk]), weight.scale, b, out, M, N, K,
                                     out.stride(0), **launch)
    else:
        _fp8_matmul_kernel[grid](xq, xs, weight.data, weight.scale, b, out, M, N, K, xq.stride(0), weight.stride(0),
                                 out.stride(0), **launch)
    return out


def scaled_mm(xq: torch.Tensor, xs: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor] = None, *,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The same product through ``torch._scaled_mm`` with row-wise scales (cuBLASLt; bf16 output)."""
    return torch._scaled_mm(xq, weight.data.t(), scale_a=xs[:, None], scale_b=weight.scale[None, :],
                            bias=bias, out_dtype=out_dtype)


def scaled_mm_fits(weight: Fp8Weight, out_dtype: torch.dtype) -> bool:
    """cuBLASLt's row-wise FP8 GEMM takes bf16 outputs and N, K multiples of 16."""
    n, k = weight.shape
    return out_dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def w8a8_linear(x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor] = None,
                config: Optional[Fp8MatmulConfig] = None) -> torch.Tensor:
    """``F.linear(x, W)`` for an FP8 weight at any number of rows, W8A8: the rows quantized (one launch), then
    :func:`fp8_matmul` with ``config``, or (None) cuBLASLt where it fits."""
    if x.stride(1) != 1:
        x = x.contiguous()
    return w8a8_quantized(*quantize_rows(x), weight, bias, config, x.dtype)


def w8a8_quantized(xq: torch.Tensor, xs: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor],
                   config: Optional[Fp8MatmulConfig], out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`w8a8_linear` of rows already quantized (by the kernel that made them: :func:`kernels.norm.rms_norm_fp8`,
    :func:`kernels.activation.silu_and_mul_fp8`)."""
    if config is None and scaled_mm_fits(weight, out_dtype):
        return scaled_mm(xq, xs, weight, bias, out_dtype=out_dtype)
    return fp8_matmul(xq, xs, weight, bias, config=config or FP8_MATMUL_CONFIGS[0], out_dtype=out_dtype)
