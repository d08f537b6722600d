"""A pure speculative step as one CUDA graph: drafts, a decode forward over every drafted position, acceptance.

A step whose every row speculates (n-gram drafts, ``K`` of them each, greedy, no penalties, logprobs or grammar:
one user editing a text) is, on a small model, paced by its launches, not by the GPU.  Through the mixed-step
runner it would run its ``R (K + 1)`` tokens as prefill chunks (the prefill attention, unfused norms) with some
forty launches from Python around the body (drafting, the LM head over every position, acceptance).  Here each
position is a *decode row* instead: token ``j`` of a row at position ``base + j`` attends over ``base + j + 1``
keys, the ones its own row's earlier tokens wrote in the same layer (every row's KV is written before any row
attends), so the step is a decode step of ``R (K + 1)`` rows on the fused one-token kernels, whose logits give
each position's argmax.  The step, from the slot tables to its output tensor, is one function of static
buffers, captured once per row count ``R``:

- :meth:`Speculator.token_inputs`: the last token written at the row's first position, the drafts (the n-gram
  kernel), each token's input id and position, from the device lengths;
- the decode forward (:func:`executor_proc.step.decode_step.decode_batch` with those ids), the argmax;
- :meth:`Speculator.accept`: the accepted counts, the tables' updates, the step's one output tensor.

A step copies its speculative arrays (:func:`executor_proc.step.speculate.row_arrays`: their sizes depend on
``R`` and ``K`` only) into one static buffer (one device copy) and replays.  Captures are lazy (a few
milliseconds, once per row count), before the step's arrays are in place: the warm-up runs on padding rows.  The
same function runs eagerly without capture (the CPU), which is how the CPU tests exercise it; there the torch
backend attends from host lengths, the rows' upper bounds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from executor_proc.step.decode_step import DecodeInputs, decode_batch
from executor_proc.step.graphs import GraphCapture
from executor_proc.step.sample import GREEDY, SamplingMode
from executor_proc.step.slot_tables import SlotTables
from executor_proc.step.speculate import SpecStep, Speculator, row_arrays


@dataclass
class SpecGraph:
    """One row count's step template (arrays: views of the static buffer) and, once captured, graph and output."""

    template: SpecStep
    graph: Optional[torch.cuda.CUDAGraph] = None
    out: Optional[torch.Tensor] = None
    host_lens: Optional[list[int]] = None  # uncaptured: each position's context upper bound (the torch backend's)


