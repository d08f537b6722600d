"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), readable top to bottom.

Tokens of all rows of a step are packed into one flat sequence ``[T, hidden]``;
only attention knows about rows (through :class:`ForwardBatch` and the paged
KV cache).  Every op with more than one implementation (attention, rotary + KV
write, norms, activation, linears) goes through the model's
:class:`executor_proc.backends.base.Backend`.  Module names follow the HF
checkpoints (``model.layers.N.self_attn.q_proj``), so weights load by name
without a mapping table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from executor_proc.backends.base import Backend, NormInput, Stream, normed, split_heads
from executor_proc.backends.torch_backend import TorchBackend
from executor_proc.step.batch import ForwardBatch
from executor_proc.model.kv_cache import KVCache
from executor_proc.model.config import ModelConfig
from executor_proc.model.fp8_checkpoint import kv_scale_name, row_scales, scale_problem
from executor_proc.model.mlp import MLP, FusedLinear
from executor_proc.model.moe import MoEBlock, checkpoint_name, mixtral_name, stack_checkpoint_name
from kernels.fp8 import FP8
from kernels.reference import rms_norm_ref

# Buffers some HF checkpoints carry that the model recomputes, and FP8 checkpoints' static activation scales (the
# kernels scale activations per token: executor_proc/model/fp8_checkpoint.py).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".input_scale")
_SCALE = ".weight_scale"  # an FP8 weight's scales, loaded into the buffer of that name (fp8_checkpoint.prepare_fp8)
_HEAD_SCALES = {"lm_head.weight_scale": "LM head", "model.embed_tokens.weight_scale": "embedding"}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


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


