"""The inputs of one forward step, as the model and the attention code see them.

Built by :mod:`executor_proc.step.worker` from a :class:`ipc.protocol.StepPlan` and
the slot tables.  Device tensors are filled from pinned host buffers with
non-blocking copies; the host lists are the plan's own numbers, so nothing here
ever reads a device value back.

Layout (T tokens in R rows, rows in plan order)::

    input_ids     [T]   token ids (decode rows: gathered from last_token[slot])
    positions     [T]   absolute position of each token
    kv_index      [T]   flat KV-cache index: block_id * block_size + offset
    query_start   [R+1] cumulative query lengths (row r = tokens query_start[r]:query_start[r+1])
    context_lens  [R]   tokens of KV the row attends to, new ones included
    block_tables  [R, max_blocks] the rows' block tables (padded with 0)
    sample_index  [S]   token index of each sampled row's last token (None: every token, as in decode)
    sample_slots  [S]   slot of each sampled row (for sampling parameters)

A CUDA-graph decode step builds its batch on the device from static buffers
(:mod:`executor_proc.step.decode_step`): it has no host context lengths, which only
the eager torch backend needs.

A graph-shaped mixed step (:mod:`executor_proc.step.mixed_step`) is padded to a
bucket of ``T`` tokens and ``R`` rows, decode rows first (row ``r < D`` is token
``r``), and carries what its attention reads from the device instead of host lengths::

    decode_context_lens [R]  a decode row's context length, 0 for every other row
    prefill_tiles       [1 + 2 * max] int32: the count, then (row, query block) pairs
                        of ``tile_m`` tokens: the prefill rows' work for the prefill kernel

Its host lists describe the real rows only (the torch backend attends them; padded
tokens come last and write no KV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_index: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    sample_index: Optional[torch.Tensor]
    sample_slots: torch.Tensor
    # Host copies of the row shapes (from the plan, never read back from the device).
    host_query_lens: list[int]
    host_context_lens: Optional[list[int]]
    block_size: int
    # A graph-shaped mixed step (module docstring); None otherwise.
    decode_context_lens: Optional[torch.Tensor] = None
    prefill_tiles: Optional[torch.Tensor] = None
    tile_m: int = 0  # query tokens per prefill tile
    tile_programs: int = 0  # programs per KV head that walk the tiles
    # The tokens that write KV when some real ones do not (a speculative step's positions past a row's drafts, on
    # the padding slot), for the torch backend; None: every real token writes.
    host_kv_rows: Optional[list[int]] = None

    @property
    def num_rows(self) -> int:
        return len(self.host_query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        return all(n == 1 for n in self.host_query_lens)
