"""The RMSNorm between two skinny matmuls without a launch of its own (:mod:`kernels.gemv`, 2-16 rows).

The projection before the norm adds the residual in its epilogue and stores, per program, the partial
sums of the squares of what it stored (:func:`kernels.gemv.gemv_residual`); the projection after it (its
weight times the norm's weight, :meth:`executor_proc.model.llama.CausalLM.fold_norms`) takes the
un-normalised stream, loads those sums right after its PDL wait and scales its float32 sums by
``rsqrt(mean + eps)`` after its loop (``sumsq=`` of :func:`kernels.gemv.gemv` in its "dot" forms,
:func:`kernels.gemv.gemv_silu` and :func:`kernels.gemv_qkv.qkv_rope`).  The pieces those kernels share are
here: :func:`_load_residual` and :func:`_store_rows` (the producer's epilogue), :func:`_load_partials` and
:func:`_partials_rstd` (the consumer's norm), and how many sums a producer leaves.
Squares summed in the consumer's loop or by every consumer program from x cost as much as the launch saves
(measured); on an H100 the producer's epilogue costs 0.2-0.4 us and the consumer's load 0-1 us, against
1.3-1.6 us for the norm's launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["SUMSQ_MAX", "loads_at_once", "sumsq_fits", "sumsq_programs"]

SUMSQ_MAX = 4096  # partial sums of squares one program of the next matmul reads at once (gemv_residual)


@triton.jit
def _load_residual(r_ptr, stride_rm, offs_m, offs_n, m_mask, n_mask, RESIDUAL: tl.constexpr):
    """The residual tile :func:`_store_rows` adds (unused without ``RESIDUAL``), loaded right after the PDL wait so
    that its latency hides behind the weight stream, not in the program's tail."""
    mask = m_mask[:, None] & n_mask[None, :] & RESIDUAL  # without it: no load (the mask folds to false)
    return tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)


@triton.jit
def _store_rows(y, r, offs_m, offs_n, m_mask, n_mask, M, y_ptr, stride_ym, ss_ptr, dt: tl.constexpr,
                RESIDUAL: tl.constexpr):
    """Store the float32 sums ``y [rows, features]`` rounded as F.linear rounds (into a float32 ``y_ptr``, as they
    are: the LM head's logits, as cuBLAS writes them with a float32 output).  ``RESIDUAL``: plus the
    residual tile ``r`` (rounded as :func:`kernels.norm.fused_add_rms_norm` rounds the add), and this
    program's partial sums of the stored values' squares, one per row, to ``ss [programs, M]``."""
    mask = m_mask[:, None] & n_mask[None, :]
    if RESIDUAL or y_ptr.dtype.element_ty != tl.float32:  # a float32 out (the LM head's logits): the sums unrounded
        y = y.to(dt)
    if RESIDUAL:
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
        h = tl.where(mask, y.to(tl.float32), 0.0)
        tl.store(ss_ptr + tl.program_id(0) * M + offs_m, tl.sum(h * h, axis=1), mask=m_mask)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_partials(ss_ptr, P, M, ROWS: tl.constexpr, P_PAD: tl.constexpr):
    """The producer's partial sums of squares ``ss [P, M]`` (:func:`_store_rows`) as a ``[P_PAD, ROWS]`` tile;
    loaded right after the PDL wait, summed after the loop (:func:`_partials_rstd`)."""
    offs_p = tl.arange(0, P_PAD)
    offs_r = tl.arange(0, ROWS)
    return tl.load(ss_ptr + offs_p[:, None] * M + offs_r[None, :], mask=(offs_p < P)[:, None] & (offs_r < M)[None, :],
                   other=0.0)


@triton.jit
def _partials_rstd(ss, K, eps):
    """RMSNorm's ``rsqrt(mean(x^2) + eps)`` per row (``[ROWS]``) from :func:`_load_partials`' tile, summed in one
    fixed order; rows past M get ``rsqrt(eps)``."""
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _to_mma_rows(v, offs_m, ROWS: tl.constexpr):
    """A per-row value of the ``ROWS`` true rows (``[ROWS]``, e.g. :func:`_partials_rstd`) as a column over the
    MMA's padded rows ``offs_m`` (``[len(offs_m), 1]``; padded rows get 0)."""
    return tl.sum(tl.where(offs_m[:, None] == tl.arange(0, ROWS)[None, :], v[None, :], 0.0), axis=1)[:, None]


def sumsq_programs(config: tuple, n: int) -> int:
    """How many partial sums per row :func:`kernels.gemv.gemv_residual` leaves (one per program)."""
    return triton.cdiv(n, config[1])


def sumsq_fits(config: tuple, n: int, m: int) -> bool:
    """Whether the next matmul may read ``config``'s partial sums for ``m`` rows in one load
    (:func:`loads_at_once`)."""
    return loads_at_once(sumsq_programs(config, n), m)


def loads_at_once(programs: int, m: int) -> bool:
    """Whether ``programs`` partial sums for ``m`` rows fit one load of the consumer (a few registers per thread:
    at most ``SUMSQ_MAX`` values, padded to powers of two)."""
    return triton.next_power_of_2(programs) * triton.next_power_of_2(m) <= SUMSQ_MAX
