"""Build a ready :class:`executor_proc.step.worker.Worker` from an :class:`ExecutorConfig` (no sockets).

Load the model, pick the kernels (Triton on CUDA, torch on the CPU), size and
allocate the KV cache, and capture the decode graphs.  The executor process
and the GPU benchmarks share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ipc.config import ExecutorConfig
from executor_proc.model.kv_cache import KVCache, kv_cache_bytes_per_block
from executor_proc.model.loader import load_model
from executor_proc.model.config import ModelConfig
from executor_proc.step.slot_tables import SlotTables
from executor_proc.step.worker import Worker

CPU_KV_BUDGET_BYTES = 2 * 1024**3
GRAPH_STAGE = "capturing CUDA graphs"

ProgressCallback = Callable[[str, int, int], None]


@dataclass
class Engine:
    worker: Worker
    model_config: ModelConfig
    num_kv_blocks: int
    max_model_len: int
    device: torch.device


def resolve_device(name: str) -> torch.device:
    """The device, with an explicit index for CUDA (made current)."""
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    return device


def uses_triton(cfg: ExecutorConfig, device: torch.device) -> bool:
    """Triton kernels on CUDA unless the config says torch; on the CPU only when asked (interpreter)."""
    return cfg.kernels == "triton" or (cfg.kernels == "auto" and device.type == "cuda")


def build_engine(cfg: ExecutorConfig, progress: ProgressCallback = lambda stage, done, total: None) -> Engine:
    """Everything the executor needs before its first plan; ``progress(stage, done, total)`` reports it."""
    device = resolve_device(cfg.device)
    dtype = getattr(torch, cfg.resolved_dtype())
    model, mcfg = load_model(model_path(cfg, progress), cfg.load_format, device, dtype, progress_cb=progress)
    max_len = min(cfg.max_model_len or mcfg.max_model_len, mcfg.max_model_len)
    max_blocks = -(-max_len // cfg.block_size)
    triton = uses_triton(cfg, device)
    graph_max_batch = (cfg.cuda_graph_max_batch or cfg.num_slots) if triton and cfg.cuda_graphs else 0
    if triton:
        from executor_proc.backends.triton_backend import install_triton_kernels
        from kernels.sampling import sample
        tune_max_m = graph_max_batch if device.type == "cuda" else 0
        progress("tuning linear kernels", 0, 1)
        install_triton_kernels(model, max_len, cfg.num_slots + 1, device, tune_max_m=tune_max_m)
        progress("tuning linear kernels", 1, 1)
    else:
        from kernels.sampling_ref import sample
    per_block = kv_cache_bytes_per_block(mcfg, cfg.block_size, dtype)
    num_blocks = cfg.num_kv_blocks or _auto_num_blocks(cfg, device, per_block, cfg.num_slots * max_blocks)
    progress("kv_cache", 0, 1)
    kv = KVCache(mcfg, num_blocks, cfg.block_size, device=device, dtype=dtype)
    progress("kv_cache", 1, 1)
    worker = Worker(model, kv, SlotTables(cfg.num_slots, max_blocks, device), cfg.block_size, device, sample,
                    graph_max_batch=graph_max_batch, capture_graphs=device.type == "cuda")
    worker.capture_graphs(lambda done, total: progress(GRAPH_STAGE, done, total))
    return Engine(worker, mcfg, num_blocks, max_len, device)


def model_path(cfg: ExecutorConfig, progress: ProgressCallback) -> str:
    """The folder or file to load; the default model ("") is converted from its GGUF file on first use."""
    if cfg.model:
        return cfg.model
    from executor_proc.model.default_model import ensure_default_model

    progress("preparing the default model", 0, 1)
    folder = ensure_default_model()
    progress("preparing the default model", 1, 1)
    return folder


def _auto_num_blocks(cfg: ExecutorConfig, device: torch.device, per_block: int, useful: int) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.kv_memory_fraction)
    else:
        budget = CPU_KV_BUDGET_BYTES
    return max(1, min(useful, budget // per_block))
