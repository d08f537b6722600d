"""Paged prefill / chunked-prefill attention (varlen, causal), GQA-packed.

Rows are laid out as in :class:`executor_proc.step.batch.ForwardBatch`: row ``r`` owns
query tokens ``query_start[r]:query_start[r+1]`` and attends to the first
``context_lens[r]`` tokens of its KV (cached prefix + the new chunk, whose K/V
were written into the cache before this call).  The ``j``-th new token of a row
sits at position ``context_len - qlen + j`` and sees keys ``0..position``.
Decode rows (``qlen == 1``) are just rows of length one, so a mixed step can run
all its rows through this kernel.

*GQA packing*: one program owns a query block of ``BQ`` tokens of one row for one KV
head, and its ``BLOCK_M = next_pow2(GROUP * BQ)`` score rows are the (token, head)
pairs of that block (row ``m``: token ``m // GROUP``, head ``kvh * GROUP + m % GROUP``;
rows past ``GROUP * BQ`` are padding), so every K/V tile brought on chip feeds all
``GROUP`` query heads of its KV head.  :func:`tile_tokens` picks ``BQ`` (128 score rows
for long work, fewer for short rows).

Each block streams its keys in ``BLOCK_N`` tiles with an online softmax (float32,
exp2 domain, scale folded in), in two loops: the *off-band* tiles, every key below
the block's first position rounded down to ``BLOCK_N``, seen by every query, with no
mask at all; then the *diagonal* tiles up to the block's last position, with the
causal mask as a finite additive term (no -inf, so no NaN guard: every query sees
at least one key in its first tile).

Plain grid ``(Hkv, R, cdiv(max_query_len, BQ))`` with the host-known maximum query
length; the query-block axis is the slowest and runs backwards, so the blocks with
the most keys start first (longest-processing-time order); a program whose block
lies past its row's end exits at once.

*Work-tile form* (``tiles=``, what a CUDA graph of a mixed step captures): the host
lists the step's ``(row, query block)`` pairs in a device table ``[1 + 2 * max]``
int32 (the count first; :mod:`executor_proc.step.mixed_step` lists the longest first),
and a fixed grid ``(num_programs, Hkv)`` walks it, program ``i`` taking entries
``i, i + num_programs, ...``.  The grid depends only on the graph's bucket, never on
the rows, and a row not in the table (a decode row of a mixed step, a padded row)
costs nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .paged_kv import load_kv_pair
from .reference import prefill_attention_ref  # noqa: F401  (re-exported)

__all__ = ["prefill_attention", "prefill_attention_ref", "tile_tokens", "block_rows"]

_LOG2E = 1.4426950408889634
_MAX_ROWS = 128  # score rows per program for long work (two m64 wgmma tiles on Hopper)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block_rows(group: int, tokens: int) -> int:
    """Score rows of a program holding ``tokens`` query tokens of ``group`` heads each (>= 16: dot minimum)."""
    return max(16, _pow2(group * tokens))


def tile_tokens(group: int, max_query_len: int) -> int:
    """Query tokens per program (the work-tile ``block_m``) for ``group`` query heads per KV head.

    ``128 // group`` tokens (128 score rows) once the rows are long enough, fewer for
    short rows (decode-like: ``max_query_len`` tokens, at least 16 score rows); at least
    one token whatever the group.  Depends only on its arguments, so a graph bucket
    (``max_query_len`` = its token count) gets a fixed value.
    """
    rows = min(_MAX_ROWS, block_rows(group, max(1, max_query_len)))
    return max(1, rows // group)


@triton.jit
def _attend_tiles(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, kvh, lo, hi, ctx, pos, offs_d, qk_scale,
                  stride_kb, stride_kt, stride_kh,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online-softmax update over keys ``lo .. hi`` (``lo`` a multiple of ``BLOCK_N``).

    ``MASKED`` False: every key is visible to every query and below ``ctx`` (off-band).
    """
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        t = start + offs_n
        k, v = load_kv_pair(k_ptr, v_ptr, bt_row, t, ctx, kvh, offs_d, stride_kb, stride_kt, stride_kh,
                            BLOCK_SIZE, HEAD_DIM, D_PAD, MASKED)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)  # an FP8 cache widened
        if MASKED:
            # Keys past a query's position (and so every key >= ctx, read as 0) get -1e6: finite.
            qk = qk * qk_scale + tl.where(t[None, :] <= pos[:, None], 0.0, -1.0e6)
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_ij[:, None]
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_ij[:, None]  # one FMA
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_ij)
        l_ij = tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PREC)
        l_i = l_i * alpha + l_ij  # updated last: fewer live registers across the dots
        m_i = m_ij
    return m_i, l_i, acc


