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
checkpoint's products).  Scales must be finite and positive floats (anything else is refused, naming the
tensor).  Activation scales: the kernels always use dynamic per-token scales (W8A8) or none
(W8A16), so a checkpoint's static ``input_scale`` tensors are read and dropped: a per-token scale is never
coarser than a per-tensor one.  KV-cache scales (``kv_cache_scheme``: ``self_attn.k_scale`` / ``v_scale``, the
older ``k_proj.output_scale`` / ``v_proj.output_scale``, AutoFP8's ``self_attn.kv_scale``) are kept by the model
(:func:`kv_scale_name`) and used by ``--kv-cache-dtype fp8`` in place of its start-up calibration
(:mod:`executor_proc.model.kv_scales`).  Projections the config leaves out (``ignore`` / ``ignored_layers``: module
names, or ``re:`` patterns) load in float, each fused projection's parts alike (q, k and v; gate and up; a layer's
experts).  The LM head and embedding must be unquantized (``ignore: ["lm_head"]``), as
this engine keeps them (:mod:`executor_proc.model.quantization`).  The layers' norms are not folded into such
weights (a per-column product would re-quantize them).

The format's config is read here field by field (the few that decide the layout; anything else is refused
by name) rather than through the ``compressed-tensors`` package, which would bring pydantic and transformers
into the executor for five fields.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Optional

import torch

from executor_proc.model.moe import mixtral_name
from executor_proc.model.quantization import fp8_parts, use_fp8
from kernels.fp8 import FP8, Fp8Weight

_SUPPORTED = "compressed-tensors float-quantized or fp8 (per-tensor or per-channel scales)"


def fp8_config(folder: str) -> Optional[dict]:
    """The folder's ``quantization_config`` where it declares FP8 weights this loader reads (None: no quantization);
    ValueError naming the field for one it cannot."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    return config["quantization_config"] if isinstance(config, dict) and fp8_scheme(config) else None


def _object(value, field: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{field}: an object expected, got {type(value).__name__} {value!r:.60}")
    return value


def fp8_scheme(config: dict) -> Optional[str]:
    """``"compressed-tensors"`` or ``"fp8"`` for a supported ``quantization_config``, None without one."""
    q = config.get("quantization_config")
    if not q:
        return None
    q = _object(q, "quantization_config")
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("weight_block_size"):
            raise ValueError(f"quantization_config.weight_block_size {q['weight_block_size']}: block-wise FP8 scales "
                             f"are not supported ({_SUPPORTED})")
        _names(q.get("ignored_layers"), "quantization_config.ignored_layers")
        return method
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported ({_SUPPORTED})")
    if q.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"quantization_config.format {q.get('format')!r} is not supported ({_SUPPORTED})")
    groups = _object(q.get("config_groups") or {}, "quantization_config.config_groups")
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups: one group supported, got {len(groups)}")
    name, group = next(iter(groups.items()))
    group = _object(group, f"quantization_config.config_groups.{name}")
    weights = _object(group.get("weights") or {}, f"quantization_config.config_groups.{name}.weights")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(f"quantization_config weights: 8-bit float supported, got num_bits "
                         f"{weights.get('num_bits')!r}, type {weights.get('type')!r}")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"quantization_config weights.strategy {weights.get('strategy')!r}: channel or tensor "
                         f"supported")
    _names(q.get("ignore"), "quantization_config.ignore")
    return method


def _names(value, field: str) -> list[str]:
    """A list of module names (or ``re:`` patterns) from the config, checked."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{field}: a list of module names expected, got {value!r:.80}")
    for v in value:
        if v.startswith("re:"):
            try:
                re.compile(v[3:])
            except re.error as e:
                raise ValueError(f"{field}: {v!r} is not a regular expression ({e})") from None
    return value


def ignored_modules(q: dict) -> Callable[[str], bool]:
    """Whether the config leaves a module (by its full name) unquantized: ``ignore`` (compressed-tensors: names, or
    ``re:`` patterns matched from the name's start) or ``ignored_layers`` (``fp8``: names)."""
    names = _names(q.get("ignore") if q.get("quant_method") == "compressed-tensors" else q.get("ignored_layers"),
                   "quantization_config.ignore")
    exact = {n for n in names if not n.startswith("re:")}
    patterns = [re.compile(n[3:]) for n in names if n.startswith("re:")]
    return lambda module: module in exact or any(p.match(module) for p in patterns)


