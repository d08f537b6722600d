"""Prompt lookup (n-gram drafts) on the device: one program per speculative row.

The rule is :mod:`kernels.ngram_ref`'s: the longest suffix of ``NMAX`` down to ``NMIN`` tokens that also ends
earlier in the slot's tokens (the most recent end wins among equal lengths) proposes the ``K`` tokens that
followed (the copy going on with itself past the newest token).  A program walks the row's candidate ends ``BLOCK`` at a time; at each end the suffix lengths nest
(a match of ``m`` tokens is one of ``m - 1`` and one more token), so one pass over ``NMAX`` shifted loads scores
every length: ``m * (W + 1) + end``, the largest score wins.  The row's length is read on the device (a loop
bound), so the kernel replays in a CUDA graph whatever the slots' lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ngram_drafts"]

_BLOCK = 256


@triton.jit
def _ngram_kernel(tokens_ptr, stride_t, slots_ptr, lengths_ptr, out_ptr, W, K: tl.constexpr, KPAD: tl.constexpr,
                  NMIN: tl.constexpr, NMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    base = tokens_ptr + slot * stride_t
    n = tl.load(lengths_ptr + row).to(tl.int64)
    best = tl.full([BLOCK], -1, tl.int64)
    for e0 in range(0, n, BLOCK):
        ends = e0 + tl.arange(0, BLOCK).to(tl.int64)
        match = ends < n
        for m in tl.static_range(1, NMAX + 1):
            tail = tl.load(base + tl.maximum(n - m, 0))
            before = tl.load(base + ends - m, mask=(ends >= m) & (ends < n), other=-1)
            match = match & (before == tail) & (ends >= m) & (n >= m)
            if m >= NMIN:
                best = tl.maximum(best, tl.where(match, m * (W + 1) + ends, -1))
    top = tl.max(best, axis=0)
    start = tl.where(top >= 0, top % (W + 1), 0)
    ks = tl.arange(0, KPAD)
    period = tl.maximum(n - start, 1)
    offs = start + ks.to(tl.int64) % period
    found = tl.full([KPAD], 0, tl.int64) + top >= 0
    inside = (ks < K) & found
    drafts = tl.load(base + offs, mask=inside, other=0).to(tl.int64)
    tl.store(out_ptr + row * K + ks, drafts, mask=ks < K)


def ngram_drafts(tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, k: int, ngram_min: int,
                 ngram_max: int) -> torch.Tensor:
    """``[R, k]`` int64 drafts for ``slots [R]`` whose tables ``tokens [rows, W]`` hold ``lengths [R]`` tokens."""
    R = slots.shape[0]
    out = torch.empty(R, k, dtype=torch.int64, device=tokens.device)
    if R == 0:
        return out
    assert tokens.stride(1) == 1
    _ngram_kernel[(R,)](tokens, tokens.stride(0), slots, lengths, out, tokens.shape[1], K=k,
                        KPAD=triton.next_power_of_2(k), NMIN=ngram_min, NMAX=ngram_max, BLOCK=_BLOCK)
    return out
