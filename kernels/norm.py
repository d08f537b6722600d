"""RMSNorm and fused residual-add + RMSNorm (HF LlamaRMSNorm semantics).

``rms_norm(x, w)``: ``y = w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` - the
normalised value is rounded to x's dtype *before* the weight multiply, exactly as
HF does (the product is then rounded again), so results match HF bit for bit up
to the rsqrt / summation order.

``fused_add_rms_norm(x, residual, w)``: ``residual = (x + residual).to(dtype)``
(HF adds in the model dtype), then ``rms_norm(residual, w)``; returns
``(normed, residual)``.  Either output may alias its input (pass ``out=x`` /
``residual_out=residual``): each program reads its row before writing it.

``rms_norm_fp8(x, w, residual)``: the same norm (after the add, where there is a residual) with its
rounded output quantized per row for an FP8 matmul (:func:`kernels.matmul_fp8.quantize_rows`'s
arithmetic), in the same launch: the model-dtype output is never written or read back.  Bit for bit
the plain norm's values under the interpreter; compiled for a GPU, the row's sum of squares may round
differently in this form (on an H200, 1 and 5 of 8M and 16M e4m3 values one step apart at widths
4,096 and 8,192 without a residual; none with one, none at 1,024).

One program per row, the whole row in registers (``BLOCK = next_pow2(N)``; N up
to 16384).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .e4m3 import row_scale, scaled_to_e4m3
from .fp8 import FP8
from .pdl import pdl_args, pdl_launch, pdl_wait
from .reference import fused_add_rms_norm_ref, rms_norm_ref  # noqa: F401

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_fp8", "rms_norm_ref", "fused_add_rms_norm_ref"]


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps,
    BLOCK: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr = False, s_ptr=None, QUANT: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: safe before the wait
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(rout_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    pdl_launch(USE_PDL)
    h = (w * y).to(x_ptr.dtype.element_ty)
    if QUANT:  # the rounded output quantized for an FP8 matmul: out is e4m3, s_ptr the row's scale
        hf = h.to(tl.float32)
        scale = row_scale(tl.max(tl.abs(hf), axis=0))
        tl.store(s_ptr + row, scale)
        tl.store(out_ptr + row * stride_o + offs, scaled_to_e4m3(hf, scale), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + offs, h, mask=mask)


def _check(x, weight):
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, N] with a contiguous last dim"
    assert weight.shape == (x.shape[1],) and weight.stride(0) == 1
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert x.shape[1] <= 16384


def _warps(n):
    return 1 if n <= 512 else (4 if n <= 4096 else 8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x ``[T, N]``, weight ``[N]`` -> ``[T, N]`` in x's dtype."""
    _check(x, weight)
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(1) == 1
    T, N = x.shape
    if T:
        _rms_norm_kernel[(T,)](x, x, weight, out, out, x.stride(0), 0, out.stride(0), 0, N, eps,
                               BLOCK=triton.next_power_of_2(N), ADD=False, num_warps=_warps(N), **pdl_args(x))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       out: Optional[torch.Tensor] = None,
                       residual_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual_out = x + residual``; ``out = rms_norm(residual_out)``.  Returns both."""
    _check(x, weight)
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
    if out is None:
        out = torch.empty_like(x)
    if residual_out is None:
        residual_out = torch.empty_like(x)
    assert out.shape == x.shape and residual_out.shape == x.shape
    assert out.stride(1) == 1 and residual_out.stride(1) == 1 and residual_out.dtype == x.dtype
    T, N = x.shape
    if T:
        _rms_norm_kernel[(T,)](x, residual, weight, out, residual_out,
                               x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
                               N, eps, BLOCK=triton.next_power_of_2(N), ADD=True, num_warps=_warps(N),
                               **pdl_args(x))
    return out, residual_out


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_rows(rms_norm(x + residual))`` in one launch: ``(q [T, N] e4m3, scales [T] float32, the residual
    stream)`` (the stream: ``x + residual`` in a new tensor, or x itself without a residual)."""
    _check(x, weight)
    T, N = x.shape
    q = torch.empty(T, N, dtype=FP8, device=x.device)
    s = torch.empty(T, dtype=torch.float32, device=x.device)
    if residual is None:
        stream = x
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        stream = torch.empty_like(x)
    if T:
        _rms_norm_kernel[(T,)](x, x if residual is None else residual, weight, q, stream, x.stride(0),
                               0 if residual is None else residual.stride(0), q.stride(0), stream.stride(0), N, eps,
                               BLOCK=triton.next_power_of_2(N), ADD=residual is not None, num_warps=_warps(N),
                               s_ptr=s, QUANT=True, **pdl_args(x))
    return q, s, stream
