"""Host<->device staging without hidden synchronisation.

:class:`PinnedStaging` packs one step's host inputs (token ids, positions,
table diffs, ...) into one pinned buffer and sends them with one non-blocking
copy.  Its buffers form a ring; a buffer is refilled only after the event of its
last copy has completed, so the CPU never overwrites bytes the copy engine is
still reading.  On the CPU the same calls simply build tensors.

:class:`TokenRing` brings sampled tokens back: a device->device copy into a ring
slot on the compute stream (so the next step may overwrite its own output at
once), then a device->host copy of that slot on the copy stream into pinned
memory, with an event the output thread waits on.  A step with logprobs sends its
``[S, 21]`` ids and logprobs the same way, in the same ring slot, under the same
event; prompt logprobs (eager prefill steps only, any number of rows) are copied
non-blocking into freshly pinned memory on the compute stream, which the copy
stream waits for before it records the event.  A slot is reused only after
the output thread has read it (:meth:`TokenCopy.release`) and its copy event has
passed on the device.
"""

from __future__ import annotations

import queue
from typing import Optional, Sequence

import numpy as np
import torch

from kernels.logprobs_ref import MAX_TOP_N

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
_ITEMSIZE = {dt: np.dtype(t).itemsize for dt, t in _NUMPY.items()}
# Every part starts at a 16-byte boundary of the device buffer.  Triton compiles a kernel variant per
# (pointer argument, 16-byte aligned or not): parts at mere 8-byte places would give each eager step's index
# arrays (query_start, context_lens, positions, ...) an alignment that depends on the sizes of the parts before
# them, and a step that met a new combination compiled a variant while serving, its main thread blocked for
# hundreds of ms (the swap resumes of docs/performance.md, "Host KV tier").
_ALIGN = 16


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """(byte offset of each part, total bytes): parts in order, each at a multiple of ``_ALIGN``."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    return offsets, total


class HostUpload:
    """One step's host->device inputs; :meth:`add` parts, then :meth:`send` once."""

    def __init__(self, staging: "PinnedStaging"):
        self._staging = staging
        self._parts: list[tuple[object, torch.dtype]] = []

    def add(self, values: Sequence | np.ndarray, dtype: torch.dtype) -> int:
        """Queue ``values`` as a 1-D tensor of ``dtype``; returns its index in :meth:`send`'s list."""
        self._parts.append((values, dtype))
        return len(self._parts) - 1

    def send(self) -> list[torch.Tensor]:
        """The device tensors, in the order they were added (enqueued, not waited for)."""
        return self._staging._send(self._parts)


class PinnedStaging:
    """A ring of pinned host buffers for host->device inputs (see the module docstring)."""

    def __init__(self, device: torch.device, depth: int = 4, initial_bytes: int = 1 << 16):
        self.device = device
        self.pinned = device.type == "cuda"
        self._depth = depth
        self._bufs: list[Optional[torch.Tensor]] = [None] * depth
        self._events = [torch.cuda.Event() if self.pinned else None for _ in range(depth)]
        # The compute stream, looked up once (torch.cuda.current_stream() is a Python-level call per use).
        self._stream = torch.cuda.current_stream(device) if self.pinned else None
        self._initial = initial_bytes
        self._next = 0

    def upload(self) -> HostUpload:
        return HostUpload(self)

    def _send(self, parts: list[tuple[object, torch.dtype]]) -> list[torch.Tensor]:
        if not self.pinned:
            return [torch.as_tensor(np.asarray(v, dtype=_NUMPY[dt])) for v, dt in parts]
        sizes = [len(v) * _ITEMSIZE[dt] for v, dt in parts]
        offsets, total = layout(sizes)
        k = self._next
        self._next = (k + 1) % self._depth
        self._events[k].synchronize()  # returns at once unless this buffer's copy (depth steps ago) is pending
        buf = self._bufs[k]
        if buf is None or buf.numel() < total:
            buf = self._bufs[k] = torch.empty(max(total, self._initial, 2 * (0 if buf is None else buf.numel())),
                                              dtype=torch.uint8, pin_memory=True)
        host = buf.numpy()
        for (values, dt), off, n in zip(parts, offsets, sizes):
            host[off:off + n].view(_NUMPY[dt])[:] = values
        dev = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=self.device)
        dev[:total].copy_(buf[:total], non_blocking=True)
        self._events[k].record(self._stream)
        return [dev[off:off + n].view(dt) for (_, dt), off, n in zip(parts, offsets, sizes)]


class TokenCopy:
    """A step's tokens on their way to the host: wait with :meth:`synchronize`, then :meth:`release`."""

    def __init__(self, ring: "TokenRing", slot: int, event: torch.cuda.Event):
        self._ring, self._slot, self._event = ring, slot, event

    def synchronize(self) -> None:
        self._event.synchronize()

    def release(self) -> None:
        """Give the ring slot back (after the host values were read)."""
        self._ring._free.put(self._slot)


class TokenRing:
    """Sampled tokens device->host through a ring of pinned buffers (see the module docstring)."""

    def __init__(self, device: torch.device, max_tokens: int, depth: int = 8, logprob_width: int = MAX_TOP_N + 1):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._dev = torch.empty(depth, max_tokens, dtype=torch.int64, device=device)
        self._host = torch.empty(depth, max_tokens, dtype=torch.int64, pin_memory=True)
        shape = (depth, max_tokens, logprob_width)
        self._lp_dev = (torch.empty(shape, dtype=torch.int64, device=device),
                        torch.empty(shape, dtype=torch.float32, device=device))
        self._lp_host = (torch.empty(shape, dtype=torch.int64, pin_memory=True),
                         torch.empty(shape, dtype=torch.float32, pin_memory=True))
        self._copied = [torch.cuda.Event() for _ in range(depth)]
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for k in range(depth):
            self._free.put(k)

    def copy_out(self, tokens: torch.Tensor, outputs=None) -> tuple[torch.Tensor, TokenCopy]:
        """Enqueue the copy of ``tokens [n]`` (int64, on the device); returns (pinned host view, copy).

        ``outputs`` (a :class:`executor_proc.step.step_outputs.StepOutputs`): its device
        logprobs are copied too and replaced by their host tensors.
        """
        n = tokens.shape[0]
        k = self._free.get()  # blocks only if every slot is still with the output thread
        main = torch.cuda.current_stream(self.device)
        main.wait_event(self._copied[k])  # on the device: the slot's previous D2H copy is done
        self._dev[k, :n].copy_(tokens)
        lp = outputs.logprobs if outputs is not None else None
        m = lp[0].shape[0] if lp is not None else 0  # the sampled rows (a speculative step sends more tokens)
        if lp is not None:
            for dev, src in zip(self._lp_dev, lp):
                dev[k, :m].copy_(src)
        if outputs is not None and outputs.prompt_logprobs is not None:
            outputs.prompt_logprobs = tuple(t.to("cpu", non_blocking=True) for t in outputs.prompt_logprobs)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            self._host[k, :n].copy_(self._dev[k, :n], non_blocking=True)
            if lp is not None:
                for host, dev in zip(self._lp_host, self._lp_dev):
                    host[k, :m].copy_(dev[k, :m], non_blocking=True)
                outputs.logprobs = tuple(host[k, :m] for host in self._lp_host)
            self._copied[k].record(self.stream)
        return self._host[k, :n], TokenCopy(self, k, self._copied[k])
