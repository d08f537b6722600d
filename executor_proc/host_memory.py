"""Host memory at start-up: what is checked against the host's available memory before it is allocated (the slots'
tables, a CPU's KV cache; the weights: :func:`executor_proc.model.loader.check_host_memory`), and a host
out-of-memory while something is allocated, named with the flags that size it.  All one-line refusals
(:class:`executor_proc.memory_plan.StartupRefused`, :class:`~executor_proc.memory_plan.MemoryPlanError`)."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from executor_proc.memory_plan import GIB, MemoryPlanError, StartupRefused, available_host_bytes
from executor_proc.step.slot_tables import SlotTables
from ipc.config import ExecutorConfig


def host_out_of_memory(e: BaseException) -> Optional[str]:
    """The first line of an exception that says the host ran out of memory (a MemoryError, or torch's allocator's
    RuntimeError); None for any other."""
    first = str(e).splitlines()[0] if str(e) else "out of memory"
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in first):
        return first
    return None


@contextlib.contextmanager
def host_allocation(part: str, advice: str):
    """Host memory that runs out while ``part`` is allocated: :class:`MemoryPlanError` naming the part and the
    ``advice`` that makes it smaller (the flags that size it), no traceback."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        first = host_out_of_memory(e)
        if first is None:
            raise
        raise MemoryPlanError(f"the host ran out of memory while allocating {part} ({first}); {advice}") from None


def kv_advice(cfg: ExecutorConfig) -> str:
    """The flags that make the KV cache smaller: the count given, else what sizes it on the cpu (the slots and the
    context length, up to its fixed budget)."""
    if cfg.num_kv_blocks is not None:
        return f"lower --num-kv-blocks {cfg.num_kv_blocks:,}"
    return "lower --max-num-seqs or --max-model-len, or give a smaller --num-kv-blocks"


HOST_SLOTS_SHARE = 0.5  # of the host's available memory the slots' tables may take on the CPU


def check_host_slots(num_slots: int, max_blocks: int, vocab: int, max_len: int,
                     available: Optional[int] = None) -> None:
    """Refuse (in one line naming --max-num-seqs) slot tables that would take more than :data:`HOST_SLOTS_SHARE` of
    the host's available memory: the kernel would rather kill the process (or another one) than fail an allocation
    (100,000 slots of the default model: ~23 GiB).  A slot's bytes are measured on tables of one and two slots."""
    available = available_host_bytes() if available is None else available
    cpu = torch.device("cpu")
    per_slot = _storage_bytes(SlotTables(2, max_blocks, cpu, vocab)) - _storage_bytes(SlotTables(1, max_blocks, cpu,
                                                                                                  vocab))
    if num_slots * per_slot > HOST_SLOTS_SHARE * available:
        # a tenth below the limit: the memory available moves between one start and the next, and a count right
        # at the limit would be refused by the start that takes the advice
        fit = max(1, int(0.9 * HOST_SLOTS_SHARE * available // per_slot))
        raise StartupRefused(f"--max-num-seqs {num_slots:,}: the slots' tables take "
                             f"{num_slots * per_slot / 2**30:,.1f} GiB of host memory ({per_slot / 2**20:.2f} MiB a slot at --max-model-len {max_len:,} "
                             f"and a {vocab:,}-token vocabulary), more than half of the "
                             f"{available / 2**30:.1f} GiB available: use --max-num-seqs {fit:,} or fewer")


def _storage_bytes(obj) -> int:
    """Bytes of the distinct tensor storages in ``obj``'s attributes and its attributes' (the penalty tables),
    views of one storage counted once."""
    storages: dict[int, int] = {}
    for value in vars(obj).values():
        inner = (value,) if isinstance(value, torch.Tensor) else vars(value).values() if hasattr(value, "__dict__") \
            else ()
        for t in inner:
            if isinstance(t, torch.Tensor):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def check_host_kv(blocks: int, block_bytes: int, given: bool, processes: int = 1,
                  available: Optional[int] = None) -> None:
    """A KV cache in host memory (the cpu) fits what the host has available now, the weights loaded, counting the
    ``processes`` that each hold one (tensor-parallel ranks, data-parallel replicas): else MemoryPlanError naming
    --num-kv-blocks when it was ``given`` (a count past the address space would fail far from here, in the
    allocator's words)."""
    one, have = blocks * block_bytes, available_host_bytes() if available is None else available
    if one * processes > have:
        what = f"--num-kv-blocks {blocks:,}: the KV cache" if given else f"the KV cache ({blocks:,} blocks)"
        size = f"{processes} x {one / GIB:,.1f} GiB (one a process)" if processes > 1 else f"{one / GIB:,.1f} GiB"
        advice = "lower --num-kv-blocks" if given else "give a smaller --num-kv-blocks"
        raise MemoryPlanError(f"{what} would take {size}, more than the {have / GIB:.1f} GiB of host memory "
                              f"available; {advice}")
