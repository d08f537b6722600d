"""The one place that chooses the executor's backend (torch or Triton) from the config and the device."""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from executor_proc.backends.base import Backend
from executor_proc.backends.torch_backend import TorchBackend
from executor_proc.model.quantization import is_quantized
from ipc.config import ExecutorConfig

ProgressCallback = Callable[[str, int, int], None]


def uses_triton(cfg: ExecutorConfig, device: torch.device) -> bool:
    """Triton kernels on CUDA unless the config says torch; on the CPU only when asked (interpreter)."""
    return cfg.kernels == "triton" or (cfg.kernels == "auto" and device.type == "cuda")


def select_backend(cfg: ExecutorConfig, device: torch.device, model, max_positions: int,
                   progress: ProgressCallback = lambda stage, done, total: None) -> Backend:
    """The backend for ``model`` (a :class:`executor_proc.model.llama.CausalLM` on ``device``).

    Triton on CUDA (``kernels: auto``) or when asked: its decode workspace holds
    ``num_slots + 1`` rows (the padding slot; speculation's steps run up to ``K + 2`` times as many with fewer
    splits), and on CUDA with graphs its linears
    are tuned for the sizes of :func:`tuned_sizes`: 1, 2, 4, 8, 16 rows (skinny matmul and the fused norm / SiLU /
    rotary matmuls), 16, 32, ... up to the largest graph (tiled matmul; at 16 the faster of the two is kept), and the
    layers' norms are folded into
    the matmuls after them (:func:`folds_norms`) before the weights are quantized (:func:`quantize`), each
    tuning phase reported through ``progress`` (its kernels compiled, then its shapes timed).  Otherwise torch.
    """
    if cfg.batch_invariant and is_quantized(model):  # --quantization fp8 is refused with the flags (ipc.config)
        raise ValueError("an FP8 checkpoint cannot run --batch-invariant: its linears change kernel (and activation "
                         "rounding) between 8 and 9 rows")
    if not uses_triton(cfg, device):
        quantize(cfg, model)
        return TorchBackend(model.rope_inv_freq)
    from executor_proc.backends.gemv_tuning import tune_all, tuner_report
    from executor_proc.backends.triton_backend import TritonBackend
    from kernels.interpreter_patch import patch_interpreter

    patch_interpreter()  # the CPU runs the kernels in Triton's interpreter (a no-op on a GPU)
    c = model.config
    check_head_dim(c.head_dim, cfg.kv_cache_dtype, device)
    # one-token rows of a forward: n-gram steps' K + 1 positions a row as decode rows, the mixed-step body's hidden
    # rows under either method
    backend = TritonBackend(model.rope_inv_freq, max_positions, c.num_heads, c.num_kv_heads, c.head_dim,
                            cfg.num_slots + 1, device, batch_invariant=cfg.batch_invariant,
                            max_decode_rows=(cfg.num_slots + 1) * cfg.speculative.values_per_slot())
    if folds_norms(cfg) and not is_quantized(model):  # FP8 from the checkpoint: a fold would re-quantize
        model.fold_norms()
        backend.norms_folded = True
    quantize(cfg, model)  # after the fold (the folded weights are what is quantized), before the tuning
    small, wide = tuned_sizes(cfg, backend, device)
    if small:
        tune_all(backend, model, small, wide, progress)
    if os.environ.get("FORERUN_TUNER_LOG"):  # which kernels this process runs (benchmarks keep it with their results)
        with open(os.environ["FORERUN_TUNER_LOG"], "w") as f:
            json.dump(tuner_report(backend), f, indent=1)
    return backend


def check_head_dim(head_dim: int, kv_cache_dtype: str, device: torch.device) -> None:
    """The attention kernels' heads: at most 256 values, and on a GPU an FP8 cache's at least 32 (its keys are read
    as two halves of even and odd values, each a matrix product's depth of 16 at least); ValueError otherwise."""
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim}: the attention kernels take heads of up to 256 values")
    if kv_cache_dtype == "fp8" and device.type == "cuda" and head_dim < 32:
        raise ValueError(f"--kv-cache-dtype fp8 needs a head_dim of 32 or more on the GPU, this model's is {head_dim}")


def quantize(cfg: ExecutorConfig, model) -> None:
    """``quantization: fp8``: the model's layer weights in FP8 (:mod:`executor_proc.model.quantization`)."""
    if cfg.quantization == "fp8" and not is_quantized(model):  # an FP8 checkpoint is FP8 already
        from executor_proc.model.quantization import quantize_model

        quantize_model(model)


def folds_norms(cfg: ExecutorConfig) -> bool:
    """Whether the Triton backend folds the layers' norms into q|k|v and gate|up (:meth:`CausalLM.fold_norms`,
    so that at 2-8 tokens the residual add and the norm ride in the matmuls: ``TritonBackend.project_out``):
    not in batch-invariant mode (one kernel per op whatever the batch), not under tensor parallelism (the
    output projections' partial sums are all-reduced before the residual add), not with
    ``FORERUN_FOLD_NORMS=0`` (the benchmarks' baseline)."""
    return not cfg.batch_invariant and cfg.tensor_parallel_size == 1 and os.environ.get("FORERUN_FOLD_NORMS") != "0"


def tuned_sizes(cfg: ExecutorConfig, backend: Backend, device: torch.device) -> tuple[list[int], list[int]]:
    """The row counts the start-up tunes the linears for (none: no tuning): ``small`` for the skinny and fused
    kernels (1, 2, 4, 8 rows, and 16 for the "dot" forms of 9-16), ``wide`` for the tiled matmul (the decode
    graphs' larger buckets).  A speculative step runs each row's K + 1 positions as decode rows, so the small
    sizes reach ``slots x (K + 1)`` rows however few the slots: one slot at K = 8 is a 9-row step (untuned, the
    default model's verify step took 1.26 ms on an H200, 0.97 tuned; 0.71 once the attention kept its splits:
    :func:`kernels.decode_attention.split_pairs`).  Batch-invariant linears are one
    kernel for every batch size: nothing to choose per size."""
    from executor_proc.backends.triton_linears import m_bucket

    graphs = graph_max_batch(cfg, backend) if device.type == "cuda" and not cfg.batch_invariant else 0
    if graphs == 0:
        return [], []
    rows = graphs * (cfg.speculative.num_tokens + 1 if cfg.speculative.method is not None else 1)
    small = [m for m in (1, 2, 4, 8) if m <= m_bucket(rows)] + ([16] if rows > 8 else [])  # keyed by bucket
    return small, [16 << i for i in range(8) if 16 << i <= m_bucket(graphs)]


def graph_max_batch(cfg: ExecutorConfig, backend: Backend) -> int:
    """The largest pure-decode step run through the decode graphs (0: none; none under ``moe_expert_counts``,
    whose tally would count a graph's padding rows)."""
    if not (backend.supports_graphs and cfg.cuda_graphs) or cfg.moe_expert_counts:
        return 0
    return cfg.cuda_graph_max_batch or cfg.num_slots


def mixed_max_tokens(cfg: ExecutorConfig, backend: Backend) -> int:
    """The largest step with prefill chunks run through the mixed-step runner (0: none; see ``mixed_graphs``)."""
    if cfg.mixed_graphs == "off" or cfg.moe_expert_counts or (
            cfg.mixed_graphs == "auto" and not graph_max_batch(cfg, backend)):
        return 0
    return min(cfg.cuda_graph_max_tokens or cfg.max_num_batched_tokens, cfg.max_num_batched_tokens)
