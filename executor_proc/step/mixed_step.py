"""A step with prefill chunks as functions of static device buffers, padded to a bucket (what graphs capture).

A mixed step (decode rows and prefill chunks) or a prefill step of ``T`` tokens in
``R`` rows runs in a bucket of ``Tb >= T`` tokens and ``Rb >= R`` rows
(:class:`MixedShape`), in two parts:

- the *body* (:func:`mixed_body`): the decoder for all ``Tb`` tokens, then the final
  norm of the sampled rows' last tokens, written into a static hidden buffer
  ``[Rb, hidden]``.  It does not depend on how rows sample, so one body per bucket
  serves every sampling mode;
- the *head* (:func:`mixed_head`): LM head and :func:`executor_proc.step.sample.sample_rows`
  for ``Sb`` rows of that buffer (``Sb``: the row bucket of the sampled rows), one per
  (``Sb``, sampling mode), like a decode graph's sampling.

The inputs of every bucket live in one flat int64 buffer (the host packs them with
:func:`pack`, one upload and one device copy per step)::

    sample_slots      [R_max]  slot of each sampled row           (head; padding: the pad slot)
    sample_positions  [R_max]  position of each sampled token     (head)
    -- body of bucket (Tb, Rb) --
    ids               [Tb]  prompt ids; -1: a decode row's token, gathered from last_token
    positions         [Tb]
    token_slots       [Tb]  padding tokens: the pad slot (no KV write)
    row_slots         [Rb]
    query_start       [Rb+1]  padded rows start and end at T: they are empty
    context_lens      [Rb]
    decode_lens       [Rb]  a decode row's context length, 0 for prefill and padded rows
    sample_index      [Rb]  token index of each sampled row's last token
    tiles             [1 + 2 * max_tiles]  prefill work: count, (row, query block) pairs,
                      the blocks with the most keys first (they take longest)

Rows are in plan order, every decode row first (row ``r < D`` is token ``r``), which is
what lets decode rows use the split-KV decode kernel while the prefill kernel walks
only the prefill rows' tiles (:mod:`executor_proc.backends.triton_backend`).  Padded
tokens come last and write no KV; padded rows have no tokens; padded sampled rows
sample for the pad slot: nothing real reads what they compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from executor_proc.step.batch import ForwardBatch
from executor_proc.step.plan_rows import PlanRows
from executor_proc.step.sample import Sampled, SamplingMode, sample_rows
from executor_proc.step.slot_tables import SlotTables
from kernels.prefill_attention import tile_tokens

def token_buckets(max_tokens: int) -> list[int]:
    """8, 16, 32, 48, 64, 96, 128, then every 64 to 1024, every 128 to 2048, every 256 beyond; ``max_tokens`` last.

    The 8-token bucket keeps a step of up to 8 tokens (one speculative row of K <= 7 drafts, a short chunk) on
    the skinny matmuls of decode, which read each weight once at bandwidth."""
    sizes = [8, 16, 32, 48, 64, 96] + list(range(128, 1024, 64)) + list(range(1024, 2048, 128))
    sizes += list(range(2048, max_tokens, 256))
    return [t for t in sizes if t < max_tokens] + [max_tokens]


def row_buckets(max_rows: int) -> list[int]:
    """8, 32, 128, 512, ... below ``max_rows``, then ``max_rows``."""
    sizes, r = [], 8
    while r < max_rows:
        sizes.append(r)
        r *= 4
    return sizes + [max_rows]


@dataclass(frozen=True)
class MixedShape:
    """A body bucket: ``tokens`` and ``rows`` (``rows <= tokens``); ``max_rows``: the widest row bucket;
    ``group``: the model's query heads per KV head (the prefill kernel's tile depends on it)."""

    tokens: int
    rows: int
    max_rows: int
    group: int = 1

    @property
    def tile_m(self) -> int:
        """Query tokens per prefill work tile: the prefill kernel's own choice for this bucket."""
        return tile_tokens(self.group, self.tokens)

    @property
    def tile_programs(self) -> int:
        """Programs per KV head that walk the tiles: enough for one row of every token."""
        return -(-self.tokens // self.tile_m)

    @property
    def max_tiles(self) -> int:
        """At most ``ceil(Tb / tile_m)`` tiles of tokens plus one partial tile per row."""
        return self.tile_programs + self.rows

    def lengths(self) -> dict[str, int]:
        """The body's arrays and their lengths, in buffer order."""
        t, r = self.tokens, self.rows
        return dict(ids=t, positions=t, token_slots=t, row_slots=r, query_start=r + 1, context_lens=r,
                    decode_lens=r, sample_index=r, tiles=1 + 2 * self.max_tiles)

    @property
    def size(self) -> int:
        """int64 elements of the packed inputs (sample arrays and body)."""
        return 2 * self.max_rows + sum(self.lengths().values())


def pack(rows: PlanRows, shape: MixedShape, pad_slot: int) -> np.ndarray:
    """The step's packed inputs for ``shape`` (module docstring); every row past the real ones is padding."""
    buf = np.zeros(shape.size, dtype=np.int64)
    sampled = rows.sampled
    s, rmax = len(sampled), shape.max_rows
    buf[:rmax] = pad_slot
    buf[:s] = rows.slots[sampled]
    buf[rmax:rmax + s] = rows.sample_positions
    parts, at = {}, 2 * rmax
    for name, n in shape.lengths().items():
        parts[name], at = buf[at:at + n], at + n
    t, r, d = rows.num_tokens, rows.num_rows, rows.num_decode
    parts["ids"][:t] = rows.ids
    parts["positions"][:t] = rows.positions
    parts["token_slots"][:] = pad_slot
    parts["token_slots"][:t] = rows.slots[rows.token_rows]
    parts["row_slots"][:] = pad_slot
    parts["row_slots"][:r] = rows.slots
    parts["query_start"][:] = t
    parts["query_start"][:r + 1] = rows.query_start
    parts["context_lens"][:r] = rows.context_lens
    parts["decode_lens"][:d] = rows.context_lens[:d]
    parts["sample_index"][:s] = rows.logits_index
    _pack_tiles(parts["tiles"], rows, shape.tile_m)
    return buf


def _pack_tiles(tiles: np.ndarray, rows: PlanRows, tile_m: int) -> None:
    """The prefill rows' (row, query block) pairs, most keys first: the kernel's programs take them
    in order, so the longest start first and the short ones fill in (longest-processing-time)."""
    d = rows.num_decode
    qlens = rows.qlens[d:]
    per_row = -(-qlens // tile_m)
    n = int(per_row.sum())
    row = np.repeat(np.arange(d, rows.num_rows), per_row)
    block = np.arange(n) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    prefix = np.repeat(rows.context_lens[d:] - qlens, per_row)
    order = np.argsort(-(prefix + np.minimum((block + 1) * tile_m, qlens[row - d])), kind="stable")
    tiles[0] = n
    tiles[1:1 + 2 * n:2] = row[order]
    tiles[2:2 + 2 * n:2] = block[order]


@dataclass
class MixedInputs:
    """Device views of one body bucket's inputs (and the sampled rows' slots)."""

    shape: MixedShape
    sample_slots: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor
    token_slots: torch.Tensor
    row_slots: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    decode_lens: torch.Tensor
    sample_index: torch.Tensor
    tiles: torch.Tensor


def mixed_inputs(buffer: torch.Tensor, shape: MixedShape) -> MixedInputs:
    """The views of ``shape``'s inputs in the flat ``buffer``."""
    views, at = {}, 2 * shape.max_rows
    for name, n in shape.lengths().items():
        views[name], at = buffer[at:at + n], at + n
    return MixedInputs(shape, buffer[:shape.rows], **views)


def mixed_batch(inputs: MixedInputs, tables: SlotTables, block_size: int,
                host: Optional[PlanRows] = None) -> ForwardBatch:
    """The bucket's :class:`ForwardBatch`, computed on the device; ``host``: the real rows (eager calls only)."""
    slots, pos, bs = inputs.token_slots, inputs.positions, block_size
    block_ids = tables.block_table[slots, pos // bs].to(torch.int64)
    shape = inputs.shape
    return ForwardBatch(
        input_ids=torch.where(inputs.ids < 0, tables.last_token[slots], inputs.ids),
        positions=pos,
        kv_index=torch.where(slots == tables.pad_slot, -1, block_ids * bs + pos % bs),
        query_start=inputs.query_start.to(torch.int32),
        context_lens=inputs.context_lens.to(torch.int32),
        block_tables=tables.block_table[inputs.row_slots],
        sample_index=inputs.sample_index,
        sample_slots=inputs.sample_slots,
        host_query_lens=[] if host is None else host.qlens.tolist(),
        host_context_lens=None if host is None else host.context_lens.tolist(),
        block_size=bs,
        decode_context_lens=inputs.decode_lens.to(torch.int32),
        prefill_tiles=inputs.tiles.to(torch.int32),
        tile_m=shape.tile_m,
        tile_programs=shape.tile_programs,
    )


def mixed_body(model, kv_cache, tables: SlotTables, inputs: MixedInputs, block_size: int, hidden: torch.Tensor,
               host: Optional[PlanRows] = None) -> None:
    """Forward of the bucket; the sampled rows' final hidden states into ``hidden [Rb, hidden_size]``."""
    hidden.copy_(model.final_hidden(mixed_batch(inputs, tables, block_size, host), kv_cache))


def mixed_head(model, tables: SlotTables, hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               mode: SamplingMode) -> Sampled:
    """LM head + sampling of ``Sb`` rows: tokens ``[Sb]`` (and logprobs), ``last_token`` updated."""
    return sample_rows(model.backend, model.logits(hidden), tables, slots, positions, mode)
