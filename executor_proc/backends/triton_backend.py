"""The Triton backend: the CUDA fast path's attention, ops and sampler on the Triton kernels.

Per step, :meth:`TritonBackend.plan` only picks views and host numbers (no
device work, no host reads), so it is the same inside and outside a CUDA graph.
Per layer:

- ``rotate_and_store``: one ``rope_kv_write`` launch rotates q (in place) and k
  and writes k and v into the paged cache (``kv_index < 0`` skips a token:
  padded graph rows);
- ``attend``: a pure-decode step uses the split-KV ``decode_attention`` with a
  fixed number of splits per batch size and one preallocated workspace; a
  graph-shaped mixed step (``batch.prefill_tiles``) runs its decode rows through
  the same ``decode_attention`` (rows past them have length 0 and write zeros) and
  then its prefill rows through ``prefill_attention``'s work-tile form, which
  overwrites the prefill tokens; any other step with a prefill chunk (eager) runs
  every row (decode rows are rows of length 1) through ``prefill_attention``.

The linears and the chains around them are :class:`executor_proc.backends.triton_linears.TritonLinears`'s, the
MoE ops :class:`executor_proc.backends.triton_moe.TritonMoE`'s.  Ops here: ``rms_norm``, ``add_rms_norm`` and
``silu_and_mul`` are single Triton launches.  With ``batch_invariant`` decode attention always uses
``INVARIANT_ATTENTION_SPLITS`` (and every linear one tile per weight), so a row's result does not depend on the rows
beside it.  The sampler is :func:`kernels.sampling.sample`; penalties and logprobs are :mod:`kernels.penalties` and
:mod:`kernels.logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from executor_proc.backends.base import NO_SCALE, KVScale, QKNorm, SamplingRows, argmax_store
from executor_proc.backends.triton_linears import TritonLinears
from executor_proc.backends.triton_moe import TritonMoE
from executor_proc.step.batch import ForwardBatch
from kernels import argmax
from kernels.activation import silu_and_mul
from kernels.decode_attention import DecodeWorkspace, decode_attention, default_num_splits, split_pairs
from kernels.decode_rows import decode_rows
from kernels.kv_write import rope_cos_sin_cache, rope_kv_write
from kernels.logprobs import token_logprobs
from kernels.norm import fused_add_rms_norm, rms_norm
from kernels.penalties import PenaltyTables, apply_penalties, count_sampled
from kernels.prefill_attention import prefill_attention
from kernels.sampling import sample

# Batch-invariant decode attention splits each row's KV into this many parts at every batch size. The H100
# sweep of 1..16 (2026-11): 8 costs ~1 us/layer more than 16 at batch 1 (1B shape) and
# saves ~2 us/layer at batch 64; on the 8B shape it is the best of 1..16 at batch 1 and no worse at 64.
INVARIANT_ATTENTION_SPLITS = 8


@dataclass
class TritonPlan:
    positions: torch.Tensor
    kv_index: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start: torch.Tensor
    max_query_len: int
    pure_decode: bool
    num_splits: int
    decode_context_lens: Optional[torch.Tensor] = None  # a graph-shaped mixed step (ForwardBatch)
    prefill_tiles: Optional[torch.Tensor] = None
    tile_m: int = 0
    tile_programs: int = 0


class TritonBackend(TritonLinears, TritonMoE):
    """:class:`executor_proc.backends.base.Backend` on the Triton kernels."""

    supports_graphs = True

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, max_batch: int, device: torch.device, batch_invariant: bool = False,
                 max_decode_rows: int = 0):
        """``max_batch``: the most rows of a decode step; ``max_decode_rows``: of any one-token-a-row forward (a
        speculative step's positions), which takes fewer attention splits past ``max_batch``."""
        self.cos_sin = rope_cos_sin_cache(inv_freq.float().to(device), max_positions)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device = device
        # batch-invariant: every call, whatever its rows, keeps the one split count (room for it at every size)
        # (a speculative step's rows take the splits the default rule gives them: room for that at every row count)
        self.workspace = DecodeWorkspace(max_batch, num_heads, head_dim, device=device, max_rows=max_decode_rows,
                                         min_splits=INVARIANT_ATTENTION_SPLITS if batch_invariant else 1,
                                         min_pairs=split_pairs(max_decode_rows, num_kv_heads, device,
                                                               head_dim=head_dim))
        TritonLinears.__init__(self)
        TritonMoE.__init__(self, device)
        self.batch_invariant = batch_invariant
        # Batch-invariant mode: one attention split count for every batch; each weight's kernel, by shape.
        self.invariant_splits = min(INVARIANT_ATTENTION_SPLITS, self.workspace.max_splits)
        # batch-invariant: decode attention's tile too is one for every call (an FP8 cache's depends on the rows)
        self._attention_rows = max_batch if batch_invariant else None

    def use_choices_of(self, other: "TritonBackend") -> None:
        """Take ``other``'s tuned kernel choices (tests compare two workers on the same kernels)."""
        self.gemv_choice, self.prologue_choice = other.gemv_choice, other.prologue_choice
        self.matmul_choice, self.fp8_matmul_choice = other.matmul_choice, other.fp8_matmul_choice
        self.moe_small_choice, self.moe_grouped_choice = other.moe_small_choice, other.moe_grouped_choice

    def plan(self, batch: ForwardBatch) -> TritonPlan:
        if batch.prefill_tiles is not None:
            rows = batch.decode_context_lens.shape[0]
            return TritonPlan(batch.positions, batch.kv_index, batch.block_tables, batch.context_lens,
                              batch.query_start, batch.tile_m, pure_decode=False,
                              num_splits=self._num_splits(rows),
                              decode_context_lens=batch.decode_context_lens, prefill_tiles=batch.prefill_tiles,
                              tile_m=batch.tile_m, tile_programs=batch.tile_programs)
        qlens = batch.host_query_lens
        pure_decode = batch.is_pure_decode
        rows = len(qlens)
        return TritonPlan(
            positions=batch.positions,
            kv_index=batch.kv_index,
            block_tables=batch.block_tables,
            context_lens=batch.context_lens,
            query_start=batch.query_start,
            max_query_len=max(qlens, default=0),
            pure_decode=pure_decode,
            num_splits=self._num_splits(rows) if pure_decode else 1,
        )

    def _num_splits(self, rows: int) -> int:
        """Fixed per batch size (never per length): one value serves a whole graph bucket; one value
        for every batch size when batch-invariant."""
        if self.batch_invariant:
            return self.invariant_splits
        return min(default_num_splits(rows, self.num_kv_heads, self.device, self.workspace.max_splits, self.head_dim),
                   self.workspace.splits_for(rows))

    @property
    def max_decode_rows(self) -> int:
        """The most rows one decode forward may have (past the decode steps' batch with fewer attention splits,
        or, batch-invariant, the same split count)."""
        return self.workspace.max_rows

    def rotate_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, plan: TritonPlan, kv_scale: KVScale = NO_SCALE,
                         qk_norm: Optional[QKNorm] = None) -> torch.Tensor:
        return rope_kv_write(q, k, v, plan.positions, self.cos_sin, k_cache, v_cache, plan.kv_index, q_out=q,
                             kv_scale=kv_scale, qk_norm=qk_norm)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TritonPlan,
               scale: float, kv_scale: KVScale = NO_SCALE) -> torch.Tensor:
        if plan.pure_decode:
            return decode_attention(q, k_cache, v_cache, plan.block_tables, plan.context_lens, scale,
                                    workspace=self.workspace, num_splits=plan.num_splits, kv_scale=kv_scale,
                                    config_rows=self._attention_rows)
        if plan.prefill_tiles is not None:
            out = torch.empty_like(q)
            rows = plan.decode_context_lens.shape[0]  # decode rows are the first rows and tokens
            decode_attention(q[:rows], k_cache, v_cache, plan.block_tables, plan.decode_context_lens, scale,
                             out=out[:rows], workspace=self.workspace, num_splits=plan.num_splits, kv_scale=kv_scale,
                             config_rows=self._attention_rows)
            return prefill_attention(q, k_cache, v_cache, plan.block_tables, plan.query_start, plan.context_lens,
                                     plan.max_query_len, scale, out=out, block_m=plan.tile_m,
                                     tiles=plan.prefill_tiles, num_programs=plan.tile_programs, kv_scale=kv_scale)
        return prefill_attention(q, k_cache, v_cache, plan.block_tables, plan.query_start, plan.context_lens,
                                 plan.max_query_len, scale, kv_scale=kv_scale)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    decode_rows = staticmethod(decode_rows)

    @staticmethod
    def argmax(logits: torch.Tensor, last_token: Optional[torch.Tensor] = None,
               slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        if logits.shape[0] <= argmax.MAX_ROWS:
            return argmax.argmax_rows(logits, last_token, slots)  # the pick kernel writes last_token too
        return argmax_store(logits, last_token, slots)

    @staticmethod
    def sample(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        return sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.seed, rows.position,
                      filtered=rows.filtered)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, tables: PenaltyTables, slots: torch.Tensor,
                        in_place: bool) -> torch.Tensor:
        """In place when the raw logits are not needed afterwards (no logprobs): one read and write less."""
        return apply_penalties(logits, tables, slots, out=logits if in_place else None)

    @staticmethod
    def count_sampled(tables: PenaltyTables, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        count_sampled(tables, slots, tokens)

    @staticmethod
    def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                       num_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(logits, tokens, num_logprobs)
