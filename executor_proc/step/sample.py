"""Sampling a step's rows: the one function both the graph and the eager paths call.

:func:`sample_rows` takes the argmax when every sampled row is greedy (the rule is
:func:`kernels.sampling_ref.is_greedy`; the slot tables keep its host mirror), else
the backend's sampler with the rows' parameters gathered from the slot tables; then
it writes the tokens to ``last_token[slot]``, where the next decode row reads its
input.  Everything stays on the device.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from executor_proc.backends.base import Backend
from executor_proc.step.slot_tables import SlotTables


def sample_rows(backend: Backend, logits: torch.Tensor, tables: SlotTables, slots: torch.Tensor,
                positions: torch.Tensor, greedy: bool) -> torch.Tensor:
    """Tokens ``[S]`` for ``logits [S, vocab]`` of the rows of ``slots``; ``last_token[slots]`` updated.

    ``positions [S]`` is where each sampled token goes (its row's context length):
    with the slot's seed it keys the random stream, so the same seed gives the same
    token in any batch, at any pipeline depth.
    """
    if greedy:
        tokens = argmax_rows(logits)
    else:
        tokens = backend.sample(logits, tables.sampling_rows(slots, positions))
    tables.last_token[slots] = tokens
    return tokens


ARGMAX_SPLIT_MAX_ROWS = 32


@functools.lru_cache(maxsize=None)
def _argmax_chunk(vocab: int) -> Optional[int]:
    """A divisor of ``vocab`` near its square root (None if there is no useful one)."""
    for d in range(math.isqrt(vocab), 31, -1):
        if vocab % d == 0:
            return d
    return None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, -1)`` (first index on ties), as two short reductions.

    torch reduces one wide row in one block: 27 us for one row of 128256 on an
    H100 (8 us in two stages: max per chunk, then the first chunk with the overall
    max).  With many rows torch already fills the GPU, so they keep its argmax.
    """
    rows, vocab = logits.shape
    chunk = _argmax_chunk(vocab)
    if chunk is None or rows >= ARGMAX_SPLIT_MAX_ROWS:
        return torch.argmax(logits, dim=-1)
    part_max, part_idx = logits.view(rows, vocab // chunk, chunk).max(dim=-1)
    best = part_max.argmax(dim=-1, keepdim=True)
    return (best * chunk + part_idx.gather(1, best))[:, 0]
