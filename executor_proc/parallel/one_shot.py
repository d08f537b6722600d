"""The one-shot all-reduce: small tensors summed over peer-to-peer buffers, for tensor-parallel ranks on one host.

A decode step all-reduces ``[rows, hidden]`` twice a layer, a few KiB; NCCL's ring costs about 10 us a call
however small the tensor.  One shot instead, in one kernel (``kernels/all_reduce.py`` at 2 ranks; torch's
``torch.ops.symm_mem.one_shot_all_reduce_copy_out`` at 4 and 8, :data:`TRITON_RANKS` says why)::

    rank r: x_r -> copy into buffer[r]              buffer[0] | buffer[1] | ... | buffer[N-1]
            signal the peers, wait for them          flags in the same memory; every rank maps every rank's
            x = buffer[0] + buffer[1] + ... + buffer[N-1]   (read over NVLink, added in rank order)

Every rank adds the same N values in the same order, so every rank gets the same bits (the ranks then sample
the same token: :mod:`executor_proc.parallel.model`).  No host work: it is captured in the CUDA graphs like the
rest of the step.  The Triton kernel's programs each sum one chunk and wait only for the peers' programs of that
chunk, and calls alternate between two halves of each buffer, so one barrier a call suffices (its docstring says
why); torch's kernel has two barriers a call.  Either way the flags go back to zeros after every
call (the Triton kernel's half is flipped on the device), so no host-side counter is baked into a captured graph,
which can therefore be replayed any number of times, between eager calls, as long as every rank runs the same
sequence (the same plans, in order).

The buffers come from ``torch.distributed._symmetric_memory.empty``, ``rendezvous``-ed by every rank at start-up
(its cuMem allocation shared by file descriptor and mapped on every peer; the rendezvous is a collective with host
work, so it never runs inside a capture); the kernel gets every rank's address.  It reads the peers' buffers
point to point and needs no multicast object (NVLink multicast stays off: ``NO_MULTICAST_ENV``).

Rank death.  The flags have no timeout: a rank whose peer died spins in the barrier, exactly as NCCL's kernels
spin on a dead peer.  The supervisor treats the group as one executor (``scheduler_proc/supervisor.py``): a rank's
exit, or no step result for the hang timeout, kills every rank (SIGKILL ends a process whatever its GPU is
running) and starts a new group, with new buffers and zeroed flags.

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
# on H200s over NVLink (scripts/bench_tp.py --parts allreduce, 20 calls in a replayed graph): at 2 ranks one shot
# (the Triton kernel) beats NCCL at every size up to the buffer's 2 MiB (4.9 against 10.2 us at 1 KiB, 12.7 against
# 30.4 at 2 MiB); at 4, torch's one-shot kernel beats NCCL from 1 KiB to 1 MiB, the largest timed there (7.4 / 14.5,
# 19.9 / 23.0 us).  8 ranks not measured: vLLM's choice of its one-shot kernel there (custom_all_reduce.cuh: below
# 256 KiB).  A decode row of the 8B shape all-reduces 8 KiB: batches up to 128 rows (256 at 2 ranks) go one shot,
# prefill chunks NCCL.
AUTO_MAX_BYTES = {2: ONE_SHOT_MAX_BYTES, 4: 1 * MiB, 8: 256 * KiB}
DTYPES = (torch.float32, torch.bfloat16)  # the model dtypes of tensor-parallel serving
# Group sizes that run the Triton kernel: those it is checked and timed at on GPUs.  Larger groups keep torch's
# one-shot kernel (torch.ops.symm_mem.one_shot_all_reduce_copy_out / _out; specialised for 2, 4 and 8 ranks,
# float32 and bfloat16, tensors of whole 4-byte words), checked and timed at 4 ranks on H200s (above).
TRITON_RANKS = (2,)
WORD = 4  # torch's kernel moves 4, 8 or 16 bytes a thread


class OneShotRefused(StartupRefused):
    """``--all-reduce one-shot`` cannot run on these devices (one line naming the flag)."""


def takes_one_shot(mode: str, world_size: int, nbytes: int, dtype: torch.dtype) -> bool:
    """Whether an all-reduce of ``nbytes`` of ``dtype`` over ``world_size`` ranks runs one shot under
    ``--all-reduce mode`` (else NCCL): ``one-shot`` up to the buffer's size, ``auto`` up to :data:`AUTO_MAX_BYTES`."""
    if mode == "nccl" or world_size not in ONE_SHOT_RANKS or dtype not in DTYPES:
        return False
    if not 0 < nbytes <= ONE_SHOT_MAX_BYTES or (world_size not in TRITON_RANKS and nbytes % WORD):
        return False
    return mode == "one-shot" or nbytes <= AUTO_MAX_BYTES[world_size]


