"""Build a ready :class:`executor_proc.step.worker.Worker` from an :class:`ExecutorConfig` (no sockets).

Load the model, choose its backend (:func:`executor_proc.backends.select.select_backend`),
size and allocate the KV cache, and capture the CUDA graphs (decode steps, and steps with
prefill chunks), timing the capture and the device memory it took.  The executor process
and the GPU benchmarks share it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from executor_proc.backends.select import graph_max_batch, mixed_max_tokens, select_backend
from executor_proc.model.config import ModelConfig
from executor_proc.model.kv_cache import KVCache, kv_cache_bytes_per_block
from executor_proc.model.loader import load_model
from executor_proc.step.host_kv import HostKV, num_host_blocks
from executor_proc.step.slot_tables import SlotTables
from executor_proc.step.worker import Worker
from ipc.config import ExecutorConfig
from kernels.precompile import STAGE as COMPILE_STAGE

CPU_KV_BUDGET_BYTES = 2 * 1024**3
GRAPH_STAGE = "capturing CUDA graphs"

ProgressCallback = Callable[[str, int, int], None]


@dataclass
class BuiltWorker:
    """The worker and the capacity it reports to the scheduler (``ExecutorReady``)."""

    worker: Worker
    model_config: ModelConfig
    num_kv_blocks: int
    max_model_len: int
    device: torch.device
    num_host_blocks: int = 0  # the host KV tier's pool (0: off)
    num_graphs: int = 0  # CUDA graphs captured at start-up
    graph_capture_s: float = 0.0  # how long capturing them took
    graph_memory_bytes: int = 0  # device memory they took (free memory before - after)
    tp: Optional[object] = None  # executor_proc.parallel.group.TPGroup when tensor_parallel_size > 1


def resolve_device(name: str) -> torch.device:
    """The device, with an explicit index for CUDA (made current)."""
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    return device


def build_worker(cfg: ExecutorConfig, progress: ProgressCallback = lambda stage, done, total: None) -> BuiltWorker:
    """Everything the executor needs before its first plan; ``progress(stage, done, total)`` reports it.

    With ``tensor_parallel_size > 1`` this is one rank's worker: it joins the group first, loads its
    shard, and sizes its KV cache (its KV heads only) and host pool to the smallest any rank can hold.
    """
    tp_size = cfg.tensor_parallel_size
    tp = None
    if tp_size > 1:
        from executor_proc.parallel.group import init_group, rank_device

        device = resolve_device(rank_device(cfg.device, cfg.tp_rank))
        tp = init_group(cfg.tp_init_method, cfg.tp_rank, tp_size, device)
    else:
        device = resolve_device(cfg.device)
    dtype = getattr(torch, cfg.resolved_dtype())
    model, mcfg = load_model(model_path(cfg, progress), cfg.load_format, device, dtype, progress_cb=progress, tp=tp)
    max_len = min(cfg.max_model_len or mcfg.max_model_len, mcfg.max_model_len)
    max_blocks = -(-max_len // cfg.block_size)
    backend = select_backend(cfg, device, model, max_len, progress)
    model.use_backend(backend)
    per_block = kv_cache_bytes_per_block(model.config, cfg.block_size, dtype)  # the rank's KV heads
    num_blocks = cfg.num_kv_blocks or _auto_num_blocks(cfg, device, per_block, cfg.num_slots * max_blocks)
    # A host pool costs per_block on every rank: its budget is the whole group's.
    host_blocks = num_host_blocks(cfg, device, per_block * tp_size)
    if tp is not None:
        num_blocks, host_blocks = tp.agree_min(num_blocks), tp.agree_min(host_blocks)
    progress("kv_cache", 0, 1)
    kv = KVCache(model.config, num_blocks, cfg.block_size, device=device, dtype=dtype)
    progress("kv_cache", 1, 1)
    host_kv = None
    if host_blocks:
        progress("host_kv_cache", 0, 1)
        # Only rank 0 reports which backups are done: the other ranks' are ordered before their later steps.
        host_kv = HostKV(kv, host_blocks, device, backup_stream=cfg.host_kv_backup_stream and cfg.tp_rank == 0)
        progress("host_kv_cache", 1, 1)
    tables = SlotTables(cfg.num_slots, max_blocks, device, mcfg.vocab_size)
    max_batch = graph_max_batch(cfg, backend)
    worker = Worker(model, kv, tables, cfg.block_size, device, graph_max_batch=max_batch,
                    capture_graphs=device.type == "cuda" and max_batch > 0, host_kv=host_kv,
                    mixed_max_tokens=mixed_max_tokens(cfg, backend))
    num_graphs, capture_s, graph_bytes = _capture_graphs(
        worker, device, lambda done, total: progress(GRAPH_STAGE, done, total),
        lambda done, total: progress(COMPILE_STAGE, done, total))
    return BuiltWorker(worker, mcfg, num_blocks, max_len, device, host_blocks, num_graphs=num_graphs,
                       graph_capture_s=capture_s, graph_memory_bytes=graph_bytes, tp=tp)


def _capture_graphs(worker: Worker, device: torch.device, progress, compile_progress) -> tuple[int, float, int]:
    """Compile every graph's kernels, then capture them; (how many, seconds, device bytes taken)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()  # what the allocator caches counts as free: the graphs' pool is what they add
    free = torch.cuda.mem_get_info(device)[0] if cuda else 0
    t0 = time.perf_counter()
    worker.capture_graphs(progress, compile_progress=compile_progress)
    seconds = time.perf_counter() - t0
    if cuda:
        torch.cuda.empty_cache()  # the compile pass's scratch graphs are gone: their memory goes back
    taken = free - torch.cuda.mem_get_info(device)[0] if cuda else 0
    return worker.num_graphs, seconds, max(0, taken)


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
        torch.cuda.empty_cache()  # the tuner's scratch, still cached by the allocator, counts as free
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.kv_memory_fraction)
    else:
        budget = CPU_KV_BUDGET_BYTES
    return max(1, min(useful, budget // per_block))
