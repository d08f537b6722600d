"""The mixture-of-experts part of a model's shape, parsed from an HF ``config.json`` dict.

Three families share one MoE layer (a router, top-k of E SiLU-gated experts, their weighted sum):

- Qwen3-MoE (``qwen3_moe``): ``num_experts`` (transformers 5 writes ``num_local_experts``),
  ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``, and the layers that stay
  dense: ``mlp_only_layers`` and every layer ``i`` with ``(i + 1) % decoder_sparse_step != 0``;
- Qwen2-MoE (``qwen2_moe``): the same plus a shared expert of ``shared_expert_intermediate_size``
  on every token, scaled by ``sigmoid(shared_expert_gate(x))``;
- Mixtral (``mixtral``): ``num_local_experts`` experts of ``intermediate_size``, every layer sparse,
  the top-k weights always renormalised to sum to one.

A field out of range is refused here, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k routing weights divided by their sum (HF's norm_topk_prob)
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    sparse_step: int = 1  # HF's decoder_sparse_step
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is an MoE layer (else a dense MLP of the model's intermediate_size)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0

    def to_hf_fields(self, model_type: str) -> dict[str, Any]:
        """The fields :func:`parse_moe` reads, as HF names them for ``model_type``."""
        if model_type == "mixtral":
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.top_k}
        d: dict[str, Any] = {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.intermediate_size,
            "norm_topk_prob": self.renormalize,
            "decoder_sparse_step": self.sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
        }
        if model_type == "qwen2_moe":
            d["shared_expert_intermediate_size"] = self.shared_intermediate_size
        return d


def parse_moe(d: dict[str, Any], model_type: str) -> Optional[MoEConfig]:
    """The MoE config of a ``model_type`` config dict (None for a dense family)."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    if model_type == "mixtral":
        num_experts = _positive(d, "num_local_experts", d.get("num_local_experts", d.get("num_experts")))
        intermediate = _positive(d, "intermediate_size", d.get("intermediate_size"))
        renormalize, shared, step, dense = True, 0, 1, ()
    else:
        key = "num_local_experts" if d.get("num_experts") is None and "num_local_experts" in d else "num_experts"
        num_experts = _positive(d, key, d.get(key))
        if d.get("num_local_experts") not in (None, num_experts):
            raise ValueError(f"config.json fields 'num_experts' ({num_experts}) and 'num_local_experts' "
                             f"({d['num_local_experts']!r}) disagree: keep one")
        intermediate = _positive(d, "moe_intermediate_size", d.get("moe_intermediate_size"))
        renormalize = flag_field(d, "norm_topk_prob", False)
        shared = 0
        if model_type == "qwen2_moe":
            shared = _positive(d, "shared_expert_intermediate_size", d.get("shared_expert_intermediate_size"))
        step = _positive(d, "decoder_sparse_step", d.get("decoder_sparse_step", 1))
        dense = _layer_list(d, "mlp_only_layers")
    top_k = _positive(d, "num_experts_per_tok", d.get("num_experts_per_tok"))
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) is more than the model's {num_experts} experts")
    return MoEConfig(num_experts, top_k, intermediate, renormalize, shared, step, dense)


def _positive(d: dict[str, Any], key: str, value: Any) -> int:
    if value is None:
        raise ValueError(f"config.json lacks the required field {key!r} (a mixture-of-experts model)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def flag_field(d: dict[str, Any], key: str, default: bool) -> bool:
    """A true/false field (absent or null: ``default``); a string such as "false" is refused by name (it would read
    as true)."""
    value = d.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config.json field {key!r} must be true or false, got {value!r}")
    return value


def _layer_list(d: dict[str, Any], key: str) -> tuple[int, ...]:
    value = d.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"config.json field {key!r} must be a list of layer indices, got {value!r}")
    return tuple(sorted(set(value)))
