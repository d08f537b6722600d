"""Paged decode attention, split-KV ("flash decoding") with a merge step.

One query token per row.  The grid is fixed for a given batch size and
``num_splits``: ``(B, Hkv, num_splits)``.  Each program reads its row's length
from ``context_lens`` *on the device*, cuts the row's KV into ``num_splits``
contiguous ranges of whole ``BLOCK_N``-token tiles, and exits at once when its
range is empty (short rows, padded rows with length 0).  Nothing depends on
host-side lengths, so a launch is capturable in a CUDA graph and replays for
any lengths that fit the block tables.

All ``G = H // Hkv`` query heads of one KV head are handled by one program: they
are the M dimension of ``tl.dot`` (padded to 16), so each K/V tile is read from
memory once per KV head.  Scores and the online softmax are float32; P is cast
to q's dtype for the P@V product (fp16/bf16) as in FlashAttention.  An FP8 cache
(``--kv-cache-dtype fp8``, e4m3) is read as 16-bit words of two values, widened to float16 in registers (see
``F16_DOTS``).

With ``num_splits > 1`` each split writes an unnormalised partial output and its
(max, sum) into a preallocated workspace (:class:`DecodeWorkspace`), then counts
itself in on the workspace's arrival counter of its (row, KV head); the split that
arrives last merges the row's non-empty splits for its G heads, writes the output
and sets the counter back to zero for the next call.  No second kernel: at batch 1
a merge launch per layer cost about as much as the merge itself (16 x ~1.9 us per
1B step).  Ordering: every thread's partial stores happen before the program's
counter increment (a CTA barrier, then a GPU-scope acquire-release atomic), and
the merger reads the partials through L2 (``.cg``) after its acquiring increment.
With ``num_splits == 1`` the split kernel normalises and writes the output directly.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .e4m3 import e4m3_pair_to_f16
from .paged_kv import load_kv_tile, load_words
from .pdl import pdl_args, pdl_launch, pdl_wait

from .reference import decode_attention_ref  # noqa: F401  (re-exported)

__all__ = ["decode_attention", "DecodeWorkspace", "default_num_splits", "split_pairs", "decode_attention_ref"]

_LOG2E = 1.4426950408889634

# the most splits per (row, KV head) the default rule gives: MAX_SPLITS, FEW_ROWS_MAX_SPLITS at up to FEW_ROWS rows
MAX_SPLITS = 16
FEW_ROWS = 1
FEW_ROWS_MAX_SPLITS = 32


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cl_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr, arrivals_ptr,
    qk_scale,  # softmax scale * log2(e) (* an FP8 cache's K scale)
    v_scale,  # an FP8 cache's V scale (1 otherwise)
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_btb,
    stride_ob, stride_oh,
    stride_pob, stride_poh, stride_pos,
    stride_pmb, stride_pmh, stride_ab,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, G_MERGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr = False,
    F16_DOTS: tl.constexpr = False,
):
    """``F16_DOTS`` (an FP8 cache under bf16 / fp16 queries): both products take float16 operands, K and V widened
    from e4m3 exactly in one conversion and q and the probabilities rounded to float16 (more mantissa than
    bfloat16, less range: a query entry past 65,504 would overflow); the sums stay float32.  The head dim must be
    even (K and V are read two values a word)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)

    pdl_wait(USE_PDL)  # everything below reads this step's data: q, the cache, the lengths
    ctx = tl.load(cl_ptr + b)
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    tile_lo = sp * tiles_per_split
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    if tile_lo >= n_tiles:
        if sp == 0:  # empty row (length 0): zeros; a later empty split has nothing to do
            tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     tl.zeros([G_PAD, D_PAD], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=g_mask[:, None] & d_mask[None, :])
        return
    tile_hi = tl.minimum(tile_lo + tiles_per_split, n_tiles)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    offs_n = tl.arange(0, BLOCK_N)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    if F16_DOTS:
        # an FP8 cache read as 16-bit words, two e4m3 values each: head dims 2j (low byte) and 2j + 1 (high byte)
        # go to separate products (q's even and odd dims, one accumulator each), so that no operand is ever read
        # from shared memory a byte at a time (how the compiler fetched e4m3 tiles as MMA operands)
        offs_w = tl.arange(0, D_PAD // 2)
        w_mask = g_mask[:, None] & (2 * offs_w < HEAD_DIM)[None, :]
        q_even = tl.load(q_row + 2 * offs_w[None, :], mask=w_mask, other=0.0).to(tl.float16)
        q_odd = tl.load(q_row + 2 * offs_w[None, :] + 1, mask=w_mask, other=0.0).to(tl.float16)
        acc_even = tl.zeros([G_PAD, D_PAD // 2], tl.float32)
        acc_odd = tl.zeros([G_PAD, D_PAD // 2], tl.float32)
        if HEAD_DIM == D_PAD:
            w_dims = offs_w < D_PAD // 2  # (all: folded away)
        else:
            w_dims = 2 * offs_w < HEAD_DIM
        kw_ptr = k_ptr.to(tl.pointer_type(tl.uint16))
        vw_ptr = v_ptr.to(tl.pointer_type(tl.uint16))
        for tile in range(tile_lo, tile_hi):
            t = tile * BLOCK_N + offs_n
            t_mask = t < ctx
            blk = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
            off = (t % BLOCK_SIZE).to(tl.int64)
            k_even, k_odd = e4m3_pair_to_f16(load_words(kw_ptr, blk, off, t_mask, kvh, offs_w, w_dims,
                                                        stride_kb, stride_kt, stride_kh))
            s = tl.dot(q_even, tl.trans(k_even), input_precision=DOT_PREC)
            s = tl.dot(q_odd, tl.trans(k_odd), s, input_precision=DOT_PREC) * qk_scale  # [G_PAD, BLOCK_N], log2
            p, alpha, m_i, l_i = _softmax_step(s, t_mask, m_i, l_i)
            v_even, v_odd = e4m3_pair_to_f16(load_words(vw_ptr, blk, off, t_mask, kvh, offs_w, w_dims,
                                                        stride_vb, stride_vt, stride_vh))
            p = p.to(tl.float16)
            acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even, input_precision=DOT_PREC)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision=DOT_PREC)
        acc = tl.reshape(tl.join(acc_even, acc_odd), (G_PAD, D_PAD))  # dims back in order: 2j, 2j + 1
    else:
        q = tl.load(q_row + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for tile in range(tile_lo, tile_hi):
            t = tile * BLOCK_N + offs_n
            t_mask = t < ctx
            k, v = load_kv_tile(k_ptr, v_ptr, bt_row, t, t_mask, kvh, offs_d, d_mask,
                                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, BLOCK_SIZE)
            # (an FP8 cache under float32 queries widens to float32 here)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * qk_scale  # [G_PAD, BLOCK_N], log2
            p, alpha, m_i, l_i = _softmax_step(s, t_mask, m_i, l_i)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    pdl_launch(USE_PDL)
    acc = acc * v_scale  # exact at 1

    st_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=st_mask)
    else:
        tl.store(po_ptr + b.to(tl.int64) * stride_pob + heads[:, None] * stride_poh + sp * stride_pos
                 + offs_d[None, :], acc, mask=st_mask)
        ml_off = b.to(tl.int64) * stride_pmb + heads * stride_pmh + sp
        tl.store(pm_ptr + ml_off, m_i, mask=g_mask)
        tl.store(pl_ptr + ml_off, l_i, mask=g_mask)
        tl.debug_barrier()  # all of this program's partial stores before its arrival
        counter = arrivals_ptr + b.to(tl.int64) * stride_ab + kvh
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        n_valid = tl.cdiv(n_tiles, tiles_per_split)  # the non-empty splits
        if arrived == n_valid - 1:  # the last one in merges, and re-arms the counter
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            _merge_group(out_ptr, po_ptr, pm_ptr, pl_ptr, b, kvh, n_valid, stride_ob, stride_oh,
                         stride_pob, stride_poh, stride_pos, stride_pmb, stride_pmh,
                         GROUP, G_MERGE, HEAD_DIM, D_PAD, S_PAD)


@triton.jit
def _softmax_step(s, t_mask, m_i, l_i):
    """One tile of the online softmax: ``s`` (log2 scores, tokens past ``t_mask`` dropped) against the running max
    and sum; (probabilities, the old terms' rescale, the new max, the new sum)."""
    s = tl.where(t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _merge_group(out_ptr, po_ptr, pm_ptr, pl_ptr, b, kvh, n_valid,
                 stride_ob, stride_oh, stride_pob, stride_poh, stride_pos, stride_pmb, stride_pmh,
                 GROUP: tl.constexpr, G_MERGE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 S_PAD: tl.constexpr):
    """Combine the ``n_valid`` partials of row ``b``'s heads of KV head ``kvh`` into ``out``."""
    offs_g = tl.arange(0, G_MERGE)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + offs_g
    gs_mask = (offs_g < GROUP)[:, None] & (offs_s < n_valid)[None, :]
    ml_off = b.to(tl.int64) * stride_pmb + heads[:, None] * stride_pmh + offs_s[None, :]
    m = tl.load(pm_ptr + ml_off, mask=gs_mask, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(pl_ptr + ml_off, mask=gs_mask, other=0.0, cache_modifier=".cg")
    m_max = tl.max(tl.where(gs_mask, m, -1.0e30), axis=1)  # finite for padded heads too
    w = tl.where(gs_mask, tl.exp2(m - m_max[:, None]), 0.0)
    den = tl.sum(l * w, axis=1)
    d_mask = offs_d < HEAD_DIM
    po = tl.load(po_ptr + b.to(tl.int64) * stride_pob + heads[:, None, None] * stride_poh
                 + offs_s[None, :, None] * stride_pos + offs_d[None, None, :],
                 mask=gs_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
    o = tl.sum(po * w[:, :, None], axis=1) / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=(offs_g < GROUP)[:, None] & d_mask[None, :])


class DecodeWorkspace:
    """Preallocated partial results for split-KV decode, sized for the largest batch.

    Allocate once (outside graph capture) and pass to every :func:`decode_attention`
    call; a call uses the first ``B`` rows and first ``num_splits`` splits.
    A call of more rows, up to ``max_rows`` (a speculative step's positions as decode rows), takes fewer splits:
    at most :meth:`splits_for` of its row count, its partials packed into the same memory (:meth:`partials`),
    which holds at least ``min_splits`` splits of ``max_rows`` rows (batch-invariant attention keeps its one split
    count at every row count) and at least ``min_pairs`` (row, split) pairs (:func:`split_pairs`: room for the
    default split count at every row count, so that a few slots' speculative rows are not cut to fewer splits).
    """

    def __init__(self, max_batch: int, num_heads: int, head_dim: int, max_splits: int = FEW_ROWS_MAX_SPLITS,
                 device: torch.device | str = "cuda", max_rows: int = 0, min_splits: int = 1, min_pairs: int = 0):
        self.max_batch, self.num_heads, self.head_dim, self.max_splits = max_batch, num_heads, head_dim, max_splits
        self.max_rows = max(max_rows, max_batch)
        # (row, split) pairs: max_splits for up to FEW_ROWS rows, MAX_SPLITS (or fewer) for every row
        pairs = max(max_batch * min(max_splits, MAX_SPLITS), min(max_batch, FEW_ROWS) * max_splits)
        self.capacity = max(pairs, self.max_rows * min_splits, min_pairs)
        n = self.capacity * num_heads
        self.partial_out = torch.empty(n * head_dim, dtype=torch.float32, device=device)
        self.partial_m = torch.empty(n, dtype=torch.float32, device=device)
        self.partial_l = torch.empty(n, dtype=torch.float32, device=device)
        # splits done per (row, KV head) of the call in progress; the merging split re-zeroes its entry
        self.arrivals = torch.zeros(self.max_rows, num_heads, dtype=torch.int32, device=device)
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # by (rows, splits)

    def splits_for(self, rows: int) -> int:
        """The most splits (a power of two) a call of ``rows`` rows can keep its partials for."""
        s = self.max_splits
        while s > 1 and rows * s > self.capacity:
            s //= 2
        return s

    def partials(self, rows: int, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out, m, l) partials of a call: ``[rows, heads, splits, ...]`` views packed into the buffers (made once
        per row and split count: an eager forward asks at every layer)."""
        views = self._views.get((rows, splits))
        if views is None:
            assert rows <= self.max_rows and splits <= self.splits_for(rows), (rows, splits, self.max_rows)
            shape = (rows, self.num_heads, splits)
            n = rows * self.num_heads * splits
            views = self._views[rows, splits] = (self.partial_out[:n * self.head_dim].view(*shape, self.head_dim),
                                                 self.partial_m[:n].view(shape), self.partial_l[:n].view(shape))
        return views


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def default_num_splits(batch: int, num_kv_heads: int, device: torch.device | str = "cuda",
                       max_splits: int = FEW_ROWS_MAX_SPLITS, head_dim: int = 64) -> int:
    """Splits per (row, KV head) so that the grid has about 4 programs per SM at head_dim 64, 2 at 128; at most
    :data:`MAX_SPLITS`, or :data:`FEW_ROWS_MAX_SPLITS` at up to :data:`FEW_ROWS` rows (and ``max_splits``).

    Depends on the batch size and head shape only (never on lengths), so one value serves a whole
    CUDA-graph bucket.  Short rows simply leave the later splits empty.  The H100 sweep
    (``scripts/bench_kernels.py decode-attention``, 512-token rows): at head_dim 128 a program streams twice
    the bytes per tile and fewer, longer programs won at batch 32 and 64 (batch 64: 1 split 50 us
    against 2 splits 55 us per layer); at head_dim 64 the 4-per-SM rule was best at every batch.  An FP8 cache
    takes the same counts: with its deeper pipelines (:func:`_default_config`) they were the best of 1-16 splits
    on an H200 at every row count from 4 to 256 (`decode_stages_h200_2026-11-30.json`).  At one row 16 splits left
    most SMs idle (8 KV heads: 128 programs on 132 SMs): 32 splits, on an H200, took 16k tokens from 38.0 to 26.6 us
    (8B heads; FP8 18.5 -> 14.1; 1B heads 34.9 -> 20.5), 2k tokens 1.04-1.17x; one row of 512 tokens with 1B heads
    took 0.36 us longer (4.09 -> 4.45: there the extra splits are empty programs); at 2-4 rows they were slower at
    some lengths (2 rows of 512, 8B heads: 7.6 against 6.0 us; `attention_few_rows_h200_2026-11-30.json`).
    """
    cap = min(max_splits, FEW_ROWS_MAX_SPLITS if batch <= FEW_ROWS else MAX_SPLITS)
    return _splits(batch * num_kv_heads, _programs_wanted(device, head_dim), cap)


def split_pairs(max_rows: int, num_kv_heads: int, device: torch.device | str = "cuda",
                max_splits: int = FEW_ROWS_MAX_SPLITS, head_dim: int = 64) -> int:
    """The most (row, split) pairs :func:`default_num_splits` asks for at any row count up to ``max_rows``: what a
    :class:`DecodeWorkspace` holds so that no call gets fewer splits than that rule gives (a speculative step of
    one slot at K = 8 is 9 rows: cut from 16 splits to 2, the default model's verify step took 0.97 ms on an H200
    against 0.71)."""
    return max((r * default_num_splits(r, num_kv_heads, device, max_splits, head_dim)
                for r in range(1, max_rows + 1)), default=0)


def _programs_wanted(device: torch.device | str, head_dim: int) -> int:
    return 4 * _num_sms(torch.device(device)) * 64 // max(64, triton.next_power_of_2(head_dim))


def _splits(row_heads: int, want: int, max_splits: int) -> int:
    s = 1
    while s < max_splits and row_heads * s < want:
        s *= 2
    return s


# an FP8 cache's tiles: up to this many rows long ones (the few programs each stream more), past it short ones
FP8_FEW_ROWS = 2


def _default_config(head_dim: int, fp8: bool = False, rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages).  bf16: the best of the H100 sweep in docs/kernels.md, but at 3-4 rows
    (head_dim 64) and 4 rows (128) 64-token tiles in two-warp programs (H200, 512-16k tokens: 8B heads at 4 rows
    15.7 -> 10.8 us at 2k, 90.7 -> 69.3 at 16k; 1B heads at 3-4 rows 1.0-1.25x; at 3 rows of 8B heads they lost at
    16k; `attention_few_rows_h200_2026-11-30.json`).  An FP8 cache: the best over contexts of 512 to 16k tokens in
    H200 sweeps of 1-256 rows (8B and 1B heads, `decode_stages_h200_2026-11-30.json`,
    `fp8_attention_warps_h200_2026-11-30.json`).  At head_dim 128 its pipelines are 5 stages deep: the page-id load
    of each tile takes a stage of the compiler's pipeline, and below 5 the K and V tiles had one buffer, loaded
    after the previous tile's products, so that no load overlapped them (5 give two buffers: the next tile in
    flight); past 128 rows 128-token tiles (3-4% faster at 256 rows of 512-2,048 tokens, 2% slower at 128 rows of
    1k).  From 3 to 128 rows two warps a program, not four: the softmax's row max and sum and the probabilities'
    layout for the P@V product cross warps through shared memory, nine barriers a tile, and with four warps the SMs
    issued in half their cycles (no warp eligible) while DRAM ran at 69% (ncu, 8 rows of 16k); two warps, each
    holding more of the tile, take 3-11% less time at 4-128 rows of 512-16k tokens (8 rows of 16k: 72.1 against
    77.5 us).  At head_dim 64 long tiles up to :data:`FP8_FEW_ROWS` rows, short ones in many small programs past it.
    """
    if fp8:
        if head_dim <= 64:
            return (256, 4, 3) if rows <= FP8_FEW_ROWS else (64, 2, 4)
        if rows <= FP8_FEW_ROWS or rows > 128:
            return (128, 4, 5)
        return (64, 2, 5)
    if head_dim <= 64:
        return (64, 2, 3) if 3 <= rows <= 4 else (32, 2, 3)
    return (64, 2, 3) if rows == 4 else (64, 4, 3)


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens) -> None:
    assert q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape)
    B, H, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    assert Dk == D and D <= 256, "head_dim mismatch or > 256"
    assert H % Hkv == 0, "num_heads must be a multiple of num_kv_heads"
    assert block_size & (block_size - 1) == 0 and 1 <= block_size <= 256, "block_size must be a power of two"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert v_cache.dtype == k_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn), k_cache.dtype
    assert k_cache.dtype != torch.float8_e4m3fn or D % 2 == 0, "an FP8 cache needs an even head_dim"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "last dim must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] >= B and block_tables.dtype == torch.int32
    assert block_tables.stride(1) == 1
    assert context_lens.shape == (B,) and context_lens.dtype == torch.int32
    assert q.device == k_cache.device == block_tables.device == context_lens.device


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[DecodeWorkspace] = None,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    kv_scale: tuple[float, float] = (1.0, 1.0),
    config_rows: Optional[int] = None,
) -> torch.Tensor:
    """Paged decode attention (``kv_scale``: an FP8 cache's (K, V) scales: values = stored * scale).

    q ``[B, H, D]`` (last dim contiguous), k_cache/v_cache ``[num_blocks, block_size, Hkv, D]``
    (last dim contiguous), block_tables ``[B, max_blocks]`` int32, context_lens ``[B]`` int32
    on the device (rows with length 0 give zeros).  Returns ``out [B, H, D]`` in q's dtype.

    For CUDA-graph capture pass ``out`` and ``workspace`` (allocated beforehand) and a
    fixed ``num_splits`` (default :func:`default_num_splits` of the batch size).  ``config_rows``: the row count
    whose default tile the call takes (default its own; an FP8 cache's tile depends on it, so a batch-invariant
    caller passes one value for every call).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    # an FP8 cache under 16-bit queries: float16 products on e4m3 read two a word, its own tiles
    fp8 = k_cache.dtype == torch.float8_e4m3fn and q.dtype in (torch.bfloat16, torch.float16)
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, q.device, workspace.max_splits if workspace else FEW_ROWS_MAX_SPLITS, D)
    dflt = _default_config(D, fp8, B if config_rows is None else config_rows)
    block_n = block_n or dflt[0]
    num_warps = num_warps or dflt[1]
    num_stages = num_stages or dflt[2]
    if B == 0:
        return out
    if num_splits > 1:
        if workspace is None:
            workspace = DecodeWorkspace(B, H, D, num_splits, q.device)
        assert workspace.num_heads == H and workspace.head_dim == D
        po, pm, pl = workspace.partials(B, num_splits)
        arrivals = workspace.arrivals
    else:
        po = pm = pl = out  # unused
        arrivals = context_lens
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    d_pad = triton.next_power_of_2(D)
    _split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, po, pm, pl, arrivals,
        scale * _LOG2E * kv_scale[0], kv_scale[1],
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        po.stride(0) if num_splits > 1 else 0, po.stride(1) if num_splits > 1 else 0,
        po.stride(2) if num_splits > 1 else 0,
        pm.stride(0) if num_splits > 1 else 0, pm.stride(1) if num_splits > 1 else 0,
        arrivals.stride(0) if num_splits > 1 else 0,
        GROUP=G, G_PAD=max(16, triton.next_power_of_2(G)), G_MERGE=max(2, triton.next_power_of_2(G)),
        HEAD_DIM=D, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, S_PAD=max(2, triton.next_power_of_2(num_splits)), DOT_PREC=dot_prec,
        F16_DOTS=fp8,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q),
    )
    return out
