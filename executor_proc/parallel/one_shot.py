"""The one-shot all-reduce: small tensors summed over peer-to-peer buffers, for tensor-parallel ranks on one host.

A decode step all-reduces ``[rows, hidden]`` twice a layer, a few KiB; NCCL's ring costs about 10 us a call
however small the tensor.  One shot instead::

    rank r: x_r -> copy into buffer[r]              buffer[0] | buffer[1] | ... | buffer[N-1]
            barrier (flags in the same memory)       one per rank, every rank maps every rank's (CUDA IPC)
            out = buffer[0] + buffer[1] + ... + buffer[N-1]   (read over NVLink, added in rank order)
            barrier (nobody refills its buffer while a peer still reads it)

Every rank adds the same N values in the same order, so every rank gets the same bits (the ranks then sample
the same token: :mod:`executor_proc.parallel.model`).  One kernel, no host work: it is captured in the CUDA graphs
like the rest of the step.

The kernel is torch's: ``torch.ops.symm_mem.one_shot_all_reduce_out(Tensor input, str reduce_op, str group_name,
Tensor(a!) out) -> Tensor(a!)`` (registered in torch/csrc/distributed/c10d/symm_mem/SymmetricMemory.cpp, the
kernel in CUDASymmetricMemoryOps.cu; torch 2.11 has it), or where ``x_r`` starts on a 16-byte boundary its
``one_shot_all_reduce_copy_out(Tensor symm_buffer, Tensor local_input, ...)``, which copies ``x_r`` into the buffer
itself (a launch fewer: 8B decode step at TP=2 -2.3%, docs/performance.md).  ``input`` is a view of a buffer from
``torch.distributed._symmetric_memory.empty`` that every rank has ``rendezvous``-ed (its cuMem allocation shared
by file descriptor and mapped on every peer; the first rendezvous is a collective with host work, so it runs at
start-up, never inside a capture, and later calls find it cached); ``out`` is any contiguous tensor.  Its
``load_and_reduce`` (CUDASymmetricMemory-inl.h) loads the N buffers and adds them from rank 0 up, specialised for
world sizes 2, 4 and 8 (:data:`ipc.config.ONE_SHOT_RANKS`); float32 and bfloat16 only.  It reads the peers'
buffers point to point and needs no multicast object (NVLink multicast stays off: ``NO_MULTICAST_ENV``).

Barrier flags.  Each buffer has a signal pad, one 32-bit slot per (thread block, peer).  A block signals peer p by
a compare-and-swap 0 -> 1 on its slot in p's pad (spinning while it is still 1: p has not consumed the last
signal), and waits for p by a compare-and-swap 1 -> 0 on p's slot in its own pad.  Every signal is consumed by
the one wait it is meant for, so after each launch every pad is back to zeros: a barrier never meets the flags of
an earlier call, and no host-side counter is baked into a captured graph, which can therefore be replayed any
number of times, between eager calls, as long as every rank runs the same sequence (the same plans, in order).
This does the job of epoch numbers without a counter to keep in step.

Rank death.  The flags have no timeout: a rank whose peer died spins in the barrier, exactly as NCCL's kernels
spin on a dead peer.  The supervisor treats the group as one executor (``scheduler_proc/supervisor.py``): a rank's
exit, or no step result for the hang timeout, kills every rank (SIGKILL ends a process whatever its GPU is
running) and starts a new group, with new buffers and zeroed pads.

Which all-reduces go one shot is decided from shapes and the dtype alone (:func:`takes_one_shot`), so every rank
decides alike.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from executor_proc.memory_plan import StartupRefused
from ipc.config import ONE_SHOT_MAX_BYTES, ONE_SHOT_RANKS

KiB = 1024
MiB = 1024 * KiB
# --all-reduce auto (the default): one-shot up to these sizes (bytes, by number of ranks), NCCL past them.  Measured
# on H200s over NVLink (scripts/bench_tp.py --parts allreduce): inside a replayed graph one shot beats NCCL at every
# size timed, at 2 ranks from 1 KiB to 2 MiB, the buffer's size (7.0 against 11.2 us at 1 KiB, 20.5 against 31.2
# at 2 MiB), and at 4 from 1 KiB to 1 MiB, the largest timed there (7.4 / 14.5, 19.9 / 23.0, the gap closing).
# 8 ranks not measured: vLLM's choice of its one-shot kernel there (custom_all_reduce.cuh: below 256 KiB).  A decode
# row of the 8B shape all-reduces 8 KiB: batches up to 128 rows (256 at 2 ranks) go one shot, prefill chunks NCCL.
AUTO_MAX_BYTES = {2: ONE_SHOT_MAX_BYTES, 4: 1 * MiB, 8: 256 * KiB}
DTYPES = (torch.float32, torch.bfloat16)  # what torch's kernel is built for
WORD = 4  # the kernel moves 4, 8 or 16 bytes a thread: a tensor must be a whole number of 4-byte words


class OneShotRefused(StartupRefused):
    """``--all-reduce one-shot`` cannot run on these devices (one line naming the flag)."""


def takes_one_shot(mode: str, world_size: int, nbytes: int, dtype: torch.dtype) -> bool:
    """Whether an all-reduce of ``nbytes`` of ``dtype`` over ``world_size`` ranks runs one shot under
    ``--all-reduce mode`` (else NCCL): ``one-shot`` up to the buffer's size, ``auto`` up to :data:`AUTO_MAX_BYTES`."""
    if mode == "nccl" or world_size not in ONE_SHOT_RANKS or dtype not in DTYPES:
        return False
    if not 0 < nbytes <= ONE_SHOT_MAX_BYTES or nbytes % WORD:
        return False
    return mode == "one-shot" or nbytes <= AUTO_MAX_BYTES[world_size]


