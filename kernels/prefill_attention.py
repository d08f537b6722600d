"""Paged prefill / chunked-prefill attention (varlen, causal).

Rows are laid out as in :class:`executor_proc.step.batch.ForwardBatch`: row ``r`` owns
query tokens ``query_start[r]:query_start[r+1]`` and attends to the first
``context_lens[r]`` tokens of its KV (cached prefix + the new chunk, whose K/V
were written into the cache before this call).  The ``j``-th new token of a row
sits at position ``context_len - qlen + j`` and sees keys ``0..position``.
Decode rows (``qlen == 1``) are just rows of length one, so a mixed step can run
all its rows through this kernel.

Grid ``(cdiv(max_query_len, BLOCK_M), H, R)`` with the host-known maximum query
length (the plan knows it); a program whose query block lies past its row's end
exits at once.  Each program streams the row's keys in ``BLOCK_N`` tiles with an
online softmax (scores in float32, exp2 domain), skips tiles entirely past its
last query's position, and masks only where needed.

*Work-tile form* (``tiles=``, what a CUDA graph of a mixed step captures): the host
lists the step's ``(row, query block)`` pairs in a device table ``[1 + 2 * max]``
int32 (the count first), and a fixed grid ``(num_programs, H)`` walks it, program
``i`` taking entries ``i, i + num_programs, ...``.  The grid depends only on the
graph's bucket, never on the rows, and a row not in the table (a decode row of a
mixed step, a padded row) costs nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .paged_kv import load_kv_tile
from .reference import prefill_attention_ref  # noqa: F401  (re-exported)

__all__ = ["prefill_attention", "prefill_attention_ref", "default_block_m"]

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cl_ptr, r, qb, h, q_start, q_len,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_btb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Query block ``qb`` of row ``r`` (tokens ``q_start .. q_start + q_len``), head ``h``."""
    ctx = tl.load(cl_ptr + r)
    prefix = ctx - q_len
    kvh = h // GROUP

    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    pos = prefix + offs_m  # absolute positions of these queries
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    # Keys needed: 0 .. last visible position of this query block (inclusive).
    last_pos = tl.minimum(prefix + (qb + 1) * BLOCK_M, ctx)  # exclusive bound
    n_tiles = tl.cdiv(last_pos, BLOCK_N)
    bt_row = bt_ptr + r.to(tl.int64) * stride_btb
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(0, n_tiles):
        t = tile * BLOCK_N + offs_n
        t_mask = t < last_pos
        k, v = load_kv_tile(k_ptr, v_ptr, bt_row, t, t_mask, kvh, offs_d, d_mask,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, BLOCK_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        visible = (t[None, :] <= pos[:, None]) & t_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have seen no key yet keep m = -inf; guard exp2(-inf - -inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qs_ptr, cl_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_btb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    qb = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2)
    q_start = tl.load(qs_ptr + r)
    q_len = tl.load(qs_ptr + r + 1) - q_start
    if qb * BLOCK_M < q_len:
        _attend_block(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cl_ptr, r, qb, h, q_start, q_len, qk_scale,
                      stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                      stride_ot, stride_oh, stride_btb,
                      GROUP, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_N, DOT_PREC)


@triton.jit
def _prefill_tiles_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qs_ptr, cl_ptr, tiles_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_btb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    h = tl.program_id(1)
    n = tl.load(tiles_ptr)
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        r = tl.load(tiles_ptr + 1 + 2 * i)
        qb = tl.load(tiles_ptr + 2 + 2 * i)
        q_start = tl.load(qs_ptr + r)
        q_len = tl.load(qs_ptr + r + 1) - q_start
        _attend_block(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cl_ptr, r, qb, h, q_start, q_len, qk_scale,
                      stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                      stride_ot, stride_oh, stride_btb,
                      GROUP, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_N, DOT_PREC)


def default_block_m(max_query_len: int) -> int:
    """Query tokens per program: 16 for short queries (decode-like rows), else 64."""
    return 16 if max_query_len <= 16 else 64


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    out: Optional[torch.Tensor] = None,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    tiles: Optional[torch.Tensor] = None,
    num_programs: Optional[int] = None,
) -> torch.Tensor:
    """Varlen causal attention over the paged cache.

    q ``[T, H, D]`` (last dim contiguous; may be a view of a fused QKV output),
    k_cache/v_cache ``[num_blocks, block_size, Hkv, D]``, block_tables ``[R, max_blocks]``
    int32, query_start ``[R+1]`` int32, context_lens ``[R]`` int32 (all on the device),
    ``max_query_len`` a host int >= every row's query length.  Returns ``[T, H, D]``.

    With ``tiles`` (int32 ``[1 + 2 * max]``: the count, then ``(row, query block)`` pairs
    of ``block_m`` tokens, which must be given) only the listed blocks are computed, by a
    grid of ``num_programs`` programs per head whatever the rows (module docstring):
    ``out`` rows of tokens outside them are left as they were.
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
    T, H, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    assert Dk == D and D <= 256 and H % Hkv == 0
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    R = context_lens.shape[0]
    assert query_start.shape == (R + 1,) and query_start.dtype == torch.int32
    assert context_lens.dtype == torch.int32 and block_tables.dtype == torch.int32
    assert block_tables.dim() == 2 and block_tables.shape[0] >= R and block_tables.stride(1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if tiles is not None:
        assert block_m is not None and num_programs is not None and num_programs > 0
        assert tiles.dtype == torch.int32 and tiles.dim() == 1 and tiles.device == q.device
    elif R == 0 or T == 0 or max_query_len <= 0:
        return out
    if block_m is None:
        block_m = default_block_m(max_query_len)
    block_n = block_n or (64 if D <= 64 else 32)
    num_warps = num_warps or 4
    num_stages = num_stages or 2
    if tiles is None:
        kernel, grid, extra = _prefill_kernel, (triton.cdiv(max_query_len, block_m), H, R), ()
    else:
        kernel, grid, extra = _prefill_tiles_kernel, (num_programs, H), (tiles,)
    kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens, *extra,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=H // Hkv, HEAD_DIM=D, D_PAD=triton.next_power_of_2(D),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
