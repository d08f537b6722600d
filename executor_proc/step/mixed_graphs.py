"""CUDA graphs of steps with prefill chunks: a body per (tokens, rows) bucket, a head per (rows, mode).

A thin layer over :mod:`executor_proc.step.mixed_step`.  A step that carries a
prefill chunk (with or without decode rows) of ``T`` tokens in ``R`` rows takes the
smallest token bucket ``Tb >= T`` (:func:`executor_proc.step.mixed_step.token_buckets`:
8, 16 to 128 by 16 and 32, then every 64 or 128 tokens, up to the step's token budget)
and the smallest row bucket ``Rb >= R`` (8, 32, 128, ... up to the slots; at most
``Tb``).  It copies its packed inputs into the runner's flat buffer (one device copy),
replays the body of ``(Tb, Rb)``, then the head of ``(Sb, mode)`` where ``Sb`` is the
row bucket of its ``S`` sampled rows (no head when nothing samples), and reads the
first ``S`` tokens of the head's static output.

Every body and the heads of the two plain sampling modes are captured at start-up,
largest first; a head for another mode (penalties, logprobs) the first time a step
needs it, on padded sample rows (one warm-up and capture, once per row bucket and
mode: a head is small).  With ``capture=False`` (the CPU, tests)
the runner calls the same functions eagerly on the same buffers.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from executor_proc.step.graphs import HEAVIEST_MODE, START_MODES, CaptureJob, GraphCapture
from executor_proc.step.mixed_step import MixedInputs, MixedShape, mixed_inputs, pack, row_buckets, token_buckets
from executor_proc.step.plan_rows import PlanRows, plan_rows
from executor_proc.step.sample import Sampled, SamplingMode
from ipc.protocol import StepPlan

BodyFn = Callable[[MixedInputs, torch.Tensor, Optional[PlanRows]], None]
HeadFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, SamplingMode], Sampled]
_NO_ROWS = plan_rows(StepPlan(0, [], [], [], [], []))


class MixedGraphs:
    def __init__(self, body_fn: BodyFn, head_fn: HeadFn, max_tokens: int, max_rows: int, pad_slot: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, capture: bool,
                 capturer: Optional[GraphCapture] = None, group: int = 1, max_sampled: int = 0):
        """``body_fn(inputs, hidden_out, host_rows)`` and ``head_fn(hidden, slots, positions, mode)``:
        :func:`executor_proc.step.mixed_step.mixed_body` and ``mixed_head`` bound to a model;
        ``group``: its query heads per KV head (sets the prefill work tile); ``max_rows``: the most rows (and
        hidden rows out) of a body; ``max_sampled``: of a head (default ``max_rows``; fewer with speculation,
        whose drafted positions are hidden rows the head does not sample)."""
        self.body_fn, self.head_fn = body_fn, head_fn
        self.token_buckets = token_buckets(max_tokens)
        self.row_buckets = row_buckets(max_rows)
        self.head_buckets = row_buckets(min(max_sampled or max_rows, max_rows))
        self.max_rows = max_rows
        self.pad_slot = pad_slot
        self.device = device
        self.capture = capture
        self.capturer = capturer or GraphCapture(device)
        self.group = group
        self.shapes = [MixedShape(t, r, max_rows, group) for t in self.token_buckets for r in self._rows_for(t)]
        self.inputs = torch.zeros(max(s.size for s in self.shapes), dtype=torch.int64, device=device)
        self.hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
        self.no_tokens = torch.zeros(0, dtype=torch.int64, device=device)
        self.bodies: dict[MixedShape, torch.cuda.CUDAGraph] = {}
        self.heads: dict[tuple[int, SamplingMode], tuple[torch.cuda.CUDAGraph, Sampled]] = {}

    def _rows_for(self, tokens: int) -> list[int]:
        return sorted({min(r, tokens) for r in self.row_buckets})

    def shape_for(self, rows: PlanRows, min_rows: int = 0) -> Optional[MixedShape]:
        """The smallest bucket holding the step (and ``min_rows`` sampled hidden rows), or None if too large.

        A bucket has at most as many rows as tokens, so a step that reads more hidden rows than it has tokens
        (speculative rows: each row's sampled position and every drafted one) takes a larger token bucket."""
        need = max(rows.num_rows, min_rows)
        i = bisect.bisect_left(self.token_buckets, max(rows.num_tokens, need))
        if i == len(self.token_buckets) or need > self.max_rows:
            return None
        tokens = self.token_buckets[i]
        fitting = self._rows_for(tokens)
        if need > fitting[-1]:
            return None
        return MixedShape(tokens, fitting[bisect.bisect_left(fitting, need)], self.max_rows, self.group)

    def pack(self, rows: PlanRows, shape: MixedShape) -> np.ndarray:
        """The step's packed inputs (for the step's upload; :meth:`load` puts them in place)."""
        return pack(rows, shape, self.pad_slot)

    def load(self, packed: torch.Tensor) -> None:
        """Copy a step's packed inputs (on the device) into the static buffer."""
        self.inputs[:packed.numel()].copy_(packed)

    def run(self, shape: MixedShape, num_sampled: int, mode: SamplingMode,
            host: Optional[PlanRows] = None, before_head: Optional[Callable[[], None]] = None) -> Sampled:
        """Replay (or, without capture, run) the body and the head on the loaded inputs; ``num_sampled`` rows.

        ``host``: the step's rows, for an eager call on a backend that attends from host lengths;
        ``before_head``: called between the two (a grammar mask binds there, while the body runs).
        """
        graph = self.bodies.get(shape)
        if graph is not None:
            graph.replay()
        else:
            self.body_fn(mixed_inputs(self.inputs, shape), self.hidden[:shape.rows], host)
        if num_sampled == 0:
            return Sampled(self.no_tokens)
        if before_head is not None:
            before_head()
        rows = self.head_buckets[bisect.bisect_left(self.head_buckets, num_sampled)]
        entry = self.heads.get((rows, mode))
        if entry is None:
            if not self.capture:
                return self._call_head(rows, mode).head(num_sampled)
            self._capture_head_now(rows, mode)
            entry = self.heads[(rows, mode)]
        graph, out = entry
        graph.replay()
        return out.head(num_sampled)

    def _call_head(self, rows: int, mode: SamplingMode) -> Sampled:
        r = self.max_rows
        return self.head_fn(self.hidden[:rows], self.inputs[:rows], self.inputs[r:r + rows], mode)

    def capture_jobs(self, modes: Iterable[SamplingMode] = START_MODES) -> list[CaptureJob]:
        """Captures still to do: every body, largest first, then the heads of ``modes`` (none without capture)."""
        if not self.capture:
            return []
        bodies = sorted((s for s in self.shapes if s not in self.bodies), key=lambda s: (s.tokens, s.rows),
                        reverse=True)
        heads = [(r, m) for r in reversed(self.head_buckets) for m in modes if (r, m) not in self.heads]
        return [self._body_job(s) for s in bodies] + [self._head_job(r, m) for r, m in heads]

    def heaviest_jobs(self) -> list[CaptureJob]:
        """The widest head of :data:`HEAVIEST_MODE`, if not captured yet (none without capture)."""
        key = (self.head_buckets[-1], HEAVIEST_MODE)
        return [self._head_job(*key)] if self.capture and key not in self.heads else []

    def drop(self) -> None:
        """Forget every captured body and head (start-up captures them again against the final KV cache)."""
        self.bodies.clear()
        self.heads.clear()

    def _body_job(self, shape: MixedShape) -> CaptureJob:
        """The body on an all-padding step (no KV write, nothing sampled for a real slot)."""
        inputs, hidden = mixed_inputs(self.inputs, shape), self.hidden[:shape.rows]
        return CaptureJob(lambda: self.body_fn(inputs, hidden, None),
                          lambda graph, _: self.bodies.__setitem__(shape, graph),
                          prepare=lambda: self.load(torch.from_numpy(self.pack(_NO_ROWS, shape)).to(self.device)))

    def _head_job(self, rows: int, mode: SamplingMode) -> CaptureJob:
        return CaptureJob(lambda: self._call_head(rows, mode),
                          lambda graph, out: self.heads.__setitem__((rows, mode), (graph, out)))

    def _capture_head_now(self, rows: int, mode: SamplingMode) -> None:
        """A lazy capture in the middle of serving: on padded sample rows, then the step's back."""
        r = self.max_rows
        saved = self.inputs[:2 * r].clone()
        self.inputs[:r].fill_(self.pad_slot)
        self.inputs[r:2 * r].fill_(0)
        self._head_job(rows, mode).capture(self.capturer)
        self.inputs[:2 * r].copy_(saved)
