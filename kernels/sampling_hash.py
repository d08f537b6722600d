"""The sampler's random numbers and float keys as Triton helpers (shared by the sampling kernels).

The uniforms are bit-identical to :func:`kernels.sampling_ref.hash_uniform` (lowbias32 keyed
by seed, position and vocab index; see that module's docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


__all__ = ["hash_uniform_triton", "tl_mix32", "tl_row_key", "tl_uniform", "tl_okey"]


@triton.jit
def tl_mix32(x):
    # lowbias32 on uint32 (wrapping multiplies); see sampling_ref.mix32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def tl_row_key(seed, pos):
    k = tl_mix32(seed.to(tl.uint32) ^ 0x243F6A88)
    k = tl_mix32(k ^ (seed >> 32).to(tl.uint32))
    k = tl_mix32(k ^ pos.to(tl.uint32))
    k = tl_mix32(k ^ (pos >> 32).to(tl.uint32))
    return k


@triton.jit
def tl_uniform(idx, k):
    h = tl_mix32(tl_mix32(idx.to(tl.uint32) ^ 0x6A09E667) ^ k)
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23


@triton.jit
def tl_okey(s):
    # float32 -> int32 whose signed order is the float order (-0.0 folded into +0.0,
    # so that key order and float comparison agree on ties)
    b = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _hash_kernel(seed_ptr, pos_ptr, out_ptr, V, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k = tl_row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
    tl.store(out_ptr + row.to(tl.int64) * stride_o + idx, tl_uniform(idx, k), mask=idx < V)


def hash_uniform_triton(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kernel's uniforms ``[S, V]`` (for tests: must equal :func:`hash_uniform` bit for bit)."""
    S = seed.shape[0]
    out = torch.empty(S, vocab, dtype=torch.float32, device=seed.device)
    block = min(1024, triton.next_power_of_2(vocab))
    if S:
        _hash_kernel[(S, triton.cdiv(vocab, block))](seed, position, out, vocab, out.stride(0), BLOCK=block)
    return out
