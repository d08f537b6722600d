"""The device memory plan: what the server may use, what each part takes, what is left for the KV cache.

Pure arithmetic, no torch: :mod:`executor_proc.build` measures the parts on the device and calls
:func:`plan_memory`.  The budget is ``gpu_memory_utilization x total`` device memory (vLLM's rule),
and it holds, in the order they are measured::

    weights       the model's parameters (this rank's shard), and a draft model's (speculative decoding)
    activations   the step machinery's fixed buffers (slot and penalty tables, workspaces, rings) plus the
                  transient peak of the profile steps: the full token budget in short rows and in
                  context-long rows, sampled with penalties and logprobs, prompt logprobs for every token
                  (the heaviest step kind)
    graphs        every CUDA graph's memory pool (and the largest of the heaviest sampling mode), captured
                  against a provisional KV cache just large enough for the profile step, measured, dropped
    other         what is on the device outside torch's allocator: the CUDA context, NCCL's buffers,
                  kernel modules, other processes' memory
    kv            the rest, in whole blocks (at most what the slots can use); with a draft model a block id
                  holds the model's KV and the draft's (its cache has one more block: scratch)

The KV cache is then allocated and the graphs captured again against it (a capture 256 MiB over the
measured one plans the KV cache again, once).  A plan that cannot hold the KV of one request of
``max_model_len`` tokens is refused with :class:`MemoryPlanError`, whose message names the numbers and
the flags that would fit.

While serving nothing outgrows the plan: the allocator gives cached segments back once it holds more
than the plan (``cap_allocator``, a soft cap), lazy captures empty its cache before they capture,
prompt logprobs run the LM head over the step's rows as one block, 1,024 positions at a time (one slice
alive, as in the profile's long row), and a prompt split across steps keeps its chunk's last hidden row
(not its float32 logits) for the next chunk.

Host memory is not planned, only checked against what the host has available (:func:`available_host_bytes`), before
it is allocated: the kernel would rather kill a process than fail an allocation.  The weights on the cpu
(:func:`executor_proc.model.loader.check_host_memory`), the slots' tables (``host_memory.check_host_slots``) and the host
KV tier's pool (``host_kv.num_host_blocks``) are held to it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Optional

GIB = 1024**3
MAX_UTILIZATION = 0.98  # what a refusal may suggest: the last 2% is the driver's and the other processes'


class StartupRefused(Exception):
    """A configuration the executor will not run: a one-line message for the user, no traceback."""


class MemoryPlanError(StartupRefused):
    """The configuration does not fit the device."""


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's plan, in bytes (``kv_blocks`` and ``kv_tokens`` in blocks and tokens); on the cpu ``total`` is
    the KV cache's fixed budget."""

    device: str
    total: int
    utilization: float
    weights: int
    activations: int
    graphs: int
    other: int
    kv_blocks: int
    block_bytes: int
    block_size: int
    draft_weights: int = 0  # the draft model's parameters (0: no draft model)
    draft_block_bytes: int = 0  # its KV bytes per block id, beside block_bytes

    @property
    def budget(self) -> int:
        return int(self.total * self.utilization)

    @property
    def draft_kv(self) -> int:
        """The draft model's KV cache: a block per block id, and its scratch block."""
        return (self.kv_blocks + 1) * self.draft_block_bytes if self.draft_block_bytes else 0

    @property
    def kv(self) -> int:
        """The KV caches: the model's, and the draft model's."""
        return self.kv_blocks * self.block_bytes + self.draft_kv

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    @property
    def planned(self) -> int:
        """What the plan gives this process's own allocations: all but ``other``."""
        return self.weights + self.draft_weights + self.activations + self.graphs + self.kv

    def as_dict(self) -> dict[str, float]:
        """The numbers (bytes, blocks, tokens), for ``ExecutorReady.memory_plan_bytes``."""
        d = {k: v for k, v in asdict(self).items() if k != "device"}
        d.update(budget=self.budget, kv=self.kv, draft_kv=self.draft_kv, kv_tokens=self.kv_tokens,
                 planned=self.planned)
        return d

    def line(self) -> str:
        """The plan in one line (what ``forerun serve`` prints at start-up)."""
        draft = self.draft_block_bytes > 0
        tokens = f"{self.kv_tokens:,} tokens" + (" (the model's and the draft's KV)" if draft else "")
        kv = f"KV {_gib(self.kv)}" + (f" (draft {_gib(self.draft_kv)})" if draft else "")
        if self.device == "cpu":
            weights = f"weights {_gib(self.weights)}" + (f" + draft {_gib(self.draft_weights)}" if draft else "")
            return (f"memory plan (cpu: host memory is not planned like a GPU's; the KV cache gets at most a "
                    f"fixed {_gib(self.total)} GiB): {weights} GiB, {kv} GiB = {tokens}")
        used = self.planned + self.other
        weights = f"weights {_gib(self.weights)}" + (f" + draft weights {_gib(self.draft_weights)}" if draft else "")
        return (f"memory plan: {weights} + activations {_gib(self.activations)} + graphs {_gib(self.graphs)} + "
                f"other {_gib(self.other)} + {kv} = {_gib(used)} GiB of {_gib(self.budget)} ({self.utilization:g} "
                f"x {_gib(self.total)} GiB); KV {tokens}")


