"""Shared pieces of the paged attention kernels."""

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_ptr, v_ptr, bt_row, t, t_mask, kvh, offs_d, d_mask,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 BLOCK_SIZE: tl.constexpr):
    """K and V ``[len(t), D_PAD]`` of one row's tokens ``t`` (KV head ``kvh``), through its block table."""
    blk = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    off = (t % BLOCK_SIZE).to(tl.int64)
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + (blk * stride_kb + off * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + (blk * stride_vb + off * stride_vt + kvh * stride_vh)[:, None] + offs_d[None, :],
                mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def load_words(w_ptr, blk, off, t_mask, kvh, offs_w, w_dims, stride_b, stride_t, stride_h):
    """16-bit words ``[len(blk), len(offs_w)]`` of an FP8 cache (two e4m3 values each; ``w_ptr``: the cache as
    ``uint16``) for tokens at (page ``blk``, offset ``off``), KV head ``kvh``; strides in e4m3 values."""
    return tl.load(w_ptr + ((blk * stride_b + off * stride_t + kvh * stride_h) // 2)[:, None] + offs_w[None, :],
                   mask=t_mask[:, None] & w_dims[None, :], other=0)


@triton.jit
def load_kv_pair(k_ptr, v_ptr, bt_row, t, t_end, kvh, offs_d, stride_b, stride_t, stride_h,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr):
    """K and V ``[len(t), D_PAD]`` of tokens ``t`` (KV head ``kvh``) when K and V share their strides.

    One page-id load and one address computation serve both.  ``MASKED``: tokens at or past
    ``t_end`` read 0 (page id 0); otherwise every token of ``t`` must be below ``t_end`` and the
    loads carry no token mask (what lets the compiler pipeline them as plain async copies).
    """
    if MASKED:
        t_mask = t < t_end
        blk = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0)
    else:
        blk = tl.load(bt_row + t // BLOCK_SIZE)
    off = blk.to(tl.int64) * stride_b + (t % BLOCK_SIZE) * stride_t + kvh * stride_h
    ptr = off[:, None] + offs_d[None, :]
    if MASKED:
        mask = t_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + ptr, mask=mask, other=0.0)
        v = tl.load(v_ptr + ptr, mask=mask, other=0.0)
    elif HEAD_DIM == D_PAD:
        k = tl.load(k_ptr + ptr)
        v = tl.load(v_ptr + ptr)
    else:
        mask = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + ptr, mask=mask, other=0.0)
        v = tl.load(v_ptr + ptr, mask=mask, other=0.0)
    return k, v
