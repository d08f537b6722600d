"""Token logprobs in pure torch (the CPU executor's version and the reference for :mod:`kernels.logprobs`).

What is reported: the model's raw distribution, ``log_softmax`` of the float32 logits as the
model produced them, *before* temperature, penalties, logit_bias and top-k/top-p/min-p (what
OpenAI and vLLM report by default).  Per row, with ``n = num_logprobs[row]``:

    ids [S, 1 + MAX_TOP_N] int64, logprobs [S, 1 + MAX_TOP_N] float32
    column 0        the token's rank and its logprob             (if n >= 0)
    columns 1..n    the n most likely tokens, most likely first  (ties in any order)
    the rest        id -1, logprob -inf (padding; also the whole row when n < 0 = off)

The token is the sampled one (or, for prompt logprobs, the prompt's next token): the caller knows it, and
column 0 carries its *rank* instead, vLLM's: how many of the vocabulary's logits are at least its own (1: the
most likely; a tie counts against it).  Fixed shapes, so a captured graph's outputs are static buffers.
"""

from __future__ import annotations

import torch

__all__ = ["MAX_TOP_N", "token_logprobs_ref", "pad_logprobs"]

MAX_TOP_N = 20


def pad_logprobs(ids: torch.Tensor, lps: torch.Tensor, num_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Put the padding (id -1, -inf) where column j > num_logprobs[row] (column 0 kept iff n >= 0)."""
    col = torch.arange(ids.shape[1], device=ids.device)[None, :]
    keep = col <= num_logprobs.long()[:, None]
    return torch.where(keep, ids, -1), torch.where(keep, lps, float("-inf"))


def token_logprobs_ref(logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: torch.Tensor,
                       max_top_n: int = MAX_TOP_N) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, logprobs)`` ``[S, 1 + max_top_n]`` for logits ``[S, V]``, sampled ``tokens`` ``[S]`` (column 0 of
    ``ids``: each token's rank)."""
    x = logits.float()
    lsm = torch.log_softmax(x, dim=-1)
    top_lp, top_ids = torch.topk(lsm, min(max_top_n, lsm.shape[1]), dim=-1)
    S = lsm.shape[0]
    pad = max_top_n - top_ids.shape[1]
    if pad:
        top_ids = torch.cat([top_ids, top_ids.new_full((S, pad), -1)], dim=1)
        top_lp = torch.cat([top_lp, top_lp.new_full((S, pad), float("-inf"))], dim=1)
    tok = tokens.long()[:, None]
    rank = (x >= x.gather(1, tok)).sum(1, keepdim=True)
    ids = torch.cat([rank, top_ids], dim=1)
    lps = torch.cat([lsm.gather(1, tok), top_lp], dim=1)
    return pad_logprobs(ids, lps, num_logprobs)
