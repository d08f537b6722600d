"""A whole pure-decode step as a function of static device buffers (what a CUDA graph captures).

Inputs, one row per bucket row (``B`` rows; rows past the step's real rows are
padding: the tables' padding slot, position 0, context length 1)::

    slots         [B] int64
    positions     [B] int64   position of the row's new token
    context_lens  [B] int64   = positions + 1

:func:`decode_step` gathers the input tokens from ``last_token[slot]``, the KV
write indices from the block table (-1 for padded rows: no KV write; both in the
backend's ``decode_rows``), runs the
model, samples with the per-slot parameters (:func:`executor_proc.step.sample.sample_rows`
in the step's :class:`SamplingMode`: penalties, argmax or sampler, logprobs, counts),
writes the tokens back to ``last_token`` and returns them.  It only
reads and writes device tensors whose addresses never change, allocates only
fixed shapes, and never reads a device value on the host, so it can be
captured once and replayed; on the CPU it runs eagerly (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_proc.step.batch import ForwardBatch
from executor_proc.step.sample import Sampled, SamplingMode, sample_rows
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


def decode_batch(backend, inputs: DecodeInputs, tables: SlotTables, block_size: int) -> ForwardBatch:
    """The step's :class:`ForwardBatch`, computed on the device from the slot tables (the backend's
    ``decode_rows``: one launch in the Triton backend)."""
    rows = backend.decode_rows(inputs.slots, inputs.positions, inputs.context_lens, tables.last_token,
                               tables.block_table, tables.pad_slot, block_size)
    return ForwardBatch(
        input_ids=rows.input_ids,
        positions=inputs.positions,
        kv_index=rows.kv_index,
        query_start=rows.query_start,
        context_lens=rows.context_lens,
        block_tables=rows.block_tables,
        sample_index=None,
        sample_slots=inputs.slots,
        host_query_lens=[1] * inputs.batch_size,
        host_context_lens=None,
        block_size=block_size,
    )


def decode_step(model, kv_cache, tables: SlotTables, inputs: DecodeInputs, block_size: int,
                mode: SamplingMode) -> Sampled:
    """Forward + sample + ``last_token`` update for one bucket; tokens ``[B]`` int64 (and logprobs)."""
    logits = model(decode_batch(model.backend, inputs, tables, block_size), kv_cache)
    return sample_rows(model.backend, logits, tables, inputs.slots, inputs.context_lens, mode)
