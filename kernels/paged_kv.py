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