class OneShotAllReduce:
    """This rank's buffer of the group's symmetric set, and the kernel that sums the set (``TPGroup.all_reduce``
    calls it for the tensors :meth:`takes` accepts)."""

    def __init__(self, mode: str, world_size: int, device: torch.device, group_name: str,
                 nbytes: int = ONE_SHOT_MAX_BYTES):
        from torch.distributed import _symmetric_memory as symm_mem

        # Never a multicast object, even where a caller forgot NO_MULTICAST_ENV: read at allocation.
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        self.mode = mode
        self.world_size = world_size
        self.group_name = group_name
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)  # viewed as each call's dtype
        torch.cuda.synchronize(device)  # its signal pad is zeroed before any peer can signal into it
        # A collective: every rank maps every buffer.  The group is found by name (torch 2.11 deprecated
        # enable_symm_mem_for_group: rendezvous reaches the group's store itself).
        self.handle = symm_mem.rendezvous(self.buffer, group_name)
        # The variant that copies the input into the buffer itself (a launch fewer a call; torch 2.11 has it).
        self.copy_in = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")

    def takes(self, x: torch.Tensor) -> bool:
        return takes_one_shot(self.mode, self.world_size, x.numel() * x.element_size(), x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        if self.copy_in and x.is_contiguous() and x.data_ptr() % 16 == 0:
            # One launch: the kernel copies x into this rank's buffer, then stores the sum over x.  Each thread
            # copies and later stores the same elements, so summing in place reads nothing it has overwritten.
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, x)
            return x
        staged.copy_(x)
        # The kernel stores as wide as the buffer's alignment allows, into ``out`` unchecked: a view that starts
        # off a 16-byte boundary (or is not contiguous) gets its sum through a fresh tensor.
        out = x if x.is_contiguous() and x.data_ptr() % 16 == 0 else torch.empty_like(
            x, memory_format=torch.contiguous_format)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        if out is not x:
            x.copy_(out)
        return x


def why_not_here(world_size: int, devices: list[torch.device]) -> Optional[str]:
    """Why the one-shot path cannot run on ``devices`` (every rank's, in rank order), or None.  Every rank asks
    the same questions of the same devices, so every rank gets the same answer."""
    if world_size not in ONE_SHOT_RANKS:
        return f"it runs on {', '.join(map(str, ONE_SHOT_RANKS[:-1]))} or {ONE_SHOT_RANKS[-1]} ranks, not {world_size}"
    if not _has_op():
        return f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce_out"
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"{a} cannot read {b} peer to peer"
    return None


def _has_op() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out")
    except (ImportError, RuntimeError):
        return False


def setup_one_shot(mode: str, rank: int, world_size: int, device: torch.device,
                   group_name: str) -> Optional[OneShotAllReduce]:
    """The one-shot path of ``--all-reduce mode`` for this rank (None: NCCL alone); raises :class:`OneShotRefused`
    for ``one-shot`` where it cannot run.  A collective: every rank calls it at the same point."""
    if mode == "nccl":
        return None
    devices = [torch.device("cuda", device.index - rank + r) for r in range(world_size)]  # rank r on cuda:(i + r)
    why = why_not_here(world_size, devices)
    if why is None:
        return OneShotAllReduce(mode, world_size, device, group_name)
    if mode == "one-shot":
        raise OneShotRefused(f"--all-reduce one-shot cannot run here: {why}; use --all-reduce nccl or auto")
    return None
