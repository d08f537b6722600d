"""FP8 checkpoints, loaded as they are: e4m3 layer weights with their scales, no bf16 round trip.

A safetensors folder whose ``config.json`` carries a ``quantization_config`` of either kind:

- ``quant_method: "compressed-tensors"``, ``format: "float-quantized"`` (the RedHatAI / neuralmagic ``-FP8``
  models): one config group of 8-bit float weights with ``strategy`` "channel" (``weight_scale [N, 1]``) or
  "tensor" (one scale per projection);
- ``quant_method: "fp8"`` with ``weight_scale`` tensors (per tensor or per channel; block-wise
  ``weight_block_size`` checkpoints are refused).

The layers' linears are built FP8 before the tensors are read (:func:`prepare_fp8`; a mixture-of-experts
layer's stacked experts too, each expert's tensors loading into its rows of the stacks), and
:meth:`executor_proc.model.llama.CausalLM.load_weights` copies each e4m3 weight and its scale in; a per-tensor
scale becomes that projection's rows' scale, so a fused q|k|v keeps one scale per row (exactly the
checkpoint's products).  Activation scales: the kernels always use dynamic per-token scales (W8A8) or none
(W8A16), so a checkpoint's static ``input_scale`` tensors are read and dropped: a per-token scale is never
coarser than a per-tensor one.  The LM head and embedding must be unquantized (``ignore: ["lm_head"]``), as
this engine keeps them (:mod:`executor_proc.model.quantization`).  The layers' norms are not folded into such
weights (a per-column product would re-quantize them).

The format's config is read here field by field (the few that decide the layout; anything else is refused
by name) rather than through the ``compressed-tensors`` package, which would bring pydantic and transformers
into the executor for five fields.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from executor_proc.model.quantization import fp8_parts, use_fp8
from kernels.fp8 import FP8, Fp8Weight

_SUPPORTED = "compressed-tensors float-quantized or fp8 (per-tensor or per-channel scales)"


def checkpoint_is_fp8(folder: str) -> bool:
    """Whether the HF folder's config.json declares FP8 weights this loader reads; ValueError naming the field for a
    quantization it cannot."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return fp8_scheme(json.load(f)) is not None


def fp8_scheme(config: dict) -> Optional[str]:
    """``"compressed-tensors"`` or ``"fp8"`` for a supported ``quantization_config``, None without one."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("weight_block_size"):
            raise ValueError(f"quantization_config.weight_block_size {q['weight_block_size']}: block-wise FP8 scales "
                             f"are not supported ({_SUPPORTED})")
        return method
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported ({_SUPPORTED})")
    if q.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"quantization_config.format {q.get('format')!r} is not supported ({_SUPPORTED})")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups: one group supported, got {len(groups)}")
    weights = next(iter(groups.values())).get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(f"quantization_config weights: 8-bit float supported, got {weights.get('num_bits')}-bit "
                         f"{weights.get('type')}")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"quantization_config weights.strategy {weights.get('strategy')!r}: channel or tensor "
                         f"supported")
    return method


@torch.no_grad()
def prepare_fp8(model) -> None:
    """Make ``model``'s layer projections FP8 (values and per-row scales, uninitialised) before the checkpoint's
    tensors are copied in: each fused weight an :class:`Fp8Weight`, its parts' weights views with a
    ``weight_scale`` buffer, as :func:`executor_proc.model.quantization.quantize_model` leaves them; a
    mixture-of-experts layer's stacks e4m3 with ``[E, rows]`` scales (each expert's ``weight_scale`` loads into
    its rows: :meth:`MoEBlock.expert_views`), its shared expert as a dense MLP, its router float."""
    for layer in model.model.layers:
        fused, experts = fp8_parts(layer)
        if experts is not None:
            experts.use_fp8(*(_unfilled(w, experts.dtype) for w in (experts.w13, experts.w2)))
        for f in fused:
            use_fp8(f, _unfilled(f.weight, f.weight.dtype))


def _unfilled(w: torch.Tensor, dtype: torch.dtype) -> Fp8Weight:
    """An FP8 weight of ``w``'s shape (a stack too), uninitialised values and scales 1, for the checkpoint's."""
    return Fp8Weight(torch.empty(w.shape, dtype=FP8, device=w.device),
                     torch.ones(w.shape[:-1], dtype=torch.float32, device=w.device), dtype)


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's ``weight_scale`` as one float32 scale per output row: ``[rows, 1]`` or ``[rows]`` as it is,
    one value (per tensor) repeated."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1).expand(rows)
    if scale.numel() != rows:
        raise ValueError(f"weight_scale of {scale.numel()} values for {rows} rows (per tensor or per channel only)")
    return scale.reshape(rows)
