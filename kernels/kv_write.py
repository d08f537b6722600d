"""Write new K/V into the paged cache, optionally fused with rotary embedding of q and k.

``kv_index[t]`` is the flat cache index ``block * block_size + offset`` of token
``t``; a negative index skips the token's K/V write (padded rows).  With rotary the
query is still rotated for every token (cheap, and padded rows are ignored later).

Rotary is the neox / HF-Llama "rotate half" form on the full head dim:
``out[:D/2] = x1*cos - x2*sin``, ``out[D/2:] = x2*cos + x1*sin`` with
``cos_sin_cache[pos] = cat(cos, sin)`` float32 ``[max_pos, D]`` built by
:func:`kernels.reference.rope_cos_sin_cache` from the model's ``inv_freq``
(Llama-3 scaling included).  Arithmetic is float32; results are cast to the
output dtype once.

One program per token: it reads all heads of the token's q, k and v (``[heads, D/2]``
tiles) so every access is a contiguous head-dim run.  Models with per-head q and k norms (Qwen3) have them
applied here too, before the rotation (``qk_norm``), rounded as the unfused norm rounds.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .e4m3 import to_e4m3
from .pdl import pdl_args, pdl_launch, pdl_wait
from .reference import inverse_scales, kv_write_ref, rope_cos_sin_cache, rope_kv_write_ref  # noqa: F401

__all__ = ["kv_write", "rope_kv_write", "rope_cos_sin_cache", "kv_write_ref", "rope_kv_write_ref"]


@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, index_ptr, pos_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qot, stride_qoh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    stride_cs, k_inv, v_inv, qw_ptr, kw_ptr, eps,
    H: tl.constexpr, H_PAD: tl.constexpr, HKV: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ROPE: tl.constexpr, QK_NORM: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    offs_kh = tl.arange(0, HKV_PAD)
    kv_mask = (offs_kh < HKV)[:, None] & d_mask[None, :]
    pdl_wait(USE_PDL)  # everything below reads or writes this step's data
    kv_index = tl.load(index_ptr + t).to(tl.int64)

    k_lo = k_ptr + t * stride_kt + offs_kh[:, None] * stride_kh + offs_d[None, :]
    v_lo = v_ptr + t * stride_vt + offs_kh[:, None] * stride_vh + offs_d[None, :]
    k1 = tl.load(k_lo, mask=kv_mask, other=0.0)
    k2 = tl.load(k_lo + HALF, mask=kv_mask, other=0.0)
    pdl_launch(USE_PDL)  # the attention after it may start its prologue
    if QK_NORM:
        k1, k2 = _head_norm(k1, k2, kw_ptr, offs_d, d_mask, eps, HALF)

    if ROPE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)[None, :]
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
        offs_h = tl.arange(0, H_PAD)
        q_mask = (offs_h < H)[:, None] & d_mask[None, :]
        q_lo = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
        q1 = tl.load(q_lo, mask=q_mask, other=0.0)
        q2 = tl.load(q_lo + HALF, mask=q_mask, other=0.0)
        if QK_NORM:
            q1, q2 = _head_norm(q1, q2, qw_ptr, offs_d, d_mask, eps, HALF)
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        qo_lo = qo_ptr + t * stride_qot + offs_h[:, None] * stride_qoh + offs_d[None, :]
        tl.store(qo_lo, (q1 * cos - q2 * sin).to(qo_ptr.dtype.element_ty), mask=q_mask)
        tl.store(qo_lo + HALF, (q2 * cos + q1 * sin).to(qo_ptr.dtype.element_ty), mask=q_mask)
        k1f = k1.to(tl.float32)
        k2f = k2.to(tl.float32)
        k1 = k1f * cos - k2f * sin
        k2 = k2f * cos + k1f * sin

    if kv_index >= 0:
        blk = kv_index // BLOCK_SIZE
        off = kv_index % BLOCK_SIZE
        v1 = tl.load(v_lo, mask=kv_mask, other=0.0)
        v2 = tl.load(v_lo + HALF, mask=kv_mask, other=0.0)
        kc = kc_ptr + blk * stride_kcb + off * stride_kct + offs_kh[:, None] * stride_kch + offs_d[None, :]
        vc = vc_ptr + blk * stride_vcb + off * stride_vct + offs_kh[:, None] * stride_vch + offs_d[None, :]
        tl.store(kc, to_cache(k1, kc_ptr, k_inv), mask=kv_mask)
        tl.store(kc + HALF, to_cache(k2, kc_ptr, k_inv), mask=kv_mask)
        tl.store(vc, to_cache(v1, vc_ptr, v_inv), mask=kv_mask)
        tl.store(vc + HALF, to_cache(v2, vc_ptr, v_inv), mask=kv_mask)


@triton.jit
def _head_norm(x1, x2, w_ptr, offs_d, d_mask, eps, HALF: tl.constexpr):
    """Each head's RMSNorm (Qwen3's q and k norms) on its two halves ``[heads, HALF]``, rounded as
    :func:`kernels.reference.rms_norm_ref` rounds: the normalised value to x's dtype, then times the weight."""
    dt = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    var = (tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * HALF)
    rstd = (1.0 / tl.sqrt(var + eps))[:, None]
    w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0)[None, :].to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0)[None, :].to(tl.float32)
    y1 = (x1f * rstd).to(dt).to(tl.float32)
    y2 = (x2f * rstd).to(dt).to(tl.float32)
    return (w1 * y1).to(dt), (w2 * y2).to(dt)


