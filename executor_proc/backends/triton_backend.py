"""The CUDA fast path's attention backend and norm/activation ops, on the Triton kernels.

Per step, :meth:`TritonAttention.plan` only picks views and host numbers (no
device work, no host reads), so it is the same inside and outside a CUDA graph.
Per layer:

- ``rotate_and_store``: one ``rope_kv_write`` launch rotates q (in place) and k
  and writes k and v into the paged cache (``slot_mapping < 0`` skips a token:
  padded graph rows);
- ``attend``: a pure-decode step uses the split-KV ``decode_attention`` with a
  fixed number of splits per batch size and one preallocated workspace; any
  step with a prefill chunk runs every row (decode rows are rows of length 1)
  through ``prefill_attention``.

:class:`TritonOps` gives the model ``rms_norm``, ``fused_add_rms_norm``,
``silu_and_mul`` (on the fused gate|up projection) and ``linear``: cuBLAS, or
the Triton skinny matmul (:mod:`kernels.gemv`) for the (shape, batch) pairs
where :func:`tune_linears` measured it faster on this GPU.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from executor_proc.step.batch import ForwardBatch
from kernels.activation import silu_and_mul
from kernels import gemv as skinny
from kernels.decode_attention import DecodeWorkspace, decode_attention, default_num_splits
from kernels.kv_write import rope_cos_sin_cache, rope_kv_write
from kernels.norm import fused_add_rms_norm, rms_norm
from kernels.prefill_attention import prefill_attention


@dataclass
class TritonPlan:
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start: torch.Tensor
    max_query_len: int
    pure_decode: bool
    num_splits: int


class TritonAttention:
    """:class:`executor_proc.backends.torch_backend.AttentionBackend` on the Triton kernels."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, max_batch: int, device: torch.device):
        self.cos_sin = rope_cos_sin_cache(inv_freq.float().to(device), max_positions)
        self.num_kv_heads = num_kv_heads
        self.device = device
        self.workspace = DecodeWorkspace(max_batch, num_heads, head_dim, device=device)

    def plan(self, batch: ForwardBatch, rotary: torch.nn.Module, dtype: torch.dtype) -> TritonPlan:
        qlens = batch.host_query_lens
        pure_decode = batch.is_pure_decode
        rows = len(qlens)
        return TritonPlan(
            positions=batch.positions,
            slot_mapping=batch.slot_mapping,
            block_tables=batch.block_tables,
            context_lens=batch.context_lens,
            query_start=batch.query_start,
            max_query_len=max(qlens, default=0),
            pure_decode=pure_decode,
            # Fixed per batch size (never per length): one value serves a whole graph bucket.
            num_splits=default_num_splits(rows, self.num_kv_heads, self.device) if pure_decode else 1,
        )

    def rotate_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, plan: TritonPlan) -> torch.Tensor:
        return rope_kv_write(q, k, v, plan.positions, self.cos_sin, k_cache, v_cache, plan.slot_mapping, q_out=q)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TritonPlan,
               scale: float) -> torch.Tensor:
        if plan.pure_decode:
            return decode_attention(q, k_cache, v_cache, plan.block_tables, plan.context_lens, scale,
                                    workspace=self.workspace, num_splits=plan.num_splits)
        return prefill_attention(q, k_cache, v_cache, plan.block_tables, plan.query_start, plan.context_lens,
                                 plan.max_query_len, scale)


GemvConfig = tuple


def m_bucket(m: int) -> int:
    """The batch size a skinny-matmul choice is keyed by: the next power of two."""
    return 1 << max(0, m - 1).bit_length()


class TritonOps:
    """RMSNorm, fused residual-add + RMSNorm and SiLU-and-mul as single Triton launches; tuned linears."""

    def __init__(self) -> None:
        # (N, K, m_bucket) -> skinny-matmul config; absent: cuBLAS.
        self.gemv_choice: dict[tuple[int, int, int], GemvConfig] = {}
        self.gemv_everywhere: Optional[GemvConfig] = None  # tests: force the Triton path
        self.gemv_timings: dict = {}  # what the tuner measured (benchmarks report it)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        m = x.shape[0]
        if m <= 8 and x.stride(1) == 1:
            config = self.gemv_everywhere or self.gemv_choice.get((weight.shape[0], weight.shape[1], m_bucket(m)))
            if config is not None and skinny.config_fits(config, m):
                return skinny.gemv(x, weight, bias, config=config)
        return F.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
        return rms_norm(x, norm.weight, norm.eps)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(x, residual, norm.weight, norm.eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)


def install_triton_kernels(model, max_positions: int, max_batch: int, device: torch.device,
                           tune_max_m: int = 0) -> None:
    """Switch ``model`` (a :class:`executor_proc.model.CausalLM` on ``device``) to the Triton kernels.

    With ``tune_max_m`` > 0 (CUDA), the linears' kernel is chosen by :func:`tune_linears` for
    batch sizes 1, 2, 4, 8 up to it.
    """
    c = model.config
    backend = TritonAttention(model.model.rotary_emb.inv_freq, max_positions, c.num_heads, c.num_kv_heads,
                              c.head_dim, max_batch, device)
    ops = TritonOps()
    model.use_kernels(backend, ops)
    if tune_max_m > 0:
        ops.gemv_choice, ops.gemv_timings = tune_linears(model, [m for m in (1, 2, 4, 8) if m <= tune_max_m])


def _weight_groups(model) -> dict[tuple[int, int], list[torch.Tensor]]:
    """The model's decode-time weights by shape (each group is streamed layer after layer, as in a step)."""
    groups: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for w in (attn.qkv.weight, attn.o_proj.weight, mlp.gate_up.weight, mlp.down_proj.weight):
            groups[tuple(w.shape)].append(w)
    groups[tuple(model.lm_head.weight.shape)].append(model.lm_head.weight)
    return groups


def tune_linears(model, ms: list[int], reps: int = 5, margin: float = 0.97) -> tuple[dict, dict]:
    """Time cuBLAS and every fitting :data:`kernels.gemv.CONFIGS` on the model's weights; keep the
    skinny kernel where it is faster by more than ``1 - margin``.  Returns (choice, ms per pass).

    Each candidate streams all the weights of one shape (more than L2 holds, as in a real step),
    captured in a CUDA graph so that launch overhead does not count; the median of ``reps``
    passes counts.  A config that fails to compile is skipped.
    """
    choice, timings = {}, {}
    for (n, k), weights in _weight_groups(model).items():
        for m in ms:
            x = torch.randn(m, k, dtype=weights[0].dtype, device=weights[0].device)
            best_t, best = _time_pass(lambda w: F.linear(x, w), weights, reps) * margin, None
            timings[(n, k, m, "cublas")] = best_t / margin
            for config in [c for c in skinny.CONFIGS if skinny.config_fits(c, m)]:
                try:
                    t = _time_pass(lambda w: skinny.gemv(x, w, config=config), weights, reps)
                except Exception:  # a config this GPU or Triton cannot build is simply not a candidate
                    continue
                timings[(n, k, m, config)] = t
                if t < best_t:
                    best_t, best = t, config
            if best is not None:
                choice[(n, k, m)] = best
    return choice, timings


def _time_pass(fn, weights: list[torch.Tensor], reps: int) -> float:
    """Median ms of one pass over ``weights``, replayed as a CUDA graph (as in a decode step: no launch gaps)."""
    for w in weights[:2]:
        fn(w)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]