def available_host_bytes() -> int:
    """Host memory available now (MemAvailable), or the free physical pages where /proc is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_memory(*, device: str, total: int, utilization: float, weights: int, activations: int, graphs: int,
                other: int, block_bytes: int, block_size: int, max_model_len: int,
                useful_blocks: Optional[int] = None, draft_weights: int = 0, draft_block_bytes: int = 0) -> MemoryPlan:
    """The KV cache gets what the budget leaves after the measured parts, in whole blocks, at most
    ``useful_blocks`` (what the slots can fill); :class:`MemoryPlanError` if that cannot hold one request
    of ``max_model_len`` tokens.  A draft model (``draft_weights``, ``draft_block_bytes``) adds its weights to the
    parts and its KV bytes to every block (and its scratch block)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    free = int(total * utilization) - weights - draft_weights - activations - graphs - other - draft_block_bytes
    blocks = max(0, free) // (block_bytes + draft_block_bytes)
    if useful_blocks is not None:
        blocks = min(blocks, useful_blocks)
    plan = MemoryPlan(device, total, utilization, weights, activations, graphs, other, blocks, block_bytes,
                      block_size, draft_weights, draft_block_bytes)
    check_fits(plan, max_model_len)
    return plan


def gc_threshold(plan: MemoryPlan) -> float:
    """The allocator's garbage-collection threshold while serving: the plan's share of the device (what torch's
    allocator may hold), strictly between 0 and 1 as torch requires."""
    return min(0.999, max(0.001, plan.planned / plan.total))


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def check_fits(plan: MemoryPlan, max_model_len: int) -> None:
    """Raise :class:`MemoryPlanError` if the plan's KV cache cannot hold one request of ``max_model_len``."""
    need = blocks_for(max_model_len, plan.block_size)
    if plan.kv_blocks >= need:
        return
    raise MemoryPlanError(refusal(plan, max_model_len))


def refusal(plan: MemoryPlan, max_model_len: int) -> str:
    """Why the server will not start, with the numbers and the flags that would make it fit."""
    blocks = blocks_for(max_model_len, plan.block_size)
    need = blocks * plan.block_bytes + ((blocks + 1) * plan.draft_block_bytes if plan.draft_block_bytes else 0)
    fits_len = plan.kv_tokens
    if plan.device == "cpu":
        return (f"the KV cache cannot hold one request of --max-model-len {max_model_len:,} tokens "
                f"({_gib(need)} GiB): on the cpu it gets a fixed {_gib(plan.total)} GiB ({fits_len:,} tokens); "
                f"lower --max-model-len to {fits_len:,} or less")
    short = need - plan.kv
    weights = plan.weights + plan.draft_weights
    parts = (f"weights {_gib(weights)} + activations {_gib(plan.activations)} + graphs {_gib(plan.graphs)} "
             f"+ other {_gib(plan.other)} GiB")
    fixes = []
    util = (weights + plan.activations + plan.graphs + plan.other + need) / plan.total
    if util <= MAX_UTILIZATION:
        fixes.append(f"raise --gpu-memory-utilization to {_ceil2(util):.2f}")
    if fits_len > 0:
        fixes.append(f"lower --max-model-len to {fits_len:,}")
    fixes.append(f"lower --max-num-seqs (the graphs take {_gib(plan.graphs)} GiB) or --max-num-batched-tokens "
                 f"(activations {_gib(plan.activations)} GiB)")
    return (f"not enough device memory for one request of --max-model-len {max_model_len:,} tokens: its KV cache "
            f"needs {_gib(need)} GiB, and the budget of {_gib(plan.budget)} GiB (--gpu-memory-utilization "
            f"{plan.utilization:g} x {_gib(plan.total)} GiB on {plan.device}) less {parts} leaves {_gib(plan.kv)} "
            f"GiB, {_gib(short)} GiB short; " + ", or ".join(fixes))


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _ceil2(x: float) -> float:
    return -(-int(x * 10000) // 100) / 100
