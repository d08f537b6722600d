"""The inputs of one forward step, as the model and the attention code see them.

Built by :mod:`executor_proc.step.worker` from a :class:`ipc.protocol.StepPlan` and
the slot tables.  Device tensors are filled from pinned host buffers with
non-blocking copies; the host lists are the plan's own numbers, so nothing here
ever reads a device value back.

Layout (T tokens in R rows, rows in plan order)::

    input_ids     [T]   token ids (decode rows: gathered from last_token[slot])
    positions     [T]   absolute position of each token
    slot_mapping  [T]   flat KV-cache index: block_id * block_size + offset
    query_start   [R+1] cumulative query lengths (row r = tokens query_start[r]:query_start[r+1])
    context_lens  [R]   tokens of KV the row attends to, new ones included
    block_tables  [R, max_blocks] the rows' block tables (padded with 0)
    sample_index  [S]   token index of each sampled row's last token (None: every token, as in decode)
    sample_slots  [S]   slot of each sampled row (for sampling parameters)

A CUDA-graph decode step builds its batch on the device from static buffers
(:mod:`executor_proc.step.decode_step`): it has no host context lengths, which only
the eager torch backend needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    sample_index: Optional[torch.Tensor]
    sample_slots: torch.Tensor
    # Host copies of the row shapes (from the plan, never read back from the device).
    host_query_lens: list[int]
    host_context_lens: Optional[list[int]]
    block_size: int

    @property
    def num_rows(self) -> int:
        return len(self.host_query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        return all(n == 1 for n in self.host_query_lens)


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
    ``non_blocking=True``) and the batch's tensors are views of its device copy.
    """
    rows = [RowInput(*row) for row in rows]
    if len(rows) != len(block_tables):
        raise ValueError(f"{len(rows)} rows but {len(block_tables)} block tables")
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
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
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        query_start.append(query_start[-1] + n)
        query_lens.append(n)
        context_lens.append(context)
        if row.sample:
            sample_index.append(query_start[-1] - 1)
            sample_slots.append(row.slot)
        tables.append(list(table[:needed]))
    max_blocks = max(len(t) for t in tables)
    flat_tables = [b for t in tables for b in t + [0] * (max_blocks - len(t))]
    parts = [input_ids, positions, slot_mapping, query_start, context_lens, flat_tables, sample_index, sample_slots]
    host = torch.tensor([v for part in parts for v in part], dtype=torch.int64)
    if pin_memory:
        host = host.pin_memory()
    dev = host.to(device, non_blocking=pin_memory)
    views = list(torch.split(dev, [len(p) for p in parts]))
    views[5] = views[5].view(len(rows), max_blocks)
    return ForwardBatch(
        input_ids=views[0],
        positions=views[1],
        slot_mapping=views[2],
        query_start=views[3],
        context_lens=views[4],
        block_tables=views[5],
        sample_index=views[6],
        sample_slots=views[7],
        host_query_lens=query_lens,
        host_context_lens=context_lens,
        block_size=block_size,
    )
