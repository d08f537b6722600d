"""Per-slot state on the device, indexed by slot for a request's whole life.

    last_token   [num_slots]              the slot's newest sampled token (next decode input)
    block_table  [num_slots, max_blocks]  KV block ids, appended as the request grows
    temperature, top_k, top_p, min_p, seed [num_slots]  sampling parameters

Plans change these tables by diffs (admits, releases, block appends); every
change is a small host->device copy from pinned memory followed by an indexed
write on the device, so applying a plan never waits for the GPU.
"""

from __future__ import annotations

import torch

from ipc.protocol import StepPlan


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, through pinned memory and a non-blocking copy."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class SlotTables:
    def __init__(self, num_slots: int, max_blocks: int, device: torch.device):
        self.num_slots = num_slots
        self.max_blocks = max_blocks
        self.device = device
        z = dict(device=device)
        self.last_token = torch.zeros(num_slots, dtype=torch.int64, **z)
        self.block_table = torch.zeros(num_slots, max_blocks, dtype=torch.int32, **z)
        self.temperature = torch.ones(num_slots, dtype=torch.float32, **z)
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, **z)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, **z)
        self.min_p = torch.zeros(num_slots, dtype=torch.float32, **z)
        self.seed = torch.zeros(num_slots, dtype=torch.int64, **z)
        # Host mirror of which slots are greedy: an all-greedy step skips the sampler (no sync needed).
        self.greedy = [True] * num_slots

    def apply(self, plan: StepPlan) -> None:
        """Releases, then admissions, then block-table appends (a plan may reuse a freed slot)."""
        dev = self.device
        if plan.releases:
            self.block_table[to_device(plan.releases, torch.int64, dev)] = 0
        if plan.admits:
            slots = to_device([a.slot for a in plan.admits], torch.int64, dev)
            s = [a.sampling for a in plan.admits]
            self.temperature[slots] = to_device([x.temperature for x in s], torch.float32, dev)
            self.top_k[slots] = to_device([x.top_k for x in s], torch.int64, dev)
            self.top_p[slots] = to_device([x.top_p for x in s], torch.float32, dev)
            self.min_p[slots] = to_device([x.min_p for x in s], torch.float32, dev)
            self.seed[slots] = to_device([x.seed for x in s], torch.int64, dev)
            for a in plan.admits:
                self.greedy[a.slot] = a.sampling.temperature == 0.0
            self.block_table[slots] = 0
        if plan.block_appends:
            a = to_device(plan.block_appends, torch.int64, dev).view(-1, 3)
            self.block_table[a[:, 0], a[:, 1]] = a[:, 2].to(torch.int32)
