"""A whole pure-decode step as a function of static device buffers (what a CUDA graph captures).

Inputs, one row per bucket row (``B`` rows; rows past the step's real rows are
padding: the tables' padding slot, position 0, context length 1)::

    slots         [B] int64
    positions     [B] int64   position of the row's new token
    context_lens  [B] int64   = positions + 1

:func:`decode_step` gathers the input tokens from ``last_token[slot]``, the KV
write slots from the block table (-1 for padded rows: no KV write), runs the
model, samples with the per-slot parameters (or argmax when every row is
greedy), writes the tokens back to ``last_token`` and returns them.  It only
reads and writes device tensors whose addresses never change, allocates only
fixed shapes, and never reads a device value on the host, so it can be
captured once and replayed; on the CPU it runs eagerly (tests).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from executor_proc.step.batch import ForwardBatch
from executor_proc.step.slot_tables import SlotTables


@dataclass
class DecodeInputs:
    """Views of the static input buffers of one bucket."""

    slots: torch.Tensor
    positions: torch.Tensor
    context_lens: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.slots.shape[0])


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


def decode_batch(inputs: DecodeInputs, tables: SlotTables, block_size: int) -> ForwardBatch:
    """The step's :class:`ForwardBatch`, computed on the device from the slot tables."""
    slots, pos = inputs.slots, inputs.positions
    b = inputs.batch_size
    block_tables = tables.block_table[slots]
    block_ids = block_tables.gather(1, (pos // block_size)[:, None])[:, 0].to(torch.int64)
    slot_mapping = torch.where(slots == tables.pad_slot, -1, block_ids * block_size + pos % block_size)
    return ForwardBatch(
        input_ids=tables.last_token[slots],
        positions=pos,
        slot_mapping=slot_mapping,
        query_start=torch.arange(b + 1, dtype=torch.int32, device=slots.device),
        context_lens=inputs.context_lens.to(torch.int32),
        block_tables=block_tables,
        sample_index=None,
        sample_slots=slots,
        host_query_lens=[1] * b,
        host_context_lens=None,
        block_size=block_size,
    )


def decode_step(model, kv_cache, tables: SlotTables, inputs: DecodeInputs, block_size: int, greedy: bool,
                sampler: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Forward + sample + ``last_token`` update for one bucket; returns the tokens ``[B]`` int64."""
    batch = decode_batch(inputs, tables, block_size)
    logits = model(batch, kv_cache)
    slots = inputs.slots
    if greedy:
        tokens = argmax_rows(logits)
    else:
        # The new token's position keys the random stream: the same seed gives the same token anywhere.
        tokens = sampler(logits, tables.temperature[slots], tables.top_k[slots], tables.top_p[slots],
                         tables.min_p[slots], tables.seed[slots], inputs.positions + 1)
    tables.last_token[slots] = tokens
    return tokens
