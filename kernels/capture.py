"""CUDA graph capture for start-up, which captures hundreds of graphs.

``torch.cuda.graph`` synchronizes the device and empties the allocator's cache before every capture
(then the next allocations go back to ``cudaMalloc``), and its default error mode forbids every other
thread's unsafe CUDA calls while it captures, which would break the kernel loads of
:mod:`kernels.precompile`'s compile pool.  :func:`capturing` does neither: it captures on a side
stream that waits for the current one, in ``thread_local`` mode unless told otherwise.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

_streams: dict = {}  # device -> the side stream captures run on


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, device: torch.device, pool=None,
              mode: str = "thread_local") -> Iterator[None]:
    """Capture the block's work on ``device`` into ``graph`` (from the memory ``pool`` if given)."""
    stream: Optional[torch.cuda.Stream] = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode=mode)
        try:
            yield
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
