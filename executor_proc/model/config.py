"""The model's shape, parsed once from an HF ``config.json`` dict.

Only the Llama family is supported: Llama, Mistral, Qwen2 and Qwen3 share one
decoder (RMSNorm, rotary attention with GQA, SiLU-gated MLP) and differ only in
biases, the Qwen3 per-head q/k norms and the rope variant; their mixture-of-experts
versions (Qwen2-MoE, Qwen3-MoE, Mixtral) replace the MLP of some or all layers by
an MoE layer (:mod:`executor_proc.model.moe_config`).  Anything else is refused
here, naming the field, so that a model never runs with silently wrong numerics.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from executor_proc.model.moe_config import MOE_MODEL_TYPES, MoEConfig, flag_field, parse_moe

logger = logging.getLogger(__name__)

# HF architecture name -> model_type written back into config.json.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
_ARCHITECTURE_BY_MODEL_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent rope scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Optional[Llama3RopeScaling] = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: Optional[int] = None
    # Sliding-window attention is not implemented; max_model_len is capped to it instead.
    sliding_window: Optional[int] = None
    moe: Optional[MoEConfig] = None  # the MoE families' experts (None: every layer a dense MLP)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported_architecture(self.architecture))
        if (self.moe is not None) != (self.model_type in MOE_MODEL_TYPES):
            raise ValueError(f"{self.architecture} {'needs' if self.moe is None else 'has no'} mixture-of-experts "
                             f"fields")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim < 1:
            raise ValueError(f"num_attention_heads ({self.num_heads}) exceeds hidden_size ({self.hidden_size}): "
                             f"no head_dim follows from them; give head_dim in config.json")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise ValueError(f"config.json field 'rms_norm_eps' must be a finite number >= 0, got {self.rms_norm_eps}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"config.json field 'rope_theta' must be a positive number, got {self.rope_theta}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def max_model_len(self) -> int:
        """Longest sequence this engine runs exactly (capped at the sliding window)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Parse an HF ``config.json`` dict (transformers 4.x or 5.x layout)."""
        architecture = _architecture(d)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        act = d.get("hidden_act", d.get("hidden_activation", "silu"))
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        hidden_size = _required(d, "hidden_size")
        num_heads = _required(d, "num_attention_heads")
        num_kv_heads = _optional(d, "num_key_value_heads") or num_heads
        rope_theta, rope_scaling = _parse_rope(d, _DEFAULT_THETA.get(model_type, 10000.0))
        max_pos = _required(d, "max_position_embeddings")
        attention_bias = flag_field(d, "attention_bias", False)
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v biases and no o_proj bias
        elif model_type == "qwen2_moe":
            qkv_bias, o_bias = flag_field(d, "qkv_bias", True), False
        elif model_type in ("mistral", "mixtral"):
            qkv_bias = o_bias = False
        else:
            qkv_bias = o_bias = attention_bias
        sliding_window = _sliding_window(d, model_type, max_pos)
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=_required(d, "intermediate_size"),
            num_layers=_required(d, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=_optional(d, "head_dim") or _DEFAULT_HEAD_DIM.get(model_type) or hidden_size // num_heads,
            vocab_size=_required(d, "vocab_size"),
            rms_norm_eps=_number(d, "rms_norm_eps", _DEFAULT_EPS.get(model_type, 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=max_pos,
            rope_scaling=rope_scaling,
            tie_word_embeddings=flag_field(d, "tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=model_type == "llama" and flag_field(d, "mlp_bias", False),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            eos_token_ids=_token_ids(d.get("eos_token_id")),
            bos_token_id=d.get("bos_token_id"),
            sliding_window=sliding_window,
            moe=parse_moe(d, model_type),
        )

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """Read ``config.json`` from a folder (or a config file given directly), plus generation eos ids."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json at {path!r}")
        try:
            with open(file, encoding="utf-8") as f:
                d = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:  # a GGUF or a text file given as a config
            hint = ": a .gguf file loads with --load-format gguf (or auto)" if file.endswith(".gguf") else ""
            raise ValueError(f"not a folder with config.json nor a JSON model config ({type(e).__name__}: {e})"
                             f"{hint}") from None
        if not isinstance(d, dict):
            raise ValueError("not a folder with config.json nor a JSON model config (not a JSON object)")
        # generation_config.json often lists more end tokens (e.g. Llama 3's <|eot_id|>) than config.json.
        generation = os.path.join(os.path.dirname(file), "generation_config.json")
        if os.path.isfile(generation):
            try:
                with open(generation, encoding="utf-8") as f:
                    extra = _token_ids(json.load(f).get("eos_token_id"))
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
                raise ValueError(f"{generation}: not a valid generation config ({type(e).__name__}: {e})") from None
            d = d | {"eos_token_id": list(dict.fromkeys(_token_ids(d.get("eos_token_id")) + extra))}
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-compatible ``config.json`` dict (readable by transformers 4.x and 5.x)."""
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _token_id_field(self.eos_token_ids),
        }
        if self.rope_scaling is not None:
            s = self.rope_scaling
            scaling = {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
            rope_parameters.update(scaling)
            d["rope_scaling"] = scaling  # transformers 4.x reads this one
        d["rope_parameters"] = rope_parameters
        if self.model_type in ("llama", "qwen3", "qwen3_moe"):
            d["attention_bias"] = self.qkv_bias
        if self.model_type == "qwen2_moe":
            d["qkv_bias"] = self.qkv_bias
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.model_type in ("mistral", "mixtral"):
            d["sliding_window"] = self.sliding_window
        if self.moe is not None:
            d.update(self.moe.to_hf_fields(self.model_type))
        return d


def _unsupported_architecture(name: str) -> str:
    return f"unsupported architecture {name!r}; forerun supports {', '.join(SUPPORTED_ARCHITECTURES)}"


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if isinstance(archs, str):  # one name where transformers writes a list of them
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json field 'architectures' must be a list of names, got {archs!r}")
    if archs:
        for arch in archs:
            if arch in SUPPORTED_ARCHITECTURES:
                return arch
        raise ValueError(_unsupported_architecture(archs[0]))
    model_type = d.get("model_type")
    if model_type in _ARCHITECTURE_BY_MODEL_TYPE:
        return _ARCHITECTURE_BY_MODEL_TYPE[model_type]
    raise ValueError(
        f"config.json names no supported architecture (architectures={archs}, model_type={model_type!r}); "
        f"forerun supports {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


# HF's defaults where a family's differ from Llama's (rope_theta 10,000; rms_norm_eps 1e-6): MixtralConfig's
_DEFAULT_THETA = {"mixtral": 1e6}
_DEFAULT_EPS = {"mixtral": 1e-5}
# transformers' defaults where a config.json leaves head_dim out (Qwen3's is 128, not hidden / heads)
_DEFAULT_HEAD_DIM = {"qwen3": 128}


def _required(d: dict[str, Any], key: str) -> int:
    """A size field: present, and a positive integer (a string or a float would fail far from here)."""
    if d.get(key) is None:
        raise ValueError(f"config.json lacks the required field {key!r}")
    return _optional(d, key)


def _optional(d: dict[str, Any], key: str) -> Optional[int]:
    """A size field that may be absent (None): else a positive integer."""
    value = d.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def _number(d: dict[str, Any], key: str, default: float) -> float:
    """A real-valued field (absent or null: ``default``); a string or a list is refused by name."""
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config.json field {key!r} must be a number, got {value!r}")
    return float(value)


def _parse_rope(d: dict[str, Any], default_theta: float) -> tuple[float, Optional[Llama3RopeScaling]]:
    # transformers 5.x: rope_parameters holds theta and type; 4.x: rope_theta + rope_scaling.
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    params = d.get(key) or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json field {key!r} must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope_parameters are not supported: {sorted(params)}")
    theta = _number(params if params.get("rope_theta") else d, "rope_theta", default_theta)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    for field in ("factor", "low_freq_factor", "high_freq_factor"):
        if params.get(field) is None:
            raise ValueError(f"llama3 rope scaling lacks the field {field!r}")
        # each divides a frequency or a wavelength: zero or less would serve NaN (transformers asks factor >= 1)
        if _number(params, field, 0.0) <= 0:
            raise ValueError(f"config.json {key}.{field} must be a number above 0, got {params[field]!r}")
    if params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ValueError(f"config.json {key}: high_freq_factor ({params['high_freq_factor']!r}) must be above "
                         f"low_freq_factor ({params['low_freq_factor']!r})")
    original = params.get("original_max_position_embeddings") or d.get("max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ValueError(f"config.json {key}.original_max_position_embeddings must be a positive integer, "
                         f"got {original!r}")
    scaling = Llama3RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                                high_freq_factor=float(params["high_freq_factor"]),
                                original_max_position_embeddings=original)
    return theta, scaling


def _sliding_window(d: dict[str, Any], model_type: str, max_pos: int) -> Optional[int]:
    window = d.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        layer_types = d.get("layer_types") or []
        uses_window = flag_field(d, "use_sliding_window", False) and (
            not layer_types or "sliding_attention" in layer_types
        )
        window = window if uses_window else None
    elif model_type not in ("mistral", "mixtral"):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"config.json field 'sliding_window' must be a positive integer or null, got {window!r}")
    if window is not None and window < max_pos:
        logger.warning(
            "forerun: sliding_window=%d is not implemented; sequences are capped at %d tokens so attention stays "
            "exact",
            window,
            window,
        )
        return int(window)
    return None


def _token_ids(value: Any) -> tuple[int, ...]:
    """``eos_token_id``: a token id, a list of them, or null."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise ValueError(f"config.json field 'eos_token_id' must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def _token_id_field(ids: tuple[int, ...]) -> Any:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)
