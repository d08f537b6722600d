"""Acceptance of speculative drafts, the torch reference of :mod:`kernels.spec_accept` (the CPU's path).

Each speculative row accepts the longest prefix of its drafts equal to the tokens chosen after its positions; the
slot's last token, token table and length are updated, and the step's output is built (the kernel's docstring).
Its row and place of each position come from ``first_tok`` with ops whose output sizes are data (fine on the CPU).
"""

from __future__ import annotations

import torch

__all__ = ["accept_drafts_ref", "accept_prefix"]


def accept_prefix(drafts: torch.Tensor, target: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """``[R]`` accepted drafts: the longest prefix with ``drafts[:, j] == target[:, j]`` and ``j < num_drafts``
    (``drafts [R, K]``, ``target [R, K + 1]``: the token chosen after each input)."""
    K = drafts.shape[1]
    ok = (drafts == target[:, :K]) & (torch.arange(K, device=drafts.device)[None, :] < num_drafts[:, None])
    return ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


def accept_drafts_ref(chosen: torch.Tensor, drafts: torch.Tensor, ks: torch.Tensor, slots: torch.Tensor,
                      base: torch.Tensor, sampled_at: torch.Tensor, first_tok: torch.Tensor, tokens: torch.Tensor,
                      last_token: torch.Tensor, token_table: torch.Tensor, lengths: torch.Tensor,
                      max_width: int) -> torch.Tensor:
    """:func:`kernels.spec_accept.accept_drafts`'s arithmetic, the same arguments and result."""
    rows, num_tokens = slots.shape[0], chosen.shape[0]
    dev = chosen.device
    tok_row = torch.repeat_interleave(torch.arange(rows, device=dev), torch.diff(
        first_tok, append=torch.tensor([num_tokens], device=dev)))
    tok_j = torch.arange(num_tokens, device=dev) - first_tok[tok_row]
    target = torch.zeros(rows, max_width + 1, dtype=torch.int64, device=dev)
    target[tok_row, tok_j] = chosen
    accepted = accept_prefix(drafts, target, ks)
    last_token[slots] = target.gather(1, accepted[:, None])[:, 0]
    token_table[slots[tok_row], base[tok_row] + 1 + tok_j] = chosen.to(token_table.dtype)
    lengths[slots] = base + accepted + 1
    further = chosen[tok_j > 0]  # row after row
    return torch.cat([tokens.index_put((sampled_at,), target[:, 0]), further, accepted])