# An FP8 KV cache's per-layer scales as checkpoints name them: (layer, "k" / "v" / "kv")
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)$")


def kv_scale_name(name: str) -> Optional[tuple[int, str]]:
    """``(layer, "k" | "v" | "kv")`` for a checkpoint's KV-cache scale tensor, else None."""
    m = _KV_SCALE.match(name)
    return None if m is None else (int(m[1]), m[2] or m[3])


def scale_problem(scale: torch.Tensor, rows: Optional[int] = None) -> Optional[str]:
    """What is wrong with a checkpoint's scale tensor (None: nothing): a float, finite and positive everywhere, and
    (a weight's, of ``rows`` rows) one value, or one a row."""
    if rows is not None and scale.numel() not in (1, rows):
        return f"{scale.numel()} values for {rows} rows (per tensor or per channel only)"
    if not scale.is_floating_point() or scale.dtype == FP8:
        return f"a scale must be a float tensor, got {scale.dtype}"
    if scale.numel() and not bool(torch.isfinite(scale).all()):
        return "holds a NaN or an infinity"
    if scale.numel() and not bool((scale > 0).all()):
        return "holds a value <= 0 (scales must be positive)"
    return None


@torch.no_grad()
def prepare_fp8(model, ignored: Callable[[str], bool] = lambda module: False) -> None:
    """Make ``model``'s layer projections FP8 (values and per-row scales, uninitialised) before the checkpoint's
    tensors are copied in: each fused weight an :class:`Fp8Weight`, its parts' weights views with a
    ``weight_scale`` buffer, as :func:`executor_proc.model.quantization.quantize_model` leaves them; a
    mixture-of-experts layer's stacks e4m3 with ``[E, rows]`` scales (each expert's ``weight_scale`` loads into
    its rows: :meth:`MoEBlock.expert_views`), its shared expert as a dense MLP, its router float.  Projections
    ``ignored`` (by module name) stay float; a fused projection, or a layer's experts, whose parts disagree is
    refused (ValueError naming them)."""
    names = {id(m): n for n, m in model.named_modules()}
    for i, layer in enumerate(model.model.layers):
        fused, experts = fp8_parts(layer)
        if experts is not None:
            parts = [f"model.layers.{i}.mlp.experts.{e}.{p}" for e in experts.experts
                     for p in ("gate_proj", "up_proj", "down_proj")]
            if not _all_or_none(parts, ignored, lambda p: mixtral_name(p + ".")[:-1]):
                experts.use_fp8(*(_unfilled(w, experts.dtype) for w in (experts.w13, experts.w2)))
        for f in fused:
            if not _all_or_none([names[id(lin)] for lin in f.linears], ignored):
                use_fp8(f, _unfilled(f.weight, f.weight.dtype))


def _all_or_none(parts: list[str], ignored: Callable[[str], bool], alias: Callable[[str], str] = str) -> bool:
    """Whether every part is ignored (by its name or ``alias`` of it); ValueError when only some are."""
    skipped = [p for p in parts if ignored(p) or ignored(alias(p))]
    if skipped and len(skipped) != len(parts):
        kept = [p for p in parts if p not in skipped]
        raise ValueError(f"quantization_config ignores {skipped[0]} but not {kept[0]}: the parts of a fused "
                         f"projection (q, k and v; gate and up; a layer's experts) must share one precision")
    return bool(skipped)


def _unfilled(w: torch.Tensor, dtype: torch.dtype) -> Fp8Weight:
    """An FP8 weight of ``w``'s shape (a stack too), uninitialised values and scales 1, for the checkpoint's."""
    return Fp8Weight(torch.empty(w.shape, dtype=FP8, device=w.device),
                     torch.ones(w.shape[:-1], dtype=torch.float32, device=w.device), dtype)


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's ``weight_scale`` (one :func:`scale_problem` passes) as one float32 scale per output row:
    ``[rows, 1]`` or ``[rows]`` as it is, one value (per tensor) repeated."""
    scale = scale.float()
    return scale.reshape(1).expand(rows) if scale.numel() == 1 else scale.reshape(rows)
