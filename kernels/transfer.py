"""Many fixed-size byte items between two memories (device KV pool <-> pinned host pool).

One call copies ``len(src_offsets)`` items of ``item_bytes`` bytes each: item ``i`` goes from
byte ``src_offsets[i]`` of ``src`` to byte ``dst_offsets[i]`` of ``dst``. ``src`` and ``dst``
are contiguous tensors of any dtype, read as flat bytes; offsets are int64 tensors. Any item
size and any alignment is correct: no byte is ever dropped.

:func:`copy_items_ref` is the torch statement of the op (the CPU path and the tests'
reference). :func:`copy_items` is the entry point the executor calls: the Triton kernel where
one exists for the tensors' devices, the reference otherwise.

The kernel (:func:`copy_items_triton`) is one launch over ``items x chunks``. Pinned host
memory is read and written in place through unified virtual addressing: a pinned CPU tensor's
address is valid on the device, and it reaches Triton as a :class:`_DevicePointer` (an object
with ``data_ptr()`` and ``dtype``, which Triton's launcher treats like a tensor), rounded down
to 16 bytes with the remainder added to the offsets. Per item, with ``r = (src - dst) mod 16``:
``r`` a multiple of 4 -> the widest unit ``G`` (16, 8 or 4 bytes) dividing ``r``; a byte head
brings both addresses to a multiple of ``G``, the body moves ``G``-byte units (16 as
``int32 x 4`` vectors). Otherwise the destination is aligned to 16 and each of its words is
built from the two aligned source words it straddles (shifted-word path). A masked byte tail
takes what is left after the last whole unit, so no byte is dropped.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["ItemCopy", "TransferConfig", "as_bytes", "copy_items", "copy_items_ref", "copy_items_triton",
           "default_config"]


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


@dataclass(frozen=True)
class TransferConfig:
    """Launch shape: ``block`` bytes per loop step, ``chunk`` bytes of an item per program;
    ``shifted``: items whose addresses disagree modulo 4 take the shifted-word path (else
    2- or 1-byte accesses); ``max_programs``: at most this many programs per chunk, each
    looping over items (None: one program per item and chunk). A copy that runs beside
    other kernels (the host tier's backups) takes a few SMs at PCIe speed instead of
    flooding every SM with programs that wait on PCIe while the other kernels queue."""

    block: int = 8192
    chunk: int = 16384
    num_warps: int = 4
    shifted: bool = True
    max_programs: Optional[int] = None


DEFAULT_CONFIG = TransferConfig()


def default_config(item_bytes: int) -> TransferConfig:
    """The launch shape for items of this size: one shape for all, since the H100 sweep
    (docs/kernels.md, "Host transfer") found no item size that gains from another."""
    return DEFAULT_CONFIG


@triton.jit
def _as_units(ptr, E: tl.constexpr):
    """``ptr`` (bytes) as a pointer to ``E``-byte integers."""
    if E == 8:
        return ptr.to(tl.pointer_type(tl.int64))
    elif E == 4:
        return ptr.to(tl.pointer_type(tl.int32))
    elif E == 2:
        return ptr.to(tl.pointer_type(tl.int16))
    else:
        return ptr


@triton.jit
def _copy_span(src_ptr, dst_ptr, s, d, n, chunk, G: tl.constexpr, CHUNK: tl.constexpr,
               BLOCK: tl.constexpr):
    """One program's share of one item whose two addresses agree modulo ``G`` bytes.

    ``s``/``d`` are the item's byte addresses relative to 16-byte-aligned bases. Program
    ``chunk`` moves body units ``[chunk * CHUNK, +CHUNK)`` (in bytes); chunk 0 also moves the
    byte head (up to the first ``G``-aligned address) and the byte tail (after the last unit).
    """
    E: tl.constexpr = 4 if G == 16 else G  # element bytes; a 16-byte unit is int32 x 4
    K: tl.constexpr = G // E  # elements per unit
    head = tl.minimum((G - d % G) % G, n)
    units = (n - head) // G
    if chunk == 0:
        j = tl.arange(0, 16)
        hm = j < head
        tl.store(dst_ptr + d + j, tl.load(src_ptr + s + j, mask=hm), mask=hm)
        t0 = head + units * G
        tm = j < n - t0
        tl.store(dst_ptr + d + t0 + j, tl.load(src_ptr + s + t0 + j, mask=tm), mask=tm)
    src_u = _as_units(src_ptr, E) + ((s + head) // G) * K
    dst_u = _as_units(dst_ptr, E) + ((d + head) // G) * K
    lo = chunk * (CHUNK // E)
    hi = tl.minimum(lo + CHUNK // E, units * K)
    for k in range(lo, hi, BLOCK // E):
        idx = k + tl.arange(0, BLOCK // E)
        m = idx < hi
        tl.store(dst_u + idx, tl.load(src_u + idx, mask=m), mask=m)


@triton.jit
def _copy_span_shifted(src_ptr, dst_ptr, s, d, n, chunk, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One program's share of an item whose addresses disagree modulo 4 (``r = s' mod 4 != 0``
    once ``d'`` is 16-aligned): each 16-aligned destination word is built from the two aligned
    source words it straddles, ``(lo >> 8r) | (hi << (32 - 8r))``, so stores stay 16-byte wide.

    The aligned source words each hold at least one byte of the item, so they never cross into
    a page the item does not touch; the extra bytes read are dropped, none are written."""
    head = tl.minimum((16 - d % 16) % 16, n)
    units = (n - head) // 16
    if chunk == 0:
        j = tl.arange(0, 16)
        hm = j < head
        tl.store(dst_ptr + d + j, tl.load(src_ptr + s + j, mask=hm), mask=hm)
        t0 = head + units * 16
        tm = j < n - t0
        tl.store(dst_ptr + d + t0 + j, tl.load(src_ptr + s + t0 + j, mask=tm), mask=tm)
    s1 = s + head
    r = (s1 % 4).to(tl.uint32)
    src_w = src_ptr.to(tl.pointer_type(tl.uint32)) + (s1 - s1 % 4) // 4
    dst_w = dst_ptr.to(tl.pointer_type(tl.uint32)) + ((d + head) // 16) * 4
    lo = chunk * (CHUNK // 4)
    hi = tl.minimum(lo + CHUNK // 4, units * 4)
    for k in range(lo, hi, BLOCK // 4):
        idx = k + tl.arange(0, BLOCK // 4)
        m = idx < hi
        w0 = tl.load(src_w + idx, mask=m)
        w1 = tl.load(src_w + idx + 1, mask=m)
        tl.store(dst_w + idx, (w0 >> (8 * r)) | (w1 << (32 - 8 * r)), mask=m)


@triton.jit
def _copy_item(src_ptr, dst_ptr, src_off_ptr, dst_off_ptr, src_shift, dst_shift, item_bytes, item, chunk,
               CHUNK: tl.constexpr, BLOCK: tl.constexpr, SHIFTED: tl.constexpr):
    """Chunk ``chunk`` of item ``item``, by the widest path its two addresses allow."""
    s = tl.load(src_off_ptr + item).to(tl.int64) + src_shift
    d = tl.load(dst_off_ptr + item).to(tl.int64) + dst_shift
    n = item_bytes.to(tl.int64)
    rel = (s - d) & 15
    if rel == 0:
        _copy_span(src_ptr, dst_ptr, s, d, n, chunk, 16, CHUNK, BLOCK)
    elif rel % 8 == 0:
        _copy_span(src_ptr, dst_ptr, s, d, n, chunk, 8, CHUNK, BLOCK)
    elif rel % 4 == 0:
        _copy_span(src_ptr, dst_ptr, s, d, n, chunk, 4, CHUNK, BLOCK)
    elif SHIFTED:
        _copy_span_shifted(src_ptr, dst_ptr, s, d, n, chunk, CHUNK, BLOCK)
    elif rel % 2 == 0:
        _copy_span(src_ptr, dst_ptr, s, d, n, chunk, 2, CHUNK, BLOCK)
    else:
        _copy_span(src_ptr, dst_ptr, s, d, n, chunk, 1, CHUNK, BLOCK)


# Offsets may lie at any 8-byte place (the executor's upload now puts every part at 16 bytes,
# executor_proc/step/staging.py; other callers need not): a compiled variant per alignment would
# compile (hundreds of ms) at the first call that meets a new one, while serving.
_NO_ALIGN = (dict(do_not_specialize_on_alignment=["src_off_ptr", "dst_off_ptr"])
             if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters else {})


@triton.jit(do_not_specialize=["src_shift", "dst_shift", "item_bytes", "num_items"], **_NO_ALIGN)
def _copy_items_kernel(src_ptr, dst_ptr, src_off_ptr, dst_off_ptr, src_shift, dst_shift, item_bytes, num_items,
                       CHUNK: tl.constexpr, BLOCK: tl.constexpr, SHIFTED: tl.constexpr, PERSISTENT: tl.constexpr):
    """Grid ``(programs, chunks)``: program (p, c) copies chunk ``c`` of item ``p`` (of items ``p``,
    ``p + programs``, ... when ``PERSISTENT``)."""
    chunk = tl.program_id(1)
    if PERSISTENT:
        for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
            _copy_item(src_ptr, dst_ptr, src_off_ptr, dst_off_ptr, src_shift, dst_shift, item_bytes, item, chunk,
                       CHUNK, BLOCK, SHIFTED)
    else:
        _copy_item(src_ptr, dst_ptr, src_off_ptr, dst_off_ptr, src_shift, dst_shift, item_bytes, tl.program_id(0),
                   chunk, CHUNK, BLOCK, SHIFTED)


class _DevicePointer:
    """A raw address Triton's launcher accepts as a pointer argument (it reads ``data_ptr()``
    and ``dtype``); used for pinned host memory and for bases rounded down to 16 bytes."""

    def __init__(self, address: int, dtype: torch.dtype):
        self._address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._address


def _kernel_operand(t: torch.Tensor, interpreted: bool):
    """(pointer argument, byte shift): the base rounded down to 16 bytes plus the remainder.

    The interpreter needs the tensor itself (it copies it to numpy); alignment means nothing
    there, so the shift only keeps the path choice identical to the GPU's."""
    addr = t.data_ptr()
    if interpreted:
        return t, 0
    return _DevicePointer(addr - addr % 16, torch.uint8), addr % 16


def _offsets_operand(off: torch.Tensor, device: torch.device, interpreted: bool):
    """Offsets where the kernel can read them: on the device, pinned (by address), or copied up."""
    if off.dtype not in (torch.int32, torch.int64):
        off = off.to(torch.int64)
    off = off.contiguous()
    if interpreted or off.is_cuda:
        return off
    if off.is_pinned():
        return _DevicePointer(off.data_ptr(), off.dtype)
    return off.to(device)


def _check(src_offsets: torch.Tensor, dst_offsets: torch.Tensor, s: torch.Tensor, d: torch.Tensor,
           item_bytes: int) -> None:
    if src_offsets.dim() != 1 or src_offsets.shape != dst_offsets.shape:
        raise ValueError(f"src_offsets and dst_offsets must be 1-D of one length, got "
                         f"{tuple(src_offsets.shape)} and {tuple(dst_offsets.shape)}")
    for name, off, buf in (("src_offsets", src_offsets, s), ("dst_offsets", dst_offsets, d)):
        if off.device.type == "cpu":  # cheap to check here; device offsets are the caller's word
            lo, hi = int(off.min()), int(off.max())
            if lo < 0 or hi + item_bytes > buf.numel():
                raise ValueError(f"{name} out of range: [{lo}, {hi}] + item_bytes {item_bytes} "
                                 f"over a buffer of {buf.numel()} bytes")


class ItemCopy:
    """The kernel between two fixed buffers, bound once (pointers, shifts, grid): a call is the launch
    alone, on the current device and stream, with offsets already on the device.  The host tier backs up blocks
    beside most decode steps; ``copy_items_triton``'s per-call checks and set-up would be the host's."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, item_bytes: int, config: TransferConfig | None = None):
        s, d = as_bytes(src), as_bytes(dst)
        self.interpreted = not (s.is_cuda or d.is_cuda)
        if not self.interpreted:
            for name, t in (("src", s), ("dst", d)):
                if not t.is_cuda and not t.is_pinned():
                    raise ValueError(f"copy_items_triton: {name} is pageable host memory; pin it")
        self.device = s.device if s.is_cuda or self.interpreted else d.device
        self.config = config or default_config(item_bytes)
        self.chunks = triton.cdiv(item_bytes, self.config.chunk)
        if self.chunks > 65535:
            raise ValueError(f"item_bytes {item_bytes} over {65535 * self.config.chunk} for chunk {self.config.chunk}")
        self.item_bytes = item_bytes
        self._src, self._src_shift = _kernel_operand(s, self.interpreted)
        self._dst, self._dst_shift = _kernel_operand(d, self.interpreted)

    def __call__(self, src_offsets: torch.Tensor, dst_offsets: torch.Tensor) -> None:
        """Copy ``len(src_offsets)`` items; the offsets (int32/int64, contiguous) on the device."""
        self.launch(src_offsets, dst_offsets, src_offsets.numel())

    def launch(self, src_offsets, dst_offsets, items: int) -> None:
        """Copy ``items`` items; the offsets as the kernel reads them (device tensors, or pinned host memory
        by address: :func:`_offsets_operand`)."""
        if items == 0:
            return
        cfg = self.config
        programs = items if cfg.max_programs is None else max(1, min(items, cfg.max_programs))
        _copy_items_kernel[(programs, self.chunks)](
            self._src, self._dst, src_offsets, dst_offsets, self._src_shift, self._dst_shift, self.item_bytes, items,
            CHUNK=cfg.chunk, BLOCK=cfg.block, SHIFTED=cfg.shifted, PERSISTENT=programs < items,
            num_warps=cfg.num_warps,
        )


def copy_items_triton(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_offsets: torch.Tensor,
    dst_offsets: torch.Tensor,
    item_bytes: int,
    *,
    config: TransferConfig | None = None,
) -> None:
    """The Triton kernel: one launch on the current stream, asynchronous to the host.

    On a GPU one of ``src``/``dst`` may be a pinned CPU tensor (read or written in place over
    PCIe). Under ``TRITON_INTERPRET=1`` both are CPU tensors."""
    if item_bytes <= 0 or src_offsets.numel() == 0:
        return
    _check(src_offsets, dst_offsets, as_bytes(src), as_bytes(dst), item_bytes)
    copy = ItemCopy(src, dst, item_bytes, config)
    interpreted, device = copy.interpreted, copy.device
    with torch.cuda.device(device) if not interpreted else contextlib.nullcontext():
        copy.launch(_offsets_operand(src_offsets, device, interpreted),
                    _offsets_operand(dst_offsets, device, interpreted), src_offsets.numel())


def _kernel_reaches(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """True when the kernel can run: one side on CUDA, the other on CUDA or pinned."""
    if not (src.is_cuda or dst.is_cuda):
        return False
    return all(t.is_cuda or t.is_pinned() for t in (src, dst))


def copy_items(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_offsets: torch.Tensor,
    dst_offsets: torch.Tensor,
    item_bytes: int,
    *,
    config: TransferConfig | None = None,
) -> None:
    """Copy the items; the Triton kernel on CUDA (device and/or pinned host), the torch
    reference elsewhere (CPU only, or pageable host memory)."""
    if _kernel_reaches(src, dst):
        copy_items_triton(src, dst, src_offsets, dst_offsets, item_bytes, config=config)
    else:
        copy_items_ref(src, dst, src_offsets, dst_offsets, item_bytes)
