"""GGUF files: the checks that a file is a whole GGUF, its config and its tensors as HF names.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of ``llama`` models so that each head's rotary
pairs are interleaved (``x0 y0 x1 y1 ...``) instead of HF's half split (``x0 x1 ... y0 y1 ...``);
:func:`unpermute_qk` undoes it.  Qwen2/Qwen3 GGUFs are not permuted.  Mixture-of-experts files (``qwen3moe``,
``qwen2moe``, and Mixtral's ``llama`` with an expert count) stack each layer's experts in one tensor per
projection; the stream gives one HF-named tensor per expert, as a safetensors checkpoint does (docs/moe.md).
A file cut short, empty or not GGUF is a :class:`GGUFFileError` (a ValueError of one line).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
from dataclasses import replace
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from executor_proc.model.config import Llama3RopeScaling, ModelConfig
from executor_proc.model.llama import rope_inv_freq
from executor_proc.model.moe_config import MoEConfig, parse_moe
from ipc.models import GGUF_MAGIC

WeightStream = Iterator[tuple[str, torch.Tensor]]

# GGUF general.architecture -> HF architecture.  Mistral GGUFs say "llama" too, and Mixtral's "llama" with an
# expert count.
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# Whether the top-k routing weights are renormalised, where a file does not say ({arch}.expert_weights_norm):
# llama.cpp's defaults for these architectures, which are HF's for the released models.
_GGUF_MOE_RENORMALIZE = {"llama": True, "qwen2moe": False, "qwen3moe": True}

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # an MoE layer's router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# An MoE layer's experts, stacked [E, ...] in one tensor each (or one tensor per expert in older Mixtral files,
# blk.N.ffn_gate.E.weight): their HF projection names.
_GGUF_EXPERT_PARTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj",
                      "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_ROPE_FREQS = "rope_freqs.weight"



class GGUFFileError(ValueError):
    """A .gguf file that cannot be parsed: cut short, or not a GGUF file at all (one line saying which)."""


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` over a .gguf file (or the one .gguf file in a folder); :class:`GGUFFileError` for a file
    without GGUF's magic bytes, one cut short (a read of its header, or a tensor its header declares, past the
    file's end) or one the package cannot parse (its exceptions while parsing, whatever their type).

    The reader parses every field at once, slicing its ``np.memmap`` of the file once per part: a tokenizer's
    vocabulary and merges are hundreds of thousands of parts, and each slice of a memmap builds another memmap (4 of
    the 5 s that SmolLM2's header takes).  Ours slices a plain ndarray view of the same mapping instead (a third of
    the time), and checks that each read lies within the file: the reader maps every tensor's bytes as it parses,
    so a file that does not hold them all is refused before any is read (the package's own reader would fail on a
    short slice with an IndexError or a reshape error, or map it).  Should the package's internal ``_get`` change,
    the override is never called, and a file cut short is one the package cannot parse."""
    from gguf.gguf_reader import GGUFReader  # the class itself, whatever replaces the package-level name

    class Reader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)  # the same mapped pages; slices of it are plain arrays
            end = int(offset) + _itemsize(dtype) * int(count)
            if end > len(self.data):
                raise GGUFFileError(_cut_short(offset, end, len(self.data), getattr(self, "data_offset", None)))
            return super()._get(offset, dtype, count, override_order)

    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.gguf")))
        if len(files) != 1:
            raise ValueError(f"expected exactly one .gguf file in {path!r}, found {len(files)}")
        path = files[0]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    check_gguf_magic(path)
    try:
        return Reader(path)
    except GGUFFileError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GGUFFileError(f"not a readable GGUF file ({first})") from None


def check_gguf_magic(path: str) -> None:
    """:class:`GGUFFileError` unless the file starts with GGUF's magic bytes (an empty file, a text file, a
    safetensors file given a .gguf name)."""
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        what = "an empty file" if not head else f"it starts with {head!r}, not {GGUF_MAGIC!r}"
        raise GGUFFileError(f"not a GGUF file ({what})")


