"""Prompt lookup (n-gram drafts) on the device: one program per speculative row.

The rule is :mod:`kernels.ngram_ref`'s: the longest suffix of ``NMAX`` down to ``NMIN`` tokens that also ends
earlier in the slot's tokens (the most recent end wins among equal lengths) proposes the ``K`` tokens that
followed (the copy going on with itself past the newest token).  A program walks the row's candidate ends ``BLOCK``
at a time; at each end the suffix lengths nest (a match of ``m`` tokens is one of ``m - 1`` and one more token), so
one pass over ``NMAX`` shifted loads scores every length: ``m * (W + 1) + end``, the largest score wins.  The row's
length is read on the device (a loop bound), so the kernel replays in a CUDA graph whatever the slots' lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ngram_drafts"]

_BLOCK = 256


@triton.jit
def _lookup(row_ptr, n, newest, W, NMIN: tl.constexpr, NMAX: tl.constexpr, BLOCK: tl.constexpr):
    """The best match's score for the row's ``n`` tokens at ``row_ptr`` (``-1``: none); ``newest`` is its token
    ``n - 1`` (given, not read: the caller may have written it in this program)."""
    best = tl.full([BLOCK], -1, tl.int64)
    for e0 in range(0, n, BLOCK):
        ends = e0 + tl.arange(0, BLOCK).to(tl.int64)
        match = ends < n
        for m in tl.static_range(1, NMAX + 1):
            if m == 1:
                tail = newest
            else:
                tail = tl.load(row_ptr + tl.maximum(n - m, 0))
            before = tl.load(row_ptr + ends - m, mask=(ends >= m) & (ends < n), other=-1)  # ends - m <= n - 2
            match = match & (before == tail) & (ends >= m) & (n >= m)
            if m >= NMIN:
                best = tl.maximum(best, tl.where(match, m * (W + 1) + ends, -1))
    return tl.max(best, axis=0)


@triton.jit
def _drafts_at(row_ptr, n, newest, top, W, j):
    """The drafts ``j`` (``[J]`` int) of a lookup's best score ``top``: the tokens after the match's end (0 where
    there is none), token ``n - 1`` being ``newest``."""
    start = tl.where(top >= 0, top % (W + 1), 0)
    offs = start + j.to(tl.int64) % tl.maximum(n - start, 1)
    found = (tl.zeros_like(offs) + top) >= 0
    drafts = tl.load(row_ptr + offs, mask=found & (offs < n - 1), other=0).to(tl.int64)
    return tl.where(found & (offs == n - 1), tl.zeros_like(offs) + newest.to(tl.int64), drafts)


@triton.jit
def _ngram_kernel(tokens_ptr, stride_t, slots_ptr, lengths_ptr, out_ptr, W, K: tl.constexpr, KPAD: tl.constexpr,
                  NMIN: tl.constexpr, NMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    row_ptr = tokens_ptr + slot * stride_t
    n = tl.load(lengths_ptr + row).to(tl.int64)
    newest = tl.load(row_ptr + tl.maximum(n - 1, 0))
    top = _lookup(row_ptr, n, newest, W, NMIN, NMAX, BLOCK)
    ks = tl.arange(0, KPAD)
    tl.store(out_ptr + row * K + ks, _drafts_at(row_ptr, n, newest, top, W, ks), mask=ks < K)


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
