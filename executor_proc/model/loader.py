"""Weight loading: HF safetensors folders, GGUF files and random ("dummy") weights.

Every format ends the same way: a :class:`ModelConfig`, a model allocated
directly on the target device in the target dtype (:func:`build_model`), and a
stream of HF-named tensors fed to :meth:`CausalLM.load_weights`, which names
anything missing or unexpected.

GGUF notes: llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of
``llama`` models so that each head's rotary pairs are interleaved
(``x0 y0 x1 y1 ...``) instead of HF's half split (``x0 x1 ... y0 y1 ...``);
:func:`unpermute_qk` undoes it.  Qwen2/Qwen3 GGUFs are not permuted.  Mixture-of-experts files (``qwen3moe``,
``qwen2moe``, and Mixtral's ``llama`` with an expert count) stack each layer's experts in one tensor per
projection; the stream gives one HF-named tensor per expert, as a safetensors checkpoint does (docs/moe.md).

A model file that cannot be read (cut short, empty, another format) and weights the host cannot hold are ValueErrors
of one line saying what is wrong, which the executor's start-up turns into a refusal naming the flag.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import numpy as np
import torch

from executor_proc.memory_plan import GIB, available_host_bytes
from executor_proc.model.llama import CausalLM, build_model, rope_inv_freq
from executor_proc.model.config import Llama3RopeScaling, ModelConfig
from executor_proc.model.moe_config import MoEConfig, parse_moe
from executor_proc.model.fp8_checkpoint import checkpoint_is_fp8, prepare_fp8

if TYPE_CHECKING:
    from executor_proc.parallel.group import TPGroup
    from executor_proc.parallel.sharding import Shards

ProgressCallback = Callable[[str, int, int], None]
WeightStream = Iterator[tuple[str, torch.Tensor]]

DUMMY_SEED = 0
DUMMY_INIT_STD = 0.02

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its name ("bfloat16", "float32", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (supported: {', '.join(_DTYPES)})")
    return _DTYPES[dtype]


def detect_format(path: str) -> str:
    """The load format "auto" resolves to: "gguf" for a .gguf file, "hf" for a folder with safetensors."""
    if path.endswith(".gguf"):
        return "gguf"
    if os.path.isdir(path) and _safetensors_files(path):
        return "hf"
    if os.path.isdir(path) and glob.glob(os.path.join(path, "*.gguf")):
        return "gguf"
    raise ValueError(
        f"cannot tell the weight format of {path!r}: expected a .gguf file or a folder with "
        "config.json and *.safetensors (use load_format='dummy' for random weights from a config.json)"
    )


def load_model(
    path: str,
    load_format: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    progress_cb: Optional[ProgressCallback] = None,
    tp: Optional["TPGroup"] = None,
    expert_parallel: bool = False,
    host_replicas: int = 1,
) -> tuple[CausalLM, ModelConfig]:
    """Load a model for serving; ``progress_cb(stage, done, total)`` is called as tensors load; on the cpu, refused
    when ``host_replicas`` copies of its weights would not fit the host's available memory.

    With ``tp`` (a tensor-parallel group), the model is this rank's shard
    (:class:`executor_proc.parallel.model.ParallelCausalLM`) and only its slices are read: safetensors
    by slice, GGUF dequantised whole and then sliced, dummy weights drawn whole (the same values as one
    process draws) and then sliced.  With ``expert_parallel`` too, the rank holds whole experts, its range of
    them, and reads no other expert's tensors.  The config returned is the whole model's.
    """
    dtype = resolve_dtype(dtype)
    if load_format == "auto":
        load_format = detect_format(path)
    if load_format not in ("hf", "gguf", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r} (auto, hf, gguf, dummy)")
    reader = open_gguf(path) if load_format == "gguf" else None
    config = gguf_config(reader) if reader is not None else ModelConfig.from_pretrained(path)
    shards, make = _rank_model(config, tp, expert_parallel)
    if torch.device(device).type == "cpu":  # the weights live in host memory: every rank's part, on one host
        check_host_memory(config, dtype, replicas=host_replicas)
    if load_format == "dummy":
        model = build_model(config, device, dtype, make)
        init_dummy_weights(model, DUMMY_SEED, progress_cb, shards)
        return model, config
    if reader is not None:
        total, weights = gguf_weights(reader, config)
        if shards is not None:  # a quantised block does not slice: dequantise whole, keep the rank's part
            weights = ((name, shards.take(name, w)) for name, w in weights if shards.holds(name))
        stage = "dequantizing weights"
    else:
        total, weights = hf_weights(path, shards)
        stage = "loading weights"
    model = build_model(config, device, dtype, make)
    if reader is None and checkpoint_is_fp8(path):  # e4m3 weights and their scales, read as they are
        prepare_fp8(model)
    report = None if progress_cb is None else (lambda done: progress_cb(stage, done, total))
    model.load_weights(weights, report)
    return model, config


def model_weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the whole model's parameters and buffers in ``dtype``, from its config alone (the model built on the
    meta device: nothing allocated)."""
    with torch.device("meta"):
        return CausalLM(config, dtype).weight_bytes()


def weights_advice(dtype: torch.dtype) -> str:
    """What makes weights that do not fit smaller: half the bytes in bfloat16 (float32 only), else another model."""
    return "use dtype='bfloat16' or a smaller model" if dtype == torch.float32 else "use a smaller model"


