"""A decode step's per-row inputs from the slot tables, in one launch.

A CUDA-graph decode step starts from three static buffers (``slots``, ``positions``,
``context_lens``) and derives, on the device, what the model reads: the input token
``last_token[slot]``, the row's block table, its KV write index (``-1`` for padded rows)
and int32 context lengths and query starts.  In torch (:func:`kernels.reference.decode_rows_ref`)
that is about ten small launches of 1-2.5 us each; here it is one program per row, launched with
PDL (:mod:`kernels.pdl`) like the model's kernels.  With :mod:`kernels.argmax` it took the H100's
batch-1 1B step from 1.149 to 1.119 ms (docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_launch, pdl_wait
from .reference import DecodeRows, decode_rows_ref  # noqa: F401  (re-exported)

__all__ = ["decode_rows", "decode_rows_ref", "DecodeRows"]

_CHUNK = 512  # block-table entries copied per loop turn


@triton.jit
def _decode_rows_kernel(slots_ptr, pos_ptr, ctx_ptr, last_ptr, table_ptr, ids_ptr, kv_ptr, qs_ptr, ctx32_ptr,
                        bt_ptr, B, W, stride_t, stride_bt, pad_slot, BLOCK_SIZE: tl.constexpr,
                        CHUNK: tl.constexpr, USE_PDL: tl.constexpr = False):
    b = tl.program_id(0)
    pdl_wait(USE_PDL)  # the slot tables and inputs are written by the steps and copies before this one
    slot = tl.load(slots_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    table = table_ptr + slot * stride_t
    block = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
    token = tl.load(last_ptr + slot)
    ctx = tl.load(ctx_ptr + b)
    for w0 in range(0, W, CHUNK):
        offs = w0 + tl.arange(0, CHUNK)
        tl.store(bt_ptr + b * stride_bt + offs, tl.load(table + offs, mask=offs < W), mask=offs < W)
    pdl_launch(USE_PDL)
    tl.store(ids_ptr + b, token)
    tl.store(kv_ptr + b, tl.where(slot == pad_slot, -1, block * BLOCK_SIZE + pos % BLOCK_SIZE))
    tl.store(ctx32_ptr + b, ctx.to(tl.int32))
    tl.store(qs_ptr + b, b)
    if b == B - 1:
        tl.store(qs_ptr + B, B)


def decode_rows(slots: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                last_token: torch.Tensor, block_table: torch.Tensor, pad_slot: int, block_size: int) -> DecodeRows:
    """As :func:`kernels.reference.decode_rows_ref`, in one launch."""
    (b,) = slots.shape
    assert positions.shape == (b,) and context_lens.shape == (b,) and b > 0
    assert block_table.dim() == 2 and block_table.stride(1) == 1 and block_table.dtype == torch.int32
    dev = slots.device
    out = DecodeRows(input_ids=torch.empty(b, dtype=last_token.dtype, device=dev),
                     kv_index=torch.empty(b, dtype=torch.int64, device=dev),
                     query_start=torch.empty(b + 1, dtype=torch.int32, device=dev),
                     context_lens=torch.empty(b, dtype=torch.int32, device=dev),
                     block_tables=torch.empty(b, block_table.shape[1], dtype=torch.int32, device=dev))
    _decode_rows_kernel[(b,)](
        slots, positions, context_lens, last_token, block_table, out.input_ids, out.kv_index, out.query_start,
        out.context_lens, out.block_tables, b, block_table.shape[1], block_table.stride(0),
        out.block_tables.stride(0), pad_slot, BLOCK_SIZE=block_size, CHUNK=_CHUNK, num_warps=1,
        **pdl_args(slots),
    )
    return out
