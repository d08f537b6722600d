"""CUDA graphs of whole pure-decode steps, one per batch-size bucket and sampling mode.

A thin layer over :func:`executor_proc.step.decode_step.decode_step`: the runner owns
one static input buffer ``[3, max_bucket]`` int64 (slots, positions, context
lengths); bucket ``B`` reads its first ``B`` columns.  A step copies its rows
into the buffer (one device copy from the step's pinned upload, padded rows
filled in on the host), replays the graph of its (bucket, mode), and reads the
first ``n`` rows of the graph's static outputs.

Buckets: 1, 2, 4, 8, then every multiple of 8 up to the largest batch.  Modes
(:class:`executor_proc.step.sample.SamplingMode`: all greedy, any top-k/top-p,
any penalties, any logprobs): the two plain ones, all greedy (argmax) and sampled
(the general sampler; greedy rows inside it still take the argmax), are captured
at start-up for every bucket, as before these features existed; any other mode is
captured the first time a step needs it, for that bucket only (a one-time cost of
one warm-up and capture, a few milliseconds).  A lazy capture
warms up and captures on padding rows, then puts the step's inputs back, so the
step's own state (``last_token``, counts, KV) is touched once, by the replay.

With ``capture=False`` (the CPU, or graphs switched off) the runner calls the
same function eagerly on the same buffers, which is how the CPU tests exercise
everything but the capture itself.

Every graph of the executor (these and :mod:`executor_proc.step.mixed_graphs`') is
captured by one :class:`GraphCapture` into one memory pool: steps run one at a time
and each step's outputs are copied out before the next replay, so the graphs can
share their intermediate memory.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, TypeVar

import torch

from executor_proc.step.decode_step import DecodeInputs
from executor_proc.step.sample import GREEDY, SAMPLED, Sampled, SamplingMode
from kernels.capture import capturing
from kernels.precompile import compiled_ahead, dry_run

ProgressCallback = Callable[[int, int], None]
StepFn = Callable[[DecodeInputs, SamplingMode], Sampled]
START_MODES = (GREEDY, SAMPLED)
# The sampling mode with the most intermediates (a penalised copy of the logits beside the raw ones for
# logprobs): captured at start-up for the largest bucket, so that its memory is in the plan and a later
# lazy capture of a smaller bucket or a lighter mode reuses the pool's memory.
HEAVIEST_MODE = SamplingMode(False, filtered=True, penalised=True, logprobs=True)
Out = TypeVar("Out")


class GraphCapture:
    """Warm-up and capture of one function at a time, every graph into one shared memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None
        self.count = 0  # graphs captured so far
        # While serving (the allocator held to the memory plan: executor_proc.build.cap_allocator): the warm-up's
        # cached blocks go back to the device before a capture, inside which nothing can be given back.
        self.empty_cache_before_capture = False

    def __call__(self, fn: Callable[[], Out]) -> tuple[torch.cuda.CUDAGraph, Out]:
        """Run ``fn`` once (compiles kernels, creates handles), then capture it; (graph, its outputs)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # The warm-up runs on the current stream: its intermediates reuse the blocks the allocator keeps for
        # that stream's steps (held in the memory plan).  A fresh stream per warm-up kept each one's blocks
        # apart: lazy captures while serving added gigabytes past the plan at 256 slots.
        fn()
        if self.empty_cache_before_capture:
            torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        # thread_local (kernels.capture): the output thread may wait on copy events while a lazy capture runs,
        # and the compile pool loads kernels while the start-up captures
        with capturing(graph, self.device, pool=self.pool):
            out = fn()
        self.count += 1
        return graph, out

    def reset(self) -> None:
        """Forget the pool and the count (once every graph captured into it is dropped, its memory goes back
        at the next ``empty_cache``)."""
        self.pool = None
        self.count = 0


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to ``max_batch`` (which is always the last bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, step_fn: StepFn, max_batch: int, pad_slot: int, device: torch.device, capture: bool,
                 capturer: Optional[GraphCapture] = None):
        self.step_fn = step_fn
        self.buckets = graph_buckets(max_batch)
        self.pad_slot = pad_slot
        self.device = device
        self.capture = capture
        self.capturer = capturer or GraphCapture(device)
        self.inputs = torch.empty(3, self.buckets[-1], dtype=torch.int64, device=device)
        self.fill_padding()
        self.graphs: dict[tuple[int, SamplingMode], tuple[torch.cuda.CUDAGraph, Sampled]] = {}

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

    def capture_jobs(self, modes: Iterable[SamplingMode] = START_MODES) -> list[CaptureJob]:
        """One capture per (bucket, mode) not captured yet, largest first (none without capture)."""
        if not self.capture:
            return []
        return [self._job(b, m) for b in reversed(self.buckets) for m in modes if (b, m) not in self.graphs]

    def heaviest_jobs(self) -> list[CaptureJob]:
        """The largest bucket's graph of :data:`HEAVIEST_MODE`, if not captured yet (none without capture)."""
        key = (self.buckets[-1], HEAVIEST_MODE)
        return [self._job(*key)] if self.capture and key not in self.graphs else []

    def drop(self) -> None:
        """Forget every captured graph (start-up captures them again against the final KV cache)."""
        self.graphs.clear()

    def capture_all(self, progress: Optional[ProgressCallback] = None,
                    modes: Iterable[SamplingMode] = START_MODES) -> None:
        """Capture every (bucket, mode) graph, largest first (the smaller ones reuse its memory pool)."""
        run_captures(self.capture_jobs(modes), self.capturer, progress)

    def _job(self, bucket: int, mode: SamplingMode) -> CaptureJob:
        """The step of (bucket, mode) on the current input buffer."""
        inputs = self.view(bucket)
        return CaptureJob(lambda: self.step_fn(inputs, mode),
                          lambda graph, out: self.graphs.__setitem__((bucket, mode), (graph, out)))

    def _capture_now(self, bucket: int, mode: SamplingMode) -> None:
        """A lazy capture in the middle of serving: on padding rows, then the step's inputs back."""
        saved = self.inputs[:, :bucket].clone()
        self.fill_padding()
        self._job(bucket, mode).capture(self.capturer)
        self.inputs[:, :bucket].copy_(saved)

    def run(self, bucket: int, mode: SamplingMode) -> Sampled:
        """Replay (or, without capture, run) the bucket's step on the current input buffer; ``[bucket]`` rows."""
        entry = self.graphs.get((bucket, mode))
        if entry is None:
            if not self.capture:
                return self.step_fn(self.view(bucket), mode)
            self._capture_now(bucket, mode)
            entry = self.graphs[(bucket, mode)]
        graph, out = entry
        graph.replay()
        return out


