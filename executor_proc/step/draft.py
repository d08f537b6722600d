"""The draft model of ``--speculative-method draft``: its KV cache beside the model's, and a step's draft passes.

Design.  The drafts of a speculative row are the draft model's greedy tokens (point masses), so the verify of
:mod:`executor_proc.step.speculate` stays as it is and outputs stay those of plain sampling token for token.  The
draft's KV cache is indexed by the model's block tables, with the model's block size: block ``b`` holds the same
positions of the same request in both caches, so the scheduler's allocator knows nothing of the draft::

    draft KV  [layers, 2, num_blocks + 1, block_size, kv_heads, head_dim]   (the draft's own shape and layers)
    block num_blocks: scratch, for the writes no position owns (padding of a short context, drafts past a row's k)

Everything depending on accepted counts stays on the device, as for the model.  One step (eager) runs:

* pass 0, one forward: every prefill chunk of the step as the model runs it (the draft's KV holds every prompt),
  and per speculative row at device position ``base`` (the slot's last token) a chunk of ``K + 1`` tokens over
  positions ``base - K .. base`` from the slot's token table.  It rewrites the draft KV of the positions the
  slot's previous verify may have changed (its drafts past the accepted ones; the table holds the accepted tokens
  there), and its logits at ``base`` give draft 1.  Near the start of a context the positions below 0 are
  padding: position 0's token, their KV written to the scratch block;
* passes 1 .. K - 1: one token per speculative row, draft ``j`` at position ``base + j``, giving draft ``j + 1``.
  A row with ``k < K`` drafts repeats position ``base + k`` past its ``k``-th, its KV to the scratch block (its
  blocks end there).

The shapes depend only on the plan's rows (``R`` rows, ``K``), never on device values.  The host's context lengths
are upper bounds (the plan's positions); the device's are exact, and attention masks by position.  A step without
prefill chunks runs :meth:`DraftModel.spec_passes`, a function of ``(slots, ks, base)`` alone, on a bucket of rows
(:mod:`executor_proc.step.draft_graphs`: on CUDA a graph per bucket; padded rows have ``k = -1``, every KV write
to the scratch block).  Plain decode rows do not run the draft: a slot that speculates runs speculative rows from its
prompt's end to its finish (its requests never pause: :mod:`scheduler_proc.speculation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from executor_proc.model.kv_cache import KVCache, kv_cache_bytes_per_block
from executor_proc.step.batch import ForwardBatch
from executor_proc.step.plan_rows import PlanRows


@dataclass
class DraftStep:
    """One step's draft passes, laid out on the host: pass 0's rows (speculative chunks, then prefill chunks)."""

    num_spec: int  # speculative rows
    num_prefill: int  # prefill chunks
    query_lens: list[int]  # pass 0's rows
    context_lens: list[int]  # their host upper bounds
    decode_context_lens: list[list[int]]  # passes 1 .. K - 1: each speculative row's host upper bound
    # with prefill chunks: upload index of their rows, their tokens (in the model's batch), pass 0's sample index
    part: int = -1
    starts: int = -1  # upload index: pass 0's query_start (int32)
    sizes: tuple[int, ...] = ()
    parts: list = field(default_factory=list)  # the device arrays at ``part`` (apply), then query_start
    batch: Optional[ForwardBatch] = None  # the model's eager batch: the prefill chunks' inputs


def chunk_context_lens(starts: np.ndarray, k: int, max_tokens: int) -> np.ndarray:
    """Host upper bounds of the speculative chunks' contexts (``starts``: the rows' plan positions, upper bounds of
    ``base``).  Never exactly ``K + 1`` where a larger bound fits: the torch backend attends a chunk whose context
    equals its length causally by index, and a short context's padded chunk must be masked by position."""
    ctx = starts + 1
    return np.where((ctx == k + 1) & (ctx + 1 <= max_tokens), ctx + 1, ctx)


