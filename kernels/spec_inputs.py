"""A speculative graph step's inputs in one launch (:mod:`executor_proc.step.spec_graphs`), one program per row.

What :mod:`kernels.spec_inputs_ref` does in about fifteen torch launches: the row's first position (the plan's, or
the slot's device length), the slot's last token written there, the n-gram drafts after it (:mod:`kernels.ngram`'s
lookup, the last token held in registers rather than read back), and the row's ``WIDTH + 1`` positions' input ids,
positions and context lengths (past the row's draft count, and on the padding slot, position 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ngram import _BLOCK, _drafts_at, _lookup

__all__ = ["graph_inputs"]


@triton.jit
def _graph_inputs_kernel(tokens_ptr, stride_t, slots_ptr, ks_ptr, start_ptr, last_ptr, lengths_ptr, pad_slot,
                         base_ptr, drafts_ptr, ids_ptr, pos_ptr, lens_ptr, W, K: tl.constexpr, KPAD: tl.constexpr,
                         WIDTH: tl.constexpr, JPAD: tl.constexpr, NMIN: tl.constexpr, NMAX: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    first = tl.load(start_ptr + row).to(tl.int64)
    newest = tl.load(last_ptr + slot).to(tl.int64)
    base = tl.where(first >= 0, first, tl.load(lengths_ptr + slot).to(tl.int64))
    row_ptr = tokens_ptr + slot * stride_t
    tl.store(row_ptr + base, newest.to(tokens_ptr.dtype.element_ty))
    tl.store(base_ptr + row, base)
    n = base + 1
    top = _lookup(row_ptr, n, newest, W, NMIN, NMAX, BLOCK)
    ks = tl.arange(0, KPAD)
    tl.store(drafts_ptr + row * K + ks, _drafts_at(row_ptr, n, newest, top, W, ks), mask=ks < K)
    j = tl.arange(0, JPAD)
    ids = tl.where(j == 0, tl.zeros_like(j).to(tl.int64) + newest,
                   _drafts_at(row_ptr, n, newest, top, W, tl.maximum(j - 1, 0)))
    real = (j <= tl.load(ks_ptr + row)) & (slot != pad_slot)
    positions = tl.where(real, base + j, 0)
    out = row * (WIDTH + 1) + j
    inside = j <= WIDTH
    tl.store(ids_ptr + out, ids, mask=inside)
    tl.store(pos_ptr + out, positions, mask=inside)
    tl.store(lens_ptr + out, positions + 1, mask=inside)


def graph_inputs(tokens: torch.Tensor, slots: torch.Tensor, ks: torch.Tensor, start: torch.Tensor,
                 last_token: torch.Tensor, lengths: torch.Tensor, pad_slot: int, k: int, width: int,
                 ngram_min: int, ngram_max: int) -> tuple[torch.Tensor, ...]:
    """:func:`kernels.spec_inputs_ref.graph_inputs_ref`'s arguments and results."""
    R = slots.shape[0]
    dev = tokens.device
    base = torch.empty(R, dtype=torch.int64, device=dev)
    drafts = torch.empty(R, k, dtype=torch.int64, device=dev)
    ids, positions, lens = (torch.empty(R * (width + 1), dtype=torch.int64, device=dev) for _ in range(3))
    if R == 0:
        return base, drafts, ids, positions, lens
    assert tokens.stride(1) == 1 and k >= 1
    _graph_inputs_kernel[(R,)](tokens, tokens.stride(0), slots, ks, start, last_token, lengths, pad_slot, base, drafts,
                               ids, positions, lens, tokens.shape[1], K=k, KPAD=triton.next_power_of_2(k),
                               WIDTH=width, JPAD=triton.next_power_of_2(width + 1), NMIN=ngram_min, NMAX=ngram_max,
                               BLOCK=_BLOCK)
    return base, drafts, ids, positions, lens
