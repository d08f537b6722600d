"""A tensor-parallel rank's share of the Llama decoder (Megatron): the same modules on sharded shapes.

Per layer, in the residual stream of :class:`executor_proc.model.llama.DecoderLayer`::

    attention:  fused q|k|v (column-parallel: the rank's heads) -> attention on the rank's heads
                -> o_proj (row-parallel: a partial sum) -> all-reduce
    MLP:        fused gate|up (column-parallel) -> SiLU-mul -> down_proj (row-parallel) -> all-reduce
    MoE:        the router, replicated (every rank routes alike) -> each chosen expert on the rank's slice
                of its intermediate columns, weighted and summed (+ the shared expert's slice, scaled by
                its replicated gate) -> all-reduce: one per layer, as for the MLP
    MoE, expert parallel: the same, but each rank runs whole experts, its own range, on the (token, expert)
                pairs routed to them (the others add zero): the all-reduce sums every expert's share

Norms and the residual stream are replicated: every rank holds the whole ``[T, hidden]`` after each
all-reduce, which is why expert parallelism needs no all-to-all here: every rank already has every token
(an all-to-all dispatch pays off only when ranks hold different tokens, as with data-parallel attention).
The embedding and the LM head are vocabulary-parallel: a token's embedding is looked up on the rank that
holds its row (zeros elsewhere) and all-reduced; each rank computes the logits of its
vocabulary rows, and an all-gather gives every rank the whole ``[S, vocab]`` row, on which the usual
sampler runs.  We gather rather than sample over shards (a distributed argmax or top-k) because every
sampling feature (penalties, logit_bias, min_tokens masks, top-k/top-p, logprobs) then runs unchanged
on full rows, and every rank, holding the same bits, samples the same token with the (seed, position)
key: no token is exchanged.  It costs one all-gather of ``S x vocab`` values in the model dtype per step
(256 KB for a 128k vocabulary at batch 1 in bf16).

The KV cache of a rank holds its KV heads only (``Shards.config.num_kv_heads``).
"""

from __future__ import annotations

from typing import Optional

import torch

from executor_proc.backends.base import NormInput, Stream
from executor_proc.model.config import ModelConfig
from executor_proc.model.llama import MLP, Attention, CausalLM, StepContext
from executor_proc.model.moe import MoEBlock
from executor_proc.parallel.group import TPGroup
from executor_proc.parallel.sharding import Shards


class ParallelAttention(Attention):
    """The rank's heads; the row-parallel o_proj's partial sums are all-reduced."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, group: TPGroup):
        super().__init__(config, layer_id, dtype)
        self.group = group

    def forward(self, pre: NormInput, step: StepContext) -> Stream:
        out = super().forward(pre, step)
        assert out.sumsq is None, "the residual is added after the all-reduce (select.folds_norms)"
        return Stream(self.group.all_reduce(out.x), out.residual)


class ParallelMLP(MLP):
    """The rank's MLP columns; the row-parallel down_proj's partial sums are all-reduced."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, group: TPGroup):
        super().__init__(config, dtype)
        self.group = group

    def forward(self, pre: NormInput, backend) -> Stream:
        out = super().forward(pre, backend)
        assert out.sumsq is None, "the residual is added after the all-reduce (select.folds_norms)"
        return Stream(self.group.all_reduce(out.x), out.residual)


class ParallelMoEBlock(MoEBlock):
    """The rank's slice of every expert, or its whole experts (``experts``, expert parallelism), and its slice
    of the shared expert; the partial sums, routed and shared added together, are all-reduced once."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, group: TPGroup, experts: Optional[range] = None):
        super().__init__(config, dtype, experts)
        self.group = group

    def forward(self, pre: NormInput, backend) -> Stream:
        out = super().forward(pre, backend)
        return Stream(self.group.all_reduce(out.x), out.residual)


class ParallelCausalLM(CausalLM):
    """A rank's sharded model: ``config`` is the rank's shape, ``full_config`` the model's."""

    tensor_parallel = True

    def __init__(self, shards: Shards, group: TPGroup, dtype: torch.dtype = torch.float32):
        super().__init__(shards.config, dtype)
        self.full_config = shards.full
        self.group = group
        self.vocab_start, self.vocab_per_rank = shards.vocab_start, shards.vocab_per_rank
        for i, layer in enumerate(self.model.layers):  # same names and shapes: weights load as before
            layer.self_attn = ParallelAttention(shards.config, i, dtype, group)
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp = ParallelMoEBlock(shards.config, dtype, group, shards.experts)
            else:
                layer.mlp = ParallelMLP(shards.config, dtype, group)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_per_rank)
        x = self.model.embed_tokens(torch.where(mine, local, 0))
        return self.group.all_reduce(x * mine[:, None].to(x.dtype))  # one rank adds each row, the others zeros

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.backend.linear(hidden, self.lm_head.weight, None)
        full = self.group.all_gather_columns(local)[:, :self.full_config.vocab_size]  # padding rows cut off
        return full.float().contiguous()


def full_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in the whole model (what dummy weights are drawn at, before slicing)."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in CausalLM(config).named_parameters()}