def chunk_inputs(tokens: torch.Tensor, block_table: torch.Tensor, slots: torch.Tensor, ks: torch.Tensor,
                 base: torch.Tensor, k: int, block_size: int, scratch: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 0's speculative chunks: ``[R, K + 1]`` token ids, positions and KV indices for positions
    ``base - K .. base`` (below 0, or a padded row's, ``ks < 0``: position 0's token, KV to ``scratch``)."""
    want = base[:, None] - k + torch.arange(k + 1, device=base.device)
    pos = want.clamp(min=0)
    ids = tokens[slots[:, None], pos].to(torch.int64)
    blocks = block_table[slots].gather(1, pos // block_size).to(torch.int64)
    kv = torch.where((want >= 0) & (ks[:, None] >= 0), blocks * block_size + pos % block_size, scratch)
    return ids, pos, kv


def decode_inputs(block_table: torch.Tensor, slots: torch.Tensor, ks: torch.Tensor, base: torch.Tensor, j: int,
                  block_size: int, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass ``j``'s positions and KV indices: draft ``j`` at ``base + j``; past a row's ``k`` drafts, position
    ``base + k`` again with its KV to ``scratch`` (a padded row: ``base``)."""
    pos = base + torch.clamp(ks, min=0, max=j)
    blocks = block_table[slots].gather(1, (pos // block_size)[:, None])[:, 0].to(torch.int64)
    return pos, torch.where(ks >= j, blocks * block_size + pos % block_size, scratch)


class DraftModel:
    """The draft model, its KV cache (:meth:`allocate`) and a step's passes (:meth:`stage`, :meth:`apply`,
    :meth:`run`)."""

    def __init__(self, model, k: int, block_size: int, kv_dtype: torch.dtype, device: torch.device):
        self.model = model
        self.k = k
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.device = device
        self.kv: Optional[KVCache] = None
        self.scratch = 0  # flat KV index of the scratch block
        self.graphs = None  # executor_proc.step.draft_graphs.DraftGraphs, where the mixed-step graphs run

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one draft KV block (over the draft's layers)."""
        return kv_cache_bytes_per_block(self.model.config, self.block_size, self.kv_dtype)

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def allocate(self, num_blocks: Optional[int]) -> None:
        """A KV cache for the model's ``num_blocks`` block ids and the scratch block (None: drop it)."""
        self.kv = None
        if num_blocks is not None:
            self.kv = KVCache(self.model.config, num_blocks + 1, self.block_size, device=self.device,
                              dtype=self.kv_dtype)
            self.scratch = num_blocks * self.block_size

    def stage(self, rows: PlanRows, spec_rows: Optional[np.ndarray], max_tokens: int, upload) -> Optional[DraftStep]:
        """Lay out the step's draft passes and add their host arrays to the upload (None: no prefill chunk and no
        speculative row); ``spec_rows``: the speculative rows' indices, ``max_tokens``: a block table's tokens."""
        k = self.k
        spec = spec_rows if spec_rows is not None else np.zeros(0, dtype=np.int64)
        prefill = np.flatnonzero(rows.is_prefill)
        if not len(prefill) and not len(spec):
            return None
        starts = rows.starts[spec]
        qlens = [k + 1] * len(spec) + rows.qlens[prefill].tolist()
        ctx = chunk_context_lens(starts, k, max_tokens).tolist() + rows.context_lens[prefill].tolist()
        ks = rows.qlens[spec] - 1  # a speculative row's query: its last token and its drafts
        step = DraftStep(len(spec), len(prefill), qlens, ctx,
                         [(starts + 1 + np.minimum(ks, j)).tolist() for j in range(1, k)])
        if not len(prefill):  # the speculative chunks alone: laid out on the device (spec_passes)
            return step
        tok = np.concatenate([np.arange(rows.query_start[r], rows.query_start[r + 1]) for r in prefill])
        query_start = np.concatenate([[0], np.cumsum(qlens)])
        # pass 0's logits: each chunk's last token (a step without speculative rows reads one row, unused)
        sample = (np.arange(len(spec)) * (k + 1) + k) if len(spec) else query_start[-1:] - 1
        arrays = [prefill, tok, sample]
        step.part = upload.add(np.concatenate(arrays).astype(np.int64), torch.int64)
        step.starts = upload.add(query_start, torch.int32)
        step.sizes = tuple(len(a) for a in arrays)
        return step

    @staticmethod
    def apply(step: DraftStep, sent: list[torch.Tensor], batch: Optional[ForwardBatch]) -> None:
        """The step's device arrays, and the model's eager batch its prefill chunks are read from."""
        if step.num_prefill:
            step.parts = [*torch.split(sent[step.part], step.sizes), sent[step.starts]]
        step.batch = batch

    @torch.inference_mode()
    def run(self, step: DraftStep, tables, tokens: Optional[torch.Tensor] = None,
            rows: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> Optional[torch.Tensor]:
        """Run the passes; ``[R, K]`` drafts, or None without speculative rows.  ``tokens``: the slots' token
        table (:class:`executor_proc.step.speculate.Speculator`); ``rows``: the speculative rows' slots, draft
        counts and device positions ``base``, in row order."""
        if not step.num_prefill:
            if self.graphs is not None and self.graphs.bucket_for(step.num_spec) is not None:
                return self.graphs.run(step, *rows)
            return self.spec_passes(tables, tokens, *rows, step.context_lens, step.decode_context_lens)
        k, bs, batch = self.k, self.block_size, step.batch
        prefill, tok, sample, query_start = step.parts
        ids, pos, kv, ctx, tables_of = [], [], [], [], []
        if step.num_spec:
            slots, ks, base = rows
            c_ids, c_pos, c_kv = chunk_inputs(tokens, tables.block_table, slots, ks, base, k, bs, self.scratch)
            ids.append(c_ids.view(-1))
            pos.append(c_pos.view(-1))
            kv.append(c_kv.view(-1))
            ctx.append((base + 1).to(torch.int32))
            tables_of.append(tables.block_table[slots])
        ids.append(batch.input_ids[tok])
        pos.append(batch.positions[tok])
        kv.append(batch.kv_index[tok])
        ctx.append(batch.context_lens[prefill].to(torch.int32))
        tables_of.append(batch.block_tables[prefill])
        first = ForwardBatch(
            input_ids=torch.cat(ids), positions=torch.cat(pos), kv_index=torch.cat(kv), query_start=query_start,
            context_lens=torch.cat(ctx), block_tables=torch.cat(tables_of), sample_index=sample,
            sample_slots=sample, host_query_lens=step.query_lens, host_context_lens=step.context_lens,
            block_size=bs)
        hidden = self.model.final_hidden(first, self.kv)
        if not step.num_spec:
            return None
        return self._token_passes(tables, slots, ks, base, self.model.logits(hidden).argmax(dim=-1),
                                  step.decode_context_lens)

    @torch.inference_mode()
    def spec_passes(self, tables, tokens: torch.Tensor, slots: torch.Tensor, ks: torch.Tensor, base: torch.Tensor,
                    context_lens: list[int], decode_context_lens: list[list[int]]) -> torch.Tensor:
        """A step's draft without prefill chunks, from device tensors of fixed shapes (what a graph captures):
        ``[R, K]`` drafts of the rows ``(slots, ks, base)``; the host lists are upper bounds (module docstring)."""
        k, bs, n = self.k, self.block_size, slots.shape[0]
        ids, pos, kv = chunk_inputs(tokens, tables.block_table, slots, ks, base, k, bs, self.scratch)
        starts = torch.arange(n + 1, device=slots.device) * (k + 1)
        first = ForwardBatch(
            input_ids=ids.view(-1), positions=pos.view(-1), kv_index=kv.view(-1),
            query_start=starts.to(torch.int32), context_lens=(base + 1).to(torch.int32),
            block_tables=tables.block_table[slots], sample_index=starts[1:] - 1, sample_slots=slots,
            host_query_lens=[k + 1] * n, host_context_lens=context_lens, block_size=bs)
        return self._token_passes(tables, slots, ks, base, self.model(first, self.kv).argmax(dim=-1),
                                  decode_context_lens)

    def _token_passes(self, tables, slots: torch.Tensor, ks: torch.Tensor, base: torch.Tensor, draft: torch.Tensor,
                      decode_context_lens: list[list[int]]) -> torch.Tensor:
        """Passes 1 .. K - 1 from draft 1; ``[R, K]`` drafts."""
        n, bs = slots.shape[0], self.block_size
        drafts = [draft]
        block_table = tables.block_table[slots]
        row_starts = torch.arange(n + 1, device=slots.device, dtype=torch.int32)
        for j in range(1, self.k):
            p, kv_j = decode_inputs(tables.block_table, slots, ks, base, j, bs, self.scratch)
            one = ForwardBatch(
                input_ids=draft, positions=p, kv_index=kv_j, query_start=row_starts,
                context_lens=(p + 1).to(torch.int32), block_tables=block_table, sample_index=None,
                sample_slots=slots, host_query_lens=[1] * n, host_context_lens=decode_context_lens[j - 1],
                block_size=bs)
            draft = self.model(one, self.kv).argmax(dim=-1)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)
