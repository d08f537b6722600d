"""Greedy tokens: ``torch.argmax(logits, -1)`` for a few rows (batch-1 decode), in two short launches.

torch reduces a wide row in one block (27 us for one row of 128,256 on an H100), and a chunked
torch version is five launches (~13 us).  Here programs ``(row, chunk)``
write each chunk's maximum and its first index, then one program per row picks the first chunk
holding the row's maximum: the first index of the maximum, as torch gives it.  NaN counts as
larger than everything (torch's rule), so a broken row still yields an index inside the vocabulary.
Both kernels launch with PDL (:mod:`kernels.pdl`).  With ``last_token`` and ``slots`` the pick also
writes each row's token to ``last_token[slots[row]]`` (the decode step's feedback for the next
step), which saves the index-put launch after it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_launch, pdl_wait

__all__ = ["argmax_rows", "MAX_ROWS"]

MAX_ROWS = 256  # H100, 128,256 columns: 8 vs 28 us at 64 rows, 46 vs 55 us at 256 (torch.argmax)
_CHUNK = 2048


@triton.jit
def _chunk_max_kernel(x_ptr, pm_ptr, pi_ptr, V, stride_x, n_chunks, CHUNK: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN: the largest (and a NaN row still picks an index < V)
    m = tl.max(x, axis=0)
    i = tl.min(tl.where((x == m) & (offs < V), offs, V), axis=0)
    pdl_launch(USE_PDL)
    tl.store(pm_ptr + row * n_chunks + c, m)
    tl.store(pi_ptr + row * n_chunks + c, i)


@triton.jit
def _pick_kernel(pm_ptr, pi_ptr, out_ptr, slots_ptr, last_ptr, n_chunks, V, C_PAD: tl.constexpr,
                 STORE_LAST: tl.constexpr, USE_PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, C_PAD)
    mask = offs < n_chunks
    pdl_wait(USE_PDL)
    m = tl.load(pm_ptr + row * n_chunks + offs, mask=mask, other=float("-inf"))
    i = tl.load(pi_ptr + row * n_chunks + offs, mask=mask, other=V)
    best = tl.max(m, axis=0)
    token = tl.min(tl.where(mask & (m == best), i, V), axis=0)
    pdl_launch(USE_PDL)
    token = tl.minimum(token, V - 1).to(tl.int64)  # never past the vocabulary
    tl.store(out_ptr + row, token)
    if STORE_LAST:
        tl.store(last_ptr + tl.load(slots_ptr + row), token)


def argmax_rows(logits: torch.Tensor, last_token: Optional[torch.Tensor] = None,
                slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` (int64, first index on ties) for logits ``[S, V]``, ``S <= MAX_ROWS``;
    with ``last_token`` (int64) and ``slots [S]`` (int64) also ``last_token[slots] = tokens``."""
    rows, vocab = logits.shape
    assert rows <= MAX_ROWS and logits.stride(1) == 1 and vocab > 0
    store_last = last_token is not None
    if store_last:
        assert slots is not None and slots.shape == (rows,) and slots.dtype == torch.int64
        assert last_token.dtype == torch.int64 and last_token.stride(0) == 1
    n_chunks = triton.cdiv(vocab, _CHUNK)
    pm = torch.empty(rows, n_chunks, dtype=torch.float32, device=logits.device)
    pi = torch.empty(rows, n_chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    pdl = pdl_args(logits)
    _chunk_max_kernel[(rows, n_chunks)](logits, pm, pi, vocab, logits.stride(0), n_chunks, CHUNK=_CHUNK,
                                        num_warps=4, **pdl)
    _pick_kernel[(rows,)](pm, pi, out, slots if store_last else out, last_token if store_last else out, n_chunks,
                          vocab, C_PAD=max(2, triton.next_power_of_2(n_chunks)), STORE_LAST=store_last,
                          num_warps=1, **pdl)
    return out
