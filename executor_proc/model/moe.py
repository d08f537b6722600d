"""The mixture-of-experts layer that takes the MLP's place in Qwen2-MoE, Qwen3-MoE and Mixtral decoder layers.

Per token: the router (``gate``, a linear in the model dtype) scores the E experts, the backend routes
(softmax in float32, top-k, renormalised where the config says) and runs the k selected experts'
SiLU-gated MLPs, summing their outputs weighted by the routing weights (:meth:`Backend.moe`).  Qwen2-MoE
adds a shared expert on every token, scaled by ``sigmoid(shared_expert_gate(x))``.  With
``--moe-expert-counts`` a block also adds its routed tokens to a per-expert tally
(:mod:`executor_proc.model.expert_counts`).

The experts' weights are stacked, ``w13 [E, 2I, H]`` (each expert's gate rows, then its up rows) and
``w2 [E, H, I]``, so that one kernel reaches any expert by index.  Checkpoints keep one tensor per expert
and projection (``mlp.experts.N.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.N.w1/w3/w2`` and
``block_sparse_moe.gate``, renamed by :func:`checkpoint_name`): :meth:`MoEBlock.expert_views` names the
slices of the stacks they load into.  transformers 5's own layout keeps the stacks themselves
(``experts.gate_up_proj``, ``experts.down_proj``), loaded whole.

Under expert parallelism (:mod:`executor_proc.parallel.sharding`) a block holds a contiguous range of the
experts, ``experts``: the stacks are that range's, the router still scores all E (every rank routes every
token alike), and the backend skips the pairs routed elsewhere; the ranks' outputs are partial sums.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from executor_proc.backends.base import Backend, NormInput, Stream
from executor_proc.model.config import ModelConfig
from executor_proc.model.mlp import MLP
from kernels.fp8 import Fp8Weight
from kernels.moe_ref import route_ref

_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


_OUR_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")
_MIXTRAL_W = {proj: w for w, proj in _MIXTRAL_PROJ.items()}


# transformers 5's own layout (``save_pretrained(..., save_original_format=False)``): a layer's experts in one
# tensor each, ``experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``experts.down_proj [E, H, I]``,
# laid out as the stacks are
_STACKED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_STACK_NAME = {"gate_up_proj": "w13", "down_proj": "w2"}


def stack_checkpoint_name(stack: str) -> str:
    """A stack's name (``model.layers.N.mlp.w13`` / ``w2``) as transformers 5's stacked layout names its tensor."""
    layer, kind = stack.rsplit(".", 1)
    return f"{layer}.experts.{next(hf for hf, ours in _STACK_NAME.items() if ours == kind)}"


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name in this model: Mixtral's MoE names become the Qwen-MoE ones, transformers 5's
    stacked experts the stacks' (the rest as is)."""
    if name.endswith("_proj"):
        name = _STACKED_EXPERTS.sub(lambda m: f".mlp.{_STACK_NAME[m[1]]}", name)
    if ".block_sparse_moe." not in name:
        return name
    name = _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m[1]}.{_MIXTRAL_PROJ[m[2]]}.", name)
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


def mixtral_name(name: str) -> str:
    """What a Mixtral checkpoint calls this model's tensor ``name`` (:func:`checkpoint_name`'s inverse for the MoE
    names), so that a load error names what the user's files hold."""
    name = _OUR_EXPERT.sub(lambda m: f".block_sparse_moe.experts.{m[1]}.{_MIXTRAL_W[m[2]]}.", name)
    return name.replace(".mlp.gate.", ".block_sparse_moe.gate.")


