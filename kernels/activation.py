"""Fused SiLU-and-multiply: ``x [T, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[T, I]``.

Computed in float32 and rounded once (HF rounds after the SiLU and again after
the product; the difference is within one ulp of the model dtype).
Grid ``(T, cdiv(I, BLOCK))``; launched with PDL (:mod:`kernels.pdl`).

:func:`silu_and_mul_fp8`: the same rounded product quantized per row for an FP8 matmul
(:func:`kernels.matmul_fp8.quantize_rows`'s values, bit for bit), one program per row: the
model-dtype product is never written or read back (a prefill's largest activation).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .e4m3 import row_scale, scaled_to_e4m3
from .fp8 import FP8
from .pdl import pdl_args, pdl_launch, pdl_wait
from .reference import silu_and_mul_ref  # noqa: F401

__all__ = ["silu_and_mul", "silu_and_mul_fp8", "silu_and_mul_ref"]

# A row held in registers up to ONE_PASS_MAX_I values (16 warps above 4,096: [2048, 2 x 14336] on an H200 in 54 us,
# 3.5 TB/s being 42; when it divided by the scale, 79 us, against 89 at 8 warps, 83 read twice 2,048 at a time, and
# the plain SiLU-mul then quantize_rows 46 + 56 us); wider rows are read twice, TWO_PASS_BLOCK at a time.
ONE_PASS_MAX_I = 16384
ONE_PASS_WARPS = 16
TWO_PASS_BLOCK = 2048
TWO_PASS_WARPS = 8


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    pdl_wait(USE_PDL)
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_launch(USE_PDL)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_block(x_ptr, offs, mask, I):
    """silu(gate) * up at ``offs`` of a row, rounded to the model dtype, in float32."""
    g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + I + offs, mask=mask, other=0.0).to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, I, BLOCK: tl.constexpr,
                             ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    pdl_wait(USE_PDL)
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        y = _silu_mul_block(x_row, offs, offs < I, I)
        scale = row_scale(tl.max(tl.abs(y), axis=0))
        tl.store(q_row + offs, scaled_to_e4m3(y, scale), mask=offs < I)
    else:  # the largest magnitude first, then the row again (from L2)
        amax = tl.zeros([BLOCK], tl.float32)
        for i0 in range(0, I, BLOCK):
            offs = i0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_silu_mul_block(x_row, offs, offs < I, I)))
        scale = row_scale(tl.max(amax, axis=0))
        for i0 in range(0, I, BLOCK):
            offs = i0 + tl.arange(0, BLOCK)
            tl.store(q_row + offs, scaled_to_e4m3(_silu_mul_block(x_row, offs, offs < I, I), scale), mask=offs < I)
    tl.store(s_ptr + row, scale)
    pdl_launch(USE_PDL)


def silu_and_mul(x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x ``[T, 2I]`` (last dim contiguous) -> ``[T, I]`` in x's dtype."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1, x.shape
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    T, I = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(T, I, dtype=x.dtype, device=x.device)
    assert out.shape == (T, I) and out.dtype == x.dtype and out.stride(1) == 1
    if T:
        block = min(2048, triton.next_power_of_2(I))
        _silu_and_mul_kernel[(T, triton.cdiv(I, block))](x, out, x.stride(0), out.stride(0), I,
                                                         BLOCK=block, num_warps=4 if block >= 1024 else 2,
                                                         **pdl_args(x))
    return out


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(silu_and_mul(x))`` in one launch: ``(q [T, I] e4m3, scales [T] float32)``."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1, x.shape
    T, I = x.shape[0], x.shape[1] // 2
    q = torch.empty(T, I, dtype=FP8, device=x.device)
    s = torch.empty(T, dtype=torch.float32, device=x.device)
    if T:
        width = triton.next_power_of_2(I)
        one_pass = width <= ONE_PASS_MAX_I
        _silu_and_mul_fp8_kernel[(T,)](x, q, s, x.stride(0), q.stride(0), I,
                                       BLOCK=width if one_pass else TWO_PASS_BLOCK, ONE_PASS=one_pass,
                                       num_warps=(ONE_PASS_WARPS if width > 4096 else 4) if one_pass
                                       else TWO_PASS_WARPS, **pdl_args(x))
    return q, s
