"""An executor restart, as the planner sees it: a preemption of everything at once."""

from __future__ import annotations

from scheduler_proc.block_allocator import BlockAllocator, Pool
from scheduler_proc.host_tier import HostTier
from scheduler_proc.limits import Limits
from scheduler_proc.prefix_tree import PrefixTree
from scheduler_proc.request import Status


def new_device_blocks(limits: Limits, prefix_caching: bool) -> BlockAllocator:
    """The device's empty KV block pool: with prefix caching, one that indexes published blocks."""
    return (PrefixTree if prefix_caching else BlockAllocator)(limits.num_kv_blocks, limits.block_size)


def restart_planner(pl) -> None:
    """The executor was replaced: a preemption of everything at once, pools reset (``pl``: the Planner,
    which imports this module).

    Every in-flight step is void (its tokens will never be applied); every
    running or preempted request goes to the front of the waiting queue, in
    admission order, to be recomputed from its prompt and received tokens;
    finished requests that were draining are forgotten.  Step ids go on.
    """
    requeue = list(pl._running.values()) + [r for r in pl.draining.values() if r.status is Status.PREEMPTED]
    for req in requeue:
        req.status = Status.WAITING
        req.num_preemptions += 1
        req.slot, req.blocks, req.num_published = None, [], 0
        req.num_computed = req.num_prefill = req.spec_lag = 0
    pl.waiting.extendleft(reversed(requeue))
    pl.num_preemptions += len(requeue)
    for group in (pl._running, pl._prefilling, pl._decoding, pl._speculating, pl._paused, pl.draining):
        group.clear()
    pl.inflight.clear()
    pl._returned = pl._next_step - 1  # the steps in flight are void: none of them will come back
    pl._releases, pl._draining_blocks = [], 0
    pl.blocks = new_device_blocks(pl.limits, pl.prefix is not None)
    if pl.prefix is not None:
        pl.prefix.blocks = pl.blocks  # the new executor's KV cache is empty: nothing stays cached
    pl.host = HostTier.attach(pl.prefix, pl.limits.num_host_blocks)  # and so is its host pool
    pl.slots = Pool(pl.limits.num_slots, "slot")