@dataclass
class StepContext:
    """What every layer needs from the step, computed once."""

    plan: Any  # the backend's plan for this step
    kv_cache: KVCache
    backend: Backend


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
        self.qkv: Optional[FusedLinear] = None  # set by CausalLM.fuse_projections
        self.o: Optional[FusedLinear] = None  # o_proj alone (its weight may become FP8: quantization.py)

    def forward(self, pre: NormInput, step: StepContext) -> Stream:
        """The attention output and the residual stream, for the layer's un-normalised input."""
        t, backend = pre.x.shape[0], step.backend
        k_cache, v_cache = step.kv_cache.k[self.layer_id], step.kv_cache.v[self.layer_id]
        kv_scale = step.kv_cache.layer_scale(self.layer_id)  # an FP8 cache's (K, V) scales
        if self.q_norm is None:
            q, residual = backend.qkv_rotate_store(pre, self.qkv.weight, self.qkv.bias, k_cache, v_cache, step.plan,
                                                   kv_scale)
        else:  # q/k norms sit between the matmul and the rotary
            qkv, residual = backend.norm_linear(pre, self.qkv.weight, self.qkv.bias)
            q, k, v = split_heads(qkv, self.num_kv_heads, self.head_dim)
            q = backend.rotate_and_store(q, k, v, k_cache, v_cache, step.plan, kv_scale,
                                         (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps))
        out = backend.attend(q, k_cache, v_cache, step.plan, self.scale, kv_scale)
        return backend.project_out(out.view(t, self.num_heads * self.head_dim), self.o.weight, self.o.bias, residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_id, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        sparse = config.moe is not None and config.moe.is_sparse(layer_id)
        self.mlp = MoEBlock(config, dtype) if sparse else MLP(config, dtype)

    def forward(self, stream: Stream, step: StepContext) -> Stream:
        """Residual-stream form: the stream after this layer (its MLP output, the residual before it is added).

        Same sums as HF's ``h = x + attn(norm(x)); out = h + mlp(norm(h))``, with each
        add fused into the next norm (and, where the backend can, the norm into the next matmul, or the
        add into the matmul before it: :meth:`Backend.project_out`).
        """
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        stream = self.self_attn(stream.before(norm1.weight, norm1.eps), step)
        return self.mlp(stream.before(norm2.weight, norm2.eps), step.backend)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        # an empty weight: Embedding's own init (normal_) on the meta device imports torch._dynamo (1-6 s)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    """Decoder + LM head.  Build it with :func:`build_model` (which fuses the projections), fill it with
    :meth:`load_weights`; it runs on the torch backend until :meth:`use_backend` says otherwise."""

    tensor_parallel = False  # a rank's shard whose forward holds collectives (executor_proc.parallel.model)

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)
        self.backend: Backend = TorchBackend(self.rope_inv_freq)
        # an FP8 checkpoint's KV-cache scales, [(k, v)] per layer (load_weights): --kv-cache-dtype fp8 takes them
        self.checkpoint_kv_scales: Optional[list[tuple[float, float]]] = None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_backend(self, backend: Backend) -> None:
        """Run every later step on ``backend`` (see :func:`executor_proc.backends.select.select_backend`)."""
        self.backend = backend

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """q|k|v and gate|up become one matmul each; the separate linears become views of it (o and down stand
        alone, in the same holder).  Before the weights load: the fused storage starts uninitialised."""
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.qkv = FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj])
            attn.o = FusedLinear([attn.o_proj])
            layer.mlp.fuse()

    @torch.no_grad()
    def fold_norms(self) -> None:
        """Each layer's RMSNorm weights move into the matmul they feed (``W diag(w)``, rounded once to the
        weight dtype: the input norm into q|k|v, the post-attention norm into gate|up) and the norms keep
        weights of ones: the same function, and a matmul can then take the un-normalised residual stream and
        scale its sums by the norm's ``rsqrt(mean + eps)`` (:meth:`Backend.project_out`). The final norm
        stays (the LM head may be the embedding), and so does an MoE layer's (its router, experts and shared
        expert all read the normalised input)."""
        for layer in self.model.layers:
            folds = [(layer.input_layernorm, layer.self_attn.qkv)]
            if isinstance(layer.mlp, MLP):
                folds.append((layer.post_attention_layernorm, layer.mlp.gate_up))
            for norm, linear in folds:
                linear.weight.copy_((linear.weight.float() * norm.weight.float()[None, :]).to(linear.weight.dtype))
                norm.weight.fill_(1.0)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run one step; float32 logits ``[S, vocab]`` for ``batch.sample_index`` (every token's if None)."""
        return self.logits(self.final_hidden(batch, kv_cache))

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """The decoder with its final norm, for the tokens of ``batch.sample_index`` (every token if None)."""
        backend = self.backend
        stream = Stream(self.embed(batch.input_ids))
        step = StepContext(backend.plan(batch), kv_cache, backend)
        for layer in self.model.layers:
            stream = layer(stream, step)
        if batch.sample_index is not None:
            stream = stream.rows(batch.sample_index)
        norm = self.model.norm
        return normed(backend, stream.before(norm.weight, norm.eps))[0]

    def weight_bytes(self) -> int:
        """Bytes of the parameters and buffers as they lie on the device (a rank's shard; FP8 weights quantized)."""
        return sum(t.numel() * t.element_size() for t in (*self.parameters(), *self.buffers()))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: float32 logits ``[S, vocab]`` of :meth:`final_hidden`'s rows."""
        return self.backend.logits(hidden, self.lm_head.weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` embeddings of the step's tokens (a tensor-parallel rank's model overrides it)."""
        return self.model.embed_tokens(input_ids)

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
        stacks: dict[str, list[str]] = {}  # an MoE stack -> its experts' slices: a checkpoint holds one or the other
        for i, layer in enumerate(self.model.layers):  # stacked experts load expert by expert, or whole
            if isinstance(layer.mlp, MoEBlock):
                prefix = f"model.layers.{i}.mlp."
                views = layer.mlp.expert_views(prefix)
                params.update(views)
                stacks[prefix + "w13"] = [n for n in views if n.endswith(("gate_proj.weight", "up_proj.weight"))]
                stacks[prefix + "w2"] = [n for n in views if n.endswith("down_proj.weight")]
        params.update((n, b) for n, b in self.named_buffers() if n.endswith(_SCALE))
        loaded: set[str] = set()
        kv_scales: dict[tuple[int, str], float] = {}
        finite: list[tuple[str, torch.Tensor]] = []  # (name, no NaN or infinity in it), read once at the end
        unexpected: list[str] = []
        bad_shapes: list[str] = []
        misfits: set[str] = set()
        mixtral_names = False  # the checkpoint names its MoE tensors as Mixtral's do: errors name them so too
        for seen, (given, tensor) in enumerate(weights, 1):
            if progress_cb is not None:
                progress_cb(seen)
            name = checkpoint_name(given)
            mixtral_names |= ".block_sparse_moe." in given
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            kv = kv_scale_name(name)
            if kv is not None:  # an FP8 KV cache's scale (its largest, where per head): kept for --kv-cache-dtype fp8
                problem = scale_problem(tensor)
                if problem is not None:
                    bad_shapes.append(f"{given}: {problem}")
                    continue
                for which in ("k", "v") if kv[1] == "kv" else (kv[1],):
                    kv_scales[kv[0], which] = float(tensor.float().max())
                continue
            param = params.get(name)
            if param is None:
                if name in _HEAD_SCALES:
                    raise ValueError(f"{given}: the checkpoint's {_HEAD_SCALES[name]} is FP8, and this engine keeps it "
                                     f"in the model dtype (checkpoints made with quantization_config.ignore: "
                                     f"[\"lm_head\"] load)")
                unexpected.append(given)
                continue
            if name.endswith(_SCALE):
                problem = scale_problem(tensor, param.shape[0])
                if problem is not None:
                    bad_shapes.append(f"{given}: {problem}")
                    misfits.add(name)
                    continue
                tensor = row_scales(tensor, param.shape[0])
            if tuple(param.shape) != tuple(tensor.shape) or (param.dtype == FP8) != (tensor.dtype == FP8) \
                    or not tensor.is_floating_point():  # integers would be copied in as whole numbers (all zeros)
                bad_shapes.append(f"{given}: checkpoint {tuple(tensor.shape)} {tensor.dtype} vs model "
                                  f"{tuple(param.shape)} {param.dtype}")
                misfits.add(name)
                continue
            param.copy_(tensor)
            loaded.add(name)
            finite.append((given, _all_finite(param)))
        stacked = any(stack in loaded or stack in misfits for stack in stacks)  # the checkpoint's layout
        absent: list[str] = []
        for stack, views in stacks.items():  # a stack loaded whole stands for its experts' slices (misfit: named once)
            if stack in loaded:
                loaded.update(views)
            elif stack in misfits:
                misfits.update(views)
            elif stacked and not loaded.intersection(views):  # named as the stacked checkpoint names it
                absent.append(stack_checkpoint_name(stack))
                misfits.update(views)
        missing = sorted(set(params) - loaded - misfits - set(stacks)) + absent  # a misfit is named once
        if mixtral_names:
            missing = [mixtral_name(n) for n in missing]
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} weights: {_some(missing)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} weights: {_some(sorted(unexpected))}")
        if bad_shapes:
            problems.append(f"{len(bad_shapes)} shape or dtype mismatches: {_some(bad_shapes)}")
        layers = self.config.num_layers
        if kv_scales and len(kv_scales) != 2 * layers:
            lacking = sorted({f"model.layers.{i}.self_attn.{w}_scale" for i in range(layers) for w in "kv"
                              if (i, w) not in kv_scales})
            problems.append(f"KV cache scales for some layers only: missing {_some(lacking)}")
        if problems:
            raise ValueError(f"checkpoint does not match {self.config.architecture}: " + "; ".join(problems))
        flags = torch.stack([ok for _, ok in finite]).tolist() if finite else []  # one read of the device for all
        broken = [n for (n, _), ok in zip(finite, flags) if not ok]
        if broken:
            raise ValueError(f"{len(broken)} checkpoint weights hold NaN or infinite values: {_some(broken)}")
        if kv_scales:
            self.checkpoint_kv_scales = [(kv_scales[i, "k"], kv_scales[i, "v"]) for i in range(layers)]
        return len(loaded)


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """A device bool: no NaN or infinity in ``t`` (its largest and smallest values carry either one; e4m3 has only
    NaN, bits x1111111), computed without a full-size copy of a float tensor."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    if t.dtype == FP8:
        return ((t.view(torch.uint8) & 0x7F) != 0x7F).all()
    return torch.isfinite(torch.stack(torch.aminmax(t))).all()


def _some(names: list[str], limit: int = 8) -> str:
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                make: Callable[[ModelConfig, torch.dtype], CausalLM] = CausalLM) -> CausalLM:
    """An uninitialised model allocated directly on ``device`` in ``dtype`` (no CPU init pass);
    ``make(config, dtype)`` builds it (a tensor-parallel rank's sharded model, or the whole one)."""
    with torch.device("meta"):
        model = make(config, dtype)
    # Module.to_empty, less its torch.empty_like: that one, on a meta tensor, imports sympy (0.4 s of every start)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()  # the tied pair got two storages
    model.rope_inv_freq = rope_inv_freq(config, device)
    model.use_backend(TorchBackend(model.rope_inv_freq))
    model.fuse_projections()
    model.requires_grad_(False)
    return model.eval()
