"""Programmatic dependent launch (PDL, Hopper and later): a kernel starts while the one before it ends.

At batch 1 a decode step is ~100 launches of a few microseconds each, replayed from one CUDA graph,
and every boundary costs the ramp-down of one grid plus the ramp-up of the next.  With PDL a kernel is
launched with ``launch_pdl=True``; its programs may start as soon as every program of its predecessor
has called :func:`pdl_launch` (or exited), run whatever touches no data an in-flight kernel writes
(here: prefetch their first weight tile), then block in :func:`pdl_wait` until the predecessor has
finished and its memory is visible.  Stream capture keeps the dependency as a programmatic graph edge,
so graph replays overlap too.

Rules every PDL kernel here follows (docs/kernels.md says why):

- ``pdl_wait`` runs unconditionally, before the first load of anything a previous kernel may write,
  before every store and before any early return.  A kernel that skipped it would race its
  predecessor, and the next kernel's wait would no longer cover the kernel two back.
- ``pdl_launch`` (a hint, no memory ordering) comes after the main loop, before the epilogue's stores.
- One flag drives both the ``USE_PDL`` constexpr and the launch option: :func:`pdl_args`.

It is off where it cannot work (the CPU interpreter, GPUs before sm_90, Triton without
``triton.language.extra.cuda.gdc_wait``) and with ``FORERUN_PDL=0`` (the benchmark's baseline).
Kernels launched without PDL (torch, cuBLAS) between PDL kernels are still ordered by the stream as
usual; they only cost the overlap.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["pdl_args", "pdl_enabled", "pdl_launch", "pdl_wait"]


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Block until the previous kernel has finished and its writes are visible (no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch(USE_PDL: tl.constexpr):
    """Let the next PDL kernel's programs start (a scheduling hint; no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("FORERUN_PDL", "1") == "0":
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401  (Triton >= 3.4)
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL."""
    return device.type == "cuda" and _supported(device.index if device.index is not None
                                                else torch.cuda.current_device())


def pdl_args(t: torch.Tensor) -> dict:
    """The launch keywords of a PDL-aware kernel whose tensors live on ``t``'s device."""
    on = pdl_enabled(t.device)
    return {"USE_PDL": on, "launch_pdl": on} if on else {"USE_PDL": False}
