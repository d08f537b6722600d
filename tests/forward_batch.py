"""Test helpers for driving the model directly: a :class:`ForwardBatch` from host lists, all-token logits.

Tests only (the executor builds its batches in :mod:`executor_proc.step.worker`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import torch

from executor_proc.step.batch import ForwardBatch


def all_logits(model, batch: ForwardBatch, kv_cache) -> torch.Tensor:
    """Float32 logits ``[T, vocab]`` for every token of the step (not only the sampled ones)."""
    return model(dataclasses.replace(batch, sample_index=None), kv_cache)


class RowInput(NamedTuple):
    """One row of a step, as host values: a plain tuple works too."""

    slot: int
    token_ids: Sequence[int]  # the row's query tokens (one for a decode row)
    start_position: int  # tokens of this row already in the KV cache
    sample: bool  # sample a token after the row's last query token


def build_forward_batch(
    rows: Sequence[RowInput | tuple],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
    pin_memory: bool = False,
) -> ForwardBatch:
    """Build a :class:`ForwardBatch` from host lists with one host-to-device copy.

    ``block_tables[r]`` is row r's block table; it must cover the row's context
    (``start_position + len(token_ids)`` tokens).  All integer inputs are packed
    into one int64 host buffer (pinned if asked, then copied with
    ``non_blocking=True``) and the batch's tensors are views of its device copy (the query starts, context
    lengths and block tables int32 copies, as the engine's steps have them).
    """
    rows = [RowInput(*row) for row in rows]
    if len(rows) != len(block_tables):
        raise ValueError(f"{len(rows)} rows but {len(block_tables)} block tables")
    input_ids: list[int] = []
    positions: list[int] = []
    kv_index: list[int] = []
    query_start = [0]
    query_lens: list[int] = []
    context_lens: list[int] = []
    sample_index: list[int] = []
    sample_slots: list[int] = []
    tables: list[list[int]] = []
    for row, table in zip(rows, block_tables):
        n = len(row.token_ids)
        if n == 0:
            raise ValueError(f"row of slot {row.slot} has no query tokens")
        context = row.start_position + n
        needed = -(-context // block_size)
        if len(table) < needed:
            raise ValueError(
                f"slot {row.slot}: {context} tokens need {needed} blocks, block table has {len(table)}"
            )
        input_ids.extend(row.token_ids)
        for pos in range(row.start_position, context):
            positions.append(pos)
            kv_index.append(table[pos // block_size] * block_size + pos % block_size)
        query_start.append(query_start[-1] + n)
        query_lens.append(n)
        context_lens.append(context)
        if row.sample:
            sample_index.append(query_start[-1] - 1)
            sample_slots.append(row.slot)
        tables.append(list(table[:needed]))
    max_blocks = max(len(t) for t in tables)
    flat_tables = [b for t in tables for b in t + [0] * (max_blocks - len(t))]
    parts = [input_ids, positions, kv_index, query_start, context_lens, flat_tables, sample_index, sample_slots]
    host = torch.tensor([v for part in parts for v in part], dtype=torch.int64)
    if pin_memory:
        host = host.pin_memory()
    dev = host.to(device, non_blocking=pin_memory)
    views = list(torch.split(dev, [len(p) for p in parts]))
    views[5] = views[5].view(len(rows), max_blocks)
    for i in (3, 4, 5):  # query starts, context lengths and block tables in int32, as the engine's steps have them
        views[i] = views[i].to(torch.int32)
    return ForwardBatch(
        input_ids=views[0],
        positions=views[1],
        kv_index=views[2],
        query_start=views[3],
        context_lens=views[4],
        block_tables=views[5],
        sample_index=views[6],
        sample_slots=views[7],
        host_query_lens=query_lens,
        host_context_lens=context_lens,
        block_size=block_size,
    )
