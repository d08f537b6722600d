"""The torch backend: paged attention with SDPA, ops and sampler from the torch references.

KV cache layout, per layer (one tensor for K, one for V)::

    k_cache [num_blocks, block_size, num_kv_heads, head_dim]
    token at position p of a row lives at flat index (its kv_index)
        block_table[p // block_size] * block_size + p % block_size

Every shape comes from the batch's host lists, so nothing here reads a device
value back (and no step of it can be captured in a CUDA graph: the Triton
backend does that).  Norm, activation, rotary, KV write and sampling are the
one torch statement of each op in :mod:`kernels.reference`, :mod:`kernels.sampling_ref`,
:mod:`kernels.penalties_ref` and :mod:`kernels.logprobs_ref`, which the kernel tests also compare against.

FP8 weights (``--quantization fp8``) run :func:`kernels.fp8.fp8_linear_ref`, the Triton kernels' arithmetic
(W8A16 up to 8 rows, W8A8 above) in float32 torch ops.

Decode rows (one query token) are attended in batched runs: the blocks of every
row of a run are gathered into one padded tensor with a length mask and sent to
one SDPA call.  Prefill and chunk rows go one at a time over their gathered
context with a causal mask aligned to the end of the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from executor_proc.backends.base import (NO_SCALE, KVScale, MoEFront, NormInput, QKNorm, SamplingRows, Stream,
                                         argmax_store, unfused_mlp, unfused_moe_front, unfused_norm_linear,
                                         unfused_project_out, unfused_qkv_rotate_store)
from executor_proc.step.batch import ForwardBatch
from kernels import reference as ops
from kernels.fp8 import Fp8Weight, fp8_linear_ref
from kernels.logprobs_ref import token_logprobs_ref
from kernels.moe_ref import moe_ref, route_held
from kernels.penalties_ref import PenaltyTables, apply_penalties_ref, count_sampled
from kernels.sampling_ref import sample

LOGITS_BLOCK = 2048  # vocabulary rows per matmul of the CPU's LM head (TorchBackend.logits)


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
            # Query i sees keys 0..its position (ctx - n + i; a speculative row's host ctx is only an upper bound of
            # its context, its positions are the device's).
            keys = torch.arange(ctx, device=device)
            mask = keys[None, :] <= batch.positions[starts[r]:starts[r + 1], None]
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


@dataclass
class TorchPlan:
    """The torch backend's per-step state: row plan, rotary ``cat(cos, sin) [T, D]``, KV indices."""

    attention: AttentionPlan
    cos_sin: torch.Tensor
    kv_index: torch.Tensor
    kv_rows: Optional[torch.Tensor] = None  # the tokens that write KV, when some of the real ones do not


