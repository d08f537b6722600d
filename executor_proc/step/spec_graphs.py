"""A pure speculative step as one CUDA graph: drafts, a decode forward over every drafted position, acceptance.

A step whose every row speculates (n-gram drafts, ``K`` of them each, greedy, no penalties, logprobs or grammar: one
user editing a text; plain decode rows of paused requests beside them are rows of no drafts) is, on a small model,
paced by its launches, not by the GPU.  Through the mixed-step runner it would run its ``R (K + 1)`` tokens as
prefill chunks (the prefill attention, unfused norms) with some forty launches from Python around the body
(drafting, the LM head over every position, acceptance).  Here each position is a *decode row* instead: token ``j``
of a row at position ``base + j`` attends over ``base + j + 1`` keys, the ones its own row's earlier tokens wrote in
the same layer (every row's KV is written before any row attends), so the step is a decode step of ``R (K + 1)``
rows on the fused one-token kernels, whose logits give each position's argmax.  The step, from the slot tables to
its output tensor, is one function of static buffers, captured once per bucket of row counts:

- :meth:`Speculator.graph_inputs`: the last token written at the row's first position, the n-gram drafts, each
  position's input id, position and context length, from the device lengths (one launch on CUDA:
  :mod:`kernels.spec_inputs`, where the torch ops took about fifteen);
- the decode forward (:func:`executor_proc.step.decode_step.decode_batch` with those ids), the argmax;
- :meth:`Speculator.accept`: the accepted counts, the tables' updates, the step's one output tensor.

A step's rows are padded to a bucket of row counts (the decode graphs', :func:`graph_buckets`): padding rows run
on the padding slot at position 0 (no KV write, and their output is cut away).  A step where no row has drafts (the
scheduler gives a row none where its request's known tokens end in no repeat, or while its last drafts come back
before a pause) runs one position a row, in a second graph per bucket (``width`` 0): a decode step at the device
lengths, one position a row rather than ``K + 1``.  A step copies its speculative
arrays (:func:`executor_proc.step.speculate.row_arrays`: their sizes depend on the bucket and ``K`` only) into
one static buffer (one device copy) and replays.  A step whose every row starts at its slot's device length holds
no position: its arrays are those of its slots and draft counts alone, so a step of the same slots and counts as the
last one staged (one request speculating, or the same batch step after step) finds them in the buffer already and
uploads nothing (:meth:`again`); its host work is a plain decode step's.  That matters at batch 1: step N + 1's
plan leaves when step N - 1's result is back, so a step's period is about half of that host chain plus half of the
GPU's time (building and sending the arrays made a lone request's step 0.93 ms, 0.70-0.84 without; H200).  Every bucket
is captured at start-up with the other graphs (:meth:`capture_jobs`), so the memory plan holds them and the first
speculative step compiles nothing; a bucket missing there is captured when first used, on padding rows.  The same
function runs eagerly without capture (the CPU), which is how the CPU tests exercise it; there the torch backend
attends from host lengths, the rows' upper bounds.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from executor_proc.step.decode_step import DecodeInputs, decode_batch
from executor_proc.step.graphs import CaptureJob, GraphCapture, graph_buckets
from executor_proc.step.plan_rows import PlanRows
from executor_proc.step.sample import GREEDY, SamplingMode
from executor_proc.step.slot_tables import SlotTables
from executor_proc.step.speculate import SpecStep, Speculator, row_arrays
from ipc.protocol import StepPlan


@dataclass
class SpecGraph:
    """One (row count, width)'s step template (arrays: views of the static buffer) and, once captured, graph and
    output."""

    template: SpecStep
    graph: Optional[torch.cuda.CUDAGraph] = None
    out: Optional[torch.Tensor] = None
    host_lens: Optional[list[int]] = None  # uncaptured: each position's context upper bound (the torch backend's)
    host_kv_rows: Optional[list[int]] = None  # uncaptured: the positions that write KV (the torch backend's)


class SpecGraphs:
    def __init__(self, spec: Speculator, forward: Callable, backend, tables: SlotTables, block_size: int,
                 max_rows: int, capture: bool, capturer: GraphCapture, device: torch.device):
        """``forward(batch)``: the model's logits over the KV cache (the worker's, read at each call: start-up
        replaces it); ``backend``: the model's; ``max_rows``: the most rows one step runs here (a larger step takes
        the mixed runner)."""
        self.spec, self.forward, self.backend, self.tables = spec, forward, backend, tables
        self.block_size, self.capture, self.capturer = block_size, capture, capturer
        self.k = spec.k
        self.widths = (self.k, 0) if spec.k else (0,)  # further positions a row: the drafts', or none
        self.buckets = graph_buckets(max_rows) if max_rows > 0 else []
        self.max_rows = max_rows
        size = sum(len(a) for a in self._arrays(*self._padding(max(self.max_rows, 1), self.k), self.k))
        self.parts = torch.zeros(size, dtype=torch.int64, device=device)
        self.no_tokens = torch.zeros(max(self.max_rows, 1), dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], SpecGraph] = {}  # by (bucket, width)
        # (slots, draft counts) of the last step staged whose every row starts at its device length, and its step:
        # its arrays are still in ``parts`` (None: a capture or a step of other rows wrote them since)
        self.last: Optional[tuple[tuple, SpecStep]] = None

    def takes(self, rows: PlanRows, mode: SamplingMode) -> bool:
        """Whether the step runs here: every row a decode row (speculative, ``k <= K`` drafts, or plain: a paused
        request's), all greedy with nothing more to compute."""
        return (self.spec.draft is None and len(rows.sampled) == rows.num_rows <= self.max_rows
                and not rows.is_prefill.any() and mode == GREEDY)

    def again(self, plan: StepPlan, live: set[int]) -> Optional[SpecStep]:
        """The last step staged, if ``plan`` (greedy, no admission with tokens) has its rows again: the same slots
        and draft counts, every row speculative and its slot's length on the device (``live``), so that the arrays
        in ``parts`` are its own.  None: stage it."""
        last = self.last
        if last is None or last[0] != (plan.slots, plan.num_drafts):
            return None
        return last[1] if all(s in live for s in plan.slots) else None

    def stage(self, step: SpecStep, rows: PlanRows, upload) -> int:
        """Add the step's arrays, every row ``K + 1`` positions wide (one, when no row has drafts) and padding rows
        up to the bucket, to the upload; its result's layout follows (:meth:`SpecStep.split`).  A plain row is a
        row of 0 drafts at the plan's position (exact: its request has no drafts in flight).  Returns their upload
        index."""
        spec, _, ks, start, _ = step.host
        n = rows.num_rows
        all_ks, all_start = np.zeros(n, dtype=np.int64), rows.starts.copy()
        all_ks[spec], all_start[spec] = ks, start
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        width = self.k if all_ks.any() else 0
        step.padded, step.bucket, step.width = list(zip(spec.tolist(), ks.tolist())), bucket, width
        step.extra = bucket * width
        ours = (rows.slots, all_ks, all_start, np.arange(n, dtype=np.int64))
        padding = self._padding(bucket, width, first=n)
        arrays = self._arrays(*(np.concatenate([a, b]) for a, b in zip(ours, padding)), width)
        # every row at its device length: no position in the arrays, which a step of these rows may find again
        self.last = ((rows.slots.tolist(), all_ks.tolist()), step) if len(spec) == n and (start < 0).all() else None
        return upload.add(np.concatenate(arrays), torch.int64)

    def bind(self, step: SpecStep, part: Optional[torch.Tensor], host_starts: np.ndarray) -> SpecGraph:
        """Put the step's arrays (``part``, from :meth:`stage`; None: in place already, :meth:`again`) in place;
        ``host_starts``: each row's first position's upper bound (the uncaptured torch backend attends from host
        lengths)."""
        graph = self.graphs.get((step.bucket, step.width)) or self._new(step.bucket, step.width)
        if part is not None:
            self.parts[:part.numel()].copy_(part)
        if graph.graph is None:  # padding rows, and a row's positions past its drafts: one key each, no KV write
            n = len(host_starts)
            ks = np.zeros(n, dtype=np.int64)
            for r, k in step.padded:
                ks[r] = k
            w = step.width
            real = (np.arange(w + 1)[None, :] <= ks[:, None]).reshape(-1)  # as _step's padding slot
            lens = np.repeat(host_starts, w + 1) + np.tile(np.arange(1, w + 2), n)
            graph.host_lens = np.where(real, lens, 1).tolist() + [1] * ((step.bucket - n) * (w + 1))
            graph.host_kv_rows = np.flatnonzero(real).tolist()
        return graph

    def capture_jobs(self) -> list[CaptureJob]:
        """A capture per bucket and width not captured yet, largest first (none without capture)."""
        if not self.capture:
            return []
        return [self._job(rows, width) for rows in reversed(self.buckets) for width in self.widths
                if (rows, width) not in self.graphs]

    def run(self, graph: SpecGraph) -> torch.Tensor:
        """The step's one output tensor: the rows' first tokens, ``width`` further tokens a row, the accepted
        counts."""
        if graph.graph is not None:
            graph.graph.replay()
            return graph.out
        return self._step(graph)

    def drop(self) -> None:
        self.graphs.clear()
        self.last = None

    def _arrays(self, slots: np.ndarray, ks: np.ndarray, start: np.ndarray, sampled_at: np.ndarray,
                width: int) -> list:
        """:func:`row_arrays` of ``width + 1`` positions a row (the rows' own draft counts kept: acceptance stops
        there), then each position's slot: the padding slot past a row's drafts (no KV write)."""
        rows = len(slots)
        r = np.arange(rows, dtype=np.int64)
        arrays = row_arrays(r, slots, ks, start, r * (width + 1), sampled_at,
                            widths=np.full(rows, width, dtype=np.int64))
        tok_row, tok_j = arrays[5], arrays[6]
        return arrays + [np.where(tok_j <= ks[tok_row], slots[tok_row], self.tables.pad_slot)]

    def _padding(self, rows: int, width: int, first: int = 0) -> tuple[np.ndarray, ...]:
        """Rows ``first`` to ``rows`` of a step padded to ``rows``: the padding slot at position 0 with ``width``
        drafts (what a capture's warm-up runs), sampled in their places."""
        n = rows - first
        return (np.full(n, self.tables.pad_slot, dtype=np.int64), np.full(n, width, dtype=np.int64),
                np.zeros(n, dtype=np.int64), np.arange(first, rows, dtype=np.int64))

    def _template(self, rows: int, width: int) -> SpecGraph:
        """The bucket's step template at ``width``, its arrays views of the static buffer."""
        sizes = tuple(len(a) for a in self._arrays(*self._padding(rows, width), width))
        template = SpecStep(rows=rows, extra=rows * width, num_sampled=rows, num_tokens=rows * (width + 1),
                            sizes=sizes, width=width)
        template.parts = list(torch.split(self.parts[:sum(sizes)], sizes))
        return SpecGraph(template)

    def _job(self, rows: int, width: int) -> CaptureJob:
        """The bucket's capture at ``width``, on padding rows (before a step's arrays are copied in)."""
        graph = self._template(rows, width)

        def prepare() -> None:
            self.last = None  # the padding rows' arrays replace the last step's
            self.parts[:sum(graph.template.sizes)].copy_(torch.from_numpy(np.concatenate(
                self._arrays(*self._padding(rows, width), width))))

        def store(captured: torch.cuda.CUDAGraph, out: torch.Tensor) -> None:
            graph.graph, graph.out = captured, out
            self.graphs[rows, width] = graph

        return CaptureJob(lambda: self._step(graph), store, prepare)

    def _new(self, rows: int, width: int) -> SpecGraph:
        """A bucket and width not captured at start-up: captured now (or, without capture, its template)."""
        if not self.capture:
            graph = self.graphs[rows, width] = self._template(rows, width)
            return graph
        self._job(rows, width).capture(self.capturer)
        return self.graphs[rows, width]

    @torch.inference_mode()
    def _step(self, graph: SpecGraph) -> torch.Tensor:
        t = graph.template
        ids, positions, lens = self.spec.graph_inputs(t, self.tables)
        slots = t.parts[10]  # each position's slot; the padding slot past its row's drafts
        batch = decode_batch(self.backend, DecodeInputs(slots, positions, lens), self.tables, self.block_size)
        batch = dataclasses.replace(batch, input_ids=ids, host_context_lens=graph.host_lens,
                                    host_kv_rows=graph.host_kv_rows)
        chosen = self.backend.argmax(self.forward(batch))  # (Triton: two launches, not torch's one-block rows)
        return self.spec.accept(t, chosen, self.no_tokens[:t.rows], self.tables)