def check_host_memory(config: ModelConfig, dtype: torch.dtype, available: Optional[int] = None,
                      replicas: int = 1) -> None:
    """Refuse (ValueError, one line) weights in host memory that would take more than the host has available
    (``available`` bytes, default MemAvailable), counting the ``replicas`` that load a copy each at once (data
    parallelism on the cpu): allocated anyway, they end in an allocation error at best, the kernel's OOM killer
    ending this or another process at worst.  Checked before anything is allocated; the advice offers bfloat16
    only where half the bytes would fit."""
    weights = model_weight_bytes(config, dtype)
    available = available_host_bytes() if available is None else available
    if weights * replicas > available:
        name = str(dtype).removeprefix("torch.")
        copies = f"{replicas} replicas of {weights / GIB:.1f} GiB" if replicas > 1 else f"{weights / GIB:.1f} GiB"
        advice = ["fewer replicas (--data-parallel-size)"] if replicas > 1 else []
        if dtype == torch.float32 and weights // 2 * replicas <= available:
            advice.append("dtype='bfloat16'")
        advice.append("a smaller model")
        raise ValueError(f"its weights take {copies} in {name}, more than the {available / GIB:.1f} GiB of host "
                         f"memory available; use {' or '.join(advice)}")


# --------------------------------------------------------------------------- HF safetensors


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, name) for name in files]
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def _rank_model(config: ModelConfig, tp: Optional["TPGroup"],
                expert_parallel: bool) -> tuple[Optional["Shards"], Callable]:
    """(this rank's shards, the model class to build) for ``tp``; (None, CausalLM) without one."""
    if tp is None:
        return None, CausalLM
    from executor_proc.parallel.model import ParallelCausalLM
    from executor_proc.parallel.sharding import Shards

    shards = Shards(config, tp.rank, tp.size, expert_parallel)
    return shards, lambda _config, dtype: ParallelCausalLM(shards, tp, dtype)


def hf_weights(folder: str, shards: Optional["Shards"] = None) -> tuple[int, WeightStream]:
    """(number of tensors, stream of (name, CPU tensor)) over a folder's safetensors shards; with
    ``shards``, each tensor is the rank's slice, read as a slice (the rest, and the tensors of experts
    another rank holds, are never read)."""
    files = _safetensors_files(folder)
    if not files:
        bins = glob.glob(os.path.join(folder, "*.bin"))
        hint = " (only safetensors are supported, not .bin)" if bins else ""
        raise FileNotFoundError(f"no *.safetensors in {folder!r}{hint}")
    total = 0
    for file in files:
        with open_safetensors(file) as f:
            total += sum(1 for name in f.keys() if shards is None or shards.holds(name))

    def stream() -> WeightStream:
        for file in files:
            with open_safetensors(file) as f:
                for name in f.keys():
                    if shards is None:
                        yield name, f.get_tensor(name)
                    elif shards.holds(name):
                        yield name, shards.take(name, f.get_slice(name))

    return total, stream()


def open_safetensors(file: str):
    """``safe_open`` of one safetensors file (on the CPU, as torch tensors); a file whose header cannot be read (cut
    short, empty, another format) is a ValueError naming the file, what is wrong and its likely cause."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        reason = str(e).splitlines()[0].removeprefix("Error while deserializing header: ")
        raise ValueError(f"{os.path.basename(file)} is not a readable safetensors file ({reason}: "
                         f"{_safetensors_cause(file, reason)})") from None


def _safetensors_cause(file: str, reason: str) -> str:
    """The likely cause of a safetensors header error: a file cut short (its header declares more bytes than it
    has, or it is shorter than a header), or one that is no safetensors file at all."""
    if os.path.getsize(file) == 0:
        return "an empty file"
    if "not fully covered" in reason or "too small" in reason:
        return "truncated?"
    return "another format, or a damaged file?"


# --------------------------------------------------------------------------- GGUF

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


GGUF_MAGIC = b"GGUF"


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
        files = sorted(glob.glob(os.path.join(path, "*.gguf")))
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


# --------------------------------------------------------------------------- dummy


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = DUMMY_SEED, progress_cb: Optional[ProgressCallback] = None,
                       shards: Optional["Shards"] = None) -> None:
    """Deterministic random weights, generated on the model's device: N(0, 0.02) matrices, unit norms, zero biases.

    With ``shards`` each matrix is drawn at its whole-model shape, in the same order, and sliced, so a
    tensor-parallel rank holds exactly its part of the weights one process would draw.
    """
    params = list(model.named_parameters())
    device = params[0][1].device
    generator = torch.Generator(device=device).manual_seed(seed)
    full_shape = None
    if shards is not None:
        from executor_proc.parallel.model import full_shapes

        full_shape = full_shapes(shards.full)
    for done, (name, param) in enumerate(params, 1):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        elif full_shape is None:
            param.normal_(0.0, DUMMY_INIT_STD, generator=generator)
        else:
            whole = torch.empty(full_shape[name], dtype=param.dtype, device=device)
            param.copy_(shards.take(name, whole.normal_(0.0, DUMMY_INIT_STD, generator=generator)))
        if progress_cb is not None:
            progress_cb("initialising weights", done, len(params))