@dataclass
class CaptureJob:
    """One graph to capture: ``prepare()`` puts its inputs in place (outside any capture), ``fn()`` is the
    work it replays, ``store(graph, outputs)`` keeps it."""

    fn: Callable[[], object]
    store: Callable[[torch.cuda.CUDAGraph, object], None]
    prepare: Callable[[], None] = lambda: None

    def capture(self, capturer: GraphCapture) -> None:
        self.prepare()
        self.store(*capturer(self.fn))


def run_captures(jobs: list[CaptureJob], capturer: GraphCapture, progress: Optional[ProgressCallback] = None,
                 compile_first: bool = True, compile_progress: Optional[ProgressCallback] = None) -> None:
    """Capture the jobs in order, reporting ``progress(done, total)``; then wait for the device.  With
    ``compile_first``, a pass first runs each job with its Triton launches recorded (their kernels compiled in
    a thread pool: :func:`kernels.precompile.compiled_ahead`) and its torch ops captured into a scratch graph;
    each capture then waits for its own kernels only (``compile_progress(done, total)`` while it waits), so the
    first captures overlap the compiles of the later graphs."""
    if not jobs:
        return
    scratch: list = []  # the compile pass's scratch graphs, sharing one pool until the captures are done
    with compiled_ahead(progress=compile_progress, threads=None if compile_first else 0) as ahead:
        needs = [ahead.record(lambda job=job: (job.prepare(), dry_run(job.fn, capturer.device, scratch)))
                 for job in jobs]
        for done, (job, need) in enumerate(zip(jobs, needs)):
            ahead.wait(need)
            job.capture(capturer)
            if progress is not None:
                progress(done + 1, len(jobs))
    torch.cuda.synchronize(capturer.device)
    scratch.clear()
