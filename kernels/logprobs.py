"""Token logprobs on the device: the function of :mod:`kernels.logprobs_ref`, graph-capturable.

Three launches, none reading a device value on the host:

1. ``_lse_part_kernel``, grid ``(S, cdiv(V, BLOCK))``: each chunk's max,
   ``sum exp(x - chunk max)`` and how many of its logits are at least the token's (rows with
   ``num_logprobs < 0`` exit at once);
2. ``torch.topk(logits, max_top_n)`` (one radix select per row; the only part every row pays);
3. ``_finish_kernel``, grid ``(S,)``: ``lse = M + log(sum_c s_c exp(m_c - M))``, the token's
   rank (the chunks' counts summed) and ``x[token] - lse``, the top-n, and the padding.

Cost of rows that do not ask: the executor decides per step on the host (it knows each slot's
``num_logprobs``) whether any row asks, and only then runs this (a separate graph variant);
a step where nobody asks runs none of it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .logprobs_ref import MAX_TOP_N, token_logprobs_ref  # noqa: F401

__all__ = ["token_logprobs", "MAX_TOP_N", "token_logprobs_ref"]


@triton.jit
def _lse_part_kernel(x_ptr, stride_x, tok_ptr, n_ptr, pmax_ptr, psum_ptr, pcnt_ptr, V, NCH, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    if tl.load(n_ptr + row) >= 0:
        idx = c * BLOCK + tl.arange(0, BLOCK)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        x = tl.load(x_row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        xt = tl.load(x_row + tl.load(tok_ptr + row).to(tl.int64)).to(tl.float32)
        mx = tl.max(x, axis=0)
        s = tl.sum(tl.exp(x - mx), axis=0)
        tl.store(pmax_ptr + row * NCH + c, mx)
        tl.store(psum_ptr + row * NCH + c, s)
        tl.store(pcnt_ptr + row * NCH + c, tl.sum(((x >= xt) & (idx < V)).to(tl.int32), axis=0))


@triton.jit
def _finish_kernel(x_ptr, stride_x, tok_ptr, n_ptr, pmax_ptr, psum_ptr, pcnt_ptr, tv_ptr, ti_ptr, ids_ptr, lps_ptr,
                   NCH, TOPN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    n = tl.load(n_ptr + row)
    j = tl.arange(0, BLOCK_N)  # output column
    out = row * (TOPN + 1) + j
    ids = tl.full([BLOCK_N], -1, tl.int64)
    lps = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if n >= 0:
        cc = tl.arange(0, BLOCK_C)
        pm = tl.load(pmax_ptr + row * NCH + cc, mask=cc < NCH, other=float("-inf"))
        ps = tl.load(psum_ptr + row * NCH + cc, mask=cc < NCH, other=0.0)
        big = tl.max(pm, axis=0)
        lse = big + tl.log(tl.sum(tl.where(cc < NCH, ps * tl.exp(pm - big), 0.0), axis=0))
        rank = tl.sum(tl.load(pcnt_ptr + row * NCH + cc, mask=cc < NCH, other=0), axis=0).to(tl.int64)
        tok = tl.load(tok_ptr + row).to(tl.int64)
        xt = tl.load(x_ptr + row.to(tl.int64) * stride_x + tok).to(tl.float32)
        top = (j >= 1) & (j <= n) & (j <= TOPN)
        tv = tl.load(tv_ptr + row * TOPN + j - 1, mask=top, other=0.0).to(tl.float32)
        ti = tl.load(ti_ptr + row * TOPN + j - 1, mask=top, other=-1)
        ids = tl.where(j == 0, rank, tl.where(top, ti, -1))
        lps = tl.where(j == 0, xt - lse, tl.where(top, tv - lse, float("-inf")))
    tl.store(ids_ptr + out, ids, mask=j <= TOPN)
    tl.store(lps_ptr + out, lps, mask=j <= TOPN)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: torch.Tensor, *,
                   max_top_n: int = MAX_TOP_N, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                   block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int64, logprobs float32)`` ``[S, 1 + max_top_n]``, as :func:`token_logprobs_ref`.

    logits ``[S, V]`` (the raw model output), tokens ``[S]`` the sampled (or prompt) tokens,
    num_logprobs ``[S]`` int32 (-1 off, 0..max_top_n); ``out`` preallocated buffers.
    """
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [S, V], last dim contiguous"
    S, V = logits.shape
    assert 0 <= max_top_n <= V
    assert tokens.shape == (S,) and num_logprobs.shape == (S,)
    dev = logits.device
    if out is None:
        out = (torch.empty(S, max_top_n + 1, dtype=torch.int64, device=dev),
               torch.empty(S, max_top_n + 1, dtype=torch.float32, device=dev))
    ids, lps = out
    assert ids.shape == (S, max_top_n + 1) and ids.is_contiguous() and lps.shape == ids.shape and lps.is_contiguous()
    if S == 0:
        return out
    block = min(block, triton.next_power_of_2(V))
    nch = triton.cdiv(V, block)
    pmax = torch.empty(S, nch, dtype=torch.float32, device=dev)
    psum = torch.empty(S, nch, dtype=torch.float32, device=dev)
    pcnt = torch.empty(S, nch, dtype=torch.int32, device=dev)
    num_logprobs = num_logprobs.to(torch.int32)
    _lse_part_kernel[(S, nch)](logits, logits.stride(0), tokens, num_logprobs, pmax, psum, pcnt, V, nch,
                               BLOCK=block, num_warps=8)
    if max_top_n:
        tv, ti = torch.topk(logits, max_top_n, dim=-1)
    else:
        tv, ti = pmax, tokens  # never read
    _finish_kernel[(S,)](logits, logits.stride(0), tokens, num_logprobs, pmax, psum, pcnt, tv.contiguous(),
                         ti.contiguous(), ids, lps, nch, TOPN=max_top_n, BLOCK_C=triton.next_power_of_2(nch),
                         BLOCK_N=triton.next_power_of_2(max_top_n + 1), num_warps=1)
    return out
