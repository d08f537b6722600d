"""The host KV tier's memory and copies: a pinned host block pool beside the device KV cache.

Layouts (``E = block_size * num_kv_heads * head_dim`` elements, one *item*)::

    device  storage [num_layers, 2, num_blocks, E]        a block is 2 * num_layers strided items
    host    pool    [num_host_blocks, num_layers, 2, E]   a block is 2 * num_layers contiguous items

so a plan's backups (or onloads) of B blocks are one ``kernels.transfer.copy_items`` call of
``2 * num_layers * B`` items, whatever B.  The scheduler decides which host block holds what
(``scheduler_proc.host_tier``); this module only copies, in the order the plan says.

Ordering on CUDA, with no host wait and no host read of a device value::

    compute  ... step N-1 .................. | upload N | (record E) | wait(onload N) | step N ...
    copy     upload block ids | item offsets | onload N | (record onload N)
    backup                                                wait(E) | backup N | (record done N)
    host     ... prepare N (stage, record E) | launch step N | launch backup N | prepare N+1 ...

Onloads start as soon as the plan is staged, on the copy stream with an upload of their
own, beside the steps still in flight: their target device blocks were free when the plan
was made (a block is freed only once every step and backup that used it is done) and their
source host blocks are complete (keyed only once their backup was done); step N waits for
them on the device.  ``E`` is recorded on the compute stream once step N-1 and step N's
input upload (which carries the backups' offsets) are enqueued: backups read blocks that
steps up to N-1 wrote, and run beside step N (with few programs, so that they take a few
SMs at PCIe speed rather than all of them); they are launched once step N is enqueued, so
the launch's host time is not a gap before step N (at batch 1 a 1B step is ~1.1 ms, and a
backup's launch before it was 0.35-0.55 ms more host time in the server's step logs, which the
GPU waited for).  Their device
blocks stay out of the allocator until the scheduler hears they are done.  The output thread tells it:
:meth:`HostKV.backups_done_through` polls the events with ``query()`` (it never waits).
On the CPU every copy is immediate, onloads first.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np
import torch

from executor_proc.memory_plan import StartupRefused, available_host_bytes
from executor_proc.model.kv_cache import KVCache
from executor_proc.step.staging import PinnedStaging
from ipc.config import DEFAULT_HOST_KV_GIB, ExecutorConfig
from ipc.protocol import StepPlan
from kernels.precompile import compiled_ahead
from kernels.transfer import ItemCopy, TransferConfig, copy_items

GIB = 1 << 30
# Backups on their own stream run beside decode steps: a few programs that loop over the items move
# them at PCIe speed without taking every SM from the step (docs/performance.md, "Host KV tier").
BACKUP_PROGRAMS = 16


# Of the host's available memory, the most a host pool given by its flags may take (the kernel would rather kill a
# process than fail the pinned allocation)
HOST_POOL_SHARE = 0.8


def num_host_blocks(cfg: ExecutorConfig, device: torch.device, bytes_per_block: int,
                    available: Optional[int] = None) -> int:
    """The host pool's size: ``num_host_kv_blocks``, else ``host_kv_gib`` (default: 4 GiB on cuda, at most
    a quarter of the available host memory; off on the cpu).  A given size past :data:`HOST_POOL_SHARE` of the
    available host memory is refused in one line naming its flag."""
    if cfg.num_host_kv_blocks is None and cfg.host_kv_gib is None and device.type != "cuda":
        return 0
    available = available_host_bytes() if available is None else available
    if cfg.num_host_kv_blocks is not None:
        blocks, flag = cfg.num_host_kv_blocks, f"--num-host-kv-blocks {cfg.num_host_kv_blocks:,}"
    elif cfg.host_kv_gib is not None:
        blocks, flag = int(cfg.host_kv_gib * GIB) // bytes_per_block, f"--host-kv-gib {cfg.host_kv_gib:g}"
    else:
        return int(min(DEFAULT_HOST_KV_GIB, available / 4 / GIB) * GIB) // bytes_per_block
    if blocks * bytes_per_block > HOST_POOL_SHARE * available:
        fit = int(HOST_POOL_SHARE * available)
        raise StartupRefused(f"{flag}: the host KV tier's pool takes {blocks * bytes_per_block / GIB:.1f} GiB, more "
                             f"than {HOST_POOL_SHARE:.0%} of the {available / GIB:.1f} GiB of host memory available: "
                             f"use --host-kv-gib {fit / GIB:.1f} or --num-host-kv-blocks {fit // bytes_per_block:,} "
                             f"or less")
    return blocks


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
        self._backup: Optional[ItemCopy] = None
        if self.cuda:
            self.use_backup_launch(self.backup_stream)
        self._compute = torch.cuda.current_stream(device) if self.cuda else None  # looked up once
        self._ready = torch.cuda.Event() if self.cuda else None  # recorded per step with backups
        self._pending: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None  # (step_id, src, dst offsets)
        self._staging = PinnedStaging(device)  # the onloads' block ids, uploaded on the copy stream
        self._device_item_t = torch.from_numpy(self._device_item).to(device)  # for the onloads' expansion
        self._host_item_t = torch.from_numpy(self._host_item).to(device)
        self._onloaded: Optional[torch.cuda.Event] = None  # the staged plan's onloads, for its step to wait on
        self._backups: deque[tuple[int, torch.cuda.Event]] = deque()  # (step_id, done event), oldest first
        if self.cuda:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile (or load) the copy kernel's variants now, not at the first plan that copies: block 0 to
        host block 0 and back (zeros both), with one program and many, offsets 16- and 8-byte aligned (the
        upload aligns its parts to 16 bytes and the kernel does not specialise on the offsets' alignment: a
        precaution)."""
        storage, n = self.kv.storage, 2 * self.kv.storage.shape[0]
        dev, host = (torch.from_numpy(np.concatenate([[0], x])).to(storage.device) for x in self._offsets([0], [0]))

        def copies():
            for start in (0, 1):  # offsets from a 16-byte boundary and from 8 bytes past one (the upload's places)
                d, h = dev[start:start + n], host[start:start + n]
                for config in (TransferConfig(), TransferConfig(max_programs=max(1, n - 1))):
                    copy_items(storage, self.pool, d, h, self.item_bytes, config=config)
                    copy_items(self.pool, storage, h, d, self.item_bytes, config=config)
        with compiled_ahead() as ahead:  # the variants compile side by side, then run
            ahead.record(copies)
        copies()
        torch.cuda.synchronize(storage.device)  # start-up only

    def use_backup_launch(self, stream: Optional[torch.cuda.Stream], config: Optional[TransferConfig] = None) -> None:
        """Where backups run (a side stream, or None: the compute stream) and their launch shape (default: a
        few looping programs on a side stream, every program the copy can use on the compute stream).
        Bound once (:class:`ItemCopy`): a backup's host cost is its launch."""
        if config is None:
            config = TransferConfig(max_programs=BACKUP_PROGRAMS) if stream is not None else TransferConfig()
        self.backup_stream = stream
        self._backup = ItemCopy(self.kv.storage, self.pool, self.item_bytes, config)

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
        """Copy the ``(host, device)`` block pairs now, on the copy stream with an upload of its own, so the copy
        runs beside the steps in flight: no step in flight or backup uses the target blocks (they were free
        when the plan was made, and a block is freed only once every step and backup that used it is
        done) and the source blocks are complete copies (keyed only once their backup was done). The step
        that reads them waits for the copy (:meth:`copy`). Only the block ids travel (16 bytes a block, not
        16 per item): the item offsets are expanded on the copy stream, and the upload's pinned buffers
        need not grow for a large onload (a pinned allocation is slow and may wait for the device)."""
        storage = self.kv.storage
        if not self.cuda:
            copy_items(self.pool, storage, *self._onload_offsets(torch.tensor(onloads, dtype=torch.int64)),
                       self.item_bytes)
            return
        with torch.cuda.stream(self.copy_stream):  # the upload, the expansion and the copy, in order on one stream
            upload = self._staging.upload()
            part = upload.add(onloads, torch.int64)
            copy_items(self.pool, storage, *self._onload_offsets(upload.send()[part]), self.item_bytes)
            self._onloaded = torch.cuda.Event()
            self._onloaded.record()

    def _onload_offsets(self, onloads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Byte offsets of every item of the ``(host, device)`` pairs, expanded where ``onloads`` lies (on the
        current stream): (in the host pool, in the device storage)."""
        pairs = onloads.view(-1, 2)
        src = (pairs[:, :1] * self._host_block_bytes + self._host_item_t).reshape(-1)
        dst = (pairs[:, 1:] * self._device_block_bytes + self._device_item_t).reshape(-1)
        return src, dst

    def copy(self, step_id: int, parts: Optional[tuple], sent: list[torch.Tensor]) -> None:
        """Make the step wait (on the device) for its onloads; mark where its backups may start (after the
        previous step and this upload) and keep them for :meth:`start_backups`."""
        if self._onloaded is not None:
            self._compute.wait_event(self._onloaded)
            self._onloaded = None
        if not parts:
            return
        bk_src, bk_dst = sent[parts[0]], sent[parts[1]]
        if not self.cuda:
            copy_items(self.kv.storage, self.pool, bk_src, bk_dst, self.item_bytes)
            return
        if bk_src.numel():
            assert self._pending is None, "a step's backups were kept but never started"
            self._ready.record(self._compute)  # the backups read blocks that steps up to the previous one wrote
            self._pending = (step_id, bk_src, bk_dst)

    def start_backups(self) -> None:
        """Enqueue the kept backups, once the step itself is enqueued: the launch's host time runs while
        the GPU works instead of before the step's launch. On the backup stream they run beside the
        step (nothing waits for them); on the compute stream, after it. The output thread hears of a
        step only after this ran, so :meth:`backups_done_through` never misses a backup."""
        if self._pending is None:
            return
        step_id, src, dst = self._pending
        self._pending = None
        stream = self.backup_stream
        if stream is None:
            self._backup(src, dst)
            stream = self._compute
        else:
            stream.wait_event(self._ready)
            src.record_stream(stream)  # src and dst are views of one upload buffer
            with torch.cuda.stream(stream):
                self._backup(src, dst)
        done = torch.cuda.Event()
        done.record(stream)
        self._backups.append((step_id, done))

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
