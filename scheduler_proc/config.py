"""The scheduler's one configuration object, validated once at start.

The executor's settings are a typed field (:class:`ipc.config.ExecutorConfig`),
declared with their defaults on the shared floor; the CLI reads every default
from these classes.
"""

from __future__ import annotations

from typing import Optional

import msgspec

from ipc.config import ExecutorConfig


# The hang timeout's floor when the executor runs the Triton kernels in Triton's interpreter (--kernels triton on the
# CPU): a step of new shapes takes minutes there, not a hang.
INTERPRETER_HANG_TIMEOUT_S = 600.0
MIN_HANG_TIMEOUT_S = 1.0  # a shorter hang timeout restarts the executor during ordinary steps
MAX_SEND_HWM = 2**31 - 1  # ZeroMQ's high-water marks are C ints

class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    model: Optional[str] = None  # None: the default model (SmolLM2-135M-Instruct)
    tokenizer: Optional[str] = None  # folder with tokenizer files; default: the model folder
    pipeline_depth: int = 1  # steps planned ahead of the executor
    # At depth >= 1, a plan that starts or continues a prefill may go one step further ahead (depth + 1): its
    # larger host work in the executor then runs while two steps are on the GPU instead of one.
    prefill_ahead: bool = True
    client_address: Optional[str] = None  # default: ipc:// in the run directory
    run_dir: Optional[str] = None  # default: $FORERUN_RUN_DIR or a new temp folder
    executor_start_timeout_s: float = 600.0
    debug_checks: bool = False  # check_integrity() after every step
    enable_prefix_caching: bool = True  # share the KV blocks of common prompt prefixes between requests
    step_log: Optional[str] = None  # append each step's executor timings here (JSON lines)
    executor: ExecutorConfig = ExecutorConfig()
    # Reliability (docs/reliability.md).
    executor_hang_timeout_s: float = 30.0  # floor of the hang timeout (the rest: 50 x p99 step time)
    max_restarts: int = 5  # more executor restarts than this within restart_window_s: fail-stop
    restart_window_s: float = 60.0
    shutdown_timeout_s: float = 30.0  # SIGTERM / Ctrl-C: running requests get this long to finish
    # Waiting requests beyond which Generate is refused ("overloaded"): 64 full batches at the
    # default 64 slots, minutes of queueing; about 2 KB each for short prompts.
    max_waiting: int = 4096
    # Messages queued to one client that stopped reading before its requests are aborted
    # ("slow_reader"): about a second of tokens at 256 running requests and 1 ms steps.
    client_send_hwm: int = 200_000
    # The shared secret of the client socket (docs/reliability.md, "Hostile clients"): checked at Hello on a
    # tcp:// address, and for admin messages on any address.  Without one, a tcp:// address beyond loopback
    # is refused unless allow_unauthenticated.
    api_key: Optional[str] = None
    allow_unauthenticated: bool = False
    # Structured outputs (scheduler_proc/grammar.py): a constraint whose grammar takes longer than this to
    # compile is refused as an invalid request.
    grammar_compile_timeout_s: float = 10.0
    # This server's index among data-parallel replicas (scheduler_proc/replica.py), None when it serves alone.  A
    # replica that fails for good exits without failing its requests: its router re-sends them to another one.
    replica: Optional[int] = None

    def __post_init__(self) -> None:
        if self.pipeline_depth not in (0, 1, 2):
            raise ValueError(f"pipeline_depth must be 0, 1 or 2, got {self.pipeline_depth}")
        for name in ("executor_hang_timeout_s", "restart_window_s", "max_waiting", "client_send_hwm",
                     "grammar_compile_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.executor_hang_timeout_s < MIN_HANG_TIMEOUT_S:  # shorter than a first step (a prefill) may take
            raise ValueError(f"executor_hang_timeout_s must be at least {MIN_HANG_TIMEOUT_S:g} s (a step may take "
                             f"that long), got {self.executor_hang_timeout_s:g}")
        if self.client_send_hwm > MAX_SEND_HWM:
            raise ValueError(f"client_send_hwm must be in [1, {MAX_SEND_HWM}] (ZeroMQ's limit), got "
                             f"{self.client_send_hwm}")
        for name in ("max_restarts", "shutdown_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if self.executor_start_timeout_s <= 0:
            raise ValueError(f"executor_start_timeout_s must be positive, got {self.executor_start_timeout_s}")