class MoEBlock(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, experts: Optional[range] = None) -> None:
        """``experts``: the (global) ids of the experts this block holds; None: all of them."""
        super().__init__()
        moe = config.moe
        h, i, e = config.hidden_size, moe.intermediate_size, moe.num_experts
        self.num_experts, self.top_k, self.renormalize = e, moe.top_k, moe.renormalize
        self.experts = range(e) if experts is None else experts
        self.intermediate_size = i
        self.gate = nn.Linear(h, e, bias=False, dtype=dtype)  # the router, over all E experts
        self.dtype = dtype  # the activations'
        self.w13 = nn.Parameter(torch.empty(len(self.experts), 2 * i, h, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(len(self.experts), h, i, dtype=dtype))
        # FP8 (use_fp8): the stacks' e4m3 values stay the parameters, these their [E, rows] scales
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)
        self._fp8: Optional[tuple[Fp8Weight, Fp8Weight]] = None
        self.shared_expert: Optional[MLP] = None
        self.shared_expert_gate: Optional[nn.Linear] = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(config, dtype, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False, dtype=dtype)
        self.expert_counts: Optional[torch.Tensor] = None  # [E] int64 on the device: --moe-expert-counts only

    def fuse(self) -> None:
        """The shared expert's gate|up as one matmul (the routed experts are stacked already)."""
        if self.shared_expert is not None:
            self.shared_expert.fuse()

    def forward(self, pre: NormInput, backend: Backend) -> Stream:
        """The layer's output and the residual stream, for the un-normalised input."""
        h, residual, router_logits, routing = backend.moe_front(pre, self.gate.weight, self.top_k, self.renormalize,
                                                                self.experts.start, len(self.experts))
        out = backend.moe(h, router_logits, *self.expert_stacks(), self.top_k, self.renormalize, self.experts.start,
                          routing=routing)
        if self.expert_counts is not None:  # --moe-expert-counts: the routing again and a device add, no host read
            ids = route_ref(router_logits, self.top_k, self.renormalize)[1].flatten()
            self.expert_counts.index_add_(0, ids, torch.ones_like(ids))
        if self.shared_expert is not None:
            scale = torch.sigmoid(backend.linear(h, self.shared_expert_gate.weight, None))
            out = out + scale * self.shared_expert.normed_forward(h, backend)
        return Stream(out, residual)

    def expert_stacks(self) -> tuple:
        """``(w13, w2)`` as the backend takes them: the stacked weights, or the FP8 stacks of :meth:`use_fp8`."""
        return self._fp8 or (self.w13, self.w2)

    def use_fp8(self, w13: Fp8Weight, w2: Fp8Weight) -> None:
        """Hold the experts in FP8 (quantized at load, or to be filled from an FP8 checkpoint): the e4m3 values
        become the parameters and their scales buffers, so that the model's bytes count them; the float stacks are
        freed.  On the stacks' final device: the pair the backend gets is made here, once."""
        self.w13, self.w2 = (nn.Parameter(w.data, requires_grad=False) for w in (w13, w2))
        self.w13_scale, self.w2_scale = w13.scale, w2.scale
        self._fp8 = (Fp8Weight(self.w13, self.w13_scale, self.dtype), Fp8Weight(self.w2, self.w2_scale, self.dtype))

    def expert_views(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the slice of ``w13`` / ``w2`` it loads into, for every expert the block holds
        (``prefix``: this block's name with its trailing dot, e.g. ``model.layers.3.mlp.``)."""
        i = self.intermediate_size
        views = {}
        for local, e in enumerate(self.experts):
            at = f"{prefix}experts.{e}."
            views[at + "gate_proj.weight"] = self.w13.data[local, :i]
            views[at + "up_proj.weight"] = self.w13.data[local, i:]
            views[at + "down_proj.weight"] = self.w2.data[local]
            if self.w13_scale is not None:  # an FP8 checkpoint's (executor_proc.model.fp8_checkpoint.prepare_fp8)
                views[at + "gate_proj.weight_scale"] = self.w13_scale[local, :i]
                views[at + "up_proj.weight_scale"] = self.w13_scale[local, i:]
                views[at + "down_proj.weight_scale"] = self.w2_scale[local]
        return views
