"""A batch-invariant matmul: row i of ``x @ W^T`` is computed the same way whatever ``M`` is.

``y [M, N] = x [M, K] @ W[N, K]^T (+ b)``.  cuBLAS and the skinny GEMV pick
their kernel, tile and split of K by the number of rows, so a token's logits
change (in the last bits) with the batch it shares a step with.  Here one
program owns ``BLOCK_M x BLOCK_N`` outputs with tile sizes that never change,
and K is split into ``split_k`` ranges chosen from (N, K) and the device only,
never from M:

- ``split_k == 1``: the program walks all of K in ``BLOCK_K`` steps and writes
  ``y`` (bias added in float32, rounded once);
- ``split_k > 1``: each split writes its float32 partial sum to a workspace
  ``[split_k, M, N]`` and ``_sum_splits_kernel`` adds the splits in split order,
  then the bias, and rounds once.

Each output element therefore sees the same products, summed in the same order
(the same ``tl.dot`` tiles of K, the same split boundaries), for any M: the
other rows of a tile only share its loads.  Splitting K keeps small-M decode
steps from running on a handful of SMs (N / BLOCK_N programs) at the cost of
a workspace write and read of ``split_k * M * N`` floats.  No atomics, so it is
deterministic as well.  Used for every linear under ``--batch-invariant``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_launch, pdl_wait

__all__ = ["invariant_matmul", "choose_config", "split_k_for", "MatmulConfig", "BLOCK_M"]

BLOCK_M = 64  # >= 64 so that a 64-row step still runs on the Hopper wgmma path; never a function of M
MAX_SPLIT_K = 16
SUM_BLOCK_M, SUM_BLOCK_N = 64, 64
MIN_TILES_PER_SPLIT = 4  # a split shorter than this spends more on its partial sum than it saves


class MatmulConfig(NamedTuple):
    """One weight's kernel: tile, launch shape and split of K (fixed per weight, never per M)."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, tiles_per_split,
                   stride_xm, stride_wn, stride_ym, stride_ws_split,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr = False):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * tiles_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + tiles_per_split * BLOCK_K, K)
    pdl_wait(USE_PDL)  # x is the step's data
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
    pdl_launch(USE_PDL)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if y_ptr.dtype.element_ty != tl.float32:  # as F.linear rounds; a float32 out (logits) unrounded
            acc = acc.to(x_ptr.dtype.element_ty)
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(ws_ptr + split * stride_ws_split + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :],
                 acc, mask=out_mask)


@triton.jit
def _sum_splits_kernel(ws_ptr, b_ptr, y_ptr, M, N, stride_ym, stride_ws_split,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    at = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    pdl_wait(USE_PDL)
    acc = tl.load(ws_ptr + at, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):  # in split order, always
        acc += tl.load(ws_ptr + s * stride_ws_split + at, mask=mask, other=0.0)
    pdl_launch(USE_PDL)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def split_k_for(n: int, k: int, block_n: int, block_k: int, programs_per_sm: int, device: torch.device) -> int:
    """Splits of K (a power of two) for about ``programs_per_sm`` programs per SM at one row tile.

    A function of (N, K, tile, device) only, so every batch size sums in the same order.
    """
    tiles_n, tiles_k = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    want = programs_per_sm * _num_sms(device)
    split = 1
    while split < MAX_SPLIT_K and tiles_n * split < want and tiles_k // (2 * split) >= MIN_TILES_PER_SPLIT:
        split *= 2
    return split


def choose_config(n: int, k: int, device: torch.device) -> MatmulConfig:
    """The kernel for an ``[N, K]`` weight on ``device``, from (N, K, device) only (never M).

    From an H100 sweep of configs per weight and split rule,
    one config per weight that is within a few percent of the best at both 1 and 64 rows:

    - wide weights (gate|up, lm_head: 128-wide tiles give >= one program per two SMs) need no split:
      128 x 128 tiles, 4 stages;
    - long-K weights (down: K >= 8192) split K for about one program per SM; the splits' partial sums
      cost less than a program walking 64+ tiles of K alone; 3 stages (many short programs);
    - the rest (q|k|v, o) walk all of K in one program with 5 stages in flight: at 64 rows the split-K
      workspace round trip costs more than the idle SMs.
    """
    if triton.cdiv(n, 128) * 2 >= _num_sms(device):
        return MatmulConfig(128, 128, 4, 4, 1)
    if k >= 8192:
        return MatmulConfig(64, 128, 4, 3, split_k_for(n, k, 64, 128, 1, device))
    return MatmulConfig(64, 128, 4, 5, 1)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     split_k: Optional[int] = None, config: Optional[MatmulConfig] = None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x ``[M, K]``, weight ``[N, K]``, with results independent of M.

    ``config``: default :func:`choose_config` of the weight's shape; ``split_k`` overrides its split
    (pass the same values for every call on one weight; the backend does).  ``out`` may be float32 for a
    lower-precision x: it then holds the float32 sums unrounded (the LM head's logits, as cuBLAS writes them with a
    float32 output).
    Launched with PDL (:mod:`kernels.pdl`).
    """
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert weight.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    if bias is not None:
        assert bias.shape == (N,) and bias.stride(0) == 1
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1
    if M == 0:
        return out
    cfg = config or choose_config(N, K, x.device)
    if x.element_size() == 4 and cfg.block_k > 64:  # float32 tiles take twice the shared memory per stage
        cfg = cfg._replace(block_k=cfg.block_k // 2)
    split = split_k or cfg.split_k
    tiles_per_split = triton.cdiv(triton.cdiv(K, cfg.block_k), split)
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else weight
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, cfg.block_n), split)
    _matmul_kernel[grid](
        x, weight, b, out, ws, M, N, K, tiles_per_split, x.stride(0), weight.stride(0), out.stride(0),
        ws.stride(0) if split > 1 else 0,
        HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(x),
    )
    if split > 1:  # an elementwise sum over splits in split order: its tile does not change any result
        _sum_splits_kernel[(triton.cdiv(M, SUM_BLOCK_M), triton.cdiv(N, SUM_BLOCK_N))](
            ws, b, out, M, N, out.stride(0), ws.stride(0),
            HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=SUM_BLOCK_M, BLOCK_N=SUM_BLOCK_N, num_warps=4,
            **pdl_args(x),
        )
    return out
