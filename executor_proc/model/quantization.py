"""``--quantization fp8``: the decoder's linear layers in FP8 e4m3, quantized once the weights are loaded.

Every projection of every layer (fused q|k|v, o, fused gate|up, down; a mixture-of-experts layer's stacked
experts and shared expert) becomes a
:class:`kernels.fp8.Fp8Weight`: e4m3 values with one float32 scale per output channel, computed from the
loaded weight whatever its source (a bf16/fp16/fp32 checkpoint, GGUF, random weights).  Per-output-channel
scales keep a fused weight's parts exact views of its projections (each row has its own scale), shard with
their rows under tensor parallelism (column-parallel weights: the rank's rows and their scales; row-parallel
ones are quantized from the rank's own columns, so their scales are the rank's), and commute with the
sum over K, so a kernel applies them once to its float32 sums.  It runs after the layers' norms are folded
into q|k|v and gate|up (the folded product is what is quantized).

The embedding and the LM head stay in the model dtype: the embedding is a gather (one row per token,
nothing to gain in bandwidth), and the LM head's logits feed sampling and logprobs directly, where an
error of a few percent in a logit moves the sampled distribution (with tied embeddings they are one
tensor anyway).  On an 8B model the head is 1 GB of the 8 GB that a decode step reads.

How the quantized linears run (W8A16 up to 8 rows, W8A8 above) is :mod:`kernels.fp8`'s rule; the torch
backend follows it with the reference math, the Triton backend with the kernels.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import nn

from executor_proc.model.moe import MoEBlock
from kernels.fp8 import Fp8Weight, quantize_weight

Quantization = Literal["none", "fp8"]


def quantize_model(model) -> int:
    """Quantize ``model``'s (a :class:`executor_proc.model.llama.CausalLM`) layer projections in place; returns
    the bytes of weights saved.  Each fused projection's weight becomes an :class:`Fp8Weight` (what the backend
    receives), and its parts' ``nn.Linear`` weights FP8 views of it, each with a ``weight_scale`` buffer, so that
    the model's parameters and buffers count what the device holds.  A mixture-of-experts layer's stacked experts
    become FP8 stacks (e4m3 parameters, ``[E, rows]`` scale buffers: :meth:`MoEBlock.use_fp8`), its shared
    expert as a dense MLP; its router stays in the model dtype (a few KiB a layer, and the routing's input)."""
    saved = 0
    for layer in model.model.layers:
        fused, experts = fp8_parts(layer)
        if experts is not None:
            before = sum(w.numel() * w.element_size() for w in (experts.w13, experts.w2))
            experts.use_fp8(quantize_weight(experts.w13.data, experts.dtype),
                            quantize_weight(experts.w2.data, experts.dtype))
            saved += before - fp8_bytes(experts.expert_stacks())
        saved += sum(_quantize_fused(f) for f in fused)
    if torch.cuda.is_available() and model.lm_head.weight.is_cuda:
        torch.cuda.empty_cache()
    return saved


def fp8_parts(layer) -> tuple[list, Optional[MoEBlock]]:
    """What FP8 covers in a decoder layer: its fused projections (attention's, and the dense MLP's or a shared
    expert's) and its stacked experts (None: a dense layer).  A router stays in the model dtype."""
    mlp = layer.mlp
    fused = [layer.self_attn.qkv, layer.self_attn.o]
    if not isinstance(mlp, MoEBlock):
        return fused + [mlp.gate_up, mlp.down], None
    shared = mlp.shared_expert
    return fused + ([shared.gate_up, shared.down] if shared is not None else []), mlp


def use_fp8(fused, weight: Fp8Weight) -> None:
    """``fused`` (a :class:`FusedLinear`) holds ``weight``: its parts' ``nn.Linear`` weights become FP8 views of it,
    each with a ``weight_scale`` buffer (the float weights are freed)."""
    fused.weight = weight
    for lin, part in zip(fused.linears, weight.split(fused.sizes)):
        lin.weight = nn.Parameter(part.data, requires_grad=False)
        lin.register_buffer("weight_scale", part.scale)


def fp8_bytes(weights) -> int:
    """Bytes of FP8 weights as the device holds them (values and float32 scales)."""
    return sum(w.data.numel() + 4 * w.scale.numel() for w in weights)


def _quantize_fused(fused) -> int:
    before = fused.weight.numel() * fused.weight.element_size()
    use_fp8(fused, quantize_weight(fused.weight))
    return before - fp8_bytes([fused.weight])


def is_quantized(model) -> bool:
    """Whether ``model``'s layers hold FP8 weights: :func:`quantize_model` ran, or an FP8 checkpoint was loaded (some
    of whose projections may be float: ``executor_proc.model.fp8_checkpoint.prepare_fp8``)."""
    for layer in model.model.layers:
        fused, experts = fp8_parts(layer)
        weights = [f.weight for f in fused] + (list(experts.expert_stacks()) if experts is not None else [])
        if any(isinstance(w, Fp8Weight) for w in weights):
            return True
    return False
