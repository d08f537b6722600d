"""Pure-torch references for the Triton kernels in this package.

Nothing here imports Triton.  Each op is stated here once: the torch backend
(:mod:`executor_proc.backends.torch_backend`) runs the norm, activation, rotary and
KV-write statements below, and the kernel tests compare the Triton kernels with them.
The attention references favour clarity over speed (they loop over rows and read
``block_tables`` / ``context_lens`` on the host); the fast paths are the
Triton kernels.  Sampling's reference lives in :mod:`kernels.sampling_ref`
because it is also the CPU executor's production sampler.

Shapes and conventions (shared with the kernels):

* KV cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token at
  flat index ``s`` (``kv_index``) lives at ``cache[s // block_size, s % block_size]``.
* Grouped-query attention: query head ``h`` reads KV head ``h // (H // Hkv)``
  (HF ``repeat_kv`` order).
* Rotary: neox / HF-Llama "rotate half"; ``cos_sin_cache[pos] = cat(cos, sin)``,
  each half ``head_dim // 2`` wide (see :func:`rope_cos_sin_cache`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = [
    "DecodeRows",
    "decode_rows_ref",
    "gather_kv",
    "decode_attention_ref",
    "prefill_attention_ref",
    "kv_store",
    "kv_write_ref",
    "rope_cos_sin",
    "apply_rope",
    "rope_cos_sin_cache",
    "rope_ref",
    "rope_kv_write_ref",
    "rms_norm_ref",
    "fused_add_rms_norm_ref",
    "silu_and_mul_ref",
]


# --------------------------------------------------------------------------- attention


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence, ``[length, Hkv, D]``."""
    block_size = cache.shape[1]
    nb = (length + block_size - 1) // block_size
    blocks = cache[block_table_row[:nb].long()]  # [nb, bs, Hkv, D]
    return blocks.reshape(nb * block_size, *cache.shape[2:])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: Optional[torch.Tensor]) -> torch.Tensor:
    """q [M, H, D], k/v [L, Hkv, D] -> [M, H, D] in float32 (mask [M, L], True = visible)."""
    h, hkv = q.shape[1], k.shape[1]
    g = h // hkv
    qf = q.float().transpose(0, 1)  # [H, M, D]
    kf = k.float().repeat_interleave(g, dim=1).transpose(0, 1)  # [H, L, D]
    vf = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, M, L]
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vf).transpose(0, 1)  # [M, H, D]


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """One query token per row attending to its whole context.  ``[B, H, D]``, q's dtype.

    A row with ``context_len == 0`` gives zeros (the kernel's convention for padded rows).
    """
    out = torch.zeros_like(q)
    lens = context_lens.tolist()
    for b, length in enumerate(lens):
        if length <= 0:
            continue
        k = gather_kv(k_cache, block_tables[b], length)
        v = gather_kv(v_cache, block_tables[b], length)
        out[b] = _attend(q[b : b + 1], k, v, scale, None)[0].to(q.dtype)
    return out


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start: torch.Tensor,
                          context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Varlen causal attention over the paged cache.  q ``[T, H, D]`` -> ``[T, H, D]``.

    Row ``r`` owns tokens ``query_start[r]:query_start[r+1]``; its context holds
    ``context_lens[r]`` tokens, the last ``qlen`` of which are the new ones, so the
    ``j``-th new token sits at position ``context_len - qlen + j`` and sees keys
    ``0..position``.
    """
    out = torch.zeros_like(q)
    qs = query_start.tolist()
    lens = context_lens.tolist()
    for r, length in enumerate(lens):
        s0, s1 = qs[r], qs[r + 1]
        qlen = s1 - s0
        if qlen <= 0:
            continue
        k = gather_kv(k_cache, block_tables[r], length)
        v = gather_kv(v_cache, block_tables[r], length)
        pos = torch.arange(length - qlen, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        out[s0:s1] = _attend(q[s0:s1], k, v, scale, mask).to(q.dtype)
    return out


# --------------------------------------------------------------------------- KV write / rotary


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kv_index: torch.Tensor, kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
    """In place: store keys and values ``[T, Hkv, D]`` at their flat cache indices (all valid); an FP8 cache
    stores ``value / scale`` (``kv_scale``: its (K, V) scales)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for x, cache, inv in zip((k, v), (k_cache, v_cache), inverse_scales(kv_scale)):
        x = to_cache_dtype(x, cache.dtype, inv)
        if cache.dtype == torch.float8_e4m3fn:  # no index_copy_ for FP8 on the CPU: the same bytes as uint8
            x, cache = x.view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, kv_index, x)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, inv_scale: float = 1.0) -> torch.Tensor:
    """``x`` as the KV cache stores it: cast, and for an FP8 cache ``x * inv_scale`` in float32 clamped to e4m3's
    +-448 first (as :func:`kernels.kv_write.to_cache` does; a cast alone would make larger values NaN)."""
    if dtype == torch.float8_e4m3fn:
        return (x.float() * inv_scale).clamp(-448.0, 448.0).to(dtype)
    return x.to(dtype)


