"""The grammar mask on the device: ``logits[row, t] = -inf`` where ``table[slots[row]]`` lacks bit ``t``.

Programs ``(row, chunk)`` read the chunk's bitmask words (``BLOCK / 32`` of them) and store ``-inf``
only at the disallowed columns: the logits are never read, so a step pays a masked write of its
constrained rows (a row of 128,256 float32 logits is 0.5 MB; the bitmask 16 KB).  Rows whose slot
has no constraint hold all ones in the table and write nothing.  Reference:
:mod:`kernels.grammar_mask_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["apply_grammar_mask"]

_BLOCK = 2048


@triton.jit
def _grammar_mask_kernel(logits_ptr, stride_l, table_ptr, stride_t, slots_ptr, V, W, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    word_index = offs // 32
    inside = offs < V
    words = tl.load(table_ptr + slot * stride_t + word_index, mask=inside & (word_index < W), other=0)
    allowed = (words >> (offs % 32)) & 1
    tl.store(logits_ptr + row * stride_l + offs, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty),
             mask=inside & (allowed == 0))


def apply_grammar_mask(logits: torch.Tensor, table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """In place on ``logits [S, V]`` (unit stride along V); ``table [rows, W] int32``, ``slots [S]``."""
    S, V = logits.shape
    if S == 0:
        return logits
    assert logits.stride(1) == 1 and table.stride(1) == 1 and table.dtype == torch.int32
    grid = (S, triton.cdiv(V, _BLOCK))
    _grammar_mask_kernel[grid](logits, logits.stride(0), table, table.stride(0), slots, V, table.shape[1],
                               BLOCK=_BLOCK)
    return logits
