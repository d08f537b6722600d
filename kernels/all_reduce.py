"""The one-shot all-reduce as one Triton kernel: every rank reads every rank's buffer over NVLink and adds them.

Tensor-parallel ranks on one host each hold a buffer that every rank has mapped (torch's symmetric memory, CUDA
IPC under it: ``executor_proc/parallel/one_shot.py`` allocates them and passes their addresses).  A call sums
``x`` of ``n`` elements over the ranks, in place::

    program p of rank r:  x[chunk p] -> buffer[r][half][chunk p]          (its own buffer, local)
                          signal program p of every peer; wait for each   (flags in the peers' memory)
                          x[chunk p] = buffer[0][half][chunk p] + ... + buffer[N-1][half][chunk p]

Program p of every rank handles the same chunk (the grid and the chunking follow ``n`` alone), so program p
only waits for the peers' programs p: no grid-wide barrier, and the programs of a large sum all pull from the
peers at once (torch's one-shot kernel, which this one replaces at 2 ranks, took 21.5 us for 2 MiB there on H200s,
about 100 GB/s of NVLink's ~450; this one 12.7 us).  The sum is float32 from rank 0 up, rounded once, so every rank
gets the same bits.

One barrier a call, not two.  Calls alternate between two halves of each buffer (``half``, a parity that the
last program of a call to finish flips on the device, so a captured graph replays any number of times and eager
calls may come between replays).  A peer can still be reading this rank's half of call i while this rank writes
call i + 1's, which goes to the other half; call i + 2 writes the first half again only after every program of
call i + 1 has heard from the peers' programs of call i + 1, which each peer starts after its call i has ended.

Flags.  Rank r's flag array holds one int32 slot per (program, peer).  Program p signals peer q by a
compare-and-swap 0 -> 1 on slot (p, r) in q's array (spinning while it is still 1: q has not consumed the last
signal) and waits for q by a compare-and-swap 1 -> 0 on slot (p, q) of its own array, so every slot is zero
again after each call.  Release and acquire at system scope order the buffer writes before the signal and the
reads after the wait; a CTA barrier on each side extends them to the program's other threads.  No timeout: a
rank whose peer died spins, as NCCL's kernels do, and the supervisor kills the group.

The grid never exceeds :data:`MAX_PROGRAMS`, fewer than an H100's 132 SMs, and a program uses little of an SM,
so every program of a call is resident at once (a program that spins never holds back one that has not started).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_wait

__all__ = ["MAX_PROGRAMS", "STATE_WORDS", "one_shot_all_reduce", "plan"]

MAX_PROGRAMS = 128
MIN_CHUNK = 2048  # elements a program at least (4 KiB of bfloat16): a decode row of 4,096 takes 2 programs
BLOCK = 2048  # elements a loop iteration of a program (16 bytes a thread at 8 warps, bfloat16)
NUM_WARPS = 8
STATE_WORDS = 2  # int32 words of local state a rank keeps: the current half, and the programs done this call


def plan(n: int) -> tuple[int, int]:
    """``(programs, chunk)`` for ``n`` elements: chunks of whole blocks, as few programs as :data:`MIN_CHUNK`
    allows up to :data:`MAX_PROGRAMS`.  A function of ``n`` only, so every rank launches the same grid."""
    programs = max(1, min(MAX_PROGRAMS, triton.cdiv(n, MIN_CHUNK)))
    chunk = triton.cdiv(triton.cdiv(n, programs), BLOCK) * BLOCK
    return triton.cdiv(n, chunk), chunk


@triton.jit
def _one_shot_kernel(x_ptr, buffers_ptr, flags_ptr, state_ptr, n, chunk, half_elems,
                     RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    pdl_wait(USE_PDL)  # x is the previous kernel's output; the state, the previous all-reduce's
    dtype = x_ptr.dtype.element_ty
    half = tl.load(state_ptr)
    lo = pid * chunk
    hi = tl.minimum(lo + chunk, n)
    steps = tl.cdiv(hi - lo, BLOCK)
    mine = tl.multiple_of(tl.load(buffers_ptr + RANK).to(tl.pointer_type(dtype)), 16) + half * half_elems
    for i in range(steps):
        offs = lo + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < hi
        tl.store(mine + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)

    tl.debug_barrier()  # every thread's copy is done before the signal (released at system scope)
    my_flags = tl.load(flags_ptr + RANK).to(tl.pointer_type(tl.int32)) + pid * WORLD
    for q in tl.static_range(WORLD):
        if q != RANK:
            slot = tl.load(flags_ptr + q).to(tl.pointer_type(tl.int32)) + pid * WORLD + RANK
            while tl.atomic_cas(slot, 0, 1, sem="release", scope="sys") != 0:
                pass
    for q in tl.static_range(WORLD):
        if q != RANK:
            while tl.atomic_cas(my_flags + q, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()  # no thread reads a peer's chunk before the waits have acquired it

    for i in range(steps):
        offs = lo + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < hi
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            src = tl.multiple_of(tl.load(buffers_ptr + q).to(tl.pointer_type(dtype)), 16) + half * half_elems
            acc += tl.load(src + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(x_ptr + offs, acc.to(dtype), mask=mask)

    # The last program to finish flips the half for the next call (every program read it before arriving here).
    tl.debug_barrier()
    if tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, 1 - half)


def one_shot_all_reduce(x: torch.Tensor, buffers: torch.Tensor, flags: torch.Tensor, state: torch.Tensor,
                        half_bytes: int, rank: int, world: int) -> torch.Tensor:
    """Sum contiguous ``x`` over the ranks in place; returns ``x``.  ``buffers`` / ``flags``: int64 ``[world]``
    addresses of every rank's buffer (two halves of ``half_bytes``) and flag array (``MAX_PROGRAMS * world``
    int32, zeros at start); ``state``: this rank's :data:`STATE_WORDS` int32, zeros at start."""
    n = x.numel()
    assert x.is_contiguous() and 0 < n * x.element_size() <= half_bytes, (x.shape, half_bytes)
    programs, chunk = plan(n)
    _one_shot_kernel[(programs,)](x, buffers, flags, state, n, chunk, half_bytes // x.element_size(),
                                  RANK=rank, WORLD=world, BLOCK=BLOCK, num_warps=NUM_WARPS, **pdl_args(x))
    return x
