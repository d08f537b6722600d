"""Paged attention in plain torch: the "eager" backend, later replaced by Triton kernels.

KV cache layout, per layer (one tensor for K, one for V)::

    k_cache [num_blocks, block_size, num_kv_heads, head_dim]
    token at position p of a row lives at flat index
        block_table[p // block_size] * block_size + p % block_size

A backend has three calls: ``plan(batch, rotary, dtype)`` once per step (row
shapes, masks, rotary tables, shared by all layers), then per layer
``rotate_and_store`` (rotary on q and k, k and v into the cache; returns the
rotated q) and ``attend``.  Every shape comes from the batch's host lists, so
nothing here reads a device value back.  :mod:`executor_proc.backends.triton_backend`
is the CUDA implementation.

Decode rows (one query token) are attended in batched runs: the blocks of every
row of a run are gathered into one padded tensor with a length mask and sent to
one SDPA call.  Prefill and chunk rows go one at a time over their gathered
context with a causal mask aligned to the end of the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from executor_proc.step.batch import ForwardBatch


@dataclass
class DecodeRun:
    """Consecutive rows of one query token each; ``tokens`` is their slice of the step's tokens."""

    tokens: slice
    block_tables: torch.Tensor  # [n, num_blocks] view of the batch's block tables
    mask: torch.Tensor  # [n, 1, 1, num_blocks * block_size] True where a key is attended


@dataclass
class PrefillRow:
    """One row with several query tokens, ending at position ``context_len - 1``."""

    tokens: slice
    block_ids: torch.Tensor  # [num_blocks] view of the row's block table
    context_len: int
    mask: Optional[torch.Tensor]  # [n, context_len]; None when the chunk is the whole context


@dataclass
class AttentionPlan:
    decode_runs: list[DecodeRun] = field(default_factory=list)
    prefill_rows: list[PrefillRow] = field(default_factory=list)


@dataclass
class EagerPlan:
    """The eager backend's per-step state: row plan, rotary cos/sin ``[T, D]``, KV slots."""

    attention: AttentionPlan
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


class AttentionBackend(Protocol):
    def plan(self, batch: ForwardBatch, rotary: torch.nn.Module, dtype: torch.dtype) -> object: ...

    def rotate_and_store(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        plan: object,
    ) -> torch.Tensor: ...

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: object, scale: float
    ) -> torch.Tensor: ...


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by position (half-split layout, as HF's rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the step's keys and values ``[T, num_kv_heads, head_dim]`` at their flat cache slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def plan_attention(batch: ForwardBatch) -> AttentionPlan:
    """Split the batch into decode runs and prefill rows, and build their masks once per step."""
    plan = AttentionPlan()
    device = batch.input_ids.device
    bs = batch.block_size
    qlens, clens = batch.host_query_lens, batch.host_context_lens
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    r = 0
    while r < batch.num_rows:
        if qlens[r] == 1:
            end = r
            while end < batch.num_rows and qlens[end] == 1:
                end += 1
            num_blocks = -(-max(clens[r:end]) // bs)
            keys = torch.arange(num_blocks * bs, device=device)
            mask = keys[None, :] < batch.context_lens[r:end, None]
            plan.decode_runs.append(
                DecodeRun(
                    tokens=slice(starts[r], starts[end]),
                    block_tables=batch.block_tables[r:end, :num_blocks],
                    mask=mask[:, None, None, :],
                )
            )
            r = end
            continue
        n, ctx = qlens[r], clens[r]
        mask = None
        if ctx != n:
            # Query i sits at position ctx - n + i and sees keys 0..ctx - n + i.
            keys = torch.arange(ctx, device=device)
            queries = torch.arange(n, device=device) + (ctx - n)
            mask = keys[None, :] <= queries[:, None]
        plan.prefill_rows.append(
            PrefillRow(
                tokens=slice(starts[r], starts[r + 1]),
                block_ids=batch.block_tables[r, : -(-ctx // bs)],
                context_len=ctx,
                mask=mask,
            )
        )
        r += 1
    return plan


def attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """Attention of queries ``[T, H, D]`` over the cached context of their rows -> ``[T, H, D]``."""
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for run in plan.decode_runs:
        n = run.block_tables.shape[0]
        ids = run.block_tables.flatten()
        # [n * blocks, block_size, Hkv, D] -> [n, Hkv, L, D]
        k = k_cache.index_select(0, ids).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, ids).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[run.tokens].unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=run.mask, scale=scale, enable_gqa=True
        )
        out[run.tokens] = o.squeeze(2)
    for row in plan.prefill_rows:
        k = k_cache.index_select(0, row.block_ids).view(-1, num_kv_heads, head_dim)[: row.context_len].transpose(0, 1)
        v = v_cache.index_select(0, row.block_ids).view(-1, num_kv_heads, head_dim)[: row.context_len].transpose(0, 1)
        # 4-D inputs: the flash and memory-efficient CUDA kernels refuse 3-D ones (math fallback).
        o = F.scaled_dot_product_attention(
            q[row.tokens].transpose(0, 1).unsqueeze(0),
            k.to(q.dtype).unsqueeze(0),
            v.to(q.dtype).unsqueeze(0),
            attn_mask=row.mask,
            is_causal=row.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[row.tokens] = o[0].transpose(0, 1)
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """One-call form of :func:`plan_attention` + :func:`attend` (plans again on every call)."""
    return attend(q, k_cache, v_cache, plan_attention(batch), scale)


class EagerAttention:
    """The torch-native backend behind the :class:`AttentionBackend` interface."""

    def plan(self, batch: ForwardBatch, rotary: torch.nn.Module, dtype: torch.dtype) -> EagerPlan:
        cos, sin = rotary(batch.positions, dtype)
        return EagerPlan(plan_attention(batch), cos, sin, batch.slot_mapping)

    def rotate_and_store(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        plan: EagerPlan,
    ) -> torch.Tensor:
        k = apply_rotary(k, plan.cos, plan.sin)
        write_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        return apply_rotary(q, plan.cos, plan.sin)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: EagerPlan, scale: float
    ) -> torch.Tensor:
        return attend(q, k_cache, v_cache, plan.attention, scale)
