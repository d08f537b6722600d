"""The item-copy op (kernels/transfer.py): bit-exact round trips for odd sizes and alignments.

On the CPU the Triton kernel runs in the interpreter (tests/conftest.py sets TRITON_INTERPRET)
with both buffers on the CPU; the CUDA tests copy between the device and pinned host memory,
which the kernel reads and writes in place. Every test compares whole buffers, so a byte
dropped or a byte written outside an item fails as surely as a wrong one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.transfer import TransferConfig, copy_items, copy_items_ref, copy_items_triton

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# The kernel tests run in the interpreter on a CPU box and between the GPU and pinned memory on a GPU one.
DEVICE = "cuda" if CUDA else "cpu"

SIZES = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 4095, 4097]
# Small chunks and blocks so that the interpreter also crosses chunk and loop-step boundaries.
SMALL = TransferConfig(block=256, chunk=1024, num_warps=4)
LARGE = TransferConfig(block=2048, chunk=2048, num_warps=4)  # 4 KiB items: 3 chunks, fewer steps
NARROW = TransferConfig(block=256, chunk=1024, num_warps=4, shifted=False)  # 2- and 1-byte paths


def layout(n_items: int, item_bytes: int, align: torch.Tensor, gen: torch.Generator):
    """Disjoint random item offsets: shuffled slots of ``item_bytes + 16``, each item placed
    ``align[i]`` (0..15) bytes into its slot. Returns (offsets, buffer bytes)."""
    slot = item_bytes + 16
    perm = torch.randperm(n_items, generator=gen)
    return perm * slot + align, n_items * slot + 16


def all_pairs():
    """Source and destination alignments: every pair in 0..15 x 0..15 (256 items)."""
    a = torch.arange(16)
    return a.repeat_interleave(16), a.repeat(16)


def round_trip(item_bytes, src_align, dst_align, seed, copy, device=DEVICE, host_pinned=CUDA, hop_back=True):
    """device pool -> host pool -> second device pool; checks both hops against the reference
    (``hop_back=False``: the first hop only)."""
    gen = torch.Generator().manual_seed(seed)
    n = src_align.numel()
    dev_off, dev_size = layout(n, item_bytes, src_align, gen)
    host_off, host_size = layout(n, item_bytes, dst_align, gen)
    back_off, back_size = layout(n, item_bytes, (src_align * 7 + 3) % 16, gen)
    pool = torch.randint(0, 256, (dev_size,), dtype=torch.uint8, generator=gen)
    host = torch.randint(0, 256, (host_size,), dtype=torch.uint8, generator=gen)
    back = torch.randint(0, 256, (back_size,), dtype=torch.uint8, generator=gen)
    want_host, want_back = host.clone(), back.clone()
    copy_items_ref(pool, want_host, dev_off, host_off, item_bytes)
    copy_items_ref(want_host, want_back, host_off, back_off, item_bytes)

    pool, back = pool.to(device), back.to(device)
    if host_pinned:
        host = host.pin_memory()
    copy(pool, host, dev_off.to(device), host_off.to(device), item_bytes)
    if hop_back:
        copy(host, back, host_off.to(device), back_off.to(device), item_bytes)
    if device != "cpu":
        torch.cuda.synchronize()
    assert torch.equal(host.cpu(), want_host), f"device->host differs, item_bytes={item_bytes}"
    assert not hop_back or torch.equal(back.cpu(), want_back), f"host->device differs, item_bytes={item_bytes}"


@pytest.mark.parametrize("item_bytes", SIZES)
def test_kernel_round_trip_every_alignment(item_bytes):
    src_align, dst_align = all_pairs()
    config = SMALL if item_bytes < 1024 else LARGE
    if item_bytes in (17, 4097):
        config = dataclasses.replace(config, shifted=False)

    def copy(src, dst, so, do, n):
        copy_items_triton(src, dst, so, do, n, config=config)

    # On the CPU both hops are one copy between CPU tensors, and each hop alone meets every (source, destination)
    # alignment pair (the way back starts where the first hop ended and ends at 7 * its source + 3 mod 16, a
    # permutation): one hop suffices; the other kernel tests still make both hops.
    round_trip(item_bytes, src_align, dst_align, seed=item_bytes, copy=copy, hop_back=CUDA)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("config", [SMALL, NARROW])
def test_kernel_random_sizes_and_layouts(seed, config):
    gen = torch.Generator().manual_seed(100 + seed)
    item_bytes = int(torch.randint(1, 3000, (1,), generator=gen))
    n = int(torch.randint(1, 40, (1,), generator=gen))
    src_align = torch.randint(0, 16, (n,), generator=gen)
    dst_align = torch.randint(0, 16, (n,), generator=gen)

    def copy(src, dst, so, do, nb):
        copy_items_triton(src, dst, so, do, nb, config=config)

    round_trip(item_bytes, src_align, dst_align, seed=seed, copy=copy)


@pytest.mark.parametrize("programs", [1, 3, 15])
def test_kernel_few_programs_loop_over_every_item(programs):
    """``max_programs`` below the item count: each program loops over items (16 of them, every source and
    every destination alignment once; every pair is test_kernel_round_trip_every_alignment's), chunks
    included (1,500-byte items, 1,024-byte chunks); 15 leaves one item for a second pass."""
    config = dataclasses.replace(SMALL, max_programs=programs)

    def copy(src, dst, so, do, nb):
        copy_items_triton(src, dst, so, do, nb, config=config)

    src_align = torch.arange(16)
    round_trip(1500, src_align, (src_align * 5 + 3) % 16, seed=programs, copy=copy)


def test_kernel_default_config_many_items():
    """The shipped launch shape (one chunk per small item), many items, int32 offsets.  In the interpreter 64
    items: their addresses still differ by every residue mod 16 on both hops (every path of the kernel), and the
    grid's size means nothing there."""
    gen = torch.Generator().manual_seed(7)
    n, item_bytes = 300 if CUDA else 64, 37
    src_align = torch.randint(0, 16, (n,), generator=gen)
    dst_align = torch.randint(0, 16, (n,), generator=gen)

    def copy32(src, dst, so, do, nb):
        copy_items_triton(src, dst, so.to(torch.int32), do.to(torch.int32), nb)

    round_trip(item_bytes, src_align, dst_align, seed=7, copy=copy32)


def test_reference_matches_a_python_loop():
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (4000,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(4000, dtype=torch.uint8)
    so, do = torch.tensor([5, 1000, 2001]), torch.tensor([3000, 17, 1500])
    copy_items_ref(src, dst, so, do, 333)
    want = torch.zeros(4000, dtype=torch.uint8)
    for s, d in zip(so.tolist(), do.tolist()):
        want[d:d + 333] = src[s:s + 333]
    assert torch.equal(dst, want)


def test_non_byte_dtypes_are_read_as_bytes():
    src = torch.arange(64, dtype=torch.float32, device=DEVICE)
    dst = torch.zeros(64, dtype=torch.bfloat16, device=DEVICE)
    so, do = torch.tensor([1, 130], device=DEVICE), torch.tensor([7, 64], device=DEVICE)
    want = dst.clone()
    copy_items_ref(src, want, so, do, 21)
    copy_items_triton(src, dst, so, do, 21, config=SMALL)
    assert torch.equal(dst.view(torch.uint8).cpu(), want.view(torch.uint8).cpu())


def test_cpu_entry_point_uses_the_reference_and_empty_is_a_no_op():
    src = torch.arange(100, dtype=torch.uint8)
    dst = torch.zeros(100, dtype=torch.uint8)
    copy_items(src, dst, torch.tensor([10]), torch.tensor([50]), 5)
    assert dst[50:55].tolist() == [10, 11, 12, 13, 14] and int(dst.sum()) == 60
    copy_items_triton(src, dst, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), 5)
    copy_items_triton(src, dst, torch.tensor([1]), torch.tensor([2]), 0)
    assert int(dst.sum()) == 60


def test_bad_offsets_raise_clear_errors():
    src, dst = torch.zeros(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dst_offsets out of range"):
        copy_items_triton(src, dst, torch.tensor([0]), torch.tensor([96]), 5)
    with pytest.raises(ValueError, match="1-D of one length"):
        copy_items_triton(src, dst, torch.tensor([0, 1]), torch.tensor([0]), 5)


GPU_SIZES = SIZES + [2048 + 3, 16384 + 5, 65536 - 1, 1 << 20, (1 << 20) + 13]


@needs_cuda
@pytest.mark.parametrize("item_bytes", GPU_SIZES)
def test_gpu_device_pinned_round_trip_every_alignment(item_bytes):
    src_align, dst_align = all_pairs()
    round_trip(item_bytes, src_align, dst_align, seed=item_bytes, copy=copy_items, device="cuda",
               host_pinned=True)


@needs_cuda
@pytest.mark.parametrize("config", [SMALL, NARROW, TransferConfig()])
def test_gpu_random_layouts_pinned_offsets(config):
    """Random sizes and alignments, offsets handed over in pinned host memory."""
    gen = torch.Generator().manual_seed(11)
    for _ in range(8):
        item_bytes = int(torch.randint(1, 70000, (1,), generator=gen))
        n = int(torch.randint(1, 64, (1,), generator=gen))
        src_align = torch.randint(0, 16, (n,), generator=gen)
        dst_align = torch.randint(0, 16, (n,), generator=gen)

        def copy(src, dst, so, do, nb):
            copy_items_triton(src, dst, so.cpu().pin_memory(), do.cpu().pin_memory(), nb, config=config)

        round_trip(item_bytes, src_align, dst_align, seed=n, copy=copy, device="cuda", host_pinned=True)


@needs_cuda
def test_gpu_misaligned_views_and_pinned_tensor_dispatch():
    """Views whose base is not 16-byte aligned; the entry point picks the kernel for pinned."""
    dev = torch.randint(0, 256, (10000,), dtype=torch.uint8, device="cuda")[3:]
    host = torch.zeros(10000, dtype=torch.uint8).pin_memory()[5:]
    so, do = torch.tensor([0, 1000, 2999], device="cuda"), torch.tensor([7, 3001, 6000], device="cuda")
    copy_items(dev, host, so, do, 2501)
    want = torch.zeros(10000 - 5, dtype=torch.uint8)
    copy_items_ref(dev.cpu(), want, so.cpu(), do.cpu(), 2501)
    torch.cuda.synchronize()
    assert torch.equal(host, want)