class OneShotAllReduce:
    """This rank's buffer of the group's symmetric set, and the kernel that sums the set (``TPGroup.all_reduce``
    calls it for the tensors :meth:`takes` accepts)."""

    def __init__(self, mode: str, world_size: int, device: torch.device, group_name: str,
                 nbytes: int = ONE_SHOT_MAX_BYTES):
        from torch.distributed import _symmetric_memory as symm_mem

        from kernels.all_reduce import MAX_PROGRAMS, STATE_WORDS, one_shot_all_reduce

        # Never a multicast object, even where a caller forgot NO_MULTICAST_ENV: read at allocation.
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        self.mode = mode
        self.world_size = world_size
        self.group_name = group_name
        self.half_bytes = nbytes
        self.triton = world_size in TRITON_RANKS
        # Triton's: two halves that calls alternate between, then the flags the peers signal this rank's programs
        # in.  Torch's: one buffer (its flags live in the allocation's signal pad).
        size = 2 * nbytes + MAX_PROGRAMS * world_size * 4 if self.triton else nbytes
        self.buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
        if self.triton:
            self.buffer[2 * nbytes:].zero_()
        torch.cuda.synchronize(device)  # the flags are zeros before any peer can signal into them
        # A collective: every rank maps every buffer.  The group is found by name (torch 2.11 deprecated
        # enable_symm_mem_for_group: rendezvous reaches the group's store itself).
        self.handle = handle = symm_mem.rendezvous(self.buffer, group_name)
        self.rank = handle.rank
        if self.triton:  # every rank's buffer and flags by address, and this rank's half and arrival count
            at = self.buffer.data_ptr() - handle.buffer_ptrs[self.rank]  # the tensor's place in its allocation
            bases = [p + at for p in handle.buffer_ptrs]
            self.buffers = torch.tensor(bases, dtype=torch.int64, device=device)
            self.flags = torch.tensor([b + 2 * nbytes for b in bases], dtype=torch.int64, device=device)
            self.state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=device)
        # Torch's variant that copies the input into the buffer itself (a launch fewer a call; torch 2.11 has it).
        self.copy_in = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        self.kernel = one_shot_all_reduce  # bound once: calls are on every layer's path

    def takes(self, x: torch.Tensor) -> bool:
        return takes_one_shot(self.mode, self.world_size, x.numel() * x.element_size(), x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        # Both kernels load and store 16 bytes wide: a view off a 16-byte boundary (or not contiguous) is summed
        # through a fresh tensor (for Triton's, a misaligned pointer would also be a variant to compile).
        aligned = x.is_contiguous() and x.data_ptr() % 16 == 0
        if self.triton:
            t = x if aligned else x.clone(memory_format=torch.contiguous_format)
            self.kernel(t, self.buffers, self.flags, self.state, self.half_bytes, self.rank, self.world_size)
        elif aligned and self.copy_in:
            staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
            # One launch: the kernel copies x into this rank's buffer, then stores the sum over x.  Each thread
            # copies and later stores the same elements, so summing in place reads nothing it has overwritten.
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, x)
            return x
        else:
            staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
            staged.copy_(x)
            t = x if aligned else torch.empty_like(x, memory_format=torch.contiguous_format)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, t)
        if t is not x:
            x.copy_(t)
        return x


def why_not_here(world_size: int, devices: list[torch.device]) -> Optional[str]:
    """Why the one-shot path cannot run on ``devices`` (every rank's, in rank order), or None.  Every rank asks
    the same questions of the same devices, so every rank gets the same answer."""
    if world_size not in ONE_SHOT_RANKS:
        return f"it runs on {', '.join(map(str, ONE_SHOT_RANKS[:-1]))} or {ONE_SHOT_RANKS[-1]} ranks, not {world_size}"
    if not _has_op(world_size):
        what = "symmetric memory" if world_size in TRITON_RANKS else "torch.ops.symm_mem.one_shot_all_reduce_out"
        return f"torch {torch.__version__} has no {what}"
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"{a} cannot read {b} peer to peer"
    return None


def _has_op(world_size: int) -> bool:
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if world_size in TRITON_RANKS:
            return hasattr(symm_mem, "rendezvous")
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
