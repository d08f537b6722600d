"""The host KV tier's memory and copies: a pinned host block pool beside the device KV cache.

Layouts (``E = block_size * num_kv_heads * head_dim`` elements, one *item*)::

    device  storage [num_layers, 2, num_blocks, E]        a block is 2 * num_layers strided items
    host    pool    [num_host_blocks, num_layers, 2, E]   a block is 2 * num_layers contiguous items

so a plan's backups (or onloads) of B blocks are one ``kernels.transfer.copy_items`` call of
``2 * num_layers * B`` items, whatever B.  The scheduler decides which host block holds what
(``scheduler_proc.host_tier``); this module only copies, in the order the plan says.

Ordering on CUDA, with no host wait and no host read of a device value::

    compute  ... step N-1 | upload N | (record E) | wait(onload N) | step N ...
    copy                              wait(E) | onload N | (record onload N)
    backup                            wait(E) | backup N | (record done N)

``E`` is recorded on the compute stream once step N-1 and step N's input upload (which
carries the offsets) are enqueued.  Onloads write new device blocks that no earlier step
still reads once E has passed, and step N waits for them on the device.  Backups read
blocks that steps up to N-1 wrote, and run beside step N; their device blocks stay out of
the allocator until the scheduler hears they are done.  The output thread tells it:
:meth:`HostKV.backups_done_through` polls the events with ``query()`` (it never waits).
On the CPU every copy is immediate.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Optional

import numpy as np
import torch

from executor_proc.model.kv_cache import KVCache
from ipc.config import DEFAULT_HOST_KV_GIB, ExecutorConfig
from ipc.protocol import StepPlan
from kernels.transfer import copy_items

GIB = 1 << 30


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


def num_host_blocks(cfg: ExecutorConfig, device: torch.device, bytes_per_block: int) -> int:
    """The host pool's size: ``num_host_kv_blocks``, else ``host_kv_gib`` (default: 4 GiB on cuda, at most
    a quarter of the available host memory; off on the cpu)."""
    if cfg.num_host_kv_blocks is not None:
        return cfg.num_host_kv_blocks
    gib = cfg.host_kv_gib
    if gib is None:
        gib = min(DEFAULT_HOST_KV_GIB, available_host_bytes() / 4 / GIB) if device.type == "cuda" else 0.0
    return int(gib * GIB) // bytes_per_block


class HostKV:
    """A pinned host block pool and the onload/backup copies of each plan (see the module docstring)."""

    def __init__(self, kv: KVCache, num_blocks: int, device: torch.device, backup_stream: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"host KV pool size must be positive, got {num_blocks}")
        storage = kv.storage
        layers, num_device_blocks = storage.shape[0], storage.shape[2]
        self.kv = kv
        self.num_blocks = num_blocks
        self.cuda = device.type == "cuda"
        item_elems = storage[0, 0, 0].numel()
        self.item_bytes = item_elems * storage.element_size()
        self.pool = torch.zeros((num_blocks, layers, 2, item_elems), dtype=storage.dtype, pin_memory=self.cuda)
        items = np.arange(2 * layers, dtype=np.int64)
        self._device_item = items * num_device_blocks * self.item_bytes  # (layer, k/v) of device block 0
        self._host_item = items * self.item_bytes  # (layer, k/v) within a host block
        self._host_block_bytes = 2 * layers * self.item_bytes
        self._device_block_bytes = self.item_bytes
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.backup_stream = torch.cuda.Stream(device) if self.cuda and backup_stream else None
        self._backups: deque[tuple[int, torch.cuda.Event]] = deque()  # (step_id, done event), oldest first

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def _offsets(self, device_blocks, host_blocks) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets of every item of the blocks: (in the device storage, in the host pool)."""
        d = np.asarray(device_blocks, dtype=np.int64)[:, None] * self._device_block_bytes + self._device_item
        h = np.asarray(host_blocks, dtype=np.int64)[:, None] * self._host_block_bytes + self._host_item
        return d.reshape(-1), h.reshape(-1)

    def stage(self, plan: StepPlan, upload) -> Optional[tuple[int, int, int, int]]:
        """Add the plan's onload and backup offsets to the step's upload; their places in it (or None)."""
        if not (plan.onloads or plan.backups):
            return None
        on_dev, on_host = self._offsets(plan.onloads[1::2], plan.onloads[0::2])
        bk_dev, bk_host = self._offsets(plan.backups[0::2], plan.backups[1::2])
        return (upload.add(on_host, torch.int64), upload.add(on_dev, torch.int64),
                upload.add(bk_dev, torch.int64), upload.add(bk_host, torch.int64))

    def copy(self, step_id: int, parts: Optional[tuple[int, int, int, int]], sent: list[torch.Tensor]) -> None:
        """Enqueue the plan's onloads (the step waits for them) and backups (nothing waits for them)."""
        if parts is None:
            return
        on_src, on_dst, bk_src, bk_dst = (sent[i] for i in parts)
        storage = self.kv.storage
        if not self.cuda:
            copy_items(self.pool, storage, on_src, on_dst, self.item_bytes)
            copy_items(storage, self.pool, bk_src, bk_dst, self.item_bytes)
            return
        compute = torch.cuda.current_stream()
        ready = torch.cuda.Event()
        ready.record(compute)  # the previous step and this step's upload (the offsets) are enqueued
        if on_src.numel():
            self._on_stream(self.copy_stream, ready, self.pool, storage, on_src, on_dst)
            onloaded = torch.cuda.Event()
            onloaded.record(self.copy_stream)
            compute.wait_event(onloaded)
        if bk_src.numel():
            stream = compute if self.backup_stream is None else self.backup_stream
            self._on_stream(self.backup_stream, ready, storage, self.pool, bk_src, bk_dst)
            done = torch.cuda.Event()
            done.record(stream)
            self._backups.append((step_id, done))

    def _on_stream(self, stream, ready, src, dst, src_offsets, dst_offsets) -> None:
        """``copy_items`` on ``stream`` (None: the compute stream) once ``ready`` has passed; the offsets
        stay allocated until it has run."""
        if stream is None:
            copy_items(src, dst, src_offsets, dst_offsets, self.item_bytes)
            return
        stream.wait_event(ready)
        src_offsets.record_stream(stream)
        dst_offsets.record_stream(stream)
        with torch.cuda.stream(stream):
            copy_items(src, dst, src_offsets, dst_offsets, self.item_bytes)

    def backups_done_through(self, step_id: int) -> int:
        """The newest step id, at most ``step_id``, whose backups and every earlier step's have completed.

        Called by the output thread; ``query()`` never waits.  Step ids only grow, so the
        events complete in order per stream and the answer never goes back.
        """
        backups = self._backups
        while backups and backups[0][0] <= step_id and backups[0][1].query():
            backups.popleft()
        if backups and backups[0][0] <= step_id:
            return backups[0][0] - 1
        return step_id
