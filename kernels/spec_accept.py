"""Acceptance of speculative drafts in one launch: one program per speculative row.

A row's positions hold the token the sampler gives after each of its inputs (``chosen``, row after row: the row's
first token, then one per further position; the argmax, or the keyed draw).  The row accepts the longest prefix of
its drafts equal to those tokens, and the program writes everything the step's end needs (what the torch reference,
:mod:`kernels.spec_accept_ref`, does in about fifteen launches):

- the slot's last token (the chosen token after the last accepted draft), its token table (every chosen token at
  its position: the rejected ones lie past the new length) and its length (first position + accepted + 1);
- the step's output ``[num_sampled + further + rows]``: the row's first token in its place among the sampled rows,
  its further positions' tokens (row after row), its accepted count.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

__all__ = ["accept_drafts"]


# The row arrays are views of the step's upload at offsets that follow the row and token counts, and the counts
# change from step to step: a variant compiled per alignment or per count (divisible by 16, or 1) would compile, for
# hundreds of ms, at the first eager step that meets it, while serving.  The loads are a few words a row.
_POINTERS = ["chosen_ptr", "drafts_ptr", "ks_ptr", "slots_ptr", "base_ptr", "sampled_at_ptr", "first_ptr",
             "last_token_ptr", "tokens_ptr", "lengths_ptr", "out_ptr"]
_NO_ALIGN = (dict(do_not_specialize_on_alignment=_POINTERS)
             if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters else {})


@triton.jit(do_not_specialize=["stride_d", "stride_t", "num_tokens", "num_sampled", "num_rows"], **_NO_ALIGN)
def _accept_kernel(chosen_ptr, drafts_ptr, stride_d, ks_ptr, slots_ptr, base_ptr, sampled_at_ptr, first_ptr,
                   last_token_ptr, tokens_ptr, stride_t, lengths_ptr, out_ptr, num_tokens, num_sampled, num_rows,
                   J: tl.constexpr):
    r = tl.program_id(0)
    j = tl.arange(0, J)
    first = tl.load(first_ptr + r)
    after = tl.load(first_ptr + r + 1, mask=r + 1 < num_rows, other=num_tokens)
    width = after - first - 1  # the row's further positions (at least its drafts)
    k = tl.load(ks_ptr + r)
    chosen = tl.load(chosen_ptr + first + j, mask=j <= width, other=-1)
    drafts = tl.load(drafts_ptr + r * stride_d + j, mask=j < k, other=-1)
    # the first position whose draft is missing or differs; j = k is always one (J > K >= k)
    accepted = tl.min(tl.where((j >= k) | (drafts != chosen), j, J), axis=0)
    last = tl.sum(tl.where(j == accepted, chosen, 0), axis=0)
    slot = tl.load(slots_ptr + r)
    base = tl.load(base_ptr + r)
    tl.store(last_token_ptr + slot, last.to(last_token_ptr.dtype.element_ty))
    tl.store(tokens_ptr + slot * stride_t + base + 1 + j, chosen.to(tokens_ptr.dtype.element_ty), mask=j <= width)
    tl.store(lengths_ptr + slot, (base + accepted + 1).to(lengths_ptr.dtype.element_ty))
    tl.store(out_ptr + tl.load(sampled_at_ptr + r) + j, chosen, mask=j == 0)
    further = num_sampled + first - r  # the row's further positions' place in the output
    tl.store(out_ptr + further + j - 1, chosen, mask=(j >= 1) & (j <= width))
    tl.store(out_ptr + num_sampled + num_tokens - num_rows + r, accepted.to(tl.int64))


def accept_drafts(chosen: torch.Tensor, drafts: torch.Tensor, ks: torch.Tensor, slots: torch.Tensor,
                  base: torch.Tensor, sampled_at: torch.Tensor, first_tok: torch.Tensor, tokens: torch.Tensor,
                  last_token: torch.Tensor, token_table: torch.Tensor, lengths: torch.Tensor,
                  max_width: int) -> torch.Tensor:
    """The step's output (int64 ``[num_sampled + further + rows]``), ``tokens [num_sampled]`` (the sampled rows'
    tokens) with each row's first token in its place; updates ``last_token``, ``token_table`` and ``lengths`` at
    the rows' slots.  ``chosen [num_tokens]`` (int64) the token after each position, the rows' positions in row
    order; ``drafts [rows, K]``; ``ks``, ``slots``, ``base`` (each row's first position), ``sampled_at`` and
    ``first_tok`` (each row's first position's index in ``chosen``): ``[rows]`` int64; ``max_width``: the most
    further positions a row has."""
    rows, num_tokens, num_sampled = slots.shape[0], chosen.shape[0], tokens.shape[0]
    out = torch.empty(num_sampled + num_tokens, dtype=torch.int64, device=chosen.device)
    if num_sampled > rows:  # rows that did not speculate keep their sampled tokens
        out[:num_sampled].copy_(tokens)
    if rows == 0:
        return out
    assert token_table.stride(1) == 1 and drafts.stride(1) == 1
    _accept_kernel[(rows,)](chosen, drafts, drafts.stride(0), ks, slots, base, sampled_at, first_tok, last_token,
                            token_table, token_table.stride(0), lengths, out, num_tokens, num_sampled, rows,
                            J=triton.next_power_of_2(max_width + 1))
    return out
