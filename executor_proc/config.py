"""The executor's one configuration object, passed from the scheduler as msgspec JSON."""

from __future__ import annotations

from typing import Literal, Optional

import msgspec

LoadFormat = Literal["auto", "hf", "gguf", "dummy", "scripted"]


class ExecutorConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    model: str  # HF folder, .gguf file, config.json / folder for dummy weights, or a name for scripted
    plan_addr: str  # executor PULLs plans here (scheduler binds)
    result_addr: str  # executor PUSHes results here (scheduler binds)
    load_format: LoadFormat = "auto"
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on cpu, bfloat16 on cuda
    num_slots: int = 64  # = max running requests
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # None: size from free memory
    kv_memory_fraction: float = 0.85  # of free device memory after weights (cuda)
    max_model_len: Optional[int] = None  # None: the model's context length
    max_num_batched_tokens: int = 2048
    tokenizer_path: str = ""
    model_name: str = ""
    parent_pid: int = 0  # exit when this process goes away
    kernels: Literal["auto", "triton", "torch"] = "auto"  # auto: Triton on cuda, torch on cpu
    cuda_graphs: bool = True  # capture pure-decode steps (with Triton kernels on cuda)
    cuda_graph_max_batch: Optional[int] = None  # largest graph bucket; None: num_slots
    # load_format "scripted": no model; tokens come from executor_proc.scripted.
    scripted_vocab_size: int = 1000
    scripted_step_latency_s: float = 0.0
    scripted_eos_at: dict[int, int] = {}  # seed -> position of EOS
    scripted_tokens_at: dict[int, dict[int, int]] = {}  # seed -> {position: token} (stop tokens)

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"
