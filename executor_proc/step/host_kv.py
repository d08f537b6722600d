"""The host KV tier's memory and copies: a pinned host block pool beside the device KV cache.

Layouts (``E = block_size * num_kv_heads * head_dim`` elements, one *item*)::

    device  storage [num_layers, 2, num_blocks, E]        a block is 2 * num_layers strided items
    host    pool    [num_host_blocks, num_layers, 2, E]   a block is 2 * num_layers contiguous items

so a plan's backups (or onloads) of B blocks are one ``kernels.transfer.copy_items`` call of
``2 * num_layers * B`` items, whatever B.  The scheduler decides which host block holds what
(``scheduler_proc.host_tier``); this module only copies, in the order the plan says.

Ordering on CUDA, with no host wait and no host read of a device value::

    compute  ... step N-1 .................. | upload N | (record E) | wait(onload N) | step N ...
    copy     upload offsets | onload N | (record onload N)
    backup                                                wait(E) | backup N | (record done N)

Onloads start as soon as the plan is staged, on the copy stream with an upload of their
own, beside the steps still in flight: their target device blocks were free when the plan
was made (a block is freed only once every step and backup that used it is done) and their
source host blocks are complete (keyed only once their backup was done); step N waits for
them on the device.  ``E`` is recorded on the compute stream once step N-1 and step N's
input upload (which carries the backups' offsets) are enqueued: backups read blocks that
steps up to N-1 wrote, and run beside step N (with few programs, so that they take a few
SMs at PCIe speed rather than all of them); their device blocks stay out of the allocator
until the scheduler hears they are done.  The output thread tells it:
:meth:`HostKV.backups_done_through` polls the events with ``query()`` (it never waits).
On the CPU every copy is immediate, onloads first.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Optional

import numpy as np
import torch

from executor_proc.model.kv_cache import KVCache
from executor_proc.step.staging import PinnedStaging
from ipc.config import DEFAULT_HOST_KV_GIB, ExecutorConfig
from ipc.protocol import StepPlan
from kernels.transfer import TransferConfig, copy_items

GIB = 1 << 30
# Backups on their own stream run beside decode steps: a few programs that loop over the items move
# them at PCIe speed without taking every SM from the step (docs/performance.md, "Host KV tier").
BACKUP_PROGRAMS = 16


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
        self.backup_config = TransferConfig(max_programs=BACKUP_PROGRAMS)  # only on the backup stream
        self._staging = PinnedStaging(device)  # the onloads' offsets, uploaded on the copy stream
        self._onloaded: Optional[torch.cuda.Event] = None  # the staged plan's onloads, for its step to wait on
        self._backups: deque[tuple[int, torch.cuda.Event]] = deque()  # (step_id, done event), oldest first
        if self.cuda:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile (or load) the copy kernel's variants now, not at the first plan that copies: block 0 to
        host block 0 and back (zeros both), with one program and many, offsets 16- and 8-byte aligned."""
        storage, n = self.kv.storage, 2 * self.kv.storage.shape[0]
        dev, host = (torch.from_numpy(np.concatenate([[0], x])).to(storage.device) for x in self._offsets([0], [0]))
        for start in (0, 1):  # offsets from a 16-byte boundary and from 8 bytes past one (the upload's places)
            d, h = dev[start:start + n], host[start:start + n]
            for config in (TransferConfig(), TransferConfig(max_programs=max(1, n - 1))):
                copy_items(storage, self.pool, d, h, self.item_bytes, config=config)
                copy_items(self.pool, storage, h, d, self.item_bytes, config=config)
        torch.cuda.synchronize(storage.device)  # start-up only

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def _offsets(self, device_blocks, host_blocks) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets of every item of the blocks: (in the device storage, in the host pool)."""
        d = np.asarray(device_blocks, dtype=np.int64)[:, None] * self._device_block_bytes + self._device_item
        h = np.asarray(host_blocks, dtype=np.int64)[:, None] * self._host_block_bytes + self._host_item
        return d.reshape(-1), h.reshape(-1)

    def stage(self, plan: StepPlan, upload) -> Optional[tuple]:
        """Start the plan's onloads (see :meth:`_onload`); add its backup offsets to the step's upload and
        return their places in it (``()``: onloads only; None: no copies)."""
        if plan.onloads:
            self._onload(plan.onloads)
        if not plan.backups:
            return () if plan.onloads else None
        bk_dev, bk_host = self._offsets(plan.backups[0::2], plan.backups[1::2])
        return upload.add(bk_dev, torch.int64), upload.add(bk_host, torch.int64)

    def _onload(self, onloads: list[int]) -> None:
        """Copy the ``(host, device)`` block pairs now, on the copy stream with offsets of its own, so the copy
        runs beside the steps in flight: no step in flight or backup uses the target blocks (they were free
        when the plan was made, and a block is freed only once every step and backup that used it is
        done) and the source blocks are complete copies (keyed only once their backup was done). The step
        that reads them waits for the copy (:meth:`copy`)."""
        on_dev, on_host = self._offsets(onloads[1::2], onloads[0::2])
        storage = self.kv.storage
        if not self.cuda:
            copy_items(self.pool, storage, torch.from_numpy(on_host), torch.from_numpy(on_dev), self.item_bytes)
            return
        with torch.cuda.stream(self.copy_stream):  # the offsets' upload and the copy, in order on one stream
            upload = self._staging.upload()
            parts = upload.add(on_host, torch.int64), upload.add(on_dev, torch.int64)
            sent = upload.send()
            copy_items(self.pool, storage, sent[parts[0]], sent[parts[1]], self.item_bytes)
            self._onloaded = torch.cuda.Event()
            self._onloaded.record()

    def copy(self, step_id: int, parts: Optional[tuple], sent: list[torch.Tensor]) -> None:
        """Make the step wait (on the device) for its onloads; enqueue its backups (nothing waits for them)."""
        compute = torch.cuda.current_stream() if self.cuda else None
        if self._onloaded is not None:
            compute.wait_event(self._onloaded)
            self._onloaded = None
        if not parts:
            return
        bk_src, bk_dst = sent[parts[0]], sent[parts[1]]
        storage = self.kv.storage
        if not self.cuda:
            copy_items(storage, self.pool, bk_src, bk_dst, self.item_bytes)
            return
        ready = torch.cuda.Event()
        ready.record(compute)  # the previous step (whose KV the backups read) and this upload are enqueued
        if bk_src.numel():
            stream = compute if self.backup_stream is None else self.backup_stream
            self._on_stream(self.backup_stream, ready, storage, self.pool, bk_src, bk_dst, self.backup_config)
            done = torch.cuda.Event()
            done.record(stream)
            self._backups.append((step_id, done))

    def _on_stream(self, stream, ready, src, dst, src_offsets, dst_offsets, config=None) -> None:
        """``copy_items`` on ``stream`` once ``ready`` has passed (None: on the compute stream, with every
        program the copy can use; ``config`` applies on a side stream); the offsets stay allocated until it
        has run."""
        if stream is None:
            copy_items(src, dst, src_offsets, dst_offsets, self.item_bytes)
            return
        stream.wait_event(ready)
        src_offsets.record_stream(stream)
        dst_offsets.record_stream(stream)
        with torch.cuda.stream(stream):
            copy_items(src, dst, src_offsets, dst_offsets, self.item_bytes, config=config)

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