def inverse_scales(kv_scale: tuple[float, float]) -> tuple[float, float]:
    """``(1 / k_scale, 1 / v_scale)`` rounded to float32: what the cache-writing kernels multiply by.  Every layer
    of every step asks: an unscaled cache's answer comes without making tensors (~9 us on a CPU)."""
    if tuple(kv_scale) == (1.0, 1.0):
        return 1.0, 1.0
    return tuple(float(torch.tensor(1.0 / s, dtype=torch.float32)) for s in kv_scale)


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 kv_index: torch.Tensor) -> None:
    """:func:`kv_store` for every token whose index is >= 0 (the kernel skips padded rows' -1)."""
    keep = kv_index >= 0
    kv_store(k[keep], v[keep], k_cache, v_cache, kv_index[keep].long())


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[T, D]`` float32: ``cat(cos, sin)`` of ``position * inv_freq`` (HF order)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """:func:`rope_cos_sin` of every position below ``max_position``, ``[max_position, D]``.

    ``inv_freq`` is the model's ``[D/2]`` inverse frequencies (Llama-3 rope scaling
    already applied, as :func:`executor_proc.model.llama.rope_inv_freq` returns them).
    """
    return rope_cos_sin(torch.arange(max_position, device=inv_freq.device), inv_freq)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox rotate-half on ``x [T, heads, D]`` by ``cos_sin [T, D]``, in float32, cast back to x's dtype."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half].float(), cos_sin[:, None, half:].float()
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` with the rows of ``cos_sin_cache`` at ``positions`` (the kernel's inputs)."""
    return apply_rope(x, cos_sin_cache[positions.long()])


def rope_kv_write_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, kv_index):
    """Rotate q and k, write rotated k and v into the cache; returns rotated q."""
    q_rot = rope_ref(q, positions, cos_sin_cache)
    k_rot = rope_ref(k, positions, cos_sin_cache)
    kv_write_ref(k_rot, v, k_cache, v_cache, kv_index)
    return q_rot


# --------------------------------------------------------------------------- norm / activation


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm exactly: normalise in float32, cast to x's dtype, times weight."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    y = (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return (weight * y).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (in x's dtype), then RMSNorm of it: ``(normed, residual)``."""
    new_res = (x + residual).to(x.dtype)
    return rms_norm_ref(new_res, weight, eps), new_res


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I]`` (gate | up) -> ``silu(gate) * up`` computed in float32, cast once."""
    i = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :i]) * xf[..., i:]).to(x.dtype)


class DecodeRows(NamedTuple):
    """A decode step's per-row inputs (:mod:`kernels.decode_rows`)."""

    input_ids: torch.Tensor  # [B] last_token[slot]
    kv_index: torch.Tensor  # [B] int64 flat KV index of the new token; -1 for the padding slot
    query_start: torch.Tensor  # [B + 1] int32 0..B (one query token per row)
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32 block_table[slot]


def decode_rows_ref(slots: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                    last_token: torch.Tensor, block_table: torch.Tensor, pad_slot: int,
                    block_size: int) -> DecodeRows:
    """The rows of a decode step from the slot tables (``slots``, ``positions``, ``context_lens`` ``[B]``)."""
    block_tables = block_table[slots]
    block_ids = block_tables.gather(1, (positions // block_size)[:, None])[:, 0].to(torch.int64)
    kv_index = torch.where(slots == pad_slot, -1, block_ids * block_size + positions % block_size)
    return DecodeRows(input_ids=last_token[slots], kv_index=kv_index,
                      query_start=torch.arange(slots.shape[0] + 1, dtype=torch.int32, device=slots.device),
                      context_lens=context_lens.to(torch.int32), block_tables=block_tables)
