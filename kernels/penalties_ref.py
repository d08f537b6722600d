"""Per-slot logit penalties in pure torch (the CPU executor's version and the reference for
:mod:`kernels.penalties`).

The tables (one row per slot, plus the padding slot; :class:`PenaltyTables`)::

    output_counts [rows, V] int32   how often each token was sampled for the slot's request
    prompt_mask   [rows, V] bool    which tokens occur in the request's prompt
    generated     [rows]    int32   output tokens sampled so far (for min_tokens)
    repetition    [rows]    f32     repetition_penalty, 1.0 = off
    frequency     [rows]    f32     frequency_penalty, 0.0 = off
    presence      [rows]    f32     presence_penalty, 0.0 = off
    bias_ids      [rows, MAX_BIAS] int32  logit_bias token ids, -1 = unused; unique per slot
    bias_values   [rows, MAX_BIAS] f32    the biases, in [-100, 100]
    stop_ids      [rows, MAX_STOP] int32  EOS (unless ignore_eos) and stop_token_ids, -1 = unused
    min_tokens    [rows]    int32   EOS / stop ids are masked while generated < min_tokens

The function, for row ``i`` of slot ``q`` with float32 logits ``x``, in this order:

1. **repetition** (HF / vLLM): for tokens in the prompt or already sampled
   (``prompt_mask | count > 0``): ``x > 0 -> x / r`` (correctly rounded), else ``x * r``.
2. **frequency / presence** (OpenAI, output tokens only): where ``count > 0``:
   ``x = (x - frequency * count) - presence``.
3. **logit_bias**: ``x[id] += bias`` for each of the slot's ids.
4. **min_tokens**: while ``generated < min_tokens``, ``x[stop id] = -inf``.

Bias after the penalties (vLLM applies it before): a user's bias is their last word on a
token, so +100 forces and -100 bans it whatever it was penalised.  Logprobs are reported
from the logits *before* this function (the model's raw distribution, like OpenAI/vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PenaltyTables", "MAX_BIAS", "MAX_STOP", "apply_penalties_ref", "count_sampled", "mark_prompt",
           "reset_slots"]

MAX_BIAS = 300
MAX_STOP = 16


@dataclass
class PenaltyTables:
    """Device tables indexed by slot (see the module docstring); the last row is the padding slot."""

    output_counts: torch.Tensor
    prompt_mask: torch.Tensor
    generated: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    stop_ids: torch.Tensor
    min_tokens: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, vocab: int, device, max_bias: int = MAX_BIAS,
                 max_stop: int = MAX_STOP) -> "PenaltyTables":
        """All penalties off for every slot (and the padding slot ``num_slots``)."""
        rows = num_slots + 1
        z = dict(device=device)
        return cls(
            output_counts=torch.zeros(rows, vocab, dtype=torch.int32, **z),
            prompt_mask=torch.zeros(rows, vocab, dtype=torch.bool, **z),
            generated=torch.zeros(rows, dtype=torch.int32, **z),
            repetition=torch.ones(rows, dtype=torch.float32, **z),
            frequency=torch.zeros(rows, dtype=torch.float32, **z),
            presence=torch.zeros(rows, dtype=torch.float32, **z),
            bias_ids=torch.full((rows, max_bias), -1, dtype=torch.int32, **z),
            bias_values=torch.zeros(rows, max_bias, dtype=torch.float32, **z),
            stop_ids=torch.full((rows, max_stop), -1, dtype=torch.int32, **z),
            min_tokens=torch.zeros(rows, dtype=torch.int32, **z),
        )

    @property
    def vocab(self) -> int:
        return int(self.output_counts.shape[1])


def reset_slots(t: PenaltyTables, slots: torch.Tensor) -> None:
    """Forget counts, prompt tokens and the generated count of (re)admitted slots.

    Parameters are written by the caller (indexed writes, like the sampling parameters);
    this clears only the state the step updates.  No host sync.
    """
    t.output_counts.index_fill_(0, slots, 0)
    t.prompt_mask.index_fill_(0, slots, False)
    t.generated.index_fill_(0, slots, 0)


def mark_prompt(t: PenaltyTables, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """``prompt_mask[slots[j], tokens[j]] = True`` (one slot per token; a prefill chunk's tokens)."""
    t.prompt_mask.index_put_((slots.long(), tokens.long()), torch.ones_like(tokens, dtype=torch.bool))


def count_sampled(t: PenaltyTables, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """Count sampled tokens: ``output_counts[slot, token] += 1``, ``generated[slot] += 1``.

    Run on the device right after sampling, so the next step (already queued behind it
    in stream order) sees the counts: the scheduler never needs the token first.  Also
    rebuilds a resumed request's counts from its earlier output tokens.
    """
    slots = slots.long()
    flat = slots * t.vocab + tokens.long()
    ones = torch.ones_like(flat, dtype=torch.int32)
    t.output_counts.view(-1).index_add_(0, flat, ones)
    t.generated.index_add_(0, slots, ones)


def apply_penalties_ref(logits: torch.Tensor, t: PenaltyTables, slots: torch.Tensor) -> torch.Tensor:
    """Penalised copy ``[S, V]`` float32 of ``logits`` for rows of ``slots`` (module docstring)."""
    x = logits.float().clone()
    slots = slots.long()
    counts = t.output_counts[slots]
    seen_out = counts > 0
    rep = t.repetition[slots][:, None]
    seen = seen_out | t.prompt_mask[slots]
    penalised = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(seen, penalised, x)  # rep == 1: penalised == x
    freq = t.frequency[slots][:, None]
    pres = t.presence[slots][:, None]
    x = torch.where(seen_out, (x - freq * counts.float()) - pres, x)
    # logit_bias and min_tokens as scatters into a spare column V (static shapes, no sync)
    S, V = x.shape
    wide = torch.cat([x, x.new_zeros(S, 1)], dim=1)
    ids = t.bias_ids[slots].long()
    wide.scatter_add_(1, torch.where(ids >= 0, ids, V), t.bias_values[slots])
    stop = t.stop_ids[slots].long()
    active = (t.generated[slots] < t.min_tokens[slots])[:, None] & (stop >= 0)
    wide.scatter_(1, torch.where(active, stop, V), float("-inf"))
    x = wide[:, :V].contiguous()
    return x