class SpecGraphs:
    def __init__(self, spec: Speculator, forward: Callable, backend, tables: SlotTables, block_size: int,
                 max_tokens: int, capture: bool, capturer: GraphCapture, device: torch.device):
        """``forward(batch)``: the model's logits over the KV cache (the worker's, read at each call: start-up
        replaces it); ``backend``: the model's; ``max_tokens``: the most positions one step runs as decode rows (a
        larger step takes the mixed runner)."""
        self.spec, self.forward, self.backend, self.tables = spec, forward, backend, tables
        self.block_size, self.capture, self.capturer = block_size, capture, capturer
        self.k = spec.k
        self.max_rows = max(max_tokens // (self.k + 1), 0)
        size = sum(len(a) for a in self._arrays(*self._padding(self.max_rows)))
        self.parts = torch.zeros(size, dtype=torch.int64, device=device)
        self.no_tokens = torch.zeros(max(self.max_rows, 1), dtype=torch.int64, device=device)
        self.graphs: dict[int, SpecGraph] = {}

    def takes(self, step: SpecStep, num_rows: int, mode: SamplingMode) -> bool:
        """Whether the step runs here: every row speculates (``k <= K`` drafts), greedy, nothing more to compute."""
        return (self.spec.draft is None and step.rows == num_rows == step.num_sampled <= self.max_rows
                and mode == GREEDY and step.greedy and not step.penalised and step.extra_logprobs is None)

    def stage(self, step: SpecStep, upload) -> int:
        """Add the step's arrays, every row ``K + 1`` positions wide, to the upload; its result's layout follows
        (:meth:`SpecStep.split`).  Returns their upload index."""
        _, slots, ks, start, sampled_at = step.host
        step.padded, step.extra = ks.tolist(), step.rows * self.k
        return upload.add(np.concatenate(self._arrays(slots, ks, start, sampled_at)), torch.int64)

    def bind(self, step: SpecStep, part: torch.Tensor, host_starts: np.ndarray) -> SpecGraph:
        """Put the step's arrays (``part``, from :meth:`stage`) in place; ``host_starts``: each row's first
        position's upper bound (the uncaptured torch backend attends from host lengths)."""
        graph = self.graphs.get(step.rows) or self._new(step.rows)
        self.parts[:part.numel()].copy_(part)
        if graph.graph is None:
            graph.host_lens = (np.repeat(host_starts, self.k + 1) + np.tile(np.arange(1, self.k + 2),
                                                                             step.rows)).tolist()
        return graph

    def run(self, graph: SpecGraph) -> torch.Tensor:
        """The step's one output tensor: the rows' first tokens, ``K`` further tokens a row, the accepted counts."""
        if graph.graph is not None:
            graph.graph.replay()
            return graph.out
        return self._step(graph)

    def drop(self) -> None:
        self.graphs.clear()

    def _arrays(self, slots: np.ndarray, ks: np.ndarray, start: np.ndarray, sampled_at: np.ndarray) -> list:
        """:func:`row_arrays` of ``K + 1`` positions a row (the rows' own draft counts kept: acceptance stops
        there), then each position's slot: the padding slot past a row's drafts (no KV write)."""
        rows = len(slots)
        r = np.arange(rows, dtype=np.int64)
        arrays = row_arrays(r, slots, ks, start, r * (self.k + 1), sampled_at, self.k,
                            widths=np.full(rows, self.k, dtype=np.int64))
        tok_row, tok_j = arrays[5], arrays[6]
        return arrays + [np.where(tok_j <= ks[tok_row], slots[tok_row], self.tables.pad_slot)]

    def _padding(self, rows: int) -> tuple[np.ndarray, ...]:
        """``rows`` rows of the padding slot at position 0 with ``K`` drafts (what a capture's warm-up runs)."""
        return (np.full(rows, self.tables.pad_slot, dtype=np.int64), np.full(rows, self.k, dtype=np.int64),
                np.zeros(rows, dtype=np.int64), np.arange(rows, dtype=np.int64))

    def _new(self, rows: int) -> SpecGraph:
        arrays = self._arrays(*self._padding(rows))
        sizes = tuple(len(a) for a in arrays)
        template = SpecStep(rows=rows, extra=rows * self.k, num_sampled=rows, num_tokens=rows * (self.k + 1),
                            sizes=sizes)
        template.parts = list(torch.split(self.parts[:sum(sizes)], sizes))
        graph = self.graphs[rows] = SpecGraph(template)
        if self.capture:  # on padding rows, before the step's arrays are copied in
            self.parts[:sum(sizes)].copy_(torch.from_numpy(np.concatenate(arrays)))
            graph.graph, graph.out = self.capturer(lambda: self._step(graph))
        return graph

    @torch.inference_mode()
    def _step(self, graph: SpecGraph) -> torch.Tensor:
        t = graph.template
        ids, positions, _ = self.spec.token_inputs(t, self.tables)
        slots = t.parts[11]  # each position's slot; the padding slot past its row's drafts
        positions = torch.where(slots == self.tables.pad_slot, 0, positions)
        batch = decode_batch(self.backend, DecodeInputs(slots, positions, positions + 1), self.tables,
                             self.block_size)
        batch = dataclasses.replace(batch, input_ids=ids, host_context_lens=graph.host_lens)
        chosen = self.forward(batch).argmax(dim=-1)
        return self.spec.accept(t, chosen, self.no_tokens[:t.rows], self.tables)
