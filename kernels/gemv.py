"""Skinny matmul for decode: ``y [M, N] = x [M, K] @ W[N, K]^T (+ b)`` with small M (<= 16).

At M = 1..8 a projection is a pure weight stream; cuBLAS's heuristics leave
some shapes at 50-60% of the copy bandwidth on an H100 (Llama-3-8B's o_proj:
21 us for 33.5 MB, 64 CTAs on 132 SMs).  One program owns ``BLOCK_N`` output
features and streams their weight rows along K in ``BLOCK_K`` chunks
(contiguous loads, ``num_stages`` in flight), accumulating in float32 and
rounding once, like cuBLAS.  Two forms:

- ``"dot"``: the M rows of x are the padded M dimension of ``tl.dot`` (any M <= 16);
- ``"dotT"``: the same with the operands swapped: BLOCK_N (64+) weight rows are the MMA's M side,
  which Hopper's warpgroup MMA takes (1-3% faster than "dot" on gate|up and the LM head at 2-8 rows
  on an H100, slower on the narrow weights: the tuner decides);
- ``"row"``: elementwise products accumulated per (feature, k lane) and reduced once
  at the end (no tensor-core layout shuffles); M = 1, or up to 8 rows sharing each
  weight chunk (the accumulators grow with M: :func:`config_fits` keeps them in
  registers).  At 2 rows it is 7-16% faster than the "dot" form and cuBLAS on the
  1B shapes on an H100 (``scripts/bench_kernels.py gemv``); at 4 and 8 rows it rarely wins
  (the tuner decides per shape).

No split-K and no atomics, so the result is deterministic.

At 2-16 rows the RMSNorm between two projections needs no launch of its own: :func:`gemv_residual` adds
the residual in the first one's epilogue and leaves partial sums of squares, from which the second applies
the norm (``sumsq=``; :mod:`kernels.gemv_partials`).  At one token the "row" form may also fold the op
before it into its loads (:mod:`kernels.gemv_row`).

Whether it beats cuBLAS depends on the shape: :func:`executor_proc.backends.triton_backend`
times both (and the configs in :data:`CONFIGS`) on the model's own weights at
start-up and keeps the faster per (N, K, M).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .gemv_partials import (_load_partials, _load_residual, _to_mma_rows, _partials_rstd, _store_rows, loads_at_once,
                            sumsq_programs)
from .fp8 import weight_args
from .gemv_row import _gemv_row_kernel, lanes
from .pdl import pdl_args, pdl_launch, pdl_wait

__all__ = ["gemv", "gemv_residual", "gemv_silu", "CONFIGS", "FP8_CONFIGS", "MAX_M"]

MAX_M = 16
ROW_MAX_M, ROW_MAX_ACC = 8, 64  # the "row" form's rows, and its float32 accumulators per thread
# (form, BLOCK_N, BLOCK_K, num_warps, num_stages); "row" configs serve M = 1 and, where their
# accumulators fit (:func:`config_fits`), up to ROW_MAX_M rows (the narrow ones are for those; two rows of a
# 2,048-wide chunk on eight warps streams the 8B's gate|up and down 2-3% faster at one token); "rowk" configs
# serve 2 to ROW_MAX_M rows.
CONFIGS = (("dot", 16, 256, 4, 4), ("dot", 16, 512, 4, 3), ("dot", 32, 256, 4, 4), ("dot", 64, 128, 4, 4),
           ("row", 4, 1024, 4, 4), ("row", 8, 512, 4, 4), ("row", 16, 512, 8, 3), ("row", 16, 256, 4, 4),
           ("row", 4, 512, 4, 4), ("row", 2, 512, 4, 6), ("row", 4, 256, 4, 6), ("row", 2, 2048, 8, 4),
           ("rowk", 4, 512, 4, 4), ("rowk", 8, 256, 4, 4), ("rowk", 4, 1024, 4, 3), ("rowk", 2, 1024, 4, 4),
           ("dotT", 64, 128, 4, 4), ("dotT", 64, 256, 4, 3), ("dotT", 128, 128, 4, 3), ("dotT", 64, 64, 4, 6),
           ("dotT", 128, 64, 8, 4))
# More "row" candidates for FP8 weights (kernels/fp8.py): a byte per value, so twice the values per chunk keep each
# thread's loads 16 bytes wide.
FP8_CONFIGS = (("row", 4, 2048, 4, 4), ("row", 2, 2048, 4, 6), ("row", 8, 2048, 8, 3), ("row", 2, 4096, 8, 4),
               ("row", 1, 2048, 4, 8), ("row", 8, 1024, 4, 3))


@triton.jit
def _rows_tile(x_ptr, w_ptr, M, N, stride_xm, stride_wn, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's BLOCK_N features and the M (padded) rows of x: offsets, masks, row pointers."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    return offs_n, offs_m, offs_n < N, offs_m < M, w_rows, x_rows


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, r_ptr, ss_ptr, M, N, K, P, stride_xm, stride_wn, stride_ym,
                 stride_rm, eps, HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr,
                 DOT_PREC: tl.constexpr, SWAP: tl.constexpr = False, SILU: tl.constexpr = False,
                 RESIDUAL: tl.constexpr = False, NORM_ROWS: tl.constexpr = 0, P_PAD: tl.constexpr = 1,
                 NORM_FIRST: tl.constexpr = False, W_SCALED: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """The "dot" form (``SWAP``: "dotT").  ``W_SCALED``: w is FP8 with per-row scales at ``ws``
    (:mod:`kernels.fp8`), widened for the MMA (:func:`_mma_operands`), the sums scaled after the loop.  ``SILU``:
    w is gate|up ``[2N, K]``; the program also streams the up rows of its N features and stores
    ``silu(gate) * up`` (each rounded as the unfused ops round).
    ``RESIDUAL``: see :func:`_store_rows`.  ``NORM_ROWS`` (> 0: the rows padded to a power of two): x is
    the residual stream before an RMSNorm folded into w, and each row's accumulators are scaled by the
    norm's ``rsqrt`` from the ``P`` partial sums at ``ss`` after the loop.  The sums are loaded right after
    the PDL wait and held through the loop, or (``NORM_FIRST``: kernels at the register limit, where holding
    them costs more) summed before it."""
    offs_n, offs_m, n_mask, m_mask, w_rows, x_rows = _rows_tile(x_ptr, w_ptr, M, N, stride_xm, stride_wn, M_PAD,
                                                                BLOCK_N)
    if SWAP:
        acc_t = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    if SILU:
        if SWAP:
            acc_up_t = tl.zeros([BLOCK_N, M_PAD], tl.float32)
        else:
            acc_up = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    ws = _load_scales(ws_ptr, offs_n, n_mask, W_SCALED)
    # No weight prefetch before the wait here: peeling the first chunk out of the loop made this kernel
    # 8-23% slower on an H100 (scripts/bench_kernels.py gemv), more than PDL's overlap gives back.
    pdl_wait(USE_PDL)
    r = _load_residual(r_ptr, stride_rm, offs_m, offs_n, m_mask, n_mask, RESIDUAL)
    if NORM_ROWS > 0:
        ss = _load_partials(ss_ptr, P, M, NORM_ROWS, P_PAD)
        if NORM_FIRST:
            ss = _partials_rstd(ss, K, eps)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        x, w = _mma_operands(x, w, W_SCALED, SWAP)
        if SWAP:  # the weight rows as the MMA's M side (64+: Hopper's warpgroup MMA), the rows of x as its N
            acc_t += tl.dot(w, tl.trans(x), input_precision=DOT_PREC)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
        if SILU:  # x is in the MMA's dtype now (_mma_operands); the up rows go the gate rows' way
            w_up = tl.load(w_rows + N * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if SWAP:
                acc_up_t += tl.dot(w_up.to(x.dtype), tl.trans(x), input_precision=DOT_PREC)
            else:
                acc_up += tl.dot(x, tl.trans(w_up.to(x.dtype)), input_precision=DOT_PREC)
    pdl_launch(USE_PDL)
    if SWAP:
        acc = tl.trans(acc_t)
        if SILU:
            acc_up = tl.trans(acc_up_t)
    if W_SCALED:
        acc = acc * ws[None, :]
        if SILU:
            acc_up = acc_up * _load_scales(ws_ptr + N, offs_n, n_mask, W_SCALED)[None, :]
    if NORM_ROWS > 0:  # the norm's scale, widened from the true rows to the MMA's padded ones
        rstd = _to_mma_rows(ss if NORM_FIRST else _partials_rstd(ss, K, eps), offs_m, NORM_ROWS)
        acc = acc * rstd
        if SILU:
            acc_up = acc_up * rstd
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dt = x_ptr.dtype.element_ty
    if SILU:
        if HAS_BIAS:
            acc_up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        g = acc.to(dt).to(tl.float32)  # gate|up as the unfused matmul stores it, then kernels/activation.py
        acc = g / (1.0 + tl.exp(-g)) * acc_up.to(dt).to(tl.float32)
    _store_rows(acc, r, offs_m, offs_n, m_mask, n_mask, M, y_ptr, stride_ym, ss_ptr, dt, RESIDUAL)


@triton.jit
def _mma_operands(x, w, W_SCALED: tl.constexpr, SWAP: tl.constexpr):
    """x and a weight chunk as the MMA takes them: in the "dotT" form an FP8 weight under bfloat16 activations both
    in float16 (e4m3 widens to float16 in one conversion, to bfloat16 through float32; float16 holds a bfloat16
    value with more mantissa, within +-65,504, where x is clamped); else the weight in x's dtype.  H200, 8B
    shapes, 2-8 rows: "dotT" gate|up 42.7 -> 34.6 us, q|k|v 15.0 -> 13.1 us; "dot" loses with float16 (o, down)."""
    if SWAP and W_SCALED and x.dtype == tl.bfloat16:
        return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16), w.to(tl.float16)
    else:
        return x, w.to(x.dtype)


@triton.jit
def _load_scales(ws_ptr, offs_n, n_mask, W_SCALED: tl.constexpr):
    """The FP8 weight's per-row scales of this program's features (``W_SCALED``; else ones, unread)."""
    return tl.load(ws_ptr + offs_n, mask=n_mask & W_SCALED, other=1.0)


@triton.jit
def _rows_products(w, x):
    """[rows, features, k lanes]: a weight chunk times each of x's rows, float32."""
    return w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, r_ptr, ss_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      stride_rm, HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EACH: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                      W_SCALED: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """The "row" form for 2..``ROW_MAX_M`` rows: each weight chunk is loaded once and multiplied into every
    row's (feature, k lane) accumulator; one reduction over the lanes at the end ("rowk", ``EACH``: a
    reduction per chunk into [rows, features] instead: fewer registers, more shuffles).  ``RESIDUAL``:
    see :func:`_store_rows`."""
    offs_n, offs_m, n_mask, m_mask, w_rows, x_rows = _rows_tile(x_ptr, w_ptr, M, N, stride_xm, stride_wn, M_PAD,
                                                                BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    ws = _load_scales(ws_ptr, offs_n, n_mask, W_SCALED)
    pdl_wait(USE_PDL)  # as in the one-row kernel: the first weight chunk streams in before x is ready
    x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    r = _load_residual(r_ptr, stride_rm, offs_m, offs_n, m_mask, n_mask, RESIDUAL)
    acc = _rows_products(w, x)
    if EACH:
        acc = tl.sum(acc, axis=2)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if EACH:
            acc += tl.sum(_rows_products(w, x), axis=2)
        else:
            acc += _rows_products(w, x)
    pdl_launch(USE_PDL)
    if EACH:
        y = acc
    else:
        y = tl.sum(acc, axis=2)
    if W_SCALED:
        y = y * ws[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_rows(y, r, offs_m, offs_n, m_mask, n_mask, M, y_ptr, stride_ym, ss_ptr, x_ptr.dtype.element_ty, RESIDUAL)


def _rows_pad(m: int) -> int:
    return 1 << max(0, m - 1).bit_length()


def config_fits(config: tuple, m: int) -> bool:
    """Whether a :data:`CONFIGS` entry serves ``m`` rows: "dot" any M <= 16; "row" M = 1, and up to
    ``ROW_MAX_M`` rows while its [rows, features, lanes] accumulators stay within ``ROW_MAX_ACC`` float32
    registers per thread; "rowk" 2 to ``ROW_MAX_M`` rows, its per-chunk products within twice that (they
    live only until the chunk's reduction)."""
    form, block_n, block_k, num_warps, _ = config
    if form in ("dot", "dotT"):
        return True
    if form == "rowk":
        return 1 < m <= ROW_MAX_M and _rows_pad(m) * block_n * block_k <= 2 * ROW_MAX_ACC * 32 * num_warps
    return m == 1 or (m <= ROW_MAX_M and _rows_pad(m) * block_n * block_k <= ROW_MAX_ACC * 32 * num_warps)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
         config: tuple = CONFIGS[0], out: Optional[torch.Tensor] = None,
         sumsq: Optional[tuple[torch.Tensor, float]] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x ``[M, K]`` with ``M <= 16``; weight ``[N, K]``, both K-contiguous.

    ``sumsq=(partial sums, eps)``, "dot" and "dotT" forms: x is the residual stream before a norm folded into
    the weight, applied from the producer's partial sums as :func:`gemv_silu` does.

    ``out`` may be float32 for a lower-precision x: it then holds the float32 sums unrounded (the LM head's
    logits, as cuBLAS writes them with a float32 output: rounding them to x's dtype would turn near-ties into ties).
    """
    _check_linear(x, weight, bias)
    M, N = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1
    if M == 0:
        return out
    _launch(x, weight, bias, out, config, norm=sumsq)
    return out


def gemv_residual(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, *,
                  config: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = F.linear(x, weight, bias) + residual`` for 2 to ``MAX_M`` rows (each rounded as the unfused
    ops round: the residual add of the next norm, :func:`kernels.norm.fused_add_rms_norm`), and each
    program's partial sums of h's squares, ``[programs, M]`` float32 (:func:`sumsq_programs`), from which
    the next matmul applies the norm itself (:func:`gemv_silu`, :func:`kernels.gemv_qkv.qkv_rope`
    ``sumsq=``).  Returns ``(h, partial sums)``."""
    _check_linear(x, weight, bias)
    M, N = x.shape[0], weight.shape[0]
    assert 1 < M <= MAX_M and config_fits(config, M), (config, M)
    assert residual.shape == (M, N) and residual.stride(1) == 1 and residual.dtype == x.dtype
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    sumsq = torch.empty(sumsq_programs(config, N), M, dtype=torch.float32, device=x.device)
    _launch(x, weight, bias, out, config, residual=residual, sumsq=sumsq)
    return out, sumsq


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.shape[0] <= MAX_M and x.stride(1) == 1 and weight.stride(1) == 1
    assert x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.stride(0) == 1


def _launch(x, weight, bias, out, config, residual=None, sumsq=None, norm=None) -> None:
    """Launch ``config``'s kernel for ``out = linear(x)`` (``+ residual``, leaving the partial sums in
    ``sumsq``; or, "dot" forms, with ``norm = (partial sums, eps)`` applied to x: :func:`gemv`)."""
    M, K = x.shape
    N = weight.shape[0]
    form, block_n, block_k, num_warps, num_stages = config
    assert config_fits(config, M), (config, M)
    assert norm is None or form in ("dot", "dotT"), "the norm from partial sums needs a 'dot' form"
    if form == "dot" or form == "dotT":
        _launch_dot(x, weight, bias, out, config, N, residual, sumsq if sumsq is not None else out, norm, silu=False)
        return
    weight, ws, scaled = weight_args(weight)
    b = bias if bias is not None else weight
    r = residual if residual is not None else out
    ss = sumsq if sumsq is not None else out
    if form == "rowk" or (form == "row" and M > 1):
        _gemv_rows_kernel[(triton.cdiv(N, block_n),)](
            x, weight, ws, b, out, r, ss, M, N, K, x.stride(0), weight.stride(0), out.stride(0), r.stride(0),
            HAS_BIAS=bias is not None, M_PAD=_rows_pad(M), BLOCK_N=block_n, BLOCK_K=block_k,
            EACH=form == "rowk", RESIDUAL=residual is not None, W_SCALED=scaled, num_warps=num_warps,
            num_stages=num_stages, **pdl_args(x),
        )
        return
    if form == "row":
        assert residual is None, "the one-row kernel has no residual epilogue"
        _gemv_row_kernel[(triton.cdiv(N, block_n),)](
            x, weight, ws, b, out, x, x, x, N, K, weight.stride(0), 0.0, HAS_BIAS=bias is not None, BLOCK_N=block_n,
            BLOCK_K=block_k, W_SCALED=scaled, LANES=lanes(weight), num_warps=num_warps, num_stages=num_stages,
            **pdl_args(x),
        )
        return
    raise ValueError(f"unknown skinny-matmul form {form!r}")


def _launch_dot(x, weight, bias, out, config, n, residual, ss_out, norm, silu: bool) -> None:
    """:func:`_gemv_kernel` over ``n`` output features (gate|up's I with ``silu``)."""
    M, K = x.shape
    _, block_n, block_k, num_warps, num_stages = config
    ss, eps = norm if norm is not None else (ss_out, 0.0)
    if norm is not None:
        assert ss.dtype == torch.float32 and ss.dim() == 2 and ss.shape[1] == M and ss.is_contiguous(), ss.shape
        assert loads_at_once(ss.shape[0], M), ss.shape
    r = residual if residual is not None else out
    weight, ws, scaled = weight_args(weight)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, ws, bias if bias is not None else weight, out, r, ss, M, n, K, ss.shape[0] if norm else 0,
        x.stride(0), weight.stride(0), out.stride(0), r.stride(0), eps, HAS_BIAS=bias is not None, M_PAD=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", SWAP=config[0] == "dotT",
        SILU=silu, RESIDUAL=residual is not None, NORM_ROWS=_rows_pad(M) if norm is not None else 0,
        P_PAD=triton.next_power_of_2(ss.shape[0]) if norm is not None else 1,
        NORM_FIRST=silu and block_n >= 64,  # H100: 255 registers; summed first, 0.6-1.1 us less per call
        W_SCALED=scaled, num_warps=num_warps, num_stages=num_stages, **pdl_args(x),
    )


def gemv_silu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
              config: tuple, sumsq: Optional[tuple[torch.Tensor, float]] = None) -> torch.Tensor:
    """``silu_and_mul(F.linear(x, weight, bias))`` in one launch, for x ``[M, K]`` (M <= 16) and a gate|up
    weight ``[2I, K]``: a "dot" or "dotT" config's program streams the gate rows of its BLOCK_N features and the up
    rows of the same features, and stores ``[M, I]``, rounded as the two unfused ops round.  Saves the
    activation's launch and the gate|up round trip through memory (a few-token MLP's third launch).

    ``sumsq=(partial sums, eps)`` (from :func:`gemv_residual`): x is the residual stream before an RMSNorm
    whose weight is folded into ``weight`` (:meth:`executor_proc.model.llama.CausalLM.fold_norms`):
    ``F.linear(rms_norm(x, 1, eps), weight)`` with each row's accumulators scaled by the norm's rsqrt
    after the loop (the norm's launch saved; the normalised x is not rounded on the way)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.shape[0] <= MAX_M and x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[0] % 2 == 0
    assert x.dtype == weight.dtype and config[0] in ("dot", "dotT"), (x.dtype, weight.dtype, config)
    M, K = x.shape
    I = weight.shape[0] // 2
    if bias is not None:
        assert bias.shape == (2 * I,) and bias.stride(0) == 1
    out = torch.empty(M, I, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    _launch_dot(x, weight, bias, out, config, I, None, out, sumsq, silu=True)
    return out
