"""Pure-decode steps with grammar masks: the decode graph's forward, the masks bound, then its sampling.

A step with a constrained row cannot replay the whole-step decode graph: its masks depend on the
previous step's token and bind between the forward and the sampling
(:mod:`executor_proc.step.grammar`).  It runs the same step in two graphs on the decode graphs'
input buffer (:class:`executor_proc.step.graphs.DecodeGraphs`), per batch-size bucket:

- a *body* per bucket: the decode forward up to the final norm (the same kernels as the decode
  graph: the skinny matmuls at small batches), its hidden states into a static buffer;
- a *head* per (bucket, sampling mode): LM head and :func:`executor_proc.step.sample.sample_rows`
  (the mask kernel reads the table that the binding has just filled).

Both are captured the first time a bucket (and mode) needs them, on padding rows, as a new sampling
mode's decode graph is; with ``capture=False`` (the CPU) they run eagerly on the same buffers.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from executor_proc.step.decode_step import DecodeInputs, decode_batch
from executor_proc.step.graphs import CaptureJob, DecodeGraphs
from executor_proc.step.sample import Sampled, SamplingMode, sample_rows


def decode_body(model, kv_cache, tables, inputs: DecodeInputs, block_size: int, hidden: torch.Tensor) -> None:
    """The decode step's forward to the final norm: ``hidden [B, hidden_size]`` of the bucket's rows."""
    hidden.copy_(model.final_hidden(decode_batch(model.backend, inputs, tables, block_size), kv_cache))


def decode_head(model, tables, inputs: DecodeInputs, hidden: torch.Tensor, mode: SamplingMode) -> Sampled:
    """LM head and sampling of the bucket's rows (``last_token`` updated), as the decode step's own."""
    return sample_rows(model.backend, model.logits(hidden), tables, inputs.slots, inputs.context_lens, mode)


class SplitDecode:
    """Body and head graphs of pure-decode steps whose sampling binds a late input."""

    def __init__(self, graphs: DecodeGraphs, worker, hidden_size: int, dtype: torch.dtype):
        """``worker``: what the graphs run on (its ``model``, ``kv_cache``, ``tables``, ``block_size``, read at
        each call: start-up replaces the KV cache)."""
        self.graphs = graphs
        self.worker = worker
        self.hidden = torch.zeros(graphs.buckets[-1], hidden_size, dtype=dtype, device=graphs.device)
        self.bodies: dict[int, torch.cuda.CUDAGraph] = {}
        self.heads: dict[tuple[int, SamplingMode], tuple[torch.cuda.CUDAGraph, Sampled]] = {}

    def _body(self, bucket: int) -> Callable[[], None]:
        w, inputs, hidden = self.worker, self.graphs.view(bucket), self.hidden[:bucket]

        def body() -> None:
            with torch.inference_mode():
                decode_body(w.model, w.kv_cache, w.tables, inputs, w.block_size, hidden)
        return body

    def _head(self, bucket: int, mode: SamplingMode) -> Callable[[], Sampled]:
        w, inputs, hidden = self.worker, self.graphs.view(bucket), self.hidden[:bucket]

        def head() -> Sampled:
            with torch.inference_mode():
                return decode_head(w.model, w.tables, inputs, hidden, mode)
        return head

    def run(self, bucket: int, num_rows: int, mode: SamplingMode, before_head: Callable[[], None]) -> Sampled:
        """The bucket's body, ``before_head()`` (the masks bind: the body runs on the GPU meanwhile), then its
        head; the first ``num_rows`` rows' tokens (and logprobs)."""
        self._replay(self.bodies, bucket, self._body(bucket), keep_output=False)
        before_head()
        return self._replay(self.heads, (bucket, mode), self._head(bucket, mode), keep_output=True).head(num_rows)

    def _replay(self, graphs: dict, key: Hashable, fn: Callable, keep_output: bool):
        entry = graphs.get(key)
        if entry is None:
            if not self.graphs.capture:
                return fn()
            self._capture_now(graphs, key, fn, keep_output)
            entry = graphs[key]
        graph, out = entry if keep_output else (entry, None)
        graph.replay()
        return out

    def _capture_now(self, graphs: dict, key: Hashable, fn: Callable, keep_output: bool) -> None:
        """A capture in the middle of serving: on padding rows (no KV write, the padding slot's sampling), then
        the step's inputs back (:meth:`DecodeGraphs._capture_now`)."""
        bucket = key if isinstance(key, int) else key[0]
        saved = self.graphs.inputs[:, :bucket].clone()
        self.graphs.fill_padding()
        store = (lambda graph, out: graphs.__setitem__(key, (graph, out))) if keep_output else (
            lambda graph, _: graphs.__setitem__(key, graph))
        CaptureJob(fn, store).capture(self.graphs.capturer)
        self.graphs.inputs[:, :bucket].copy_(saved)

    def drop(self) -> None:
        """Forget every captured body and head (start-up captures the graphs again against the final KV cache)."""
        self.bodies.clear()
        self.heads.clear()
