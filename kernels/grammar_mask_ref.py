"""Torch reference of the grammar mask: logits of tokens a row's bitmask does not allow become -inf.

``table [rows, W] int32`` holds one packed bitmask per slot (bit ``t % 32`` of word ``t // 32`` set:
token ``t`` allowed, llguidance's layout); ``slots [S]`` names each logits row's slot.  Columns past
``32 * W`` are not allowed.
"""

from __future__ import annotations

import torch


def apply_grammar_mask_ref(logits: torch.Tensor, table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """In place on ``logits [S, V]``; returns it."""
    V = logits.shape[1]
    cols = torch.arange(V, device=logits.device)
    words = table[slots.long()]  # [S, W]
    inside = cols // 32 < table.shape[1]
    w = words[:, (cols // 32).clamp(max=table.shape[1] - 1)]
    allowed = ((w >> (cols % 32).to(torch.int32)) & 1).bool() & inside
    logits.masked_fill_(~allowed, float("-inf"))
    return logits
