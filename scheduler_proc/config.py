"""The scheduler's one configuration object, validated once at start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class ServerConfig:
    model: Optional[str] = None  # None: the default model (SmolLM2-135M-Instruct)
    load_format: str = "auto"
    tokenizer: Optional[str] = None  # folder with tokenizer files; default: the model folder
    device: str = "cpu"
    dtype: str = "auto"
    num_kv_blocks: Optional[int] = None
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: Optional[int] = None
    kv_memory_fraction: float = 0.85
    pipeline_depth: int = 1
    client_address: Optional[str] = None  # default: ipc:// in the run directory
    run_dir: Optional[str] = None
    executor_start_timeout_s: float = 600.0
    debug_checks: bool = False  # check_integrity() after every step
    enable_prefix_caching: bool = True  # share the KV blocks of common prompt prefixes between requests
    executor_threads: Optional[int] = None
    step_log: Optional[str] = None  # append each step's executor timings here (JSON lines)
    # ExecutorConfig fields to override (tests: load_format "scripted" and its options).
    executor_overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.pipeline_depth not in (0, 1, 2):
            raise ValueError(f"pipeline_depth must be 0, 1 or 2, got {self.pipeline_depth}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.load_format not in ("auto", "hf", "gguf", "dummy", "scripted"):
            raise ValueError(f"load_format must be auto, hf, gguf or dummy, got {self.load_format!r}")
