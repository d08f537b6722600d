"""CUDA graphs of a draft model's passes (:meth:`executor_proc.step.draft.DraftModel.spec_passes`), one per bucket.

A step whose speculative rows come without prefill chunks (every step once the prompts are in) drafts with a
function of three device vectors alone: the rows' slots, draft counts and device positions ``base``.  The runner
owns them as one static buffer ``[3, max_bucket]`` int64; bucket ``B`` reads its first ``B`` columns, and the
drafts ``[B, K]`` are the graph's static output.  Rows past the step's are padding: the tables' padding slot,
``k = -1`` and ``base = 0``, so every KV write of theirs goes to the draft's scratch block and nothing else reads
what they compute.

Buckets are the decode graphs' (:func:`executor_proc.step.graphs.graph_buckets`), captured at start-up into the
executor's one graph pool, after the KV caches are allocated; a bucket missing then is captured on padding rows
the first time a step needs it.  With ``capture=False`` (the CPU with ``--mixed-graphs on``: tests) the same
function runs eagerly on the same buffer, padded rows included, with the step's host context lengths (the torch
backend attends by them).
"""

from __future__ import annotations

import bisect
from typing import Optional

import torch

from executor_proc.step.draft import DraftModel, DraftStep
from executor_proc.step.graphs import CaptureJob, GraphCapture, graph_buckets


class DraftGraphs:
    def __init__(self, draft: DraftModel, tables, tokens: torch.Tensor, max_rows: int, device: torch.device,
                 capture: bool, capturer: GraphCapture):
        """``tables``: the slot tables; ``tokens``: the speculator's token table (both read by every pass)."""
        self.draft = draft
        self.tables = tables
        self.tokens = tokens
        self.buckets = graph_buckets(max_rows)
        self.capture = capture
        self.capturer = capturer
        self.rows = torch.empty(3, self.buckets[-1], dtype=torch.int64, device=device)  # slots, ks, base
        self.fill_padding(0)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fill_padding(self, start: int, end: Optional[int] = None) -> None:
        """Columns ``start:end`` padded rows."""
        self.rows[0, start:end].fill_(self.tables.pad_slot)
        self.rows[1, start:end].fill_(-1)
        self.rows[2, start:end].fill_(0)

    def bucket_for(self, n: int) -> Optional[int]:
        """The smallest bucket holding ``n`` rows (None: more rows than the largest)."""
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def capture_jobs(self) -> list[CaptureJob]:
        """One capture per bucket not captured yet, largest first (none without capture)."""
        return [self._job(b) for b in reversed(self.buckets) if b not in self.graphs] if self.capture else []

    def drop(self) -> None:
        self.graphs.clear()

    def _passes(self, bucket: int, context_lens: list[int], decode_context_lens: list[list[int]]) -> torch.Tensor:
        slots, ks, base = self.rows[:, :bucket]
        return self.draft.spec_passes(self.tables, self.tokens, slots, ks, base, context_lens, decode_context_lens)

    def _job(self, bucket: int) -> CaptureJob:
        """The bucket's passes on the buffer (the host lists are the torch backend's only: none captures)."""
        ones = [1] * bucket
        return CaptureJob(lambda: self._passes(bucket, ones, [ones] * (self.draft.k - 1)),
                          lambda graph, out: self.graphs.__setitem__(bucket, (graph, out)))

    def run(self, step: DraftStep, slots: torch.Tensor, ks: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """The drafts ``[R, K]`` of the step's ``R`` speculative rows."""
        n = step.num_spec
        bucket = self.bucket_for(n)
        self.rows[:, :n] = torch.stack([slots, ks, base])
        self.fill_padding(n, bucket)
        if not self.capture:
            pad = [1] * (bucket - n)
            return self._passes(bucket, step.context_lens + pad, [c + pad for c in step.decode_context_lens])[:n]
        if bucket not in self.graphs:  # captured on padding rows, then the step's rows back
            saved = self.rows[:, :bucket].clone()
            self.fill_padding(0, bucket)
            self._job(bucket).capture(self.capturer)
            self.rows[:, :bucket].copy_(saved)
        graph, out = self.graphs[bucket]
        graph.replay()
        # Copied out of the pool at once: the step's mixed-step graphs replay next, and they share the pool's
        # intermediate memory with this graph (captured before it, they may write where its output lies), while
        # the verify reads the drafts after them.
        return out[:n].clone()