@functools.lru_cache(maxsize=None)
def _itemsize(dtype) -> int:
    """Bytes of one item of a numpy dtype (the reader asks for a handful of them, hundreds of thousands of times)."""
    return np.dtype(dtype).itemsize


def _cut_short(offset: int, end: int, size: int, data_offset: Optional[int]) -> str:
    """Why a GGUF file whose reader reads ``offset..end`` of its ``size`` bytes is refused: its header runs past
    the end, or a tensor it declares (at or after ``data_offset``, where the tensors start) does."""
    if data_offset is not None and offset >= data_offset:
        return (f"not a complete GGUF file (its header declares a tensor at bytes {int(offset):,}..{end:,}, past the "
                f"file's end at byte {size:,}: truncated?)")
    return f"not a complete GGUF file (its header runs past the file's end at byte {size:,}: truncated?)"


@contextlib.contextmanager
def gguf_parsed_once():
    """While transformers reads GGUF files (it parses a file twice, its config then its tensors, and asks for the
    same tensor-name map once per tensor): the ``gguf`` package's reader is :func:`open_gguf` (the same fields and
    tensors, sliced faster), each path parsed once, and the name map memoized; yields that reader, so that a caller
    shares the parse.  Both are pure functions of their arguments: what transformers builds is the same."""
    import gguf

    name_map, reader = gguf.get_tensor_name_map, gguf.GGUFReader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(open_gguf)
    try:
        yield gguf.GGUFReader
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = name_map, reader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_hf_name(gguf_name: str) -> str:
    """The HF parameter name of a GGUF tensor (unknown names are returned unchanged)."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_PARTS:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_PARTS[parts[2]]}.{parts[3]}"
    if len(parts) == 5 and parts[0] == "blk" and parts[2] in _GGUF_EXPERT_PARTS:  # one expert's tensor
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{_GGUF_EXPERT_PARTS[parts[2]]}.{parts[4]}"
    return gguf_name


def _expert_stack(gguf_name: str) -> Optional[str]:
    """For a stack of every expert's projection (``blk.N.ffn_gate_exps.weight``), the HF name of expert E's part
    with ``{}`` for E; else None."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2].endswith("_exps") and parts[2] in _GGUF_EXPERT_PARTS:
        return f"model.layers.{parts[1]}.mlp.experts.{{}}.{_GGUF_EXPERT_PARTS[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows ``2i + j`` go back to ``j * D/2 + i``."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(gguf) -> ModelConfig:
    """A :class:`ModelConfig` from a GGUF file's metadata (``{arch}.*`` and ``tokenizer.ggml.*`` keys).

    ``gguf`` is a path or a reader from :func:`open_gguf` (parsing the header takes seconds).
    """
    reader = open_gguf(gguf) if isinstance(gguf, str) else gguf
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; forerun supports {', '.join(_GGUF_ARCHITECTURES)}"
        )

    def key(name: str, default=None):
        value = _field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks the metadata key {arch}.{name}")
        if isinstance(value, list):
            raise ValueError(f"GGUF key {arch}.{name} varies per layer ({value[:4]}...), which is not supported")
        return value

    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported (supported: none, llama3)")
    tensors = {t.name: t for t in reader.tensors}
    hidden = key("embedding_length")
    num_heads = key("attention.head_count")
    num_kv_heads = key("attention.head_count_kv", num_heads)
    head_dim = key("attention.key_length", hidden // num_heads)
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = [_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    moe = _gguf_moe(reader, arch, key, tensors)
    mixtral = moe is not None and arch == "llama"
    config = ModelConfig(
        architecture="MixtralForCausalLM" if mixtral else _GGUF_ARCHITECTURES[arch],
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),  # Mixtral's: its experts'; Qwen-MoE's: the dense layers'
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=int(vocab),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        moe=moe,
    )
    if _ROPE_FREQS in tensors:
        factors = _dequantize(tensors[_ROPE_FREQS])
        config = with_llama3_scaling(config, factors)
    return config


def _gguf_moe(reader, arch: str, key: Callable, tensors: dict) -> Optional[MoEConfig]:
    """The experts of a mixture-of-experts GGUF (``{arch}.expert_*`` keys; None for a dense model).  A layer
    without a router (``blk.N.ffn_gate_inp``) is a dense MLP of ``feed_forward_length``."""
    experts = _field(reader, f"{arch}.expert_count")
    if not experts:
        if arch in ("qwen2moe", "qwen3moe"):
            raise ValueError(f"GGUF file lacks the metadata key {arch}.expert_count")
        return None
    top_k = int(key("expert_used_count"))
    layers = key("block_count")
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors)
    renormalize = _field(reader, f"{arch}.expert_weights_norm", _GGUF_MOE_RENORMALIZE[arch])
    shared = key("expert_shared_feed_forward_length") if arch == "qwen2moe" else 0
    size = key("feed_forward_length") if arch == "llama" else key("expert_feed_forward_length")
    config = {"num_experts": int(experts), "num_experts_per_tok": top_k,
              "moe_intermediate_size": size, "norm_topk_prob": bool(renormalize), "mlp_only_layers": list(dense),
              "shared_expert_intermediate_size": shared, "num_local_experts": int(experts), "intermediate_size": size}
    if arch == "llama" and dense:
        raise ValueError(f"GGUF Mixtral file: layers {list(dense)[:4]} have no router (ffn_gate_inp)")
    return parse_moe(config, {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}[arch])


