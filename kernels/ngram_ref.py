"""Prompt lookup (n-gram drafts), the torch reference of :mod:`kernels.ngram` (the CPU's path).

For each row, its slot's tokens ``tokens[slot, :n]`` (prompt and outputs, the newest last): the longest suffix
of ``m`` tokens (``ngram_max`` down to ``ngram_min``) that also ends earlier, at an end ``e < n`` (the most
recent such end when there are several), proposes the ``k`` tokens that followed it, ``tokens[slot, e:e + k]``;
past the newest token the copy goes on with itself (draft ``i`` is ``tokens[e + i % (n - e)]``: a repeating run
keeps repeating).  A row with no match proposes zeros: a wrong draft only costs its verification.
No value is read on the host.
"""

from __future__ import annotations

import torch

__all__ = ["ngram_drafts_ref"]


def ngram_drafts_ref(tokens: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, k: int, ngram_min: int,
                     ngram_max: int) -> torch.Tensor:
    """``[R, k]`` int64 drafts for ``slots [R]`` whose tables ``tokens [rows, W]`` hold ``lengths [R]`` tokens."""
    rows = tokens[slots].to(torch.int64)  # [R, W]
    R, W = rows.shape
    n = lengths.to(torch.int64)[:, None]  # [R, 1]
    ends = torch.arange(W, device=tokens.device)[None, :]  # candidate ends e (exclusive)
    best = torch.full((R,), -1, dtype=torch.int64, device=tokens.device)
    match = torch.ones(R, W, dtype=torch.bool, device=tokens.device)
    for m in range(1, ngram_max + 1):
        # the m-th last token of the suffix against the token m places before each end
        tail = rows.gather(1, (n - m).clamp(min=0))  # [R, 1]
        before = torch.roll(rows, m, dims=1)  # before[:, e] = rows[:, e - m]
        match &= (before == tail) & (ends >= m)
        if m >= ngram_min:
            ok = match & (ends < n) & (n >= m)
            score = torch.where(ok, m * (W + 1) + ends, torch.full_like(ends, -1)).amax(dim=1)
            best = torch.maximum(best, score)
    start = torch.where(best >= 0, best % (W + 1), torch.zeros_like(best))[:, None]  # [R, 1]
    period = (n - start).clamp(min=1)
    offs = start + torch.arange(k, device=tokens.device)[None, :] % period
    return torch.where((best >= 0)[:, None], rows.gather(1, offs.clamp(max=W - 1)), torch.zeros_like(offs))
