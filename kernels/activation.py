"""Fused SiLU-and-multiply: ``x [T, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[T, I]``.

Computed in float32 and rounded once (HF rounds after the SiLU and again after
the product; the difference is within one ulp of the model dtype).
Grid ``(T, cdiv(I, BLOCK))``; launched with PDL (:mod:`kernels.pdl`).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_launch, pdl_wait
from .reference import silu_and_mul_ref  # noqa: F401

__all__ = ["silu_and_mul", "silu_and_mul_ref"]


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