@triton.jit
def _attend_block(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cl_ptr, r, qb, kvh, q_start, q_len,
    qk_scale, v_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_ot, stride_oh,
    stride_btb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Query block ``qb`` (``BQ`` tokens) of row ``r`` (tokens ``q_start .. q_start + q_len``), KV head ``kvh``."""
    ctx = tl.load(cl_ptr + r)
    prefix = ctx - q_len
    offs_m = tl.arange(0, BLOCK_M)
    tq = qb * BQ + offs_m // GROUP  # token of each score row within the row
    head = kvh * GROUP + offs_m % GROUP
    m_mask = (offs_m < BQ * GROUP) & (tq < q_len)
    pos = prefix + tq  # absolute positions (padding rows: past ctx, harmless)
    offs_d = tl.arange(0, D_PAD)
    io_mask = m_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok = (q_start + tq).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + r.to(tl.int64) * stride_btb
    first = prefix + qb * BQ  # position of the block's first query
    band = (first // BLOCK_N) * BLOCK_N  # keys below: visible to every query of the block
    end = tl.minimum(first + BQ, ctx)  # exclusive: past the block's last query
    m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, kvh, 0, band, ctx, pos, offs_d,
                                  qk_scale, stride_kb, stride_kt, stride_kh,
                                  HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, False, DOT_PREC)
    m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, kvh, band, end, ctx, pos, offs_d,
                                  qk_scale, stride_kb, stride_kt, stride_kh,
                                  HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, True, DOT_PREC)
    o = (acc * v_scale) / l_i[:, None]  # an FP8 cache's V scale (1 otherwise: exact)
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qs_ptr, cl_ptr,
    qk_scale, v_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_ot, stride_oh,
    stride_btb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    kvh = tl.program_id(0)
    r = tl.program_id(1)
    qb = tl.num_programs(2) - 1 - tl.program_id(2)  # last blocks (most keys) first
    q_start = tl.load(qs_ptr + r)
    q_len = tl.load(qs_ptr + r + 1) - q_start
    if qb * BQ < q_len:
        _attend_block(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cl_ptr, r, qb, kvh, q_start, q_len, qk_scale, v_scale,
                      stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_ot, stride_oh, stride_btb,
                      GROUP, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_M, BQ, BLOCK_N, DOT_PREC)


@triton.jit
def _prefill_tiles_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qs_ptr, cl_ptr, tiles_ptr,
    qk_scale, v_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_ot, stride_oh,
    stride_btb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    kvh = tl.program_id(1)
    n = tl.load(tiles_ptr)
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        r = tl.load(tiles_ptr + 1 + 2 * i)
        qb = tl.load(tiles_ptr + 2 + 2 * i)
        q_start = tl.load(qs_ptr + r)
        q_len = tl.load(qs_ptr + r + 1) - q_start
        _attend_block(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cl_ptr, r, qb, kvh, q_start, q_len, qk_scale, v_scale,
                      stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_ot, stride_oh, stride_btb,
                      GROUP, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_M, BQ, BLOCK_N, DOT_PREC)


def launch_config(head_dim: int, dtype: torch.dtype, rows: int) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` for a program of ``rows`` score rows.

    16-bit (swept on an H100, docs/kernels.md): BLOCK_N 64 with 3 stages, so the page-id and
    K/V loads are software-pipelined (async copies in both loops); 8 warps for 128 rows of
    D <= 64 (4 warps use 255 registers and spill), 4 for D = 128 (one warpgroup issuing both
    m64 halves: ~10% faster than 8 although it spills 58 registers).  D > 128 is not tuned.  fp32 (tests; no tensor-core
    path): smaller tiles and 2 stages (shared memory).
    """
    if dtype == torch.float32:
        return 32, 4, 2
    if head_dim > 128:
        return 32, 8, 2
    warps = 8 if rows >= 128 and head_dim <= 64 else 4
    return 64, warps, 3


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
    kv_scale: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Varlen causal attention over the paged cache (``kv_scale``: an FP8 cache's (K, V) scales).

    q ``[T, H, D]`` (last dim contiguous; may be a view of a fused QKV output),
    k_cache/v_cache ``[num_blocks, block_size, Hkv, D]`` with the same strides, block_tables
    ``[R, max_blocks]`` int32, query_start ``[R+1]`` int32, context_lens ``[R]`` int32 (all on
    the device), ``max_query_len`` a host int >= every row's query length.  Returns ``[T, H, D]``.

    ``block_m``: query tokens per program (default :func:`tile_tokens`); each program
    covers them for the ``H // Hkv`` heads of one KV head.  With ``tiles`` (int32
    ``[1 + 2 * max]``: the count, then ``(row, query block)`` pairs of ``block_m`` tokens,
    which must be given) only the listed blocks are computed, by a grid of ``num_programs``
    programs per KV head whatever the rows (module docstring): ``out`` rows of tokens
    outside them are left as they were.
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
    T, H, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    assert Dk == D and D <= 256 and H % Hkv == 0
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert v_cache.dtype == k_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride()
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
    group = H // Hkv
    block_m = block_m or tile_tokens(group, max_query_len)
    rows = block_rows(group, block_m)
    cfg_n, cfg_w, cfg_s = launch_config(D, q.dtype, rows)
    if tiles is None:
        kernel, grid, extra = _prefill_kernel, (Hkv, R, triton.cdiv(max_query_len, block_m)), ()
    else:
        kernel, grid, extra = _prefill_tiles_kernel, (num_programs, Hkv), (tiles,)
    kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens, *extra,
        scale * _LOG2E * kv_scale[0], kv_scale[1],
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=D, D_PAD=triton.next_power_of_2(D),
        BLOCK_SIZE=block_size, BLOCK_M=rows, BQ=block_m, BLOCK_N=block_n or cfg_n,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps or cfg_w, num_stages=num_stages or cfg_s,
    )
    return out
