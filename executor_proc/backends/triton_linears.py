"""Which kernel serves a linear, and the chains around one, at a step's rows (the Triton backend's matmul half).

``linear`` is cuBLAS, or the Triton skinny matmul (:mod:`kernels.gemv`) for the (shape, batch) pairs where
:func:`executor_proc.backends.gemv_tuning.tune_linears` measured it faster on this GPU, or the tiled matmul above 8
rows where it won.  At one token, ``norm_linear`` and ``silu_linear`` fold the norm (with its residual add) or the
SiLU-mul into the skinny matmul's loads (:func:`kernels.gemv_row.gemv_prologue`: one launch instead of two), and
``qkv_rotate_store`` also takes the rotary and the cache write as the q|k|v matmul's epilogue
(:func:`kernels.gemv_qkv.qkv_rope`: one launch instead of three).  At 2-16 tokens ``qkv_rotate_store`` takes the
rotary and cache write as the epilogue and ``mlp`` the SiLU-mul as gate|up's (:func:`kernels.gemv.gemv_silu`), each
where :func:`executor_proc.backends.gemv_tuning.tune_prologues` measured it faster for that weight and batch size
(otherwise the ops one by one); and with the layers' norms folded into q|k|v and gate|up (``norms_folded``,
:meth:`executor_proc.model.llama.CausalLM.fold_norms`) the norms are not launched at all: ``project_out`` (o and
down) adds the residual in the matmul's epilogue and leaves partial sums of squares, from which q|k|v and gate|up
scale their sums by the norm's rsqrt (:func:`kernels.gemv.gemv_residual`).  FP8 weights (:mod:`kernels.fp8`) run
every one of these skinny and fused kernels on their e4m3 values (widened in registers, the per-channel scales
applied to the sums) up to 8 rows, and W8A8 above (:mod:`kernels.matmul_fp8`), where the norm before q|k|v and
gate|up and the SiLU-mul before down write their output as FP8 rows with scales (one launch each, no model-dtype
copy).  With ``batch_invariant`` every linear is :func:`kernels.matmul.invariant_matmul` (one tile shape and one
split of K per weight, whatever the number of rows).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from executor_proc.backends.base import (NO_SCALE, KVScale, NormInput, Stream, normed, unfused_norm_linear,
                                         unfused_project_out, unfused_qkv_rotate_store, unfused_silu_linear)
from kernels import gemv as skinny
from kernels.activation import silu_and_mul_fp8
from kernels.fp8 import W8A16_MAX_ROWS, Fp8Weight
from kernels.gemv_partials import sumsq_fits
from kernels.gemv_qkv import qkv_rope, rope_pairs
from kernels.gemv_row import gemv_prologue
from kernels.matmul import MatmulConfig, choose_config, invariant_matmul
from kernels.matmul_fp8 import Fp8MatmulConfig, w8a8_linear, w8a8_quantized
from kernels.norm import rms_norm_fp8

__all__ = ["TritonLinears", "GemvConfig", "ONE_TOKEN_KINDS", "FP8_GEMV_DEFAULT", "skinny_rows", "m_bucket"]

GemvConfig = tuple
# The fused kernels the tuner may pick.  At one token "qkv", "norm" and "silu" fold the norm / SiLU-mul into the
# matmul's loads (every program re-reads the row: at 2+ tokens that cost more than the launch it saves on an H100);
# at 2-16 tokens "rope" and "gate_silu" are epilogues (rotary + cache write after q|k|v; SiLU-mul after gate|up).
ONE_TOKEN_KINDS = ("qkv", "norm", "silu")
# An FP8 weight's skinny matmul where the tuner chose none: [2-8 rows, one row] ("dot" at 2-8: the norm from
# partial sums needs it).
FP8_GEMV_DEFAULT = (("dot", 16, 256, 4, 4), ("row", 8, 512, 4, 4))


def skinny_rows(weight: torch.Tensor) -> int:
    """The most rows the skinny kernels serve for this weight: 16 ("dot" forms; "row" forms to 8), an FP8 weight
    :data:`kernels.fp8.W8A16_MAX_ROWS` (W8A8 above)."""
    return W8A16_MAX_ROWS if isinstance(weight, Fp8Weight) else skinny.MAX_M


def m_bucket(m: int) -> int:
    """The batch size a skinny-matmul choice is keyed by: the next power of two."""
    return 1 << max(0, m - 1).bit_length()


class TritonLinears:
    """The linears and their chains; the start-up tuner fills the choice tables (absent: cuBLAS, or unfused).  A
    mixin of :class:`executor_proc.backends.triton_backend.TritonBackend`, whose ``batch_invariant``, rotary table
    and ``rotate_and_store`` (the unfused chain's last op) it uses; ``plan`` is that backend's TritonPlan."""

    batch_invariant: bool
    cos_sin: torch.Tensor

    def __init__(self) -> None:
        # (N, K, m_bucket) -> skinny-matmul config; absent: cuBLAS.
        self.gemv_choice: dict[tuple[int, int, int], GemvConfig] = {}
        self.gemv_everywhere: Optional[GemvConfig] = None  # tests: force the Triton path
        # (N, K, m_bucket) -> tiled-matmul config for batches above 8 (where no skinny one serves); absent: cuBLAS.
        self.matmul_choice: dict[tuple[int, int, int], MatmulConfig] = {}
        # FP8 weights above 8 rows: (N, K, m_bucket) -> the Triton W8A8 kernel's config; absent: cuBLASLt.
        self.fp8_matmul_choice: dict[tuple[int, int, int], Fp8MatmulConfig] = {}
        # (kind, N, K, m_bucket) -> the config of a fused kernel (ONE_TOKEN_KINDS at m 1, "rope" and "gate_silu"
        # at 2-16); absent: unfused.
        self.prologue_choice: dict[tuple[str, int, int, int], GemvConfig] = {}
        # tests and tuning: force these kinds' fused kernels to these configs wherever they fit
        self.prologue_everywhere: Optional[dict[str, GemvConfig]] = None
        self.prologue_timings: dict = {}
        self.gemv_timings: dict = {}  # what the tuner measured (benchmarks report it)
        # Batch-invariant mode: each weight's kernel, by shape.
        self.matmul_config: dict[tuple[int, int], MatmulConfig] = {}
        # CausalLM.fold_norms ran (the layers' norm weights are in q|k|v and gate|up): at 2-16 tokens the output
        # projections add the residual and q|k|v and gate|up apply the norm themselves (project_out)
        self.norms_folded = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if isinstance(weight, Fp8Weight):
            return self._fp8_linear(x, weight, bias)
        if self.batch_invariant:
            shape = (weight.shape[0], weight.shape[1])
            config = self.matmul_config.get(shape) or self.matmul_config.setdefault(
                shape, choose_config(*shape, self.device))
            return invariant_matmul(x, weight, bias, config=config)
        config = self._gemv_config(x, weight)
        if config is not None:
            return skinny.gemv(x, weight, bias, config=config)
        tiled = self._tiled_config(x, weight)
        if tiled is not None:
            return invariant_matmul(x, weight, bias, config=tiled)  # invariant, and here simply faster
        return F.linear(x, weight, bias)

    def _fp8_linear(self, x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Up to 8 rows the skinny matmul on the FP8 weight (W8A16); above, W8A8 on the FP8 tensor cores with the
        tuned kernel (cuBLASLt where none was tuned: prefill)."""
        m = x.shape[0]
        if m <= W8A16_MAX_ROWS:
            x = x.contiguous()
            return skinny.gemv(x, weight, bias, config=self._gemv_config(x, weight) or FP8_GEMV_DEFAULT[m == 1])
        return w8a8_linear(x, weight, bias, config=self._w8a8_config(weight, m))

    @staticmethod
    def _quantized_input(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the linear of ``weight`` at x's rows runs W8A8 (an FP8 weight above ``W8A16_MAX_ROWS`` rows), so
        that the kernel making its input may hand it over quantized (:meth:`_w8a8`)."""
        return isinstance(weight, Fp8Weight) and x.shape[0] > W8A16_MAX_ROWS

    def _w8a8(self, xq: torch.Tensor, xs: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor],
              out_dtype: torch.dtype) -> torch.Tensor:
        """:meth:`_fp8_linear`'s W8A8 product of rows the norm or the SiLU-mul quantized in its own launch."""
        return w8a8_quantized(xq, xs, weight, bias, self._w8a8_config(weight, xq.shape[0]), out_dtype)

    def _w8a8_config(self, weight: Fp8Weight, m: int) -> Optional[Fp8MatmulConfig]:
        """The tuned W8A8 kernel for this weight at ``m`` rows, or None (cuBLASLt)."""
        return self.fp8_matmul_choice.get((*weight.shape, m_bucket(m)))

    def _tiled_config(self, x: torch.Tensor, weight: torch.Tensor) -> Optional[MatmulConfig]:
        """The tiled matmul's config for this weight at x's rows (above 8), or None (cuBLAS)."""
        m = x.shape[0]
        return self.matmul_choice.get((weight.shape[0], weight.shape[1], m_bucket(m))) if m > 8 else None

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits, written by the matmul itself (a Triton kernel's store, or cuBLAS with a
        float32 output on CUDA): no separate cast launch, and no rounding to the model dtype on the way."""
        gemv, tiled = (None, None) if self.batch_invariant else (self._gemv_config(hidden, weight),
                                                                 self._tiled_config(hidden, weight))
        if gemv is None and tiled is None and not self.batch_invariant and hidden.is_cuda \
                and isinstance(weight, torch.Tensor) and weight.dtype in (torch.bfloat16, torch.float16):
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)  # where linear would call cuBLAS
        if gemv is None and tiled is None:
            return self.linear(hidden, weight, None).float()
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device)
        if gemv is not None:
            return skinny.gemv(hidden, weight, None, config=gemv, out=out)
        return invariant_matmul(hidden, weight, None, config=tiled, out=out)

    def _gemv_config(self, x: torch.Tensor, weight: torch.Tensor) -> Optional[GemvConfig]:
        """The skinny GEMV's config for this weight at x's rows, or None (the tiled matmul or cuBLAS)."""
        m = x.shape[0]
        if m > skinny_rows(weight) or x.stride(1) != 1:
            return None
        config = self.gemv_everywhere or self.gemv_choice.get((weight.shape[0], weight.shape[1], m_bucket(m)))
        if config is None and isinstance(weight, Fp8Weight):  # no cuBLAS for W8A16: the untuned default
            config = FP8_GEMV_DEFAULT[m == 1]
        return config if config is not None and skinny.config_fits(config, m) else None

    def norm_linear(self, pre: NormInput, weight: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self._quantized_input(pre.x, weight) and pre.sumsq is None:  # the norm writes FP8 rows and their scales
            xq, xs, residual = rms_norm_fp8(pre.x, pre.weight, pre.eps, pre.residual)
            return self._w8a8(xq, xs, weight, bias, pre.x.dtype), residual
        config = self._fused_config("norm", pre.x, weight)
        if config is None:
            linear = self._gemv_config(pre.x, weight) if pre.sumsq is not None else None
            if linear is not None and linear[0] in ("dot", "dotT"):  # the norm from the partial sums
                return skinny.gemv(pre.x, weight, bias, config=linear, sumsq=(pre.sumsq, pre.eps)), pre.x
            return unfused_norm_linear(self, pre, weight, bias)
        return gemv_prologue(pre.x, weight, bias, config=config, norm=(pre.weight, pre.eps), residual=pre.residual)

    def qkv_rotate_store(self, pre: NormInput, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         k_cache: torch.Tensor, v_cache: torch.Tensor, plan: Any,
                         kv_scale: KVScale = NO_SCALE) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the tuner chose it: at one token norm, matmul, rotary and cache write in one launch, at 2-16
        the norm and then the rest in one launch (:func:`kernels.gemv_qkv.qkv_rope`)."""
        rope = dict(positions=plan.positions, cos_sin_cache=self.cos_sin, k_cache=k_cache, v_cache=v_cache,
                    kv_index=plan.kv_index, kv_scale=kv_scale)
        head_dim = k_cache.shape[3]
        config = self._fused_config("qkv", pre.x, weight)
        if config is not None and rope_pairs(config, head_dim):
            return qkv_rope(pre.x, weight, bias, config=config, norm=(pre.weight, pre.eps), residual=pre.residual,
                            **rope)
        config = self._fused_config("rope", pre.x, weight)
        if config is None or not rope_pairs(config, head_dim):
            return unfused_qkv_rotate_store(self, pre, weight, bias, k_cache, v_cache, plan, kv_scale)
        if pre.sumsq is not None:  # the norm from the partial sums (its weight is folded into q|k|v)
            return qkv_rope(pre.x, weight, bias, config=config, norm=None, residual=None, sumsq=(pre.sumsq, pre.eps),
                            **rope)[0], pre.x
        h, residual = normed(self, pre)
        return qkv_rope(h, weight, bias, config=config, norm=None, residual=None, **rope)[0], residual

    def mlp(self, pre: NormInput, gate_up: tuple, down: tuple) -> Stream:
        """Where the tuner chose it (2-16 tokens): the norm (or, after a residual epilogue, the partial sums of
        squares), then gate|up with SiLU-mul as its epilogue (:func:`kernels.gemv.gemv_silu`), then down
        through :meth:`project_out`; otherwise :meth:`norm_linear` and :meth:`silu_linear`."""
        config = self._fused_config("gate_silu", pre.x, gate_up[0])
        if config is None:  # with this backend's own one-token fusions, and FP8 rows quantized where made
            h, residual = self.norm_linear(pre, *gate_up)
            if self._quantized_input(h, down[0]):
                return Stream(self._w8a8(*silu_and_mul_fp8(h), *down, h.dtype), residual)
            if self._fused_config("silu", h, down[0]) is not None:
                return Stream(self.silu_linear(h, *down), residual)
            return self.project_out(self.silu_and_mul(h), *down, residual)
        if pre.sumsq is not None:  # the norm's weight is folded into gate|up
            return self.project_out(skinny.gemv_silu(pre.x, *gate_up, config=config, sumsq=(pre.sumsq, pre.eps)),
                                    *down, pre.x)
        h, residual = normed(self, pre)
        return self.project_out(skinny.gemv_silu(h, *gate_up, config=config), *down, residual)

    def project_out(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    residual: torch.Tensor) -> Stream:
        """With the norms folded, at 2-16 tokens and where a skinny matmul serves this weight: the residual
        added in its epilogue, with the partial sums of squares the next q|k|v or gate|up normalises by
        (:func:`kernels.gemv.gemv_residual`): the next norm's launch saved.  Otherwise the plain matmul."""
        m = x.shape[0]
        config = self._gemv_config(x, weight) if self.norms_folded and 1 < m else None
        if config is None or not sumsq_fits(config, weight.shape[0], m):
            return unfused_project_out(self, x, weight, bias, residual)
        h, sumsq = skinny.gemv_residual(x, weight, bias, residual, config=config)
        return Stream(h, sumsq=sumsq)

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        config = self._fused_config("silu", gate_up, weight)
        if config is None:
            return unfused_silu_linear(self, gate_up, weight, bias)
        return gemv_prologue(gate_up, weight, bias, config=config, silu=True)[0]

    def _fused_config(self, kind: str, x: torch.Tensor, weight: torch.Tensor) -> Optional[GemvConfig]:
        """The fused kernel's config for this weight at x's rows (key ``(kind, N, K, m_bucket)``), or None:
        not chosen, batch-invariant, a kind not for this many rows (``ONE_TOKEN_KINDS`` at one, the
        epilogues at 2 to :func:`skinny_rows`), or a config that does not fit them."""
        m = x.shape[0]
        if self.batch_invariant or not 0 < m <= skinny_rows(weight) or not x.is_contiguous():
            return None
        if (m == 1) != (kind in ONE_TOKEN_KINDS):
            return None
        if self.prologue_everywhere is not None:
            config = self.prologue_everywhere.get(kind)
        else:
            config = self.prologue_choice.get((kind, weight.shape[0], weight.shape[1], m_bucket(m)))
        return config if config is not None and skinny.config_fits(config, m) else None
