"""Per-slot state on the device, indexed by slot for a request's whole life.

    last_token   [num_slots + 1]              the slot's newest sampled token (next decode input)
    block_table  [num_slots + 1, max_blocks]  KV block ids, appended as the request grows
    temperature, top_k, top_p, min_p, seed [num_slots + 1]  sampling parameters

The extra last row is the *padding slot*: the rows a CUDA-graph bucket has
beyond the step's real rows point at it.  It is greedy, its block table stays
all zeros, and the step never writes KV for it, so whatever a padded row
computes is harmless and ignored.

Plans change these tables by diffs (admits, releases, block appends).  The
diffs ride in the step's one pinned host->device upload (:class:`TableDiff`
holds their place in it) and become indexed writes on the device, so applying a
plan never waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from executor_proc.backends.base import SamplingRows
from executor_proc.step.staging import HostUpload
from ipc.protocol import StepPlan
from kernels.sampling_ref import is_greedy


@dataclass
class TableDiff:
    """Where a plan's table changes sit in the step's upload (indices into ``HostUpload.send()``)."""

    releases: Optional[int] = None
    admit_slots: Optional[int] = None
    temperature: Optional[int] = None
    top_k: Optional[int] = None
    top_p: Optional[int] = None
    min_p: Optional[int] = None
    seed: Optional[int] = None
    appends: Optional[int] = None


class SlotTables:
    def __init__(self, num_slots: int, max_blocks: int, device: torch.device):
        self.num_slots = num_slots
        self.max_blocks = max_blocks
        self.device = device
        self.pad_slot = num_slots
        rows = num_slots + 1
        z = dict(device=device)
        self.last_token = torch.zeros(rows, dtype=torch.int64, **z)
        self.block_table = torch.zeros(rows, max_blocks, dtype=torch.int32, **z)
        self.temperature = torch.ones(rows, dtype=torch.float32, **z)
        self.temperature[self.pad_slot] = 0.0  # padded rows take the sampler's cheapest (greedy) path
        self.top_k = torch.zeros(rows, dtype=torch.int64, **z)
        self.top_p = torch.ones(rows, dtype=torch.float32, **z)
        self.min_p = torch.zeros(rows, dtype=torch.float32, **z)
        self.seed = torch.zeros(rows, dtype=torch.int64, **z)
        # Host mirror of which slots are greedy: an all-greedy step skips the sampler (no sync needed).
        self.greedy = [True] * rows

    def sampling_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> SamplingRows:
        """The sampling parameters of ``slots``, gathered on the device, for tokens at ``positions``."""
        return SamplingRows(slots, self.temperature[slots], self.top_k[slots], self.top_p[slots],
                            self.min_p[slots], self.seed[slots], positions)

    def stage(self, plan: StepPlan, upload: HostUpload) -> TableDiff:
        """Add the plan's table changes to the step's upload."""
        diff = TableDiff()
        if plan.releases:
            diff.releases = upload.add(plan.releases, torch.int64)
        if plan.admits:
            s = [a.sampling for a in plan.admits]
            diff.admit_slots = upload.add([a.slot for a in plan.admits], torch.int64)
            diff.temperature = upload.add([x.temperature for x in s], torch.float32)
            diff.top_k = upload.add([x.top_k for x in s], torch.int64)
            diff.top_p = upload.add([x.top_p for x in s], torch.float32)
            diff.min_p = upload.add([x.min_p for x in s], torch.float32)
            diff.seed = upload.add([x.seed for x in s], torch.int64)
            for a in plan.admits:
                self.greedy[a.slot] = is_greedy(a.sampling.temperature)
        if plan.block_appends:
            diff.appends = upload.add(plan.block_appends, torch.int64)
        return diff

    def apply(self, diff: TableDiff, sent: list[torch.Tensor]) -> None:
        """Releases, then admissions, then block-table appends (a plan may reuse a freed slot)."""
        # index_fill_, not `t[idx] = 0`: a Python scalar there is copied host->device synchronously.
        if diff.releases is not None:
            self.block_table.index_fill_(0, sent[diff.releases], 0)
        if diff.admit_slots is not None:
            slots = sent[diff.admit_slots]
            self.temperature[slots] = sent[diff.temperature]
            self.top_k[slots] = sent[diff.top_k]
            self.top_p[slots] = sent[diff.top_p]
            self.min_p[slots] = sent[diff.min_p]
            self.seed[slots] = sent[diff.seed]
            self.block_table.index_fill_(0, slots, 0)
        if diff.appends is not None:
            a = sent[diff.appends].view(-1, 3)
            self.block_table[a[:, 0], a[:, 1]] = a[:, 2].to(torch.int32)
