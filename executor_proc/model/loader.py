"""Weight loading: HF safetensors folders, GGUF files and random ("dummy") weights.

Every format ends the same way: a :class:`ModelConfig`, a model allocated
directly on the target device in the target dtype (:func:`build_model`), and a
stream of HF-named tensors fed to :meth:`CausalLM.load_weights`, which names
anything missing or unexpected.

GGUF files: :mod:`executor_proc.model.gguf_file`.

A model file that cannot be read (cut short, empty, another format) and weights the host cannot hold are ValueErrors
of one line saying what is wrong, which the executor's start-up turns into a refusal naming the flag.
"""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from executor_proc.memory_plan import GIB, available_host_bytes
from executor_proc.model.config import ModelConfig
from executor_proc.model.gguf_file import gguf_config, gguf_weights, open_gguf
from executor_proc.model.llama import CausalLM, build_model
from executor_proc.model.fp8_checkpoint import fp8_config, ignored_modules, prepare_fp8

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
    if os.path.isdir(path) and glob.glob(os.path.join(glob.escape(path), "*.gguf")):
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
    fp8 = fp8_config(path) if reader is None else None
    if fp8 is not None:  # e4m3 weights and their scales, read as they are
        prepare_fp8(model, ignored_modules(fp8))
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
        try:
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
            raise ValueError(f"{index} cannot be read as a safetensors index (a JSON object with a "
                             f"\"weight_map\"): {e}") from None
        files = set(weight_map.values()) if isinstance(weight_map, dict) else None
        if not files or not all(isinstance(name, str) for name in files):
            raise ValueError(f"{index}: \"weight_map\" must map tensor names to the folder's .safetensors files, "
                             f"got {str(weight_map)[:200]}")
        return [os.path.join(folder, name) for name in sorted(files)]
    return sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))


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
        bins = glob.glob(os.path.join(glob.escape(folder), "*.bin"))
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

