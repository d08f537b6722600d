"""The tensor-parallel process group: torch.distributed, NCCL on CUDA, gloo on the CPU.

Every collective here is issued by every rank in the same order, because every rank runs the same
plans through the same code: that is what keeps the group in step without any other coordination.
Nothing here reads a device value on the host, so the collectives can sit inside a captured CUDA
graph on NCCL (torch's ProcessGroupNCCL supports capture since NCCL 2.9.6; the communicator is
created and used once eagerly in :func:`init_group`, before any capture; the CUDA tensor-parallel tests
pass on two GPUs).  Under ``--all-reduce auto`` (the default) or ``one-shot``, small all-reduces on CUDA take the
one-shot path of :mod:`executor_proc.parallel.one_shot` instead (faster than NCCL's in graphs on H200s).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import NoReturn, Optional

import torch
import torch.distributed as dist

from executor_proc.parallel.one_shot import OneShotAllReduce, setup_one_shot

# A rank that is gone makes gloo fail at once; a stopped one is the supervisor's hang timeout's to find.
INIT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class TPGroup:
    """This process's place in the group, and the three collectives the sharded model needs."""

    rank: int
    size: int
    backend: str
    one_shot: Optional[OneShotAllReduce] = None  # the one-shot path (--all-reduce one-shot or auto on CUDA)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same bits); returns ``x``.  One shot when it
        is on and takes ``x`` (shape and dtype decide, alike on every rank), else NCCL or gloo."""
        if self.one_shot is not None and self.one_shot.takes(x):
            return self.one_shot(x)
        dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """``[S, n]`` on each rank -> ``[S, size * n]``, rank r's columns at ``r * n``.  ``S`` is the same on every
        rank (one plan): at 0 (a step of prefill chunks that samples no row) no rank gathers."""
        rows, n = x.shape
        if rows == 0:
            return x.new_empty((0, self.size * n))
        out = x.new_empty((self.size * rows, n))
        _all_gather_rows(out, x.contiguous())
        return out.view(self.size, rows, n).transpose(0, 1).reshape(rows, self.size * n)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (capacities sized from each rank's free memory)."""
        t = torch.tensor([value], dtype=torch.int64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Gloo's group is torn down; NCCL's is left to process exit (a destroy after graph capture can
        hang: pytorch/pytorch#115388)."""
        if self.backend == "gloo" and dist.is_initialized():
            dist.destroy_process_group()

    def exit_process(self, code: int) -> NoReturn:
        """End this rank's process now, skipping the interpreter's teardown.

        Gloo's worker threads drop finished work (and the tensors it holds) a moment after the collective
        returns, and ``destroy_process_group`` does not always join them: a thread that needs the GIL
        while the interpreter finalises calls ``std::terminate`` (seen under gdb on torch 2.13:
        ``~AsyncBarrierWork`` -> ``~AsyncAllgatherWork`` -> ``decref_pyobject`` in ``pt_gloo_runloop``;
        pytorch/pytorch#179291).  Our sockets linger 0, so skipping teardown loses nothing."""
        self.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")


# torch 2.13 renamed all_gather_into_tensor; the GPU machines run 2.11.
_all_gather_rows = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def rank_device(device: str, rank: int) -> str:
    """Rank ``r``'s device: ``cuda:(i + r)`` for ``cuda:i`` (``cuda`` is ``cuda:0``); the CPU for every rank."""
    d = torch.device(device)
    if d.type != "cuda":
        return device
    return f"cuda:{(d.index or 0) + rank}"


def init_group(init_method: str, rank: int, size: int, device: torch.device, all_reduce: str = "nccl") -> TPGroup:
    """Join the group (a ``file://`` rendezvous in the server's run directory) and warm its collectives up;
    ``all_reduce``: ``--all-reduce`` (on CUDA, ``one-shot`` or ``auto`` also map the one-shot path's buffers;
    :class:`executor_proc.parallel.one_shot.OneShotRefused` where ``one-shot`` cannot run)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() <= device.index:
        raise ValueError(f"tensor parallel rank {rank} needs {device}, but only {torch.cuda.device_count()} "
                         "CUDA devices are visible")
    kwargs = {"device_id": device} if backend == "nccl" else {}  # NCCL: the communicator is created now
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=INIT_TIMEOUT, **kwargs)
    group = TPGroup(rank, size, backend)
    if backend == "nccl":
        group.one_shot = setup_one_shot(all_reduce, rank, size, device, dist.group.WORLD.group_name)
    x = torch.ones(2, 3, device=device)
    group.all_reduce(x)
    if group.one_shot is not None:
        dist.all_reduce(x)  # NCCL's all-reduce too (it takes what one shot does not)
    group.all_gather_columns(x)  # every collective once, eagerly: nothing is first created inside a capture
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return group
