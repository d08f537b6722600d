"""Penalties at a speculative row's positions: each position sees the drafts before it as already sampled.

The slot tables hold a request's penalty state up to the row's first input (:mod:`kernels.penalties_ref`:
output counts, the generated count for min_tokens).  Position ``j`` of a verify row predicts the token after the
drafts ``d[0..j)``, so its logits must be penalised as if those drafts were outputs: one more count for each, and
``generated + j`` for min_tokens.  Only a few columns differ from the slot's own penalties: the drafts so far and
the min_tokens stop ids.  :func:`penalise_positions` takes the backend's penalised logits for the slot state and
rewrites just those columns from the raw logits with the position's state (the same arithmetic, in torch: the CPU's
and the GPU's path).  :func:`recount` then puts the emitted tokens into the counts.  No value is read on the host.
"""

from __future__ import annotations

import torch

from kernels.penalties_ref import PenaltyTables

__all__ = ["penalise_positions", "recount"]


def _penalised(raw: torch.Tensor, count: torch.Tensor, prompt: torch.Tensor, rep: torch.Tensor, freq: torch.Tensor,
               pres: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The penalty arithmetic of one column (all ``[N, C]``; ``rep``/``freq``/``pres`` ``[N, 1]``)."""
    seen_out = count > 0
    x = torch.where(seen_out | prompt, torch.where(raw > 0, raw / rep, raw * rep), raw)
    x = torch.where(seen_out, (x - freq * count.float()) - pres, x)
    return x + bias


def _column_state(t: PenaltyTables, slots: torch.Tensor, cols: torch.Tensor, drafts: torch.Tensor,
                  before: torch.Tensor, raw: torch.Tensor):
    """Counts (the slot's plus the drafts before the position), prompt flags, biases of columns ``cols [N, C]``."""
    V = t.vocab
    safe = cols.clamp(0, V - 1)
    extra = ((drafts[:, None, :] == cols[:, :, None]) & before[:, None, :]).sum(dim=2)
    count = t.output_counts[slots[:, None], safe] + extra.to(torch.int32)
    prompt = t.prompt_mask[slots[:, None], safe]
    ids = t.bias_ids[slots].long()  # [N, B]
    bias = ((ids[:, None, :] == cols[:, :, None]).float() * t.bias_values[slots][:, None, :]).sum(dim=2)
    return safe, count, prompt, bias, raw.float().gather(1, safe)


def penalise_positions(x: torch.Tensor, raw: torch.Tensor, t: PenaltyTables, slots: torch.Tensor,
                       drafts: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """``x [N, V]`` (the backend's penalties for each position's slot state) with the drafts' and stop ids' columns
    rewritten for positions ``j [N]`` of their rows; ``raw [N, V]`` the logits, ``drafts [N, K]`` each position's
    row's drafts (the first ``j`` count as outputs)."""
    slots = slots.long()
    K = drafts.shape[1]
    before = torch.arange(K, device=x.device)[None, :] < j[:, None]  # [N, K]: the drafts before the position
    rep, freq, pres = (v[slots][:, None] for v in (t.repetition, t.frequency, t.presence))
    x = x.clone()
    V = x.shape[1]
    wide = torch.cat([x, x.new_zeros(x.shape[0], 1)], dim=1)  # column V: where unused entries land
    masked = (t.generated[slots] + j.to(t.generated.dtype) < t.min_tokens[slots])[:, None]
    stop = t.stop_ids[slots].long()
    for cols, used in ((drafts.long(), before), (stop, stop >= 0)):
        safe, count, prompt, bias, r = _column_state(t, slots, cols, drafts.long(), before, raw)
        value = _penalised(r, count, prompt, rep, freq, pres, bias)
        is_stop = ((stop[:, None, :] == cols[:, :, None]) & (stop >= 0)[:, None, :]).any(dim=2)
        value = torch.where(masked & is_stop, torch.full_like(value, float("-inf")), value)
        wide.scatter_(1, torch.where(used, safe, V), value)
    return wide[:, :V]


def recount(t: PenaltyTables, slots: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> None:
    """``output_counts[slot, token] += weight`` and ``generated[slot] += weight`` (weights of -1 undo a count)."""
    slots = slots.long()
    w = weights.to(torch.int32)
    t.output_counts.view(-1).index_add_(0, slots * t.vocab + tokens.long(), w)
    t.generated.index_add_(0, slots, w)
