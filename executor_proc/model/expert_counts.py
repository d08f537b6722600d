"""``--moe-expert-counts``: how many tokens each MoE layer routed to each of its experts, for debugging.

Off by default, and then nothing of it runs.  On, every MoE block adds its step's top-k expert ids to one row
of a ``[MoE layers, E]`` int64 tensor on the device (an ``index_add_``, no host read), and the executor prints
the totals when it shuts down.  Every routed token counts, prefill and decode alike, speculative drafts that are
later rejected too; CUDA graphs are off under the flag (:func:`executor_proc.backends.select.graph_max_batch`),
since a graph's padding rows would be routed and counted.  The totals cover one executor's life: a restart
starts them again.  With several ranks, rank 0 counts and reports: every rank routes every token (the router
is replicated, under tensor and expert parallelism alike), so its totals are the whole model's.  Data-parallel
replicas count each their own requests, every line naming its replica.
"""

from __future__ import annotations

from typing import Optional

import torch

from executor_proc.memory_plan import StartupRefused
from executor_proc.model.moe import MoEBlock


class ExpertCounts:
    """The tally of one model's MoE layers: ``counts[i, e]`` tokens routed to expert ``e`` of MoE layer ``i``."""

    def __init__(self, model: torch.nn.Module, device: torch.device, replica: Optional[int] = None):
        """``replica``: the data-parallel replica's index, named on every line (replicas print to one stream)."""
        self.layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoEBlock)]
        if not self.layers:
            raise StartupRefused(f"--moe-expert-counts needs a mixture-of-experts model; "
                                 f"{model.config.architecture} has none")
        self.moe = model.config.moe
        self.label = "moe expert counts" if replica is None else f"moe expert counts, replica {replica},"
        self.counts = torch.zeros(len(self.layers), self.moe.num_experts, dtype=torch.int64, device=device)
        for row, i in enumerate(self.layers):
            model.model.layers[i].mlp.expert_counts = self.counts[row]

    def report(self) -> list[str]:
        """One line of totals per MoE layer (a host read: at shutdown only), after a header line."""
        totals = self.counts.tolist()
        head = (f"{self.label.rstrip(',')}: tokens routed to each of {self.moe.num_experts} experts "
                f"(top-{self.moe.top_k}) in {len(self.layers)} MoE layers since the executor started")
        return [head] + [f"{self.label} layer {i}: {' '.join(map(str, row))}" for i, row in zip(self.layers, totals)]
