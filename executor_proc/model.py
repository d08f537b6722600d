"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), readable top to bottom.

Tokens of all rows of a step are packed into one flat sequence ``[T, hidden]``;
only attention knows about rows (through :class:`ForwardBatch` and the paged
KV cache).  Module names follow the HF checkpoints (``model.layers.N.self_attn.
q_proj``), so weights load by name without a mapping table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from executor_proc.attention import AttentionBackend, EagerAttention
from executor_proc.batch import ForwardBatch
from executor_proc.kv_cache import KVCache
from executor_proc.model_config import ModelConfig

# Buffers some HF checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype (as HF does).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` in float32, llama3 scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, head_dim]`` for the given positions (computed in float32)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by position (half-split layout, as HF's rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass
class StepContext:
    """What every layer needs from the step, computed once."""

    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    attn_plan: object
    kv_cache: KVCache
    backend: AttentionBackend


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, step.cos, step.sin)
        k = apply_rotary(k, step.cos, step.sin)
        k_cache, v_cache = step.kv_cache.k[self.layer_id], step.kv_cache.v[self.layer_id]
        step.backend.write_kv(k, v, k_cache, v_cache, step.slot_mapping)
        out = step.backend.attend(q, k_cache, v_cache, step.attn_plan, self.scale)
        return self.o_proj(out.view(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_id, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), step)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """Decoder + LM head.  Build it with :func:`build_model`, fill it with :meth:`load_weights`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.attn_backend: AttentionBackend = EagerAttention()
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Run one step; float32 logits ``[S, vocab]`` for ``batch.sample_index`` (``[T, vocab]`` if all_logits)."""
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.model.rotary_emb(batch.positions, x.dtype)
        step = StepContext(
            cos=cos,
            sin=sin,
            slot_mapping=batch.slot_mapping,
            attn_plan=self.attn_backend.plan(batch),
            kv_cache=kv_cache,
            backend=self.attn_backend,
        )
        for layer in self.model.layers:
            x = layer(x, step)
        if not all_logits:
            x = x[batch.sample_index]
        return self.lm_head(self.model.norm(x)).float()

    def forward_all_logits(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Float32 logits ``[T, vocab]`` for every token of the step (for tests)."""
        return self.forward(batch, kv_cache, all_logits=True)

    @torch.no_grad()
    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        progress_cb: Optional[Callable[[int], None]] = None,
    ) -> int:
        """Copy HF-named tensors into the parameters; raise naming every missing/unexpected/misshapen one.

        ``progress_cb(n_seen)`` is called after each tensor read from ``weights``.  Returns the number copied.
        """
        params = dict(self.named_parameters())  # a tied lm_head is listed once, as embed_tokens
        loaded: set[str] = set()
        unexpected: list[str] = []
        bad_shapes: list[str] = []
        for seen, (name, tensor) in enumerate(weights, 1):
            if progress_cb is not None:
                progress_cb(seen)
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            if tuple(param.shape) != tuple(tensor.shape):
                bad_shapes.append(f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(param.shape)}")
                continue
            param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} weights: {_some(missing)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} weights: {_some(sorted(unexpected))}")
        if bad_shapes:
            problems.append(f"{len(bad_shapes)} shape mismatches: {_some(bad_shapes)}")
        if problems:
            raise ValueError(f"checkpoint does not match {self.config.architecture}: " + "; ".join(problems))
        return len(loaded)


def _some(names: list[str], limit: int = 8) -> str:
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
    """An uninitialised model allocated directly on ``device`` in ``dtype`` (no CPU init pass)."""
    with torch.device("meta"):
        model = CausalLM(config, dtype)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty may give the tied pair two storages
    model.model.rotary_emb.inv_freq = rope_inv_freq(config, device)
    model.requires_grad_(False)
    return model.eval()
