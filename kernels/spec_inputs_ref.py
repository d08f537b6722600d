"""A speculative graph step's inputs, the torch reference of :mod:`kernels.spec_inputs` (the CPU's path).

Per row: its first position (``start``, or the slot's device length where ``start < 0``), the slot's last token
written there, the n-gram drafts after it (:func:`kernels.ngram_ref.ngram_drafts_ref`), and for the row's
``width + 1`` positions each one's input id (the last token, then the drafts), position and context length;
positions past the row's draft count, and every position of a row on the padding slot, at position 0.
"""

from __future__ import annotations

import torch

from kernels.ngram_ref import ngram_drafts_ref

__all__ = ["graph_inputs_ref", "row_starts"]


def row_starts(tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, last_token: torch.Tensor,
               lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(last token, first position)`` of each row: ``start``, or the slot's device length where ``start < 0``;
    the slot's token table gets the last token there."""
    last = last_token[slots]
    base = torch.where(start >= 0, start, lengths[slots])
    tokens[slots, base] = last.to(tokens.dtype)
    return last, base


def graph_inputs_ref(tokens: torch.Tensor, slots: torch.Tensor, ks: torch.Tensor, start: torch.Tensor,
                     last_token: torch.Tensor, lengths: torch.Tensor, pad_slot: int, k: int, width: int,
                     ngram_min: int, ngram_max: int) -> tuple[torch.Tensor, ...]:
    """``(base [R], drafts [R, k], ids, positions, context lengths [R (width + 1)])`` for rows on ``slots [R]``
    with ``ks [R]`` drafts each; ``tokens`` (the slots' token tables) gets each row's last token at ``base``."""
    last, base = row_starts(tokens, slots, start, last_token, lengths)
    drafts = ngram_drafts_ref(tokens, slots, base + 1, k, ngram_min, ngram_max)
    j = torch.arange(width + 1, device=slots.device)[None, :]
    ids = torch.cat([last[:, None], drafts], dim=1)[:, :width + 1]
    real = (j <= ks[:, None]) & (slots != pad_slot)[:, None]
    positions = torch.where(real, base[:, None] + j, torch.zeros_like(j))
    return base, drafts, ids.reshape(-1), positions.reshape(-1), positions.reshape(-1) + 1
