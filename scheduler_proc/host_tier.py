"""The host KV tier as the scheduler sees it: a pool of host blocks with the device's keys.

The executor keeps a pinned host copy of KV blocks; this module decides which
host block holds what.  Host blocks live in a :class:`BlockAllocator` (the
device's counts and LRU) with keys: a host block keyed ``k`` is a complete copy
of a device block the prefix cache published for the tokens whose chained key
is ``k`` (:meth:`PrefixCache.keys`; the device's own index needs none)::

    free     count 0, no key
    cached   count 0, a key           findable, evicted least recently used first
    busy     count 1                  the target of a backup in flight (no key yet),
                                      or the source of an onload in flight (keyed)

**Backup** (device -> host): every device block published in the prefix cache
whose key the host lacks gets a host block at once (a free one, else the LRU
cached one; when every host block is busy the backup is skipped: recompute
stays the fallback).  The device block gets one more reference, so it is
neither evicted nor reused (and, being published, never rewritten) until the
backup is done.  The pair rides in the next plan's ``backups``; the executor
copies it once every earlier step has run and reports, in each
``StepResult.backups_done_step_id``, the newest step whose backups have all
completed (it never waits for them).  Then the host block gets its key and
goes to the host LRU, and the device reference is dropped.

**Onload** (host -> device): an admission that matches the device cache and
then finds the next keys of its chain on the host takes a new device block
for each host hit; the plan's ``onloads`` copy them before its rows run.  The
host block is busy (one more reference) until that step is back: the step
waited for the copy on the device.  The device blocks are published again by
the admission's prefill chunk, like blocks it computed.

**Swap** is the same two moves: a preempted request's full blocks are
published (and so backed up) when it drains, and its resume is a prefix hit
on the device or on the host; only the partial last block is recomputed.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Optional

from scheduler_proc.block_allocator import BlockAllocator

if TYPE_CHECKING:
    from scheduler_proc.prefix_cache import PrefixCache
    from scheduler_proc.request import Request
    from scheduler_proc.steps import StepDraft


class HostTier:
    """Host blocks, the backups queued and in flight, and the tier's counters."""

    def __init__(self, prefix: "PrefixCache", num_host_blocks: int):
        self.prefix = prefix
        self.device: BlockAllocator = prefix.blocks
        self.blocks = BlockAllocator(num_host_blocks, self.device.block_size)
        self._queued: list[tuple[int, int, bytes]] = []  # (device, host, key) for the next plan
        self._sent: deque[tuple[int, list[tuple[int, int, bytes]]]] = deque()  # (step_id, backups) not done
        self._pending_keys: set[bytes] = set()  # keys of the queued and sent backups
        self.num_backups = 0  # blocks backed up (done)
        self.num_onloads = 0  # blocks onloaded
        self.num_skipped = 0  # backups skipped: every host block was busy
        self.hit_tokens = 0  # tokens admissions found on the host (and onloaded)

    @classmethod
    def attach(cls, prefix: Optional["PrefixCache"], num_host_blocks: int) -> Optional["HostTier"]:
        """The tier for ``prefix``'s device blocks (it needs their keys); None without prefix caching or blocks."""
        if prefix is None or not num_host_blocks:
            return None
        prefix.host = cls(prefix, num_host_blocks)
        return prefix.host

    @property
    def has_pending(self) -> bool:
        """Backups queued or not known to be done: their blocks are still busy."""
        return bool(self._queued or self._sent)

    @property
    def num_device_busy(self) -> int:
        """Device blocks held by a backup (they come back when it is done)."""
        return len(self._queued) + sum(len(items) for _, items in self._sent)

    @property
    def num_device_returning(self) -> int:
        """Device blocks that only a backup holds: free (or cached) again once it is done. A block whose
        request still runs is busy too, but comes back to no one; counting it would make a request short
        of blocks wait for backups (a stall as long as any are in flight) instead of preempting."""
        return self.device.num_held_once(self.busy_device_blocks())

    def needs_plan(self, inflight: bool) -> bool:
        """A plan is due even without rows: backups to send, or none in flight to report them done."""
        return bool(self._queued) or (bool(self._sent) and not inflight)

    # ------------------------------------------------------------ backup

    def backup(self, blocks: list[int], keys: list[bytes], start: int, end: int) -> None:
        """Queue backups of the device blocks ``blocks[start:end]``, just published with ``keys``."""
        device, host = self.device, self.blocks
        for i in range(start, end):
            b, k = blocks[i], keys[i]
            if not device.published(b) or k in self._pending_keys or host.match([k]):
                continue  # a private copy (another copy was published first), or the host has or gets it already
            h = host.take()
            if h is None:
                self.num_skipped += end - i
                return
            device.share([b])
            self._pending_keys.add(k)
            self._queued.append((b, h, k))

    def send(self, step_id: int) -> list[int]:
        """The queued backups as a plan's flat ``(device, host)`` pairs, now in flight with ``step_id``."""
        if not self._queued:
            return []
        items, self._queued = self._queued, []
        self._sent.append((step_id, items))
        return [x for b, h, _ in items for x in (b, h)]

    def backups_done(self, step_id: int) -> None:
        """Every backup sent with a plan up to ``step_id`` has completed: key the host copies, free the device."""
        sent, host = self._sent, self.blocks
        while sent and sent[0][0] <= step_id:
            _, items = sent.popleft()
            for _, h, k in items:
                host.publish(h, k)
                self._pending_keys.discard(k)
            host.release([h for _, h, _ in items])
            self.device.release([b for b, _, _ in items])
            self.num_backups += len(items)

    # ------------------------------------------------------------ onload

    def match(self, req: "Request", num_hit: int, limit: int) -> list[int]:
        """Host blocks continuing ``req``'s device hit of ``num_hit`` blocks, up to ``limit`` blocks."""
        return self.blocks.match(req.block_keys[num_hit:limit])

    def onload(self, req: "Request", host_hit: list[int], draft: "StepDraft") -> None:
        """Give ``req`` a new device block per host hit, copied in this plan; its computation starts after them."""
        self.blocks.share(host_hit)
        new = self.device.allocate(len(host_hit))
        draft.add_blocks(req.slot, len(req.blocks), new)
        req.blocks += new
        for h, b in zip(host_hit, new):
            draft.onloads += (h, b)
        draft.onloaded += host_hit
        tokens = len(host_hit) * self.blocks.block_size
        req.num_computed += tokens
        self.hit_tokens += tokens
        self.prefix.hit_tokens += tokens  # the prefix cache's hits count both tiers
        self.num_onloads += len(host_hit)

    def step_back(self, onloaded: list[int], backups_done_step_id: int) -> None:
        """A step is back: the host blocks it onloaded may be evicted again (it waited for the copies on the
        device), and the backups its result reports done complete."""
        self.blocks.release(onloaded)
        self.backups_done(backups_done_step_id)

    # ---------------------------------------------------------- invariants

    def busy_device_blocks(self) -> list[int]:
        return [b for b, _, _ in self._queued] + [b for _, items in self._sent for b, _, _ in items]

    def check(self, onloading: list[int]) -> None:
        """Host refs are exactly the backups' targets and the in-flight onloads' sources; keys are unique."""
        self.blocks.check_integrity()
        refs: dict[int, int] = {}
        for h in [h for _, h, _ in self._queued] + [h for _, items in self._sent for _, h, _ in items] + onloading:
            refs[h] = refs.get(h, 0) + 1
        assert self.blocks.held() == refs, "host block counts differ from the backups and onloads in flight"
        targets = [h for h in refs if self.blocks.key_of(h) is None]
        assert len(targets) == len(self._pending_keys) == self.num_device_busy, "a backup's host block is keyed"
        for k in self._pending_keys:
            assert not self.blocks.match([k]), "a key both pending and on the host"
