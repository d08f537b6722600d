"""FP8 (e4m3) weights with per-output-channel scales, and the quantization math the kernels share.

A weight ``W [N, K]`` is stored as ``q = fp8(W / s)`` with ``s [N] = max|W[n, :]| / 448`` in float32
(448: the largest e4m3 value), and every product is ``y[m, n] = s[n] * sum_k x[m, k] q[n, k]``, the
scale applied once to the float32 sums (a per-output-channel scale commutes with the sum over K).
Two ways to run it, chosen by the number of rows:

- up to 8 rows (decode): W8A16, the skinny matmuls of :mod:`kernels.gemv` load the FP8 weight and
  widen it in registers (``weight_args``: the data pointer, the scales and the ``W_SCALED`` flag);
- more rows (larger batches, prefill): W8A8, each row of x quantized with its own dynamic scale
  (``xs[m] = max|x[m, :]| / 448``; the row times its reciprocal) and the FP8 tensor cores sum
  ``q_x q_w^T`` in float32, scaled by ``xs[m] * s[n]`` (:mod:`kernels.matmul_fp8`).

The torch functions here are the reference (and the CPU's emulation): :func:`fp8_linear_ref`
follows the same rule with the same roundings, so the CPU runs the GPU's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["FP8", "FP8_MAX", "MIN_SCALE", "W8A16_MAX_ROWS", "Fp8Weight", "quantize_weight", "quantize_rows_ref",
           "fp8_linear_ref", "weight_args"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Rows a linear runs W8A16 (skinny matmul, exact activations) up to; above it, W8A8 (tensor cores).
W8A16_MAX_ROWS = 8
MIN_SCALE = 1e-12  # an all-zero row or channel: any positive scale gives zeros


@dataclass
class Fp8Weight:
    """``[N, K]`` FP8 values and ``[N]`` float32 scales; ``dtype`` is the activations' (the model dtype).  A
    mixture-of-experts stack is ``[E, N, K]`` with ``[E, N]`` scales (each expert's rows scaled as a linear's)."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        assert self.data.dtype == FP8 and self.data.dim() in (2, 3), (self.data.dtype, self.data.shape)
        assert self.scale.dtype == torch.float32 and self.scale.shape == self.data.shape[:-1], self.scale.shape

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def stride(self, dim: int) -> int:
        return self.data.stride(dim)

    def dim(self) -> int:
        return self.data.dim()

    def split(self, sizes: list[int]) -> list["Fp8Weight"]:
        """Views of consecutive output rows (a fused q|k|v or gate|up back into its projections)."""
        return [Fp8Weight(d, s, self.dtype) for d, s in zip(self.data.split(sizes), self.scale.split(sizes))]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q * s`` in float32, then ``dtype``."""
        return (self.data.float() * self.scale[..., None]).to(dtype)


def quantize_weight(w: torch.Tensor, dtype: Optional[torch.dtype] = None) -> Fp8Weight:
    """Per-output-channel FP8 of ``w [N, K]`` (any float dtype; a stack ``[E, N, K]``: each expert's rows), the
    scale chosen so that each row's largest magnitude maps to 448; ``dtype``: the activations' (default: w's)."""
    if w.dim() == 3:
        flat = quantize_weight(w.reshape(-1, w.shape[-1]), dtype)
        return Fp8Weight(flat.data.view(w.shape), flat.scale.view(w.shape[:-1]), flat.dtype)
    assert w.dim() == 2 and w.is_floating_point(), (w.shape, w.dtype)
    scale = (w.abs().amax(dim=1).float() / FP8_MAX).clamp_min(MIN_SCALE)
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    for lo in range(0, w.shape[0], 4096):  # float32 temporaries of a few rows at a time
        rows = slice(lo, lo + 4096)
        q[rows] = (w[rows].float() / scale[rows, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q, scale, dtype or w.dtype)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic FP8 of activations ``x [M, K]``: ``(fp8(x * (1 / xs)[:, None]), xs [M] float32)``, each
    row multiplied by its scale's reciprocal (rounded once), as the kernels do."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # divided by tensors: torch on CUDA multiplies by the reciprocal of a Python number (a last bit off the
    # kernels' division, and so values on the other side of a rounding midpoint)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)
    inv = torch.ones_like(scale) / scale
    return (xf * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_ref(x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor] = None,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``F.linear(x, W)`` as the kernels compute it: up to :data:`W8A16_MAX_ROWS` rows of x as they are, more
    rows quantized per row (W8A8); float32 sums scaled once, bias added, rounded to ``out_dtype`` (x's)."""
    out_dtype = out_dtype or x.dtype
    q = weight.data.float()
    if x.shape[0] <= W8A16_MAX_ROWS:
        y = (x.float() @ q.T) * weight.scale[None, :]
    else:
        xq, xs = quantize_rows_ref(x)
        y = (xq.float() @ q.T) * (xs[:, None] * weight.scale[None, :])
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def weight_args(weight) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """What a skinny-matmul launch passes for ``weight`` (a tensor or an :class:`Fp8Weight`): ``(values,
    scales, W_SCALED)``; a plain weight passes itself as the (unread) scale pointer."""
    if isinstance(weight, Fp8Weight):
        return weight.data, weight.scale, True
    return weight, weight, False
