"""The scheduler's one configuration object, validated once at start.

The executor's settings are a typed field (:class:`ipc.config.ExecutorConfig`),
declared with their defaults on the shared floor; the CLI reads every default
from these classes.
"""

from __future__ import annotations

from typing import Optional

import msgspec

from ipc.config import ExecutorConfig


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    model: Optional[str] = None  # None: the default model (SmolLM2-135M-Instruct)
    tokenizer: Optional[str] = None  # folder with tokenizer files; default: the model folder
    pipeline_depth: int = 1  # steps planned ahead of the executor
    client_address: Optional[str] = None  # default: ipc:// in the run directory
    run_dir: Optional[str] = None  # default: $FORERUN_RUN_DIR or a new temp folder
    executor_start_timeout_s: float = 600.0
    debug_checks: bool = False  # check_integrity() after every step
    step_log: Optional[str] = None  # append each step's executor timings here (JSON lines)
    executor: ExecutorConfig = ExecutorConfig()

    def __post_init__(self) -> None:
        if self.pipeline_depth not in (0, 1, 2):
            raise ValueError(f"pipeline_depth must be 0, 1 or 2, got {self.pipeline_depth}")
        if self.executor_start_timeout_s <= 0:
            raise ValueError(f"executor_start_timeout_s must be positive, got {self.executor_start_timeout_s}")
