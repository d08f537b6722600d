"""Exact top-k per row without ``torch.topk``: a two-stage selection in registers.

``torch.topk`` over a 128k-wide row costs ~150 us at batch 64 on an H100 whatever ``k``
(one radix select per row, a few SMs each).  Here:

1. ``_chunk_top_kernel``, grid ``(S, cdiv(V, BLOCK))``: each program loads a ``BLOCK``-wide
   chunk once and takes its ``k`` largest by ``k`` rounds of "max, then drop the winner"
   in registers, writing ``k`` candidates per chunk;
2. ``_row_top_kernel``, grid ``(S,)``: the same rounds over the row's ``chunks * k``
   candidates.  The row's top ``k`` are among them (each chunk's top ``k`` is).

Every logit travels as one int64 *key*: the order-preserving integer of the float32 value
(``tl_okey``, ``-0.0`` folded into ``+0.0``) in the high half and ``2**31 - 1 - index`` in the
low half.  So one integer max finds the largest value and, among equal values, the lowest
index (deterministic ties), and keys are unique.  ``EMPTY`` (the smallest int64) marks
padding and dropped winners; no real logit maps to it.

The Triton helpers (:func:`tl_pack`, :func:`tl_top_keys`, ...) are shared with
:mod:`kernels.logprobs` (which fuses its logsumexp into stage 1) and
:mod:`kernels.sampling_window` (whose window is per-chunk candidates, sorted in its finish
kernel).  Reference: :func:`top_candidates_ref`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .sampling_hash import tl_okey

__all__ = ["top_candidates", "top_candidates_ref", "tl_pack", "tl_key_value", "tl_key_index", "tl_top_keys",
           "EMPTY", "DEFAULT_CHUNK", "MAX_K"]

EMPTY = -(2**63)
DEFAULT_CHUNK = 4096
MAX_K = 256  # k rounds per program: meant for small k (logprobs: 20, sampler windows: per-chunk 8-32)


@triton.jit
def tl_empty():
    return tl.full((), -9223372036854775807 - 1, tl.int64)


@triton.jit
def tl_pack(x, idx):
    """float32 values and int32 indices -> int64 keys: larger key = larger value, then lower index."""
    return (tl_okey(x).to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64)


@triton.jit
def tl_key_value(key):
    """The float32 value of a key (``-0.0`` comes back as ``+0.0``)."""
    k = (key >> 32).to(tl.int32)
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def tl_key_index(key):
    """The int32 index of a key (the low half holds ``2**31 - 1 - index``)."""
    return 2147483647 - key.to(tl.int32)


@triton.jit
def tl_top_keys(keys, n, OUT: tl.constexpr, FIRST: tl.constexpr):
    """``[OUT]`` vector: slots ``FIRST .. FIRST + n - 1`` hold the ``n`` largest keys, descending; the rest EMPTY."""
    jj = tl.arange(0, OUT)
    res = tl.full([OUT], -9223372036854775807 - 1, tl.int64)
    for i in range(0, n):
        best = tl.max(keys, axis=0)
        res = tl.where(jj == i + FIRST, best, res)
        keys = tl.where(keys == best, -9223372036854775807 - 1, keys)
    return res


@triton.jit
def _chunk_top_kernel(x_ptr, stride_x, cand_ptr, V, NCH, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    m = idx < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=m, other=0.0).to(tl.float32)
    top = tl_top_keys(tl.where(m, tl_pack(x, idx), tl_empty()), K, KP, 0)
    jj = tl.arange(0, KP)
    tl.store(cand_ptr + (row * NCH + c).to(tl.int64) * K + jj, top, mask=jj < K)


@triton.jit
def _row_top_kernel(cand_ptr, val_ptr, id_ptr, M, K: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr):
    row = tl.program_id(0)
    mm = tl.arange(0, BLOCK_M)
    keys = tl.load(cand_ptr + row.to(tl.int64) * M + mm, mask=mm < M, other=tl_empty())
    top = tl_top_keys(keys, K, KP, 0)
    jj = tl.arange(0, KP)
    none = top == tl_empty()
    out = row.to(tl.int64) * K + jj
    tl.store(val_ptr + out, tl.where(none, float("-inf"), tl_key_value(top)), mask=jj < K)
    tl.store(id_ptr + out, tl.where(none, -1, tl_key_index(top)).to(tl.int64), mask=jj < K)


def top_candidates(logits: torch.Tensor, k: int, *, chunk: int = DEFAULT_CHUNK,
                   out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                   num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values float32 [S, k], ids int64 [S, k])``: each row's ``k`` largest, descending, ties by lowest id.

    logits ``[S, V]`` float32/bf16/fp16, last dim contiguous; ``1 <= k <= min(V, MAX_K)``.
    Two launches, no host sync, static shapes (capturable).  ``chunk`` (rounded up to a power
    of two) is stage 1's width, a tuning knob: the result does not depend on it.
    """
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [S, V], last dim contiguous"
    S, V = logits.shape
    assert 1 <= k <= min(V, MAX_K), f"k={k} must be in [1, min(V={V}, {MAX_K})]"
    dev = logits.device
    if out is None:
        out = (torch.empty(S, k, dtype=torch.float32, device=dev), torch.empty(S, k, dtype=torch.int64, device=dev))
    vals, ids = out
    assert vals.shape == (S, k) and vals.is_contiguous() and ids.shape == (S, k) and ids.is_contiguous()
    if S == 0:
        return out
    block = min(triton.next_power_of_2(chunk), triton.next_power_of_2(V))
    nch = triton.cdiv(V, block)
    kp = triton.next_power_of_2(k)
    cand = torch.empty(S, nch * k, dtype=torch.int64, device=dev)
    _chunk_top_kernel[(S, nch)](logits, logits.stride(0), cand, V, nch, K=k, KP=kp, BLOCK=block,
                                num_warps=num_warps)
    _row_top_kernel[(S,)](cand, vals, ids, nch * k, K=k, KP=kp, BLOCK_M=triton.next_power_of_2(nch * k),
                          num_warps=4)
    return out


def top_candidates_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`top_candidates` returns, in torch: a stable descending sort (``-0.0 == +0.0``)."""
    x = logits.float()
    vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]