class TorchBackend:
    """:class:`executor_proc.backends.base.Backend` in plain torch (the CPU path, and the GPU's ``kernels: torch``)."""

    supports_graphs = False
    max_decode_rows = 1 << 30  # no workspace: any number of one-token rows

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq

    def plan(self, batch: ForwardBatch) -> TorchPlan:
        # A bucket-padded step (the mixed-step runner called eagerly) lists its real tokens first.
        n = sum(batch.host_query_lens)
        rows = batch.host_kv_rows  # from the host: reading the indices' -1 back would wait for the device
        kv_rows = None if rows is None else torch.tensor(rows, dtype=torch.int64, device=batch.kv_index.device)
        return TorchPlan(plan_attention(batch), ops.rope_cos_sin(batch.positions, self.inv_freq), batch.kv_index[:n],
                         kv_rows)

    def rotate_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, plan: TorchPlan, kv_scale: KVScale = NO_SCALE,
                         qk_norm: Optional[QKNorm] = None) -> torch.Tensor:
        if qk_norm is not None:
            q, k = ops.rms_norm_ref(q, qk_norm[0], qk_norm[2]), ops.rms_norm_ref(k, qk_norm[1], qk_norm[2])
        n = plan.kv_index.shape[0]  # padded tokens write no KV
        k, v, index = ops.apply_rope(k[:n], plan.cos_sin[:n]), v[:n], plan.kv_index
        if plan.kv_rows is not None:
            k, v, index = k[plan.kv_rows], v[plan.kv_rows], index[plan.kv_rows]
        ops.kv_store(k, v, k_cache, v_cache, index, kv_scale)
        return ops.apply_rope(q, plan.cos_sin)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TorchPlan,
               scale: float, kv_scale: KVScale = NO_SCALE) -> torch.Tensor:
        out = attend(q, k_cache, v_cache, plan.attention, scale * kv_scale[0])  # an FP8 cache's K scale in the scores
        if kv_scale[1] != 1.0:
            out = out * kv_scale[1]
        out[plan.kv_index.shape[0]:] = 0  # padded tokens: no rows attend for them
        return out

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if isinstance(weight, Fp8Weight):  # the kernels' arithmetic (kernels/fp8.py), in torch
            return fp8_linear_ref(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return ops.rms_norm_ref(x, weight, eps)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.fused_add_rms_norm_ref(x, residual, weight, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul_ref(gate_up)

    decode_rows = staticmethod(ops.decode_rows_ref)

    @staticmethod
    def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Float32 logits; on CUDA a 16-bit model's unrounded (a tie made by rounding would go to the lower id).
        On the CPU a matmul of several rows runs a block of the vocabulary at a time: the same bits as one
        ``F.linear`` (each logit's sum over the hidden size is the same), 17-21% faster at 2-16 rows (SmolLM2's
        49,152 x 576 head, one core: the weight block stays in cache across the rows)."""
        n = weight.shape[0]
        if hidden.is_cuda and weight.dtype in (torch.bfloat16, torch.float16):  # float32 sums, not rounded first
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)  # (as the Triton backend's logits)
        if hidden.device.type != "cpu" or hidden.shape[0] < 2 or n <= LOGITS_BLOCK:
            return F.linear(hidden, weight).float()
        out = torch.empty(hidden.shape[0], n, dtype=hidden.dtype)
        for lo in range(0, n, LOGITS_BLOCK):
            torch.mm(hidden, weight[lo:lo + LOGITS_BLOCK].t(), out=out[:, lo:lo + LOGITS_BLOCK])
        return out.float()

    argmax = staticmethod(argmax_store)

    def norm_linear(self, pre: NormInput, weight: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return unfused_norm_linear(self, pre, weight, bias)

    def mlp(self, pre: NormInput, gate_up: tuple, down: tuple) -> Stream:
        return unfused_mlp(self, pre, gate_up, down)

    def project_out(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    residual: torch.Tensor) -> Stream:
        return unfused_project_out(self, x, weight, bias, residual)

    def moe_front(self, pre: NormInput, gate: torch.Tensor, top_k: int, renormalize: bool, first_expert: int,
                  num_held: int) -> MoEFront:
        return unfused_moe_front(self, pre, gate)

    @staticmethod
    def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
            renormalize: bool, first_expert: int = 0,
            routing: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        if routing is None:
            routing = route_held(router_logits, top_k, renormalize, first_expert, w13.shape[0])
        return moe_ref(x, w13, w2, *routing)

    def qkv_rotate_store(self, pre: NormInput, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         k_cache: torch.Tensor, v_cache: torch.Tensor, plan,
                         kv_scale: KVScale = NO_SCALE) -> tuple[torch.Tensor, torch.Tensor]:
        return unfused_qkv_rotate_store(self, pre, weight, bias, k_cache, v_cache, plan, kv_scale)

    @staticmethod
    def sample(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        return sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.seed, rows.position)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, tables: PenaltyTables, slots: torch.Tensor,
                        in_place: bool) -> torch.Tensor:
        return apply_penalties_ref(logits, tables, slots)

    @staticmethod
    def count_sampled(tables: PenaltyTables, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        count_sampled(tables, slots, tokens)

    @staticmethod
    def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                       num_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs_ref(logits, tokens, num_logprobs)