@triton.jit
def to_cache(x, cache_ptr, inv_scale):
    """``x`` as the cache at ``cache_ptr`` stores it: an FP8 cache (``--kv-cache-dtype fp8``) gets ``x * inv_scale``
    (1 / its layer's scale) in float32, clamped to e4m3's +-448, rounded to nearest even; any other cache x cast."""
    dt = cache_ptr.dtype.element_ty
    if dt == tl.float8e4nv:
        return to_e4m3(tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0))
    return x.to(dt)


def _check_cache(k, v, k_cache, v_cache, kv_index):
    assert k.dim() == 3 and v.shape == k.shape, (k.shape, v.shape)
    T, Hkv, D = k.shape
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape
    assert k_cache.shape[2] == Hkv and k_cache.shape[3] == D, (k_cache.shape, k.shape)
    bs = k_cache.shape[1]
    assert bs & (bs - 1) == 0, "block_size must be a power of two"
    assert D % 2 == 0
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert kv_index.shape == (T,) and kv_index.dtype in (torch.int32, torch.int64)
    return T, Hkv, D, bs


def _launch(q, k, v, q_out, k_cache, v_cache, kv_index, positions, cos_sin_cache, rope, kv_scale=(1.0, 1.0),
            qk_norm=None):
    T, Hkv, D, bs = _check_cache(k, v, k_cache, v_cache, kv_index)
    if T == 0:
        return
    H = q.shape[1]
    half = D // 2
    _rope_kv_write_kernel[(T,)](
        q, k, v, q_out, k_cache, v_cache, kv_index, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        cos_sin_cache.stride(0), *inverse_scales(kv_scale), *(qk_norm or (k, k, 0.0)),
        H=H, H_PAD=triton.next_power_of_2(H), HKV=Hkv, HKV_PAD=triton.next_power_of_2(Hkv),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), BLOCK_SIZE=bs, ROPE=rope, QK_NORM=qk_norm is not None,
        num_warps=4 if (H * D) >= 2048 else 2, **pdl_args(k),
    )


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kv_index: torch.Tensor) -> None:
    """In place: ``k_cache/v_cache[kv_index[t]] = k/v[t]`` for ``kv_index[t] >= 0``.

    k, v ``[T, Hkv, D]`` (last dim contiguous, any token/head strides); caches
    ``[num_blocks, block_size, Hkv, D]``; kv_index ``[T]`` int32/int64 on the device.
    """
    _launch(k, k, v, k, k_cache, v_cache, kv_index, kv_index, k, False)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  kv_index: torch.Tensor, *, q_out: Optional[torch.Tensor] = None,
                  kv_scale: tuple[float, float] = (1.0, 1.0),
                  qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> torch.Tensor:
    """Rotate q and k at ``positions``, write rotated k and v into the cache; return rotated q.
    ``kv_scale``: an FP8 cache's (K, V) scales (stored = value / scale).  ``qk_norm``: ``(q weight [D], k weight
    [D], eps)``: each head of q and k RMS-normalised first (Qwen3), in the same launch.

    q ``[T, H, D]``, k/v ``[T, Hkv, D]`` (last dim contiguous; views of a fused QKV
    output are fine), positions ``[T]`` int, cos_sin_cache ``[max_pos, D]`` float32.
    ``q_out`` may be ``q`` itself (in place); default a new tensor.
    """
    T, Hkv, D, _ = _check_cache(k, v, k_cache, v_cache, kv_index)
    assert q.dim() == 3 and q.shape[0] == T and q.shape[2] == D and q.stride(2) == 1
    assert q.shape[1] % Hkv == 0
    assert positions.shape == (T,) and positions.dtype in (torch.int32, torch.int64)
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == D and cos_sin_cache.dtype == torch.float32
    assert cos_sin_cache.stride(1) == 1
    if q_out is None:
        q_out = torch.empty_like(q)
    assert q_out.shape == q.shape and q_out.stride(2) == 1
    if qk_norm is not None:
        assert qk_norm[0].shape == (D,) and qk_norm[1].shape == (D,)
    _launch(q, k, v, q_out, k_cache, v_cache, kv_index, positions, cos_sin_cache, True, kv_scale, qk_norm)
    return q_out
