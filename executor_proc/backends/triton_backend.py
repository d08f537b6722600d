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

Ops: ``rms_norm``, ``add_rms_norm`` and ``silu_and_mul`` are single Triton
launches; ``linear`` is cuBLAS, or the Triton skinny matmul
(:mod:`kernels.gemv`) for the (shape, batch) pairs where
:func:`executor_proc.backends.gemv_tuning.tune_linears` measured it faster on
this GPU.  At one token, ``norm_linear`` and ``silu_linear`` fold the norm (with its
residual add) or the SiLU-mul into the skinny matmul's loads (:func:`kernels.gemv_row.gemv_prologue`:
one launch instead of two), and ``qkv_rotate_store`` also takes the rotary and the cache write
as the q|k|v matmul's epilogue (:func:`kernels.gemv_qkv.qkv_rope`: one launch instead of three).
At 2-16 tokens ``qkv_rotate_store`` takes the rotary and cache write as the epilogue and ``mlp`` the
SiLU-mul as gate|up's (:func:`kernels.gemv.gemv_silu`), each where
:func:`executor_proc.backends.gemv_tuning.tune_prologues` measured it faster for that weight and
batch size (otherwise the ops one by one); and with the layers' norms folded into q|k|v and gate|up
(``norms_folded``, :meth:`executor_proc.model.llama.CausalLM.fold_norms`) the norms are not launched
at all: ``project_out`` (o and down) adds the residual in the matmul's epilogue and leaves partial sums
of squares, from which q|k|v and gate|up scale their sums by the norm's rsqrt
(:func:`kernels.gemv.gemv_residual`).  FP8 weights (:mod:`kernels.fp8`) run every one of these skinny and
fused kernels on their e4m3 values (widened in registers, the per-channel scales applied to the sums) up to
8 rows, and W8A8 above (:mod:`kernels.matmul_fp8`), where the norm before q|k|v and gate|up and the SiLU-mul
before down write their output as FP8 rows with scales (one launch each, no model-dtype copy).  With
``batch_invariant`` every linear is :func:`kernels.matmul.invariant_matmul` (one tile shape and one split of K per
weight, whatever the number of rows) and decode attention always uses ``INVARIANT_ATTENTION_SPLITS``, so a row's
result does not depend on the rows beside it.  ``moe`` routes in one launch
(:mod:`kernels.moe_route`) and runs :func:`kernels.moe.fused_moe`: per (token, expert) pair
up to a few dozen pairs (at every size when batch-invariant), a grouped GEMM over the experts' blocks
above, on the start-up tuner's tiles (:mod:`executor_proc.backends.moe_tuning`).  The sampler is
:func:`kernels.sampling.sample`; penalties and logprobs are :mod:`kernels.penalties` and :mod:`kernels.logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from executor_proc.backends.base import (NO_SCALE, KVScale, MoEFront, NormInput, QKNorm, SamplingRows, Stream,
                                         argmax_store, normed, unfused_moe_front, unfused_norm_linear,
                                         unfused_project_out, unfused_qkv_rotate_store, unfused_silu_linear)
from executor_proc.step.batch import ForwardBatch
from kernels import argmax, gemv as skinny
from kernels.fp8 import W8A16_MAX_ROWS, Fp8Weight
from kernels.gemv_partials import sumsq_fits
from kernels.gemv_row import gemv_prologue
from kernels.activation import silu_and_mul, silu_and_mul_fp8
from kernels.decode_rows import decode_rows
from kernels.decode_attention import DecodeWorkspace, decode_attention, default_num_splits, split_pairs
from kernels.gemv_qkv import qkv_rope, rope_pairs
from kernels.kv_write import rope_cos_sin_cache, rope_kv_write
from kernels.logprobs import token_logprobs
from kernels.matmul import MatmulConfig, choose_config, invariant_matmul
from kernels.matmul_fp8 import Fp8MatmulConfig, w8a8_linear, w8a8_quantized
from kernels.moe import MoEConfig, SmallConfig, fused_moe, fused_moe_small
from kernels.moe_route import NORM_ROUTE_MAX_TOKENS, norm_route, norm_routes_here, route, routes_here
from kernels.moe_ref import route_held
from kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_fp8
from kernels.penalties import PenaltyTables, apply_penalties, count_sampled
from kernels.prefill_attention import prefill_attention
from kernels.sampling import sample

GemvConfig = tuple
# Batch-invariant decode attention splits each row's KV into this many parts at every batch size. The H100
# sweep of 1..16 (2026-11): 8 costs ~1 us/layer more than 16 at batch 1 (1B shape) and
# saves ~2 us/layer at batch 64; on the 8B shape it is the best of 1..16 at batch 1 and no worse at 64.
INVARIANT_ATTENTION_SPLITS = 8


# The fused kernels the tuner may pick.  At one token "qkv", "norm" and "silu" fold the norm / SiLU-mul into the
# matmul's loads (every program re-reads the row: at 2+ tokens that cost more than the launch it saves on an H100);
# at 2-16 tokens "rope" and "gate_silu" are epilogues (rotary + cache write after q|k|v; SiLU-mul after gate|up).
ONE_TOKEN_KINDS = ("qkv", "norm", "silu")
# An FP8 weight's skinny matmul where the tuner chose none: [2-8 rows, one row] ("dot" at 2-8: the norm from
# partial sums needs it).
FP8_GEMV_DEFAULT = (("dot", 16, 256, 4, 4), ("row", 8, 512, 4, 4))


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


def skinny_rows(weight: torch.Tensor) -> int:
    """The most rows the skinny kernels serve for this weight: 16 ("dot" forms; "row" forms to 8), an FP8 weight
    :data:`kernels.fp8.W8A16_MAX_ROWS` (W8A8 above)."""
    return W8A16_MAX_ROWS if isinstance(weight, Fp8Weight) else skinny.MAX_M


def m_bucket(m: int) -> int:
    """The batch size a skinny-matmul choice is keyed by: the next power of two."""
    return 1 << max(0, m - 1).bit_length()


class TritonBackend:
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
        # (N, K, m_bucket) -> skinny-matmul config; absent: cuBLAS.
        self.gemv_choice: dict[tuple[int, int, int], GemvConfig] = {}
        self.gemv_everywhere: Optional[GemvConfig] = None  # tests: force the Triton path
        # (N, K, m_bucket) -> tiled-matmul config for batches above 8 (where no skinny one serves); absent: cuBLAS.
        self.matmul_choice: dict[tuple[int, int, int], MatmulConfig] = {}
        # FP8 weights above 8 rows: (N, K, m_bucket) -> the Triton W8A8 kernel's config; absent: cuBLASLt.
        self.fp8_matmul_choice: dict[tuple[int, int, int], Fp8MatmulConfig] = {}
        # (kind, N, K, m_bucket) -> the config of a fused kernel (ONE_TOKEN_KINDS at m 1, "rope" and "gate_silu"
        # at 2-16); absent: unfused.
        self.prologue_choice: dict[tuple[str, int, int, int], GemvConfig] = {}
        # tests and tuning: force these kinds' fused kernels to these configs wherever they fit
        self.prologue_everywhere: Optional[dict[str, GemvConfig]] = None
        self.prologue_timings: dict = {}
        self.gemv_timings: dict = {}  # what the tuner measured (benchmarks report it)
        # MoE layers' tiles, (E, I, H, m_bucket) -> per-pair form's SmallConfig / grouped form's MoEConfig;
        # absent: the defaults (executor_proc/backends/moe_tuning.py)
        self.moe_small_choice: dict[tuple[int, int, int, int], SmallConfig] = {}
        self.moe_grouped_choice: dict[tuple[int, int, int, int], MoEConfig] = {}
        self.moe_timings: dict = {}
        # an MoE layer's norm, router and routing in one launch at 1-4 tokens: each token's arrival counter
        self.route_arrivals = torch.zeros(NORM_ROUTE_MAX_TOKENS, dtype=torch.int32, device=device)
        self.batch_invariant = batch_invariant
        # Batch-invariant mode: one attention split count for every batch; each weight's kernel, by shape.
        self.invariant_splits = min(INVARIANT_ATTENTION_SPLITS, self.workspace.max_splits)
        # batch-invariant: decode attention's tile too is one for every call (an FP8 cache's depends on the rows)
        self._attention_rows = max_batch if batch_invariant else None
        self.matmul_config: dict[tuple[int, int], MatmulConfig] = {}
        # CausalLM.fold_norms ran (the layers' norm weights are in q|k|v and gate|up): at 2-16 tokens the output
        # projections add the residual and q|k|v and gate|up apply the norm themselves (project_out)
        self.norms_folded = False

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

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if isinstance(weight, Fp8Weight):
            return self._fp8_linear(x, weight, bias)
        if self.batch_invariant:
            shape = (weight.shape[0], weight.shape[1])
            config = self.matmul_config.get(shape) or self.matmul_config.setdefault(
                shape, choose_config(*shape, self.device))
            return invariant_matmul(x, weight, bias, config=config)
        config = self._gemv_config(x, weight)
        if config is not None:
            return skinny.gemv(x, weight, bias, config=config)
        tiled = self._tiled_config(x, weight)
        if tiled is not None:
            return invariant_matmul(x, weight, bias, config=tiled)  # invariant, and here simply faster
        return F.linear(x, weight, bias)

    def _fp8_linear(self, x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Up to 8 rows the skinny matmul on the FP8 weight (W8A16); above, W8A8 on the FP8 tensor cores with the
        tuned kernel (cuBLASLt where none was tuned: prefill)."""
        m = x.shape[0]
        if m <= W8A16_MAX_ROWS:
            x = x.contiguous()
            return skinny.gemv(x, weight, bias, config=self._gemv_config(x, weight) or FP8_GEMV_DEFAULT[m == 1])
        return w8a8_linear(x, weight, bias, config=self._w8a8_config(weight, m))

    @staticmethod
    def _quantized_input(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the linear of ``weight`` at x's rows runs W8A8 (an FP8 weight above ``W8A16_MAX_ROWS`` rows), so
        that the kernel making its input may hand it over quantized (:meth:`_w8a8`)."""
        return isinstance(weight, Fp8Weight) and x.shape[0] > W8A16_MAX_ROWS

    def _w8a8(self, xq: torch.Tensor, xs: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor],
              out_dtype: torch.dtype) -> torch.Tensor:
        """:meth:`_fp8_linear`'s W8A8 product of rows the norm or the SiLU-mul quantized in its own launch."""
        return w8a8_quantized(xq, xs, weight, bias, self._w8a8_config(weight, xq.shape[0]), out_dtype)

    def _w8a8_config(self, weight: Fp8Weight, m: int) -> Optional[Fp8MatmulConfig]:
        """The tuned W8A8 kernel for this weight at ``m`` rows, or None (cuBLASLt)."""
        return self.fp8_matmul_choice.get((*weight.shape, m_bucket(m)))

    def _tiled_config(self, x: torch.Tensor, weight: torch.Tensor) -> Optional[MatmulConfig]:
        """The tiled matmul's config for this weight at x's rows (above 8), or None (cuBLAS)."""
        m = x.shape[0]
        return self.matmul_choice.get((weight.shape[0], weight.shape[1], m_bucket(m))) if m > 8 else None

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits, written by the matmul itself (a Triton kernel's store, or cuBLAS with a
        float32 output on CUDA): no separate cast launch, and no rounding to the model dtype on the way."""
        gemv, tiled = (None, None) if self.batch_invariant else (self._gemv_config(hidden, weight),
                                                                 self._tiled_config(hidden, weight))
        if gemv is None and tiled is None and not self.batch_invariant and hidden.is_cuda \
                and isinstance(weight, torch.Tensor) and weight.dtype in (torch.bfloat16, torch.float16):
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)  # where linear would call cuBLAS
        if gemv is None and tiled is None:
            return self.linear(hidden, weight, None).float()
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device)
        if gemv is not None:
            return skinny.gemv(hidden, weight, None, config=gemv, out=out)
        return invariant_matmul(hidden, weight, None, config=tiled, out=out)

    def _gemv_config(self, x: torch.Tensor, weight: torch.Tensor) -> Optional[GemvConfig]:
        """The skinny GEMV's config for this weight at x's rows, or None (the tiled matmul or cuBLAS)."""
        m = x.shape[0]
        if m > skinny_rows(weight) or x.stride(1) != 1:
            return None
        config = self.gemv_everywhere or self.gemv_choice.get((weight.shape[0], weight.shape[1], m_bucket(m)))
        if config is None and isinstance(weight, Fp8Weight):  # no cuBLAS for W8A16: the untuned default
            config = FP8_GEMV_DEFAULT[m == 1]
        return config if config is not None and skinny.config_fits(config, m) else None

    def norm_linear(self, pre: NormInput, weight: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self._quantized_input(pre.x, weight) and pre.sumsq is None:  # the norm writes FP8 rows and their scales
            xq, xs, residual = rms_norm_fp8(pre.x, pre.weight, pre.eps, pre.residual)
            return self._w8a8(xq, xs, weight, bias, pre.x.dtype), residual
        config = self._fused_config("norm", pre.x, weight)
        if config is None:
            linear = self._gemv_config(pre.x, weight) if pre.sumsq is not None else None
            if linear is not None and linear[0] in ("dot", "dotT"):  # the norm from the partial sums
                return skinny.gemv(pre.x, weight, bias, config=linear, sumsq=(pre.sumsq, pre.eps)), pre.x
            return unfused_norm_linear(self, pre, weight, bias)
        return gemv_prologue(pre.x, weight, bias, config=config, norm=(pre.weight, pre.eps), residual=pre.residual)

    def qkv_rotate_store(self, pre: NormInput, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TritonPlan,
                         kv_scale: KVScale = NO_SCALE) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the tuner chose it: at one token norm, matmul, rotary and cache write in one launch, at 2-16
        the norm and then the rest in one launch (:func:`kernels.gemv_qkv.qkv_rope`)."""
        rope = dict(positions=plan.positions, cos_sin_cache=self.cos_sin, k_cache=k_cache, v_cache=v_cache,
                    kv_index=plan.kv_index, kv_scale=kv_scale)
        head_dim = k_cache.shape[3]
        config = self._fused_config("qkv", pre.x, weight)
        if config is not None and rope_pairs(config, head_dim):
            return qkv_rope(pre.x, weight, bias, config=config, norm=(pre.weight, pre.eps), residual=pre.residual,
                            **rope)
        config = self._fused_config("rope", pre.x, weight)
        if config is None or not rope_pairs(config, head_dim):
            return unfused_qkv_rotate_store(self, pre, weight, bias, k_cache, v_cache, plan, kv_scale)
        if pre.sumsq is not None:  # the norm from the partial sums (its weight is folded into q|k|v)
            return qkv_rope(pre.x, weight, bias, config=config, norm=None, residual=None, sumsq=(pre.sumsq, pre.eps),
                            **rope)[0], pre.x
        h, residual = normed(self, pre)
        return qkv_rope(h, weight, bias, config=config, norm=None, residual=None, **rope)[0], residual

    def mlp(self, pre: NormInput, gate_up: tuple, down: tuple) -> Stream:
        """Where the tuner chose it (2-16 tokens): the norm (or, after a residual epilogue, the partial sums of
        squares), then gate|up with SiLU-mul as its epilogue (:func:`kernels.gemv.gemv_silu`), then down
        through :meth:`project_out`; otherwise :meth:`norm_linear` and :meth:`silu_linear`."""
        config = self._fused_config("gate_silu", pre.x, gate_up[0])
        if config is None:  # with this backend's own one-token fusions, and FP8 rows quantized where made
            h, residual = self.norm_linear(pre, *gate_up)
            if self._quantized_input(h, down[0]):
                return Stream(self._w8a8(*silu_and_mul_fp8(h), *down, h.dtype), residual)
            if self._fused_config("silu", h, down[0]) is not None:
                return Stream(self.silu_linear(h, *down), residual)
            return self.project_out(self.silu_and_mul(h), *down, residual)
        if pre.sumsq is not None:  # the norm's weight is folded into gate|up
            return self.project_out(skinny.gemv_silu(pre.x, *gate_up, config=config, sumsq=(pre.sumsq, pre.eps)),
                                    *down, pre.x)
        h, residual = normed(self, pre)
        return self.project_out(skinny.gemv_silu(h, *gate_up, config=config), *down, residual)

    def project_out(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    residual: torch.Tensor) -> Stream:
        """With the norms folded, at 2-16 tokens and where a skinny matmul serves this weight: the residual
        added in its epilogue, with the partial sums of squares the next q|k|v or gate|up normalises by
        (:func:`kernels.gemv.gemv_residual`): the next norm's launch saved.  Otherwise the plain matmul."""
        m = x.shape[0]
        config = self._gemv_config(x, weight) if self.norms_folded and 1 < m else None
        if config is None or not sumsq_fits(config, weight.shape[0], m):
            return unfused_project_out(self, x, weight, bias, residual)
        h, sumsq = skinny.gemv_residual(x, weight, bias, residual, config=config)
        return Stream(h, sumsq=sumsq)

    def moe_front(self, pre: NormInput, gate: torch.Tensor, top_k: int, renormalize: bool, first_expert: int,
                  num_held: int) -> MoEFront:
        """At 1-4 tokens the norm, the router and the routing in one launch (:func:`kernels.moe_route.norm_route`:
        two launches a layer fewer); else (and batch-invariant, whose router is the invariant matmul) the norm and
        the router's linear."""
        if self.batch_invariant or not norm_routes_here(pre.x, gate, top_k):
            return unfused_moe_front(self, pre, gate)
        h, residual, logits, weights, ids = norm_route(pre.x.contiguous(), pre.residual, pre.weight, pre.eps, gate,
                                                       top_k, renormalize, self.route_arrivals, first_expert, num_held)
        return MoEFront(h, residual, logits, (weights, ids))

    def moe(self, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
            renormalize: bool, first_expert: int = 0,
            routing: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """Routing in one launch (:mod:`kernels.moe_route`, where it takes the config; none where ``routing`` is
        made), then the fused experts with the tuner's tiles for this stack and size.  Batch-invariant: the
        per-pair form at every size, on the default tiles (each pair and each token's sum computed alone, in one
        order, whatever else the step holds)."""
        held, num_experts = w13.shape[0], router_logits.shape[-1]
        if routing is not None:
            weights, ids = routing
        elif routes_here(num_experts, top_k):
            weights, ids = route(router_logits, top_k, renormalize, first_expert, held)
        else:
            weights, ids = route_held(router_logits, top_k, renormalize, first_expert, held)
        if self.batch_invariant:
            return fused_moe_small(x.contiguous(), w13, w2, weights, ids)
        key = (held, w2.shape[2], w2.shape[1], m_bucket(x.shape[0]))
        return fused_moe(x.contiguous(), w13, w2, weights, ids, partial=held < num_experts,
                         small=self.moe_small_choice.get(key), grouped=self.moe_grouped_choice.get(key))

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        config = self._fused_config("silu", gate_up, weight)
        if config is None:
            return unfused_silu_linear(self, gate_up, weight, bias)
        return gemv_prologue(gate_up, weight, bias, config=config, silu=True)[0]

    def _fused_config(self, kind: str, x: torch.Tensor, weight: torch.Tensor) -> Optional[GemvConfig]:
        """The fused kernel's config for this weight at x's rows (key ``(kind, N, K, m_bucket)``), or None:
        not chosen, batch-invariant, a kind not for this many rows (``ONE_TOKEN_KINDS`` at one, the
        epilogues at 2 to :func:`skinny_rows`), or a config that does not fit them."""
        m = x.shape[0]
        if self.batch_invariant or not 0 < m <= skinny_rows(weight) or not x.is_contiguous():
            return None
        if (m == 1) != (kind in ONE_TOKEN_KINDS):
            return None
        if self.prologue_everywhere is not None:
            config = self.prologue_everywhere.get(kind)
        else:
            config = self.prologue_choice.get((kind, weight.shape[0], weight.shape[1], m_bucket(m)))
        return config if config is not None and skinny.config_fits(config, m) else None

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
