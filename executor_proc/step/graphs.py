"""CUDA graphs of whole pure-decode steps, one per batch-size bucket and sampling mode.

A thin layer over :func:`executor_proc.step.decode_step.decode_step`: the runner owns
one static input buffer ``[3, max_bucket]`` int64 (slots, positions, context
lengths); bucket ``B`` reads its first ``B`` columns.  A step copies its rows
into the buffer (one device copy from the step's pinned upload, padded rows
filled in on the host), replays the bucket's graph, and reads the first ``n``
entries of the graph's static output.

Buckets: 1, 2, 4, 8, then every multiple of 8 up to the largest batch.  Each
bucket has two graphs: all rows greedy (argmax) and sampled (the Triton
sampler; greedy rows inside it still take the argmax).  With ``capture=False``
(the CPU, or graphs switched off) the runner calls the same function eagerly on
the same buffers, which is how the CPU tests exercise everything but the
capture itself.
"""

from __future__ import annotations

import bisect
from typing import Callable, Optional

import torch

from executor_proc.step.decode_step import DecodeInputs

ProgressCallback = Callable[[int, int], None]
StepFn = Callable[[DecodeInputs, bool], torch.Tensor]


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to ``max_batch`` (which is always the last bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, step_fn: StepFn, max_batch: int, pad_slot: int, device: torch.device, capture: bool):
        self.step_fn = step_fn
        self.buckets = graph_buckets(max_batch)
        self.pad_slot = pad_slot
        self.device = device
        self.capture = capture
        self.inputs = torch.empty(3, self.buckets[-1], dtype=torch.int64, device=device)
        self.fill_padding()
        self.graphs: dict[tuple[int, bool], tuple[Optional[torch.cuda.CUDAGraph], torch.Tensor]] = {}

    def fill_padding(self) -> None:
        """Every row a padded row (what warm-up and capture run on)."""
        self.inputs[0].fill_(self.pad_slot)
        self.inputs[1].fill_(0)
        self.inputs[2].fill_(1)

    def bucket_for(self, n: int) -> Optional[int]:
        """The smallest bucket holding ``n`` rows, or None if the step is too large for a graph."""
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def view(self, bucket: int) -> DecodeInputs:
        return DecodeInputs(self.inputs[0, :bucket], self.inputs[1, :bucket], self.inputs[2, :bucket])

    def capture_all(self, progress: Optional[ProgressCallback] = None) -> None:
        """Capture every (bucket, greedy) graph, largest first (the smaller ones reuse its memory pool)."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        todo = [(b, g) for b in reversed(self.buckets) for g in (True, False)]
        for done, (bucket, greedy) in enumerate(todo):
            inputs = self.view(bucket)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up off the capture: compiles kernels, creates handles
                self.step_fn(inputs, greedy)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.step_fn(inputs, greedy)
            self.graphs[(bucket, greedy)] = (graph, out)
            if progress is not None:
                progress(done + 1, len(todo))
        torch.cuda.synchronize(self.device)

    def run(self, bucket: int, greedy: bool) -> torch.Tensor:
        """Replay (or, without capture, run) the bucket's step on the current input buffer; tokens ``[bucket]``."""
        entry = self.graphs.get((bucket, greedy))
        if entry is None:
            return self.step_fn(self.view(bucket), greedy)
        graph, out = entry
        graph.replay()
        return out