def with_llama3_scaling(config: ModelConfig, rope_factors: np.ndarray) -> ModelConfig:
    """Recover llama3 rope parameters from the ``rope_freqs`` divisors llama.cpp stores instead of metadata."""
    factor = float(rope_factors.max())
    # Every released Llama 3.1/3.2 uses these three; the check below rejects anything else.
    scaling = Llama3RopeScaling(factor, 1.0, 4.0, 8192)
    candidate = replace(config, rope_scaling=scaling)
    plain = rope_inv_freq(replace(config, rope_scaling=None)).numpy()
    expected = plain / rope_inv_freq(candidate).numpy()
    if not np.allclose(expected, rope_factors, rtol=1e-3):
        raise ValueError("GGUF rope_freqs tensor does not match llama3 rope scaling; it is not supported")
    return candidate


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    # Copy: the reader memory-maps the file read-only.
    return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def gguf_weights(gguf, config: ModelConfig) -> tuple[int, WeightStream]:
    """(number of tensors, stream of (HF name, float32 CPU tensor)) dequantised from a GGUF path or reader."""
    reader = open_gguf(gguf) if isinstance(gguf, str) else gguf
    tensors = [t for t in reader.tensors if t.name != _ROPE_FREQS]
    permuted = _field(reader, "general.architecture") == "llama"

    stacks = {t.name: _expert_stack(t.name) for t in tensors}
    num_experts = config.moe.num_experts if config.moe is not None else 0

    def stream() -> WeightStream:
        for tensor in tensors:
            w = _dequantize(tensor)
            if permuted and ".attn_q." in tensor.name:
                w = unpermute_qk(w, config.num_heads)
            elif permuted and ".attn_k." in tensor.name:
                w = unpermute_qk(w, config.num_kv_heads)
            stack = stacks[tensor.name]
            if stack is None:
                yield gguf_hf_name(tensor.name), torch.from_numpy(w)
                continue
            for e in range(w.shape[0]):  # every expert's projection, as an HF checkpoint names it
                yield stack.format(e), torch.from_numpy(w[e])

    total = sum(num_experts if stacks[t.name] else 1 for t in tensors)
    return total, stream()
